"""inspect_h5: the H5Info of good files and a one-line DataError naming the file for each bad case."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from lwm.data.h5 import DataError, H5Info, inspect_h5
from tests.data.conftest import pattern, write_h5


def refused(path, match: str | None = None, **kw) -> str:
    """inspect_h5(path) must raise DataError: one line, naming the file (and ``match`` when given)."""
    with pytest.raises(DataError) as exc:
        inspect_h5(path, **kw)
    msg = str(exc.value)
    assert str(path) in msg
    assert "\n" not in msg
    if match is not None:
        assert match in msg, msg
    return msg


# ---------------------------------------------------------------- good files


def test_good_file_info(good_h5):
    info = inspect_h5(good_h5)
    assert info == H5Info(key="latents", frames=40, channels=4, height=8, width=8, has_actions=True, world_label=3)


def test_good_file_matches_expected_shape(good_h5):
    assert inspect_h5(good_h5, channels=4, height=8, width=8).frames == 40


def test_file_without_actions_or_label(make_h5):
    info = inspect_h5(make_h5("plain.h5", 7, channels=2, height=3, width=5))
    assert info == H5Info("latents", 7, 2, 3, 5, False, None)


def test_world_label_zero_is_kept(make_h5):
    # 0 is a valid label, not "missing"
    assert inspect_h5(make_h5("zero.h5", 5, world_label=np.int64(0))).world_label == 0


def test_single_4d_dataset_with_another_name(make_h5):
    p = make_h5("other.h5", 12, key="z")
    with h5py.File(p, "a") as f:  # other, non-4-D datasets do not count
        f.create_dataset("meta", data=np.zeros(3))
    info = inspect_h5(p)
    assert info.key == "z" and info.frames == 12 and (info.channels, info.height, info.width) == (4, 8, 8)


def test_latents_preferred_over_other_4d_dataset(make_h5):
    p = make_h5("two.h5", 9)
    with h5py.File(p, "a") as f:
        f.create_dataset("aux", data=np.zeros((5, 4, 8, 8), np.float32))
    assert inspect_h5(p).key == "latents"
    assert inspect_h5(p).frames == 9


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_float_dtypes_accepted(make_h5, dtype):
    assert inspect_h5(make_h5("f.h5", data=pattern(6).astype(dtype))).frames == 6


def test_values_within_tolerance_accepted(make_h5):
    data = pattern(10)
    data[4, 1, 2, 3] = 1.0005
    data[7, 0, 0, 0] = -1.0005
    assert inspect_h5(make_h5("tol.h5", data=data), tolerance=1e-3).frames == 10
    # ... and the same values are refused with a smaller tolerance
    refused(make_h5("tol.h5", data=data), "outside [-1, 1]", tolerance=1e-4)


def test_check_values_false_skips_value_check(make_h5):
    data = pattern(10)
    data[3] = np.nan
    assert inspect_h5(make_h5("nan.h5", data=data), check_values=False).frames == 10


def test_exactly_one_and_minus_one_accepted(make_h5):
    data = pattern(4)
    data[0] = 1.0
    data[1] = -1.0
    assert inspect_h5(make_h5("edge.h5", data=data), tolerance=0.0).frames == 4


# ---------------------------------------------------------------- bad files


def test_missing_file(tmp_path):
    refused(tmp_path / "nope.h5", "not found")
    refused(tmp_path, "a folder, not an h5 file")


def test_not_hdf5(tmp_path):
    p = tmp_path / "random.h5"
    p.write_bytes(np.random.default_rng(0).bytes(4096))
    refused(p, "cannot be opened as HDF5")
    assert "encode it first" not in refused(p)
    video = tmp_path / "clip.MP4"  # a video where an h5 file belongs (`lwm generate --data clip.mp4`): the way on
    video.write_bytes(b"\x00\x00\x00\x18ftypmp42")
    refused(video, f"; a video: encode it first, lwm data encode {video} --out DIR)")


def test_truncated_file(make_h5):
    p = make_h5("trunc.h5", 64, chunks=(4, 4, 8, 8), compression="gzip")
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) // 2])
    refused(p)


def test_corrupt_chunk(make_h5):
    """An intact file whose compressed chunk (frames 12..15) is garbage: refused, naming the unreadable block."""
    p = make_h5("corrupt.h5", 40, chunks=(4, 4, 8, 8), compression="gzip")
    with h5py.File(p, "r") as f:
        info = f["latents"].id.get_chunk_info(3)
    assert info.chunk_offset[0] == 12
    with open(p, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * info.size)
    refused(p, "unreadable at frames 8..", chunk_frames=8)


def test_3d_latents(make_h5):
    refused(make_h5("3d.h5", data=np.zeros((10, 8, 8), np.float32)), "4-D")


def test_only_3d_dataset_under_other_name(make_h5):
    refused(make_h5("3d_other.h5", key="x", data=np.zeros((10, 8, 8), np.float32)), "not exactly one 4-D dataset")


@pytest.mark.parametrize(
    "expected, name",
    [(dict(channels=16), "channels 4, expected 16"), (dict(height=4), "height 8, expected 4"),
     (dict(width=9), "width 8, expected 9"), (dict(channels=4, height=8, width=7), "width 8, expected 7")],
)
def test_wrong_shape(good_h5, expected, name):
    refused(good_h5, name, **expected)


@pytest.mark.parametrize("dtype", [np.int16, np.uint8, np.int64])
def test_integer_latents(make_h5, dtype):
    refused(make_h5("int.h5", data=np.zeros((5, 4, 8, 8), dtype)), "float16/32/64")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_names_first_bad_frame(make_h5, bad):
    data = pattern(30)
    data[13, 2, 1, 0] = bad
    data[17] = np.nan
    data[25, 0, 0, 0] = bad
    p = make_h5("nonfinite.h5", data=data)
    # frame 13 lies in the 4th block of 4 frames and in the first block of 64: the index is absolute either way
    assert "first at frame 13)" in refused(p, "NaN/inf", chunk_frames=4)
    assert "first at frame 13)" in refused(p, "NaN/inf")


def test_non_finite_in_float16(make_h5):
    data = pattern(8).astype(np.float16)
    data[6, 3, 7, 7] = np.inf
    assert "first at frame 6)" in refused(make_h5("f16.h5", data=data))


@pytest.mark.parametrize("value", [1.01, -1.002, 3.0])
def test_values_outside_range(make_h5, value):
    data = pattern(12)
    data[9, 0, 4, 4] = value
    refused(make_h5("range.h5", data=data), "outside [-1, 1]", tolerance=1e-3)


def test_zero_frames(make_h5):
    refused(make_h5("empty.h5", data=np.zeros((0, 4, 8, 8), np.float32)), "dataset 'latents' is empty")


def test_actions_wrong_length(make_h5):
    assert "(10,)" in refused(make_h5("act_len.h5", 10, actions=np.zeros(9, np.int64)), "'actions'")


def test_actions_wrong_shape(make_h5):
    refused(make_h5("act_2d.h5", 10, actions=np.zeros((10, 2), np.int64)), "'actions'")


def test_actions_float(make_h5):
    refused(make_h5("act_float.h5", 10, actions=np.zeros(10, np.float32)), "'actions' must be integers")


def test_actions_unsigned_accepted(make_h5):
    assert inspect_h5(make_h5("act_u8.h5", 10, actions=np.arange(10, dtype=np.uint8))).has_actions


@pytest.mark.parametrize("label", ["abc", np.array([1, 2]), np.bool_(True), 7.0])
def test_world_label_not_integer(make_h5, label):
    refused(make_h5("label.h5", 5, world_label=label), "world_label")


def test_world_label_written_as_a_dataset_is_refused_not_ignored(make_h5):
    path = make_h5("label_ds.h5", 5)
    with h5py.File(path, "r+") as f:
        f["world_label"] = 3
    refused(path, "'world_label' is a dataset; lwm reads an integer attribute")


def test_world_label_fractional_refused(make_h5):
    refused(make_h5("label_frac.h5", 5, world_label=2.5), "world_label")


def test_two_4d_datasets_without_latents(make_h5):
    p = make_h5("two4d.h5", 6, key="a")
    with h5py.File(p, "a") as f:
        f.create_dataset("b", data=np.zeros((6, 4, 8, 8), np.float32))
    msg = refused(p, "not exactly one 4-D dataset")
    assert "a(6, 4, 8, 8)" in msg and "b(6, 4, 8, 8)" in msg


def test_no_dataset_at_all(tmp_path):
    p = tmp_path / "nothing.h5"
    with h5py.File(p, "w") as f:
        f.create_group("g")
    assert "(datasets: none)" in refused(p)


def test_negative_actions_and_world_label_are_refused(make_h5):
    """-1 means "no label" in batches: a negative label in a file would be silently dropped by the probes."""
    actions = np.arange(10, dtype=np.int64)
    actions[4] = -1
    refused(make_h5("act_neg.h5", 10, actions=actions), "'actions'")
    refused(make_h5("label_neg.h5", 5, world_label=-1), "'world_label'")
    huge = np.full(10, 2**63, dtype=np.uint64)  # does not fit the int64 batches
    refused(make_h5("act_huge.h5", 10, actions=huge), "'actions'")


def test_a_codec_attribute_must_parse_and_fit_the_latents(tmp_path):
    import json

    from tests.data.conftest import write_h5

    def with_codec(name, codec, shape):
        path = write_h5(tmp_path / name, 4, channels=shape[0], height=shape[1], width=shape[2])
        with h5py.File(path, "a") as f:
            f.attrs["codec"] = codec
        return path

    refused(with_codec("not_json.h5", "not json", (4, 8, 8)), "attribute 'codec' is not JSON")
    pixel = json.dumps({"name": "pixel", "version": 1, "size": 16})  # [16, 8, 8] latents
    refused(with_codec("wrong_shape.h5", pixel, (4, 8, 8)),
            "names the pixel codec of size 16, for [16, 8, 8] latents, but the dataset holds [4, 8, 8]")
    assert inspect_h5(with_codec("fits.h5", pixel, (16, 8, 8))).channels == 16
    wan = {"name": "wan", "size": 64, "shift": [0.0] * 4, "scale": [1.0] * 4}  # [4, 8, 8] latents
    assert inspect_h5(with_codec("wan.h5", json.dumps(wan), (4, 8, 8))).channels == 4
    refused(with_codec("wan_nosize.h5", json.dumps({"name": "wan"}), (4, 8, 8)), "(wan) needs an integer 'size'")
    refused(with_codec("pixel_size.h5", json.dumps({"name": "pixel", "size": "abc"}), (16, 8, 8)),
            "attribute 'codec' (pixel) needs an integer 'size'")
    wide = {**wan, "size": 128, "spatial": 16}  # a VAE of 16x spatial compression (recorded in the attribute)
    assert inspect_h5(with_codec("wan16.h5", json.dumps(wide), (4, 8, 8))).channels == 4
    refused(with_codec("wan_size.h5", json.dumps({**wan, "size": 128}), (4, 8, 8)), "for [4, 16, 16] latents")
    refused(with_codec("wan_shift.h5", json.dumps({**wan, "shift": [0.0] * 3}), (4, 8, 8)), "attribute 'codec' (wan)")
    refused(with_codec("wan_scale.h5", json.dumps({**wan, "scale": [1.0, 0, 1, 1]}), (4, 8, 8)), "'scale'")
    assert inspect_h5(with_codec("other.h5", json.dumps({"name": "mine"}), (4, 8, 8))).channels == 4  # not run


@pytest.mark.parametrize(("frames", "bad", "chunk"), [(10, 3, 4), (10, 9, 5), (70, 63, 64)])
def test_a_bad_value_in_the_last_frame_of_a_chunk_is_found(tmp_path, frames, bad, chunk):
    data = pattern(frames)
    data[bad, 0, 0, 0] = 1.5
    p = write_h5(tmp_path / "x.h5", data=data)
    with pytest.raises(DataError, match="outside"):
        inspect_h5(p, chunk_frames=chunk)


# ---------------------------------------------------------------- the manifest's key, empty frames, generate's files


def test_the_key_given_must_name_a_4d_dataset(make_h5):
    path = make_h5("k.h5", 6, actions=True)
    assert inspect_h5(path, key="latents").key == "latents"
    assert "no dataset 'nope' (the key the manifest names; datasets: actions(6,), latents(6, 4, 8, 8))" in \
        refused(path, key="nope")
    refused(path, "dataset 'actions' must be 4-D [T, C, H, W], got shape (6,)", key="actions")


@pytest.mark.parametrize("shape", [(4, 0, 8, 8), (4, 4, 0, 8), (4, 4, 8, 0)])
def test_an_empty_frame_is_refused_in_one_line(make_h5, shape):
    path = make_h5("empty.h5", data=np.zeros(shape, dtype=np.float32))
    refused(path, f"dataset 'latents' is empty (shape {shape}")


def test_generate_rollouts_are_recognised_by_their_attributes(tmp_path):
    from lwm.data.h5 import GeneratedFile

    path = tmp_path / "run.mp4.h5"  # as lwm/generate.py writes it
    with h5py.File(path, "w") as f:
        f["latents"] = np.zeros((2, 5, 4, 8, 8), dtype=np.float32)
        f["ground_truth"] = np.zeros((5, 4, 8, 8), dtype=np.float32)
        f.attrs["source"], f.attrs["start"], f.attrs["context"] = "x.h5", 0, 1
    with pytest.raises(GeneratedFile, match="rollouts written by `lwm generate`"):
        inspect_h5(path)
    del_attrs = tmp_path / "plain5d.h5"  # a 5-D file of anyone else: the usual refusal
    write_h5(del_attrs, data=np.zeros((2, 5, 4, 8, 8), dtype=np.float32))
    assert "must be 4-D" in refused(del_attrs)

"""Known answers for the data layer's checks (from a mutation review): every file's C, H and W compared wherever it
sorts, the val split never every file and kept on re-index, the codec attribute's fit, generate's rollout files told
from clips, a group named latents, chunk warnings, a changed file, and `lwm data encode`'s argument checks."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from lwm.cli.main import main
from lwm.data import convert
from lwm.data.h5 import DataError, inspect_h5
from lwm.data.manifest import ManifestEntry, index_directory, val_count
from lwm.utils.video import write_video
from tests.data.conftest import write_h5


# ---------------------------------------------------------------- every file's C, H and W compared, first to last


@pytest.mark.parametrize("name", ["a_odd.h5", "m_odd.h5", "z_odd.h5"])  # first, middle, last in sorted order
@pytest.mark.parametrize(("shape", "said"), [
    (dict(channels=3), "channels 3, expected 4"),
    (dict(height=12), "height 12, expected 8"),
    (dict(width=12), "width 12, expected 8"),
])
def test_a_file_of_another_shape_is_refused_by_name_wherever_it_sorts(tmp_path, name, shape, said):
    for i in range(4):
        write_h5(tmp_path / f"k{i}.h5", 6)  # [4, 8, 8]
    write_h5(tmp_path / name, 6, **shape)
    with pytest.raises(DataError) as exc:
        index_directory(tmp_path)
    assert str(exc.value).splitlines() == [
        "1 of 5 files refused:",
        f"{tmp_path / name}: dataset 'latents' has {said} (the [C, H, W] of most files: [4, 8, 8])"]
    assert not (tmp_path / "manifest.json").exists()


# ---------------------------------------------------------------- the val split: never every file; kept on re-index


@pytest.mark.parametrize(("fraction", "files", "n_val"), [
    (0.9, 2, 1), (0.99, 10, 9), (0.75, 2, 1), (0.96, 25, 24), (0.5, 5, 2), (0.1, 2, 1), (0.04, 10, 1)])
def test_val_count_known_answers(fraction, files, n_val):
    assert val_count(fraction, files) == n_val


def test_a_large_fraction_of_two_files_leaves_one_for_training(tmp_path):
    for i in range(2):
        write_h5(tmp_path / f"a{i}.h5", 6)
    for seed in range(3):
        m = index_directory(tmp_path, val_fraction=0.9, seed=seed, resplit=True)
        assert (len(m.split("train")), len(m.split("val"))) == (1, 1)


@pytest.mark.parametrize("seed", range(12))
def test_reindexing_never_moves_a_train_file_into_val(tmp_path, seed):
    for i in range(10):
        write_h5(tmp_path / f"ep_{i:02d}.h5", 6, offset=i / 100)
    old = {e.path: e.split for e in index_directory(tmp_path, val_fraction=0.2, seed=1).entries}
    for i in range(10):
        write_h5(tmp_path / f"new_{i:02d}.h5", 6)
    again = index_directory(tmp_path, val_fraction=0.2, seed=seed)
    assert {e.path: e.split for e in again.entries if e.path in old} == old
    assert len(again.split("val")) == 4  # the 2 kept, 2 of the new files


# ---------------------------------------------------------------- h5 checks


@pytest.mark.parametrize("shape", [(16, 8, 12), (16, 12, 8)])
def test_a_codec_attribute_must_fit_the_width_as_well_as_the_height(tmp_path, shape):
    path = write_h5(tmp_path / "x.h5", 4, channels=shape[0], height=shape[1], width=shape[2])
    with h5py.File(path, "a") as f:
        f.attrs["codec"] = json.dumps({"name": "pixel", "version": 1, "size": 16})  # [16, 8, 8] latents
    with pytest.raises(DataError, match=r"for \[16, 8, 8\] latents, but the dataset holds"):
        inspect_h5(path)


def test_only_a_five_d_dataset_with_all_three_attributes_is_a_generate_rollout(tmp_path):
    four_d = write_h5(tmp_path / "mine.h5", 6)  # a clip that happens to record where it came from
    with h5py.File(four_d, "a") as f:
        f.attrs["source"], f.attrs["start"], f.attrs["context"] = "cam0", 0, 1
    assert inspect_h5(four_d).frames == 6
    five_d = write_h5(tmp_path / "five.h5", data=np.zeros((2, 5, 4, 8, 8), np.float32))
    with h5py.File(five_d, "a") as f:
        f.attrs["source"] = "cam0"  # one of the three: not generate's file
    with pytest.raises(DataError, match="must be 4-D") as exc:
        inspect_h5(five_d)
    assert type(exc.value) is DataError


def test_a_group_named_latents_is_a_one_line_refusal_not_a_traceback(tmp_path):
    path = tmp_path / "g.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("latents/x", data=np.zeros((4, 4, 8, 8), np.float32))
    with pytest.raises(DataError, match=r"g\.h5: no 'latents' dataset"):
        inspect_h5(path)
    with h5py.File(path, "a") as f:  # ... and with one 4-D dataset beside it, that one is read
        f.create_dataset("z", data=np.zeros((5, 4, 8, 8), np.float32))
    assert inspect_h5(path).key == "z"


def test_uncompressed_chunks_of_many_frames_are_not_warned_about(tmp_path, capsys):
    for name in ("a.h5", "b.h5"):
        write_h5(tmp_path / name, 24, chunks=(12, 4, 8, 8))  # chunked, no filter: reads are cheap
    assert inspect_h5(tmp_path / "a.h5").filtered_chunk_frames is None
    index_directory(tmp_path)
    assert "chunks of many frames" not in capsys.readouterr().err


def test_a_folder_of_generate_rollouts_only_is_one_line(tmp_path):
    with h5py.File(tmp_path / "v.mp4.h5", "w") as f:
        f["latents"] = np.zeros((2, 5, 4, 8, 8), np.float32)
        f.attrs["source"], f.attrs["start"], f.attrs["context"] = "x.h5", 0, 1
    with pytest.raises(DataError, match="only `lwm generate`'s rollouts"):
        index_directory(tmp_path)


def test_a_file_of_another_size_under_the_same_mtime_has_changed():
    entry = ManifestEntry("a.h5", 10, "train", bytes=1000, mtime=1.5e9)
    assert not entry.changed_since_checked(SimpleNamespace(st_size=1000, st_mtime=1.5e9))
    assert entry.changed_since_checked(SimpleNamespace(st_size=1001, st_mtime=1.5e9))
    assert entry.changed_since_checked(SimpleNamespace(st_size=1000, st_mtime=1.5e9 + 0.01))


# ---------------------------------------------------------------- lwm data encode's argument checks


@pytest.mark.parametrize(("segment", "passes"), [("5", True), ("257", True), ("8", False), ("6", False)])
def test_a_vae_segment_of_one_plus_4k_passes_the_check(tmp_path, capsys, monkeypatch, segment, passes):
    video = write_video(tmp_path / "v.mp4", np.zeros((2, 16, 16, 3), dtype=np.uint8))
    monkeypatch.setattr(convert, "make_codec", lambda *a, **k: (_ for _ in ()).throw(DataError("reached the codec")))
    argv = ["data", "encode", str(video), "--out", str(tmp_path / "o"), "--codec", "wan", "--vae", str(tmp_path),
            "--segment", segment]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert ("reached the codec" in err) == passes and (f"--segment {segment}:" in err) != passes, err


def test_a_missing_video_is_refused_before_any_is_encoded(tmp_path):
    good = write_video(tmp_path / "good.mp4", np.zeros((2, 16, 16, 3), dtype=np.uint8))
    out = tmp_path / "o"
    with pytest.raises(DataError, match="missing.mp4: video not found"):
        convert.encode_videos([str(good), str(tmp_path / "missing.mp4")], out, size=16, log=lambda line: None)
    assert not out.exists()


# ---------------------------------------------------------------- found while reading


def test_reindexing_after_the_train_files_are_gone_is_refused_not_an_all_val_manifest(tmp_path):
    for i in range(4):
        write_h5(tmp_path / f"ep{i}.h5", 6, offset=i / 100)
    m = index_directory(tmp_path, val_fraction=0.25)
    for e in m.split("train"):
        os.unlink(tmp_path / e.path)
    before = (tmp_path / "manifest.json").read_bytes()
    with pytest.raises(DataError, match="every file would be a val file: .* --resplit draws the splits again"):
        index_directory(tmp_path, val_fraction=0.25)
    assert (tmp_path / "manifest.json").read_bytes() == before  # nothing written
    assert len(index_directory(tmp_path, val_fraction=0.25, resplit=True).split("train")) == 1


def test_a_float64_value_beyond_float32s_range_is_named_as_a_value(tmp_path):
    data = np.zeros((4, 4, 8, 8))
    data[2, 0, 0, 0] = 1e39  # finite in float64, inf in float32
    path = write_h5(tmp_path / "big.h5", data=data)
    with pytest.raises(DataError, match=r"big\.h5: dataset 'latents' has values in \[0, 1e\+39\], outside \[-1, 1\]"):
        inspect_h5(path)


def test_a_video_given_twice_is_refused_before_any_is_encoded(tmp_path):
    video = write_video(tmp_path / "clip.gif", np.zeros((2, 16, 16, 3), dtype=np.uint8))
    out = tmp_path / "o"
    for again, said in ((str(video), f"{video}: given twice"),
                        (os.path.join(tmp_path, ".", "clip.gif"), f"{tmp_path}/./clip.gif: given twice (as {video} too)")):
        with pytest.raises(DataError) as exc:
            convert.encode_videos([str(video), again], out, size=16, log=lambda line: None)
        assert str(exc.value) == said
    assert not out.exists()

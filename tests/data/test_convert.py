"""`lwm data encode` / `decode` through the pixel codec, with real video files."""

from __future__ import annotations

import json
import sys

import h5py
import imageio.v3 as iio
import numpy as np
import pytest

from lwm.cli.main import main
from lwm.data import convert
from lwm.data.codecs import PixelCodec
from lwm.data.convert import framing, iter_video, make_codec, square_resize, write_latents
from lwm.data.h5 import DataError, inspect_h5
from lwm.utils.video import write_video


def read_video(path, stride: int = 1) -> np.ndarray:
    return np.stack(list(iter_video(path, stride)))


@pytest.mark.slow
def test_encode_then_decode_returns_the_resized_frames(tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, (5, 96, 160, 3), dtype=np.uint8)
    video = write_video(tmp_path / "clip.mp4", frames)
    assert main(["data", "encode", str(video), "--out", str(tmp_path / "h5")]) == 0
    h5 = tmp_path / "h5/clip.h5"
    info = inspect_h5(h5, 16, 64, 64)
    assert info.frames == 5
    expected = square_resize(read_video(video), 128)  # what the codec saw (mp4 is lossy: compare after decoding)
    with h5py.File(h5) as f:
        assert np.array_equal(PixelCodec().decode(f["latents"][...]), expected)
    assert main(["data", "decode", str(h5), "--out", str(tmp_path / "back.gif")]) == 0
    assert iio.imread(tmp_path / "back.gif", index=None).shape == (5, 128, 128, 3)


def test_square_resize_crops_the_centre():
    frames = np.zeros((1, 4, 8, 3), dtype=np.uint8)
    frames[0, :, 2:6] = 200  # the centre square
    assert np.array_equal(square_resize(frames, 4), np.full((1, 4, 4, 3), 200, dtype=np.uint8))


@pytest.mark.parametrize(("argv", "message"), [
    (["data", "encode", "/nope.mp4", "--out", "OUT"], "/nope.mp4: video not found"),
    (["data", "encode", "IN", "--out", "OUT", "--codec", "cosmos"], "--codec cosmos: unknown (known: pixel, wan, cogvideox, hunyuan)"),
    (["data", "encode", "IN", "--out", "OUT", "--codec", "wan"], "--codec wan needs --vae PATH"),
    (["data", "encode", "IN", "--out", "OUT", "--vae", "/missing"], "--vae /missing: the pixel codec has no weights"),
])
def test_encode_errors(tmp_path, capsys, argv, message):
    video = write_video(tmp_path / "v.mp4", np.zeros((2, 16, 16, 3), dtype=np.uint8))
    argv = [str(video) if a == "IN" else str(tmp_path / "o") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_decode_refuses_a_vae_the_files_codec_does_not_take(tmp_path, capsys):
    """A pixel file decoded with --vae /missing: the folder was ignored, a wrong path unnoticed."""
    h5 = tmp_path / "p.h5"
    write_latents(h5, PixelCodec(size=32), np.zeros((2, 32, 32, 3), dtype=np.uint8))
    assert main(["data", "decode", str(h5), "--out", str(tmp_path / "x.gif"), "--vae", "/missing"]) == 2
    assert (f"--vae /missing: {h5} is not encoded with a VAE (the file names the pixel codec, which has no weights): "
            f"leave --vae out") in capsys.readouterr().err
    assert not (tmp_path / "x.gif").exists()


def test_decode_needs_a_codec(tmp_path, capsys):
    with h5py.File(tmp_path / "raw.h5", "w") as f:
        f["latents"] = np.zeros((2, 16, 64, 64), dtype=np.float32)
    assert main(["data", "decode", str(tmp_path / "raw.h5"), "--out", str(tmp_path / "x.gif")]) == 2
    assert "raw.h5: cannot decode to pixels: the file names no codec" in capsys.readouterr().err


def test_two_videos_of_one_name_are_refused_before_encoding(tmp_path, capsys):
    a = write_video(tmp_path / "va/clip.gif", np.zeros((2, 16, 16, 3), dtype=np.uint8))
    b = write_video(tmp_path / "vb/clip.gif", np.zeros((2, 16, 16, 3), dtype=np.uint8))
    assert main(["data", "encode", str(a), str(b), "--out", str(tmp_path / "enc")]) == 2
    assert f"{b}: same name as {a}" in capsys.readouterr().err
    assert not (tmp_path / "enc/clip.h5").exists()


def test_decode_refuses_an_unknown_video_suffix_first(tmp_path, capsys):
    with h5py.File(tmp_path / "raw.h5", "w") as f:  # no codec either: the suffix is what is checked first
        f["latents"] = np.zeros((2, 16, 64, 64), dtype=np.float32)
    assert main(["data", "decode", str(tmp_path / "raw.h5"), "--out", str(tmp_path / "x.avi")]) == 2
    assert "x.avi: the video must end in one of .mp4, .gif" in capsys.readouterr().err


@pytest.mark.slow
def test_segments_split_a_video_into_files_that_decode_to_its_frames(tmp_path, capsys):
    """--segment 3 over 7 frames: files of 3, 3 and 1 frames, whose decoded frames in order are the video's."""
    frames = np.random.default_rng(1).integers(0, 256, (7, 40, 40, 3), dtype=np.uint8)
    video = write_video(tmp_path / "clip.mp4", frames)
    assert main(["data", "encode", str(video), "--out", str(tmp_path / "h5"), "--size", "16", "--segment", "3"]) == 0
    files = sorted((tmp_path / "h5").glob("*.h5"))
    assert [f.name for f in files] == ["clip_0000.h5", "clip_0001.h5", "clip_0002.h5"]
    codec = PixelCodec(size=16)
    decoded = []
    for f in files:
        with h5py.File(f) as h:
            decoded.append(codec.decode(h["latents"][...]))
    assert [len(d) for d in decoded] == [3, 3, 1]
    assert np.array_equal(np.concatenate(decoded), square_resize(read_video(video), 16))
    out = capsys.readouterr().out.splitlines()  # 40x40 frames: square, resized
    assert out == [f"wrote {tmp_path / 'h5' / name} ({n} frames, latents [{n}, 16, 8, 8]; 40x40 frames resized to 16x16)"
                   for name, n in (("clip_0000.h5", 3), ("clip_0001.h5", 3), ("clip_0002.h5", 1))]


def test_frames_are_streamed_with_the_stride(tmp_path):
    frames = np.random.default_rng(2).integers(0, 256, (5, 24, 24, 3), dtype=np.uint8)
    video = write_video(tmp_path / "clip.gif", frames)
    assert main(["data", "encode", str(video), "--out", str(tmp_path / "h5"), "--size", "8", "--stride", "2"]) == 0
    with h5py.File(tmp_path / "h5/clip.h5") as h:
        decoded = PixelCodec(size=8).decode(h["latents"][...])
    assert np.array_equal(decoded, square_resize(read_video(video)[::2], 8)) and len(decoded) == 3


@pytest.mark.parametrize("segment", ["6", "1"])  # 1 = 1 + 4*0: one latent per file, no transition
def test_a_vae_segment_must_be_one_plus_a_multiple_of_four(tmp_path, capsys, segment):
    video = write_video(tmp_path / "v.mp4", np.zeros((2, 16, 16, 3), dtype=np.uint8))
    argv = ["data", "encode", str(video), "--out", str(tmp_path / "o"), "--codec", "wan", "--vae", str(tmp_path),
            "--segment", segment]
    assert main(argv) == 2
    assert f"--segment {segment}: a VAE codec encodes 1 + 4k frames, k >= 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before any VAE is loaded or folder made


@pytest.mark.slow
def test_files_record_the_frame_rate_that_decoding_plays_them_at(tmp_path):
    """A 30 fps video kept every 2nd frame is 15 fps: recorded, and decoded at that rate unless --fps says."""
    frames = np.random.default_rng(0).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    video = tmp_path / "v.mp4"
    video.write_bytes(iio.imwrite("<bytes>", frames, extension=".mp4", plugin="pyav", codec="libx264", fps=30))
    assert main(["data", "encode", str(video), "--out", str(tmp_path / "h5"), "--size", "16", "--stride", "2"]) == 0
    with h5py.File(tmp_path / "h5/v.h5") as f:
        assert f.attrs["fps"] == 15.0
    assert main(["data", "decode", str(tmp_path / "h5/v.h5"), "--out", str(tmp_path / "a.mp4")]) == 0
    assert iio.immeta(tmp_path / "a.mp4", plugin="pyav")["fps"] == 15.0
    assert main(["data", "decode", str(tmp_path / "h5/v.h5"), "--out", str(tmp_path / "b.mp4"), "--fps", "24"]) == 0
    assert iio.immeta(tmp_path / "b.mp4", plugin="pyav")["fps"] == 24.0
    gif = tmp_path / "g.gif"  # a GIF declares no frame rate: none recorded, decoded at 8
    gif.write_bytes(iio.imwrite("<bytes>", frames, extension=".gif", plugin="pillow", duration=100, loop=0))
    assert main(["data", "encode", str(gif), "--out", str(tmp_path / "h5"), "--size", "16"]) == 0
    with h5py.File(tmp_path / "h5/g.h5") as f:
        assert "fps" not in f.attrs
    assert main(["data", "decode", str(tmp_path / "h5/g.h5"), "--out", str(tmp_path / "c.mp4")]) == 0
    assert iio.immeta(tmp_path / "c.mp4", plugin="pyav")["fps"] == 8.0


def test_write_latents_keeps_the_action_after_frame_4k(tmp_path):
    class FourToOne:
        frames_per_latent, attr = 4, json.dumps({"name": "stub"})

        def encode(self, frames):
            return np.zeros((1 + (len(frames) - 1) // 4, 16, 8, 8), np.float32)

    actions = np.arange(13)  # a different action after every frame
    target = tmp_path / "x.h5"
    write_latents(target, FourToOne(), np.zeros((13, 64, 64, 3), np.uint8), actions)
    with h5py.File(target) as f:
        assert f["actions"][...].tolist() == [0, 4, 8, 12]  # the action after frame 4k


def test_a_frame_by_frame_codec_is_written_in_chunks_equal_to_one_call(tmp_path, monkeypatch):
    """The pixel codec encodes ENCODE_CHUNK frames at a time straight into the file: the same values as one call,
    actions subsampled the same."""
    import lwm.data.convert as convert

    frames = np.random.default_rng(3).integers(0, 256, (7, 16, 16, 3), dtype=np.uint8)
    codec = PixelCodec(size=16)
    monkeypatch.setattr(convert, "ENCODE_CHUNK", 3)  # chunks of 3, 3 and 1
    write_latents(tmp_path / "x.h5", codec, frames, actions=np.arange(7))
    with h5py.File(tmp_path / "x.h5") as f:
        assert np.array_equal(f["latents"][...], codec.encode(frames).astype(np.float16))
        assert f["actions"][...].tolist() == list(range(7))
    assert not (tmp_path / "x.h5.tmp").exists()


def _pixel_file(path, frames: int = 3):
    write_latents(path, PixelCodec(size=16), np.random.default_rng(4).integers(0, 256, (frames, 16, 16, 3), np.uint8))
    return path


@pytest.mark.parametrize("kind", ["folder", "file parent", "the input"])
def test_decode_refuses_a_bad_out_before_decoding_with_one_line(tmp_path, capsys, kind):
    """Each was found only when the video was written (a folder: "Is a directory" and an imageio traceback), or
    not at all (an h5 file named x.gif decoded onto itself)."""
    data = _pixel_file(tmp_path / "x.gif") if kind == "the input" else _pixel_file(tmp_path / "x.h5")
    before = data.read_bytes()
    out = {"folder": tmp_path / "dir.gif", "file parent": tmp_path / "x.h5/v.gif", "the input": data}[kind]
    if kind == "folder":
        out.mkdir()
    expected = {"folder": f"{out}: is a folder, not a file to write (--out)",
                "file parent": f"{out}: cannot be created, not a folder: {data} (--out)",
                "the input": f"{out}: is the input file {data}; writing it (--out) would destroy it"}[kind]
    assert main(["data", "decode", str(data), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {expected}"]  # and no traceback
    assert data.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["dir.gif", data.name] if kind == "folder" else [data.name])


def test_decode_refuses_non_finite_latents(tmp_path, capsys):
    data = _pixel_file(tmp_path / "x.h5")
    with h5py.File(data, "r+") as f:
        f["latents"][1, 0, 0, 0] = np.nan
    assert main(["data", "decode", str(data), "--out", str(tmp_path / "v.gif")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {data}: dataset 'latents' has NaN/inf values (first at frame 1)"]
    assert not (tmp_path / "v.gif").exists()


def test_grayscale_frames_are_read_as_grey_rgb(tmp_path):
    grey = np.random.default_rng(0).integers(0, 256, (5, 40, 60), dtype=np.uint8)
    gif = tmp_path / "g.gif"
    iio.imwrite(gif, grey, plugin="pillow", duration=100)  # read back as [H, W] frames
    assert next(iio.imiter(gif)).shape == (40, 60)
    frames = read_video(gif)
    assert frames.shape == (5, 40, 60, 3) and np.array_equal(frames[..., 0], grey)
    assert np.array_equal(frames[..., 0], frames[..., 1]) and np.array_equal(frames[..., 1], frames[..., 2])


@pytest.mark.parametrize("fps", ["fast", 0.0, float("nan"), [8.0, 8.0], True])
def test_a_bad_fps_attribute_is_one_line_for_index_and_decode(tmp_path, capsys, fps):
    from lwm.data.codecs import PixelCodec

    path = tmp_path / "f.h5"
    write_latents(path, PixelCodec(size=8), np.zeros((3, 8, 8, 3), dtype=np.uint8))
    with h5py.File(path, "a") as f:
        f.attrs["fps"] = fps
    assert main(["data", "index", str(tmp_path)]) == 2
    assert f"{path}: attribute 'fps' must be a number > 0" in capsys.readouterr().err
    assert main(["data", "decode", str(path), "--out", str(tmp_path / "v.mp4"), "--fps", "8"]) == 2
    assert f"{path}: attribute 'fps' must be a number > 0" in capsys.readouterr().err


def test_encoding_again_where_a_videos_files_are_is_refused_before_reading_unless_overwrite(tmp_path, capsys,
                                                                                            monkeypatch):
    """--segment 3 then --segment 5 would leave long_0002.h5 of the first beside the second's files (its frames
    indexed twice): refused, naming a file; with overwrite, all of that name's old files are replaced."""
    from lwm.data import convert

    frames = np.random.default_rng(3).integers(0, 256, (7, 24, 24, 3), dtype=np.uint8)
    video = write_video(tmp_path / "long.gif", frames)
    out = tmp_path / "h5"
    assert main(["data", "encode", str(video), "--out", str(out), "--size", "16", "--segment", "3"]) == 0
    (out / "long_final.h5").write_bytes(b"not this video's")  # another name: untouched
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    read = []
    monkeypatch.setattr(convert, "iter_video", lambda *a, **k: read.append(a) or iter(()))
    for segment in (["--segment", "5"], []):
        assert main(["data", "encode", str(video), "--out", str(out), "--size", "16", *segment]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [f"error: {out / 'long_0000.h5'} and 2 more of that name: already there, where long.gif "
                       f"would be encoded (--overwrite replaces them, or encode into another --out)"]
    assert not read and {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()
    convert.encode_videos([str(video)], out, size=16, segment=5, log=lambda line: None, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["long_0000.h5", "long_0001.h5", "long_final.h5"]
    assert [inspect_h5(out / f"long_000{i}.h5").frames for i in range(2)] == [5, 2]
    convert.encode_videos([str(video)], out, size=16, log=lambda line: None, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["long.h5", "long_final.h5"]


PIXEL_100 = ("--size 100: the pixel codec needs a positive multiple of 8 (2x2 pixels per latent, and the model "
             "needs latents in multiples of 4: the tokenizer downsamples by 4): use --size 96 or 104")


@pytest.mark.parametrize(("codec", "size", "message"), [
    ("pixel", 100, PIXEL_100),
    ("pixel", 99, "--size 99: the pixel codec needs a positive multiple of 8 (2x2 pixels per latent, and the model "
                  "needs latents in multiples of 4: the tokenizer downsamples by 4): use --size 96 or 104"),
    ("pixel", 4, "--size 4: the pixel codec needs a positive multiple of 8 (2x2 pixels per latent, and the model "
                 "needs latents in multiples of 4: the tokenizer downsamples by 4): use --size 8"),
    ("pixel", 0, "--size 0: the pixel codec needs a positive multiple of 8 (2x2 pixels per latent, and the model "
                 "needs latents in multiples of 4: the tokenizer downsamples by 4): use --size 8"),
    ("wan", 520, "--size 520: the wan codec needs a positive multiple of 32 (8x8 pixels per latent, and the model "
                 "needs latents in multiples of 4: the tokenizer downsamples by 4): use --size 512 or 544"),
    ("hunyuan", 36, "--size 36: the hunyuan codec needs a positive multiple of 32 (8x8 pixels per latent, and the "
                    "model needs latents in multiples of 4: the tokenizer downsamples by 4): use --size 32 or 64"),
])
def test_a_size_whose_latents_the_model_cannot_train_on_is_refused_before_any_video_is_read(
        tmp_path, capsys, monkeypatch, codec, size, message):
    """`--size 100` wrote 50x50 latents, which no model can train on (the tokenizer downsamples by 4): refused with
    the nearest valid sizes, before a video is read, a folder made or a VAE (or diffusers) loaded."""
    video = write_video(tmp_path / "v.mp4", np.zeros((2, 16, 16, 3), dtype=np.uint8))
    monkeypatch.setattr(convert, "iter_video", lambda *a, **k: pytest.fail("a video was read"))
    monkeypatch.setattr(convert, "source_fps", lambda *a, **k: pytest.fail("a video was read"))
    monkeypatch.setitem(sys.modules, "diffusers", None)  # importing it fails: the check needs no diffusers
    argv = ["data", "encode", str(video), "--out", str(tmp_path / "o"), "--codec", codec, "--size", str(size)]
    assert main(argv + (["--vae", str(tmp_path)] if codec != "pixel" else [])) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {message}"]
    assert not (tmp_path / "o").exists()
    with pytest.raises(DataError) as e:  # `lwm data atari` makes its codec so
        make_codec(codec, tmp_path, size)
    assert str(e.value) == message


@pytest.mark.parametrize(("codec", "size", "latents"), [("pixel", 8, 4), ("pixel", 96, 48), ("wan", 32, 4),
                                                       ("cogvideox", 544, 68)])
def test_sizes_whose_latents_are_multiples_of_four_pass(codec, size, latents):
    assert convert.size_problem(codec, size) is None
    assert size // (2 if codec == "pixel" else 8) == latents and latents % 4 == 0


@pytest.mark.parametrize(("source", "size", "note"), [
    ((96, 160), 128, "; 160x96 frames centre-cropped to 96x96, then resized to 128x128"),  # (height, width)
    ((160, 96), 32, "; 96x160 frames centre-cropped to 96x96, then resized to 32x32"),
    ((16, 24), 16, "; 24x16 frames centre-cropped to 16x16"),
    ((40, 40), 16, "; 40x40 frames resized to 16x16"),
    ((128, 128), 128, ""),
])
def test_framing_says_the_crop_and_the_resize(source, size, note):
    assert framing(source, size) == note


@pytest.mark.slow
def test_the_encode_line_gives_the_latent_shape_and_the_centre_crop(tmp_path, capsys):
    """A 160x96 video lost 40% of its width to the centre crop, and the line said only `(3 frames)`."""
    video = write_video(tmp_path / "wide.mp4", np.zeros((3, 96, 160, 3), dtype=np.uint8))
    assert main(["data", "encode", str(video), "--out", str(tmp_path / "d")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {tmp_path / 'd' / 'wide.h5'} (3 frames, latents [3, 16, 64, 64]; 160x96 frames centre-cropped to 96x96, "
        f"then resized to 128x128)"]
    with h5py.File(tmp_path / "d" / "wide.h5") as f:
        assert f["latents"].shape == (3, 16, 64, 64)


def test_overwrite_replaces_only_the_videos_own_files(tmp_path):
    """Each file records its video: scene_0001.h5 and scene_0002.h5 of scene_0001.gif and scene_0002.gif are not
    segments of scene.gif, which --overwrite replaces; another video's file under a segment's name is refused."""
    rng = np.random.default_rng(0)
    videos = {name: write_video(tmp_path / f"{name}.gif", rng.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8))
              for name in ("scene_0001", "scene_0002", "scene")}
    out = tmp_path / "h5"
    convert.encode_videos([str(videos["scene_0001"]), str(videos["scene_0002"])], out, size=16, log=lambda line: None)
    others = {p.name: p.read_bytes() for p in out.iterdir()}
    assert convert.source_video(out / "scene_0001.h5") == "scene_0001.gif"
    convert.encode_videos([str(videos["scene"])], out, size=16, log=lambda line: None)  # nothing of its own there
    convert.encode_videos([str(videos["scene"])], out, size=16, log=lambda line: None, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["scene.h5", "scene_0001.h5", "scene_0002.h5"]
    assert all((out / name).read_bytes() == data for name, data in others.items())  # untouched
    whole = (out / "scene.h5").read_bytes()
    with pytest.raises(DataError, match=r"scene\.gif: would overwrite .*scene_0001\.h5, encoded from scene_0001\.gif"):
        convert.encode_videos([str(videos["scene"])], out, size=16, segment=1, log=lambda line: None, overwrite=True)
    assert (out / "scene_0001.h5").read_bytes() == others["scene_0001.h5"]
    # the failed encode's first segment is removed, its old file kept: never both, indexed twice
    assert sorted(p.name for p in out.iterdir()) == ["scene.h5", "scene_0001.h5", "scene_0002.h5"]
    assert (out / "scene.h5").read_bytes() == whole


def test_a_failed_overwrite_leaves_the_old_files_as_they_were(tmp_path, monkeypatch):
    """Each new segment was renamed over the old one as it was written: a failure later in the video removed the
    new ones, and with them the old files of those names (a torn mix of old segments was left)."""
    frames = np.random.default_rng(5).integers(0, 256, (12, 16, 16, 3), dtype=np.uint8)
    video = write_video(tmp_path / "long.gif", frames)
    out = tmp_path / "h5"
    convert.encode_videos([str(video)], out, size=16, segment=3, log=lambda line: None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == [f"long_000{i}.h5" for i in range(4)]
    real = convert.iter_video

    def broken(*args, **kwargs):  # a decode error after two files' worth of frames
        for i, frame in enumerate(real(*args, **kwargs)):
            if i == 8:
                raise DataError(f"{video}: broken frame 8")
            yield frame

    monkeypatch.setattr(convert, "iter_video", broken)
    lines = []
    with pytest.raises(DataError, match="broken frame 8"):
        convert.encode_videos([str(video)], out, size=16, segment=3, log=lines.append, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not lines  # no temporary files either


@pytest.mark.slow
def test_a_segmented_overwrite_keeps_another_videos_file_of_the_name(tmp_path):
    """long.h5 of long.mp4 was removed by `encode long.gif --segment 3 --overwrite`, which never writes long.h5."""
    rng = np.random.default_rng(6)
    mp4 = write_video(tmp_path / "long.mp4", rng.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8))
    gif = write_video(tmp_path / "long.gif", rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8))
    out = tmp_path / "h5"
    convert.encode_videos([str(mp4)], out, size=16, log=lambda line: None)
    kept = (out / "long.h5").read_bytes()
    convert.encode_videos([str(gif)], out, size=16, segment=3, log=lambda line: None)  # refused no more either
    convert.encode_videos([str(gif)], out, size=16, segment=3, log=lambda line: None, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["long.h5", "long_0000.h5", "long_0001.h5"]
    assert (out / "long.h5").read_bytes() == kept and convert.source_video(out / "long_0000.h5") == "long.gif"


def test_a_failed_encode_leaves_no_new_folder(tmp_path, capsys):
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video")
    assert main(["data", "encode", str(broken), "--out", str(tmp_path / "new")]) == 2
    assert str(broken) in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_decode_refuses_an_existing_video_unless_overwrite(tmp_path, capsys):
    """`lwm data decode x.h5 --out clip.mp4` replaced the source clip.mp4 with its decoded crop."""
    data = _pixel_file(tmp_path / "x.h5")
    out = tmp_path / "clip.gif"
    out.write_bytes(b"the user's video")
    assert main(["data", "decode", str(data), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {out}: already there (--overwrite replaces it)"]
    assert out.read_bytes() == b"the user's video"
    assert main(["data", "decode", str(data), "--out", str(out), "--overwrite"]) == 0
    assert iio.imread(out, index=None).shape[0] == 3


def test_16_bit_frames_are_read_by_their_high_byte(tmp_path):
    """A 16-bit grayscale PNG ramp (0, 1000, 2000, ...) read as uint8 by a cast wrapped modulo 256."""
    from PIL import Image

    ramp = (np.arange(64)[None].repeat(8, 0) * 1000).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    frame = next(convert.iter_video(tmp_path / "deep.png"))
    assert frame.dtype == np.uint8 and np.array_equal(frame[0, :, 0], (ramp[0] >> 8).astype(np.uint8))
    assert (np.diff(frame[0, :, 0].astype(int)) >= 0).all()

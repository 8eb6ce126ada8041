"""lwm/video.py: the grid of rows, the latent preview, the frame order of a written video (known answers), and the
output paths refused before any work."""

from __future__ import annotations

import gc
import sys

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from lwm.utils.errors import DataError
from lwm.utils.video import check_output, grid, latent_preview, write_video


def test_grid_stacks_rows_top_to_bottom():
    a, b = np.full((2, 4, 5, 3), 10, np.uint8), np.full((2, 4, 5, 3), 200, np.uint8)
    g = grid([a, b], pad=1)
    assert g.shape == (2, 9, 5, 3)
    assert (g[:, :4] == 10).all() and (g[:, 4] == 255).all() and (g[:, 5:] == 200).all()


def test_grid_shows_a_short_row_then_blank_cells():
    """A ground truth the file has only part of: its frames, then blank (BLANK, black) cells; the video is as long as
    the longest row."""
    from lwm.utils.video import BLANK

    a, b = np.full((3, 4, 5, 3), 10, np.uint8), np.full((1, 4, 5, 3), 200, np.uint8)
    g = grid([b, a], pad=1)
    assert g.shape == (3, 9, 5, 3) and BLANK == 0
    assert (g[0, :4] == 200).all() and (g[1:, :4] == 0).all() and (g[:, 4] == 255).all() and (g[:, 5:] == 10).all()


def test_latent_preview_maps_channels_0_1_2_to_rgb_in_place():
    x = -torch.ones(1, 4, 2, 3)
    x[0, 0, 0, 2] = 1.0  # channel 0 (red) at row 0, column 2
    x[0, 2, 1, 0] = 1.0  # channel 2 (blue) at row 1, column 0
    p = latent_preview(x, scale=2)
    assert p.shape == (1, 4, 6, 3)
    assert p[0, 0:2, 4:6].tolist() == [[[255, 0, 0]] * 2] * 2
    assert p[0, 2:4, 0:2].tolist() == [[[0, 0, 255]] * 2] * 2
    assert p.sum() == 255 * 8


def test_a_gif_keeps_the_frame_order(tmp_path):
    frames = np.zeros((3, 8, 8, 3), np.uint8)
    for t in range(3):
        frames[t, ..., t] = 255  # red, green, blue
    back = iio.imread(write_video(tmp_path / "v.gif", frames), index=None)[..., :3]
    assert [int(np.argmax(f[0, 0])) for f in back] == [0, 1, 2]


def test_check_output_refuses_a_folder_a_file_parent_and_an_input(tmp_path):
    (tmp_path / "dir.gif").mkdir()
    (tmp_path / "file").write_text("x")
    data = tmp_path / "in.h5"
    data.write_bytes(b"data")
    (tmp_path / "link.h5").hardlink_to(data)
    with pytest.raises(DataError) as e:
        check_output(tmp_path / "dir.gif")
    assert str(e.value) == f"{tmp_path / 'dir.gif'}: is a folder, not a file to write (--out)"
    with pytest.raises(DataError) as e:
        check_output(tmp_path / "file/sub/x.gif")
    assert str(e.value).startswith(f"{tmp_path / 'file/sub/x.gif'}: cannot be created") and f"{tmp_path / 'file'} (" in str(e.value)
    with pytest.raises(DataError, match=r"x\.avi: the video must end in one of \.mp4, \.gif"):
        check_output(tmp_path / "x.avi", suffixes=(".mp4", ".gif"))
    for same in (data, tmp_path / "link.h5", tmp_path / "sub/../in.h5"):  # the name itself, a hard link, a detour
        with pytest.raises(DataError) as e:
            check_output(same, "the latents", {"--data": data})
        assert str(e.value) == f"{same}: is the input --data {data}; writing it (the latents) would destroy it"
    assert check_output(tmp_path / "new/deeper/v.gif", inputs={"--data": data}) == tmp_path / "new/deeper/v.gif"
    assert data.read_bytes() == b"data" and not (tmp_path / "new").exists()  # checks only, nothing made


def test_write_video_into_a_folder_is_one_error_and_no_traceback(tmp_path, monkeypatch):
    """imageio writing into a folder raised, then raised again from its plugin's __del__ ("Exception ignored ...
    IsADirectoryError" on stderr)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    (tmp_path / "v.gif").mkdir()
    with pytest.raises(IsADirectoryError) as e:
        write_video(tmp_path / "v.gif", np.zeros((2, 8, 8, 3), np.uint8))
    assert e.value.filename2 == str(tmp_path / "v.gif")
    gc.collect()
    assert unraisable == [] and list((tmp_path / "v.gif").iterdir()) == []


def test_a_failed_video_write_keeps_the_old_file(tmp_path, monkeypatch):
    """The gif writer opened (and so emptied) the file before encoding into it: a failure lost the old video."""
    from PIL import Image

    old = write_video(tmp_path / "v.gif", np.zeros((2, 8, 8, 3), np.uint8)).read_bytes()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", full)
    monkeypatch.setattr(sys, "unraisablehook", lambda _: None)  # imageio retries the write when collected
    with pytest.raises(OSError, match="No space left"):
        write_video(tmp_path / "v.gif", np.full((2, 8, 8, 3), 255, np.uint8))
    gc.collect()
    assert (tmp_path / "v.gif").read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["v.gif"]


@pytest.mark.slow
def test_a_video_write_cut_off_while_writing_the_file_keeps_the_old_one(tmp_path, monkeypatch):
    """The new video goes to a temporary name and replaces the old one in one rename: a write that fails (a full
    disk) leaves the old file whole and no temporary behind."""
    import lwm.utils.video

    old = write_video(tmp_path / "v.mp4", np.zeros((2, 8, 8, 3), np.uint8)).read_bytes()

    def cut(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lwm.utils.video.os, "replace", cut)
    with pytest.raises(OSError, match="No space left"):
        write_video(tmp_path / "v.mp4", np.full((2, 8, 8, 3), 255, np.uint8))
    assert (tmp_path / "v.mp4").read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["v.mp4"]


@pytest.mark.slow
def test_a_video_write_removes_the_temp_videos_of_dead_writers_only(tmp_path):
    """A run killed while writing ``videos/step_N.mp4`` leaves its temp file; the next video write in that folder
    removes it (any video's name), not a live writer's, nor another file's."""
    import os
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    stale = [tmp_path / f".step_0000500.mp4.tmp-{host}-{dead.pid}", tmp_path / f".a.gif.tmp-{host}-{dead.pid}"]
    kept = [tmp_path / f".step_0000600.mp4.tmp-{host}-{os.getppid()}",  # still being written
            tmp_path / f".notes.txt.tmp-{host}-{dead.pid}"]  # not a video
    for path in stale + kept:
        path.write_bytes(b"torn")
    write_video(tmp_path / "step_0001000.mp4", np.zeros((2, 8, 8, 3), np.uint8))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["step_0001000.mp4"] + [p.name for p in kept])


@pytest.mark.slow
def test_a_temp_video_that_cannot_be_removed_does_not_fail_the_write(tmp_path, monkeypatch):
    """Another user's stale temp file in a shared folder (not ours to remove): the video is written and returned."""
    import os
    import pathlib
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    theirs = tmp_path / f".other.mp4.tmp-{socket.gethostname()}-{dead.pid}"
    theirs.write_bytes(b"torn")
    unlink = pathlib.Path.unlink

    def refuse(self, missing_ok=False):
        if self == theirs:
            raise PermissionError(1, "Operation not permitted", str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", refuse)
    path = write_video(tmp_path / "mine.mp4", np.zeros((2, 8, 8, 3), np.uint8))
    assert path == tmp_path / "mine.mp4" and path.is_file() and theirs.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".mine.mp4.tmp-")]


def test_an_mp4_taller_than_h264_takes_is_refused_in_one_line(tmp_path):
    """libx264 takes at most 16384 pixels a side: a grid of 33 rows of 512 px (lwm generate --rollouts 32 on 512 px
    VAE data) is refused by name, not an encoder traceback after all the work."""
    from lwm.utils.video import check_mp4_size

    with pytest.raises(DataError, match=r"g\.mp4: a 17024x512 video; H\.264 takes at most 16384 pixels a side"):
        check_mp4_size(33 * 516 - 4, 512, tmp_path / "g.mp4")
    check_mp4_size(16384, 512, tmp_path / "ok.mp4")
    with pytest.raises(DataError, match="H.264 takes at most"):
        write_video(tmp_path / "g.mp4", np.zeros((1, 16386, 8, 3), np.uint8))
    assert not (tmp_path / "g.mp4").exists()


def test_gif_frame_delays_are_whole_centiseconds_of_at_least_20_ms():
    from lwm.utils.video import gif_delay_ms

    assert [gif_delay_ms(fps) for fps in (8, 10, 24, 50, 60, 120)] == [120, 100, 40, 20, 20, 20]

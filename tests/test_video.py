"""lwm/video.py: the grid of rows, the latent preview, the frame order of a written video (known answers)."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import torch

from lwm.video import grid, latent_preview, write_video


def test_grid_stacks_rows_top_to_bottom():
    a, b = np.full((2, 4, 5, 3), 10, np.uint8), np.full((2, 4, 5, 3), 200, np.uint8)
    g = grid([a, b], pad=1)
    assert g.shape == (2, 9, 5, 3)
    assert (g[:, :4] == 10).all() and (g[:, 4] == 255).all() and (g[:, 5:] == 200).all()


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

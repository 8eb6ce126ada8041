"""Videos of latent clips: a latent-channel preview (until a codec decodes them to pixels), grids of rollouts
beside the ground truth, and mp4 / gif files (imageio: PyAV for mp4, Pillow for gif)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

VIDEO_SUFFIXES = (".mp4", ".gif")


def latent_preview(latents: Tensor, scale: int = 4) -> np.ndarray:
    """``[T, C, H, W]`` latents in [-1, 1] -> ``uint8 [T, H*scale, W*scale, 3]``: channels 0, 1, 2 as R, G, B
    (a look at the latents, not the video they encode), enlarged by ``scale`` (nearest)."""
    if latents.ndim != 4:
        raise ValueError(f"latents: expected [T, C, H, W], got {tuple(latents.shape)}")
    rgb = latents[:, :3].float()
    if rgb.shape[1] < 3:  # fewer channels: repeat the first
        rgb = torch.cat([rgb, rgb[:, :1].expand(-1, 3 - rgb.shape[1], -1, -1)], dim=1)
    rgb = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    rgb = rgb.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
    return rgb.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def grid(rows: list[np.ndarray], pad: int = 4) -> np.ndarray:
    """Stack videos ``[T, H, W, 3]`` (same shape) top to bottom with ``pad`` white pixels between rows."""
    T, H, W, _ = rows[0].shape
    out = np.full((T, len(rows) * H + (len(rows) - 1) * pad, W, 3), 255, dtype=np.uint8)
    for i, row in enumerate(rows):
        if row.shape != rows[0].shape:
            raise ValueError(f"row {i}: shape {row.shape} differs from {rows[0].shape}")
        out[:, i * (H + pad) : i * (H + pad) + H] = row
    return out


def write_video(path: str | Path, frames: np.ndarray, fps: int = 8) -> Path:
    """Write ``uint8 [T, H, W, 3]`` as ``.mp4`` (H.264, even sizes padded) or ``.gif``."""
    import imageio.v3 as iio

    path = Path(path)
    if path.suffix not in VIDEO_SUFFIXES:
        raise ValueError(f"{path}: the video must end in one of {VIDEO_SUFFIXES}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".mp4":
        T, H, W, _ = frames.shape
        frames = np.pad(frames, ((0, 0), (0, H % 2), (0, W % 2), (0, 0)))  # H.264 wants even sizes
        iio.imwrite(path, frames, plugin="pyav", codec="libx264", fps=fps)
    else:
        iio.imwrite(path, frames, plugin="pillow", duration=1000 / fps, loop=0)
    return path

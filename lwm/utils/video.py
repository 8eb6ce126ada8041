"""Videos of latent clips: a latent-channel preview (until a codec decodes them to pixels), grids of rollouts
beside the ground truth, and mp4 / gif files (imageio: PyAV for mp4, Pillow for gif)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lwm.utils.args import MAX_FPS
from lwm.utils.errors import DataError, refuse_first
from lwm.utils.files import atomic_write, remove_stale_temp_files

VIDEO_SUFFIXES = (".mp4", ".gif")


def check_output(path: str | Path, what: str = "--out", inputs: Mapping[str, str | Path] | None = None,
                 suffixes: tuple[str, ...] | None = None, overwrite: bool = True) -> Path:
    """Refuse an output ``path`` before any work, in one :class:`DataError` line naming it: of another suffix than
    ``suffixes``, a folder or device, one of the ``inputs``, there (unless ``overwrite``), or where it cannot write."""
    path = Path(path)
    same = next((f"{option} {source}" for option, source in (inputs or {}).items() if _same_file(path, Path(source))),
                None)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:  # the folders below the first existing one get made
        parent = parent.parent
    refuse_first(
        (f"{path}: the video must end in one of {', '.join(suffixes or ())} ({what})",
         suffixes is not None and path.suffix not in suffixes),
        (f"{path}: is a {'folder' if path.is_dir() else 'device or pipe'}, not a file to write ({what})",
         path.exists() and not path.is_file()),
        (f"{path}: is the input {same}; writing it ({what}) would destroy it", same is not None),
        (f"{path}: already there (--overwrite replaces it)", path.exists() and not overwrite),
        (f"{path}: cannot be created, {'no permission to write in' if parent.is_dir() else 'not a folder:'} {parent} "
         f"({what})", not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK))), error=DataError)
    return path


def _same_file(a: Path, b: Path) -> bool:
    """One file under two names (a hard link, a symlink, ``./x`` and ``x``), or one path where either is missing."""
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


PREVIEW_SCALE = 4  # latent_preview's enlargement
GRID_PAD = 4  # white pixels between a grid's rows


def latent_preview(latents: Tensor, scale: int = PREVIEW_SCALE) -> np.ndarray:
    """``[T, C, H, W]`` latents in [-1, 1] -> ``uint8 [T, H*scale, W*scale, 3]``."""
    channels = [c if c < latents.shape[1] else 0 for c in range(3)]  # fewer than 3: the first again
    rgb = ((latents[:, channels].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    rgb = rgb.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
    return rgb.permute(0, 2, 3, 1).contiguous().cpu().numpy()


BLANK = 0  # the value of a grid cell with no frame


def grid(rows: list[np.ndarray], pad: int = GRID_PAD) -> np.ndarray:
    """Stack videos ``[T, H, W, 3]`` (the same ``H, W``) top to bottom with ``pad`` white pixels between rows."""
    _, H, W, _ = rows[0].shape
    T = max(row.shape[0] for row in rows)
    out = np.full((T, len(rows) * H + (len(rows) - 1) * pad, W, 3), 255, dtype=np.uint8)
    for i, row in enumerate(rows):
        out[:, i * (H + pad) : i * (H + pad) + H] = BLANK
        out[: row.shape[0], i * (H + pad) : i * (H + pad) + H] = row
    return out


MP4_MAX_SIDE = 16384  # libx264's largest frame height or width


def check_mp4_size(height: int, width: int, path: str | Path) -> None:
    """Refuse (one line) an mp4 frame libx264 cannot encode, before the work that would fill it."""
    if max(height + height % 2, width + width % 2) > MP4_MAX_SIDE:
        raise DataError(f"{path}: a {height}x{width} video; H.264 takes at most {MP4_MAX_SIDE} pixels a side (fewer "
                        f"rollouts, or a .gif)")


def gif_delay_ms(fps: float) -> int:
    """A GIF frame's delay: whole centiseconds (the format's unit: 8 fps plays at 8.33), at least 20 ms (browsers
    play shorter delays, 10 ms included, at 100 ms: a 60 fps GIF would run 6x slow; GIFs top out at 50 fps)."""
    return max(20, round(100 / fps) * 10)


def write_video(path: str | Path, frames: np.ndarray, fps: float = 8) -> Path:
    """Write ``uint8 [T, H, W, 3]`` as ``.mp4`` (H.264, padded even) or else ``.gif`` (path: :func:`check_output`)."""
    import imageio.v3 as iio

    fps = min(fps, MAX_FPS)
    path = Path(path)
    # encoded to bytes first: imageio opening a file itself retries a failed write on garbage collection
    if path.suffix == ".mp4":
        T, H, W, _ = frames.shape
        check_mp4_size(H, W, path)
        frames = np.pad(frames, ((0, 0), (0, H % 2), (0, W % 2), (0, 0)))  # H.264 wants even sizes
        data = iio.imwrite("<bytes>", frames, extension=".mp4", plugin="pyav", codec="libx264", fps=fps)
    else:
        data = iio.imwrite("<bytes>", frames, extension=".gif", plugin="pillow", duration=gif_delay_ms(fps), loop=0)
    atomic_write(path, lambda f: f.write(data))
    # of a video write killed mid-way (any video's name)
    remove_stale_temp_files(path.parent, target=lambda name: Path(name).suffix in VIDEO_SUFFIXES)
    return path

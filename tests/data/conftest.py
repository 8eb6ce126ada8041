"""Fixtures for the data-layer tests: small h5 files with a known content pattern, written into tmp_path."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

C, H, W = 4, 8, 8


def pattern(frames: int, offset: float = 0.0, channels: int = C, height: int = H, width: int = W) -> np.ndarray:
    """latents[t, c, h, w] = offset + t / 1000 + (c*64 + h*8 + w) / 1e5: every frame and position is distinct and
    the frame index can be read back from the value. Stays inside [-1, 1] for offset in [-0.5, 0.5], t < 250."""
    t = np.arange(frames, dtype=np.float64)[:, None, None, None] / 1000.0
    pos = np.arange(channels * height * width, dtype=np.float64).reshape(1, channels, height, width) / 1e5
    return (offset + t + pos).astype(np.float32)


def action_pattern(frames: int, base: int = 0) -> np.ndarray:
    return (base + np.arange(frames) % 7).astype(np.int32)


def write_h5(
    path: Path,
    frames: int = 20,
    *,
    offset: float = 0.0,
    actions: bool | np.ndarray = False,
    world_label=None,
    key: str = "latents",
    data: np.ndarray | None = None,
    channels: int = C,
    height: int = H,
    width: int = W,
    chunks=None,
    compression=None,
) -> Path:
    """Write one latents file. ``data`` overrides the pattern; ``actions=True`` writes ``action_pattern``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if data is None:
        data = pattern(frames, offset, channels, height, width)
    with h5py.File(path, "w") as f:
        f.create_dataset(key, data=data, chunks=chunks, compression=compression)
        if actions is True:
            f.create_dataset("actions", data=action_pattern(data.shape[0]))
        elif actions is not False:
            f.create_dataset("actions", data=actions)
        if world_label is not None:
            f.attrs["world_label"] = world_label
    return path


@pytest.fixture
def make_h5(tmp_path):
    """``make_h5(name, frames=20, **kw) -> Path`` writes ``tmp_path/name`` (see ``write_h5``)."""

    def make(name: str, frames: int = 20, **kw) -> Path:
        return write_h5(tmp_path / name, frames, **kw)

    return make


@pytest.fixture
def good_h5(make_h5) -> Path:
    """40 frames, actions, world_label 3."""
    return make_h5("good.h5", 40, actions=True, world_label=3)


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A folder of 10 good files ep_00..ep_09 with 20 + 3*i frames (some with actions / labels)."""
    d = tmp_path / "data"
    for i in range(10):
        write_h5(d / f"ep_{i:02d}.h5", 20 + 3 * i, offset=i / 100, actions=i % 2 == 0,
                 world_label=i if i % 3 == 0 else None)
    return d


@pytest.fixture
def window_files(tmp_path):
    """Files for the window dataset: name -> (frames, offset, has_actions, world_label).

    a: 40 frames, actions, label 5; b: 23 frames, no actions, no label; c: 100 frames, actions, no label;
    d: 3 frames (shorter than the window 4 used in the tests)."""
    spec = {
        "a.h5": (40, -0.5, True, 5),
        "b.h5": (23, 0.25, False, None),
        "c.h5": (100, 0.5, True, None),
        "d.h5": (3, 0.0, True, 1),
    }
    d = tmp_path / "windows"
    for name, (frames, offset, act, label) in spec.items():
        write_h5(d / name, frames, offset=offset, actions=act, world_label=label)
    return d, spec

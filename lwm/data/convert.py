"""Videos <-> h5 latent files through a codec: ``lwm data encode`` and ``lwm data decode``.

    lwm data encode VIDEO... --codec pixel --out DIR [--fps-stride N]   one h5 per video (then `lwm data index DIR`)
    lwm data decode FILE.h5 --out VIDEO.mp4|.gif [--fps 8]

Frames are centre-cropped to a square and resized to the codec's size (128x128 for ``pixel``).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from lwm.data.codecs import PixelCodec, codec_from_attr
from lwm.data.h5 import DataError, first_line, inspect_h5

CODECS = {"pixel": PixelCodec}


def square_resize(frames: np.ndarray, size: int) -> np.ndarray:
    """``uint8 [T, H, W, 3]`` -> ``[T, size, size, 3]``: centre crop to a square, then a bilinear resize."""
    from PIL import Image

    T, H, W, _ = frames.shape
    side = min(H, W)
    top, left = (H - side) // 2, (W - side) // 2
    crop = frames[:, top : top + side, left : left + side]
    if side == size:
        return np.ascontiguousarray(crop)
    return np.stack([np.asarray(Image.fromarray(f).resize((size, size), Image.BILINEAR)) for f in crop])


def read_video(path: str | Path, stride: int = 1) -> np.ndarray:
    """All frames of a video file as ``uint8 [T, H, W, 3]`` (every ``stride``-th)."""
    import imageio.v3 as iio

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: video not found")
    try:
        frames = iio.imread(path, index=None)
    except Exception as e:  # imageio/PyAV raise many kinds
        raise DataError(f"{path}: cannot be read as a video ({first_line(e)})") from None
    if frames.ndim == 3:  # one frame (an image)
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] not in (3, 4):
        raise DataError(f"{path}: expected colour frames [T, H, W, 3], got {frames.shape}")
    return frames[::stride, ..., :3].astype(np.uint8)


def encode_videos(videos: list[str], out: str | Path, codec: str = "pixel", stride: int = 1) -> list[Path]:
    """Encode each video to ``out/<name>.h5`` (``latents`` float16 and the ``codec`` attribute)."""
    if codec not in CODECS:
        raise DataError(f"--codec {codec}: unknown (known: {', '.join(CODECS)})")
    c = CODECS[codec]()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for video in videos:
        frames = square_resize(read_video(video, stride), c.size)
        target = out / f"{Path(video).stem}.h5"
        with h5py.File(target, "w") as f:
            f.create_dataset("latents", data=c.encode(frames).astype(np.float16), chunks=(1, 16, c.size // 2, c.size // 2))
            f.attrs["codec"] = c.attr
        written.append(target)
    return written


def decode_file(path: str | Path, out: str | Path, fps: int = 8) -> Path:
    """Decode an h5 file through the codec its ``codec`` attribute names and write the video."""
    from lwm.video import write_video

    info = inspect_h5(path, check_values=False)
    with h5py.File(path, "r") as f:
        codec = codec_from_attr(f.attrs.get("codec"), str(path))
        if codec is None:
            raise DataError(f"{path}: no known codec in its 'codec' attribute; cannot decode to pixels")
        latents = np.asarray(f[info.key][...], dtype=np.float32)
    return write_video(out, codec.decode(latents), fps)

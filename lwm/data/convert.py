"""Videos <-> h5 latent files through a codec: ``lwm data encode`` and ``lwm data decode``.

    lwm data encode VIDEO... --out DIR [--codec pixel|wan|cogvideox|hunyuan] [--vae PATH] [--size S] [--stride N]
    lwm data decode FILE.h5 --out VIDEO.mp4|.gif [--fps 8] [--vae PATH]

Frames are centre-cropped to a square and resized to the codec's size (128x128 for ``pixel``, 512x512 for the
diffusers VAEs, which need ``--vae`` with their local weights; see :mod:`lwm.data.vae`). One h5 file per video
(then ``lwm data index DIR``).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch

from lwm.data.codecs import PixelCodec, codec_from_attr, missing_codec
from lwm.data.h5 import DataError, inspect_h5
from lwm.errors import first_line

CODECS = ("pixel", "wan", "cogvideox", "hunyuan")


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


def make_codec(codec: str = "pixel", vae: str | Path | None = None, size: int | None = None,
               device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The codec ``--codec`` names: the built-in pixel codec, or a diffusers VAE loaded from ``vae``."""
    if codec not in CODECS:
        raise DataError(f"--codec {codec}: unknown (known: {', '.join(CODECS)})")
    if codec == "pixel":
        if size is not None and (size < 2 or size % 2):
            raise DataError(f"--size {size}: the pixel codec needs an even size")
        return PixelCodec(size=size or 128)
    if vae is None:
        raise DataError(f"--codec {codec} needs --vae PATH, a local folder with the VAE's diffusers weights")
    from lwm.data.vae import VAECodec

    return VAECodec.load(codec, vae, size or 512, device, dtype)


def write_latents(target: Path, codec, frames: np.ndarray, actions: np.ndarray | None = None,
                  world_label: int | None = None, attrs: dict | None = None) -> int:
    """Encode ``uint8 [F, S, S, 3]`` frames into the h5 file ``target`` (``latents`` float16, ``codec``
    attribute; optional per-frame ``actions``, subsampled to latent steps, ``world_label`` and other ``attrs``); written to
    a temporary name and renamed, so a failure never leaves a half-written file. Returns the clipped count."""
    if hasattr(codec, "encode_counting"):
        latents, clipped = codec.encode_counting(frames)
    else:
        latents, clipped = codec.encode(frames), 0
    h = latents.shape[-1]
    tmp = target.with_name(target.name + ".tmp")
    with h5py.File(tmp, "w") as f:
        f.create_dataset("latents", data=latents.astype(np.float16), chunks=(1, latents.shape[1], h, h))
        if actions is not None:
            f.create_dataset("actions", data=np.asarray(actions)[:: codec.frames_per_latent][: len(latents)].astype(np.int64))
        if world_label is not None:
            f.attrs["world_label"] = np.int64(world_label)
        f.attrs["codec"] = codec.attr
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
    tmp.replace(target)
    return clipped


def encode_videos(videos: list[str], out: str | Path, codec: str = "pixel", stride: int = 1,
                  vae: str | Path | None = None, size: int | None = None, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, log=print) -> list[Path]:
    """Encode each video to ``out/<name>.h5``; ``log`` gets one line per file."""
    for video in videos:  # fail on a missing video before loading a VAE
        if not Path(video).is_file():
            raise DataError(f"{video}: video not found")
    stems: dict[str, str] = {}
    for video in videos:  # out/<name>.h5: two videos of one name would overwrite each other
        other = stems.setdefault(Path(video).stem, video)
        if other != video:
            raise DataError(f"{video}: same name as {other}, both would be written to {Path(out) / Path(video).stem}.h5 "
                            f"(encode them into different --out folders)")
    c = make_codec(codec, vae, size, device, dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for video in videos:
        frames = square_resize(read_video(video, stride), c.size)
        target = out / f"{Path(video).stem}.h5"
        clipped = write_latents(target, c, frames)
        note = f", {clipped} values clipped to [-1, 1]" if clipped else ""
        log(f"wrote {target} ({len(frames)} frames{note})")
        written.append(target)
    return written


def decode_file(path: str | Path, out: str | Path, fps: int = 8, vae: str | Path | None = None,
                device: str = "cpu") -> Path:
    """Decode an h5 file through the codec its ``codec`` attribute names and write the video."""
    from lwm.video import VIDEO_SUFFIXES, write_video

    if Path(out).suffix not in VIDEO_SUFFIXES:  # before any decoding
        raise DataError(f"{out}: the video must end in one of {', '.join(VIDEO_SUFFIXES)}")
    info = inspect_h5(path, check_values=False)
    with h5py.File(path, "r") as f:
        attr = f.attrs.get("codec")
        latents = np.asarray(f[info.key][...], dtype=np.float32)
    codec = codec_from_attr(attr, str(path), vae, device)
    if codec is None:
        raise DataError(f"{path}: cannot decode to pixels: {missing_codec(attr, str(path))}")
    return write_video(out, codec.decode(latents), fps)

"""Videos <-> h5 latent files through a codec: ``lwm data encode`` and ``lwm data decode``."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lwm.data.codecs import codec_from_attr, missing_codec, PixelCodec
from lwm.data.h5 import DataError, file_fps, inspect_h5, MODEL_MULTIPLE
from lwm.data.vae import latent_frames, SPATIAL, TEMPORAL, VAECodec, video_frames
from lwm.utils.errors import first_line
from lwm.utils.files import remove_stale_temp_files, temp_path
from lwm.utils.video import check_output, VIDEO_SUFFIXES, write_video

CODECS = ("pixel", "wan", "cogvideox", "hunyuan")


def check_size(codec: str, size: int | None) -> None:
    """Refuse a ``--size`` that gives latents the model cannot train on (height and width positive multiples of
    :data:`MODEL_MULTIPLE`)."""
    if size is None or codec not in CODECS:
        return
    cell = 2 if codec == "pixel" else SPATIAL  # pixels per latent cell
    step = cell * MODEL_MULTIPLE
    if size > 0 and size % step == 0:
        return
    below = size // step * step
    nearest = f"{below} or {below + step}" if below > 0 else f"{step}"
    if size > 0 and size % cell == 0:
        why = (f"the {codec} codec makes {size // cell}x{size // cell} latents, and the model needs latents in "
               f"multiples of {MODEL_MULTIPLE} (the tokenizer downsamples by {MODEL_MULTIPLE})")
    else:
        why = (f"the {codec} codec needs a positive multiple of {step} ({cell}x{cell} pixels per latent, and the "
               f"model needs latents in multiples of {MODEL_MULTIPLE}: the tokenizer downsamples by {MODEL_MULTIPLE})")
    raise DataError(f"--size {size}: {why}: use --size {nearest}")


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


def framing(source: tuple[int, int], size: int) -> str:
    """What :func:`square_resize` did to frames of ``(height, width)`` ``source``, for a log line."""
    H, W = source
    side = min(H, W)
    steps = [f"centre-cropped to {side}x{side}"] if H != W else []
    if side != size:
        steps.append(f"{'then ' if steps else ''}resized to {size}x{size}")
    return f"; {W}x{H} frames {', '.join(steps)}" if steps else ""


def iter_video(path: str | Path, stride: int = 1) -> Iterator[np.ndarray]:
    """The frames of a video file one at a time, ``uint8 [H, W, 3]`` (every ``stride``-th)."""
    import imageio.v3 as iio

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: video not found")
    frames = iio.imiter(path)
    index = 0
    while True:
        try:
            frame = next(frames)
        except StopIteration:
            return
        except Exception as e:  # imageio/PyAV raise many kinds
            raise DataError(f"{path}: cannot be read as a video at frame {index} ({first_line(e)})") from None
        if frame.ndim == 2:  # grayscale (a GIF or PNG of one channel): the same value in R, G and B
            frame = np.repeat(frame[..., None], 3, axis=-1)
        if frame.ndim != 3 or frame.shape[-1] not in (3, 4):
            raise DataError(f"{path}: expected colour frames [H, W, 3], got {frame.shape} at frame {index}")
        if index % stride == 0:
            yield _eight_bit(frame[..., :3], path, index)  # RGBA: the colour, the alpha dropped (not composited)
        index += 1


def _eight_bit(frame: np.ndarray, path: str | Path, index: int) -> np.ndarray:
    """A frame's colour as ``uint8``: 16-bit frames (PNG, TIFF) by their high byte (a cast would wrap them modulo
    256)."""
    if frame.dtype == np.uint8:
        return frame
    if frame.dtype == np.uint16:
        return (frame >> 8).astype(np.uint8)
    raise DataError(f"{path}: frames of {frame.dtype} values at frame {index}; lwm reads 8- and 16-bit colour")


def source_fps(path: str | Path) -> float | None:
    """The frame rate a video's container declares (None where it declares none; and for GIFs, whose per-frame delays
    PyAV reports as a rate of 100)."""
    import imageio.v3 as iio

    if Path(path).suffix.lower() == ".gif":
        return None
    try:
        fps = iio.immeta(path, plugin="pyav").get("fps")
    except Exception:  # not a container PyAV reads
        return None
    return float(fps) if fps and np.isfinite(fps) and fps > 0 else None


def read_video(path: str | Path, stride: int = 1) -> np.ndarray:
    """All frames of a video file as ``uint8 [T, H, W, 3]`` (every ``stride``-th)."""
    frames = list(iter_video(path, stride))
    if not frames:
        raise DataError(f"{path}: the video has no frames")
    return np.stack(frames)


def make_codec(codec: str = "pixel", vae: str | Path | None = None, size: int | None = None,
               device: str = "cpu", dtype: torch.dtype = torch.float32, tiling: bool = False):
    """The codec ``--codec`` names: the built-in pixel codec, or a diffusers VAE loaded from ``vae`` (``tiling``: it
    encodes in overlapping spatial tiles, see :func:`lwm.data.vae.load_vae`)."""
    if codec not in CODECS:
        raise DataError(f"--codec {codec}: unknown (known: {', '.join(CODECS)})")
    check_size(codec, size)  # before a VAE (or diffusers) is loaded
    if codec == "pixel":
        if vae is not None:  # (ignored, a wrong path went unnoticed)
            raise DataError(f"--vae {vae}: the pixel codec has no weights (--vae is for --codec {', '.join(CODECS[1:])})")
        return PixelCodec(size=size or 128)
    if vae is None:
        raise DataError(f"--codec {codec} needs --vae PATH, a local folder with the VAE's diffusers weights")

    return VAECodec.load(codec, vae, size or 512, device, dtype, tiling)


ENCODE_CHUNK = 256  # frames a frame-by-frame codec


def _encoded(codec, frames: np.ndarray) -> Iterator[tuple[np.ndarray, int]]:
    """``(latents, clipped)`` of ``frames``: chunk by chunk for a frame-by-frame codec, in one call for a temporal
    one (a causal video VAE encodes the clip as a whole)."""
    step = ENCODE_CHUNK if codec.frames_per_latent == 1 else max(1, len(frames))
    for i in range(0, len(frames), step):
        chunk = frames[i : i + step]
        if hasattr(codec, "encode_counting"):
            yield codec.encode_counting(chunk)
        else:
            yield codec.encode(chunk), 0


def write_latents(target: Path, codec, frames: np.ndarray, actions: np.ndarray | None = None,
                  world_label: int | None = None, attrs: dict | None = None) -> int:
    """Encode ``uint8 [F, S, S, 3]`` frames into the h5 file ``target`` (``latents`` float16, ``codec`` attribute;
    optional per-frame ``actions``, subsampled to latent steps, ``world_label`` and other ``attrs``)."""
    tmp = temp_path(target)
    clipped, n = 0, 0
    try:
        with h5py.File(tmp, "w") as f:
            ds = None
            for latents, count in _encoded(codec, frames):
                if ds is None:
                    total = len(frames) if codec.frames_per_latent == 1 else len(latents)
                    ds = f.create_dataset("latents", shape=(total, *latents.shape[1:]), dtype=np.float16,
                                          chunks=(1, *latents.shape[1:]))
                ds[n : n + len(latents)] = latents.astype(np.float16)
                n, clipped = n + len(latents), clipped + count
            if ds is None:
                raise DataError(f"{target}: no frames to encode")
            if actions is not None:
                f.create_dataset("actions", data=np.asarray(actions)[:: codec.frames_per_latent][:n].astype(np.int64))
            if world_label is not None:
                f.attrs["world_label"] = np.int64(world_label)
            f.attrs["codec"] = codec.attr
            for key, value in (attrs or {}).items():
                f.attrs[key] = value
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(target)
    return clipped


SOURCE_ATTR = "source_video"  # the file name of the video an encoded h5 file holds


def source_video(path: Path) -> str | None:
    """The video an h5 file was encoded from (its :data:`SOURCE_ATTR`; None: unreadable, or written before lwm
    recorded it)."""
    try:
        with h5py.File(path, "r") as f:
            value = f.attrs.get(SOURCE_ATTR)
    except OSError:
        return None
    return value.decode() if isinstance(value, bytes) else (str(value) if value is not None else None)


def earlier_outputs(out: Path, video: str | Path, segmented: bool = False) -> list[Path]:
    """The files in ``out`` an earlier encode of ``video`` wrote."""
    if not out.is_dir():
        return []
    name, stem = Path(video).name, Path(video).stem
    segment = re.compile(re.escape(stem) + r"_\d{4,}\.h5")
    return sorted(p for p in out.iterdir() if p.is_file() and (
        (p.name == f"{stem}.h5" and not segmented) or
        ((p.name == f"{stem}.h5" or segment.fullmatch(p.name)) and source_video(p) in (None, name))))


def encode_videos(videos: list[str], out: str | Path, codec: str = "pixel", stride: int = 1,
                  vae: str | Path | None = None, size: int | None = None, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, segment: int | None = None, log=print,
                  tiling: bool = False, overwrite: bool = False) -> list[Path]:
    """Encode each video to ``out/<name>.h5``, or with ``segment`` to ``out/<name>_0000.h5``, ..."""
    check_size(codec, size)
    for video in videos:  # fail on a missing video before loading a VAE
        if not Path(video).is_file():
            raise DataError(f"{video}: video not found")
    stems: dict[str, str] = {}
    for video in videos:  # out/<name>.h5
        other = stems.get(Path(video).stem)
        if other is None:
            stems[Path(video).stem] = video
            continue
        if os.path.samefile(other, video):
            raise DataError(f"{video}: given twice" + (f" (as {other} too)" if other != video else ""))
        raise DataError(f"{video}: same name as {other}, both would be written to {Path(out) / Path(video).stem}.h5 "
                        f"(encode them into different --out folders)")
    earlier = {video: earlier_outputs(Path(out), video, segment is not None) for video in videos}
    if not overwrite:
        for video, paths in earlier.items():
            if paths:
                more = f" and {len(paths) - 1} more of that name" if len(paths) > 1 else ""
                raise DataError(f"{paths[0]}{more}: already there, where {Path(video).name} would be encoded "
                                f"(--overwrite replaces them, or encode into another --out)")
    vae_codec = codec in CODECS[1:]
    if segment is not None and (segment < 1 or (vae_codec and ((segment - 1) % TEMPORAL or segment == 1))):
        raise DataError(f"--segment {segment}: " + ("must be >= 1" if segment < 1 else
                        f"a VAE codec encodes 1 + {TEMPORAL}k frames, k >= 1 (the rest of each file would be "
                        f"dropped; one frame is one latent, no transition); "
                        f"e.g. --segment {1 + TEMPORAL * max(1, (segment - 1) // TEMPORAL)}"))
    c = make_codec(codec, vae, size, device, dtype, tiling)
    out = Path(out)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out)  # of encodes killed mid-way
    written: list[Path] = []
    staged: list[tuple[Path, Path, str]] = []  # this video's

    def write(target: Path, frames: list[np.ndarray], video: str, fps: float | None, source: tuple[int, int]) -> None:
        if target in written or target in [t for _, t, _ in staged]:  # a segment name another video's file took
            raise DataError(f"{video}: would overwrite {target}, written from another video (rename one)")
        other = source_video(target) if target.is_file() and target not in earlier[video] else None
        if other is not None and other != Path(video).name:  # a file of another video under this name: kept
            raise DataError(f"{video}: would overwrite {target}, encoded from {other} (rename one, or encode into "
                            f"another --out)")
        attrs = {SOURCE_ATTR: Path(video).name, **({"fps": fps / stride} if fps else {})}
        tmp = temp_path(target)
        staged.append((tmp, target, ""))
        clipped = write_latents(tmp, c, np.stack(frames), attrs=attrs)
        with h5py.File(tmp, "r") as f:
            shape = list(f["latents"].shape)
        note = f", {clipped} values clipped to [-1, 1]" if clipped else ""
        staged[-1] = (tmp, target, f"wrote {target} ({frames_note(c, len(frames))}, latents {shape}{note}"
                                   f"{framing(source, c.size)})")

    def encode(video: str, progress: Progress) -> None:
        stem, frames, part, fps = Path(video).stem, [], 0, source_fps(video)
        source = (0, 0)
        task = progress.add_task(f"encoding {Path(video).name}", total=None)
        for frame in iter_video(video, stride):
            frames.append(square_resize(frame[None], c.size)[0])
            source = frame.shape[:2]
            progress.advance(task)
            if segment is not None and len(frames) == segment:
                write(out / f"{stem}_{part:04d}.h5", frames, video, fps, source)
                frames, part = [], part + 1
        if frames:
            write(out / (f"{stem}_{part:04d}.h5" if segment is not None else f"{stem}.h5"), frames, video, fps,
                  source)
        elif part == 0:
            raise DataError(f"{video}: the video has no frames")
        progress.remove_task(task)

    columns = (TextColumn("{task.description}"), SpinnerColumn(), TextColumn("{task.completed} frames read"),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        for video in videos:
            try:
                encode(video, progress)
            except BaseException:  # its files written so far, to temporary names
                for tmp, _, _ in staged:
                    tmp.unlink(missing_ok=True)
                if made and not any(out.iterdir()):
                    out.rmdir()
                raise
            for tmp, target, line in staged:  # the whole video encoded: its files moved in
                tmp.replace(target)
                written.append(target)
                log(line)
            staged.clear()
            for stale in earlier[video]:  # old segments would be indexed beside the new ones
                if stale not in written:
                    stale.unlink(missing_ok=True)
    return written


def frames_note(codec, frames: int) -> str:
    """``"N frames"`` encoded, for a log line; through a VAE also the latent frames and the trailing frames that fill
    no group of :data:`TEMPORAL` (dropped)."""
    what = f"{frames} frames"
    if codec.frames_per_latent > 1:
        latents, dropped = latent_frames(frames), frames - video_frames(latent_frames(frames))
        what += f" -> {latents} latent frame{'s' if latents > 1 else ''}" + (
            f", the last {dropped} dropped (no whole group of {TEMPORAL})" if dropped else "")
    return what


def decode_file(path: str | Path, out: str | Path, fps: float | None = None, vae: str | Path | None = None,
                tiling: bool = False, device: str = "cpu", overwrite: bool = False) -> Path:
    """Decode an h5 file through the codec its ``codec`` attribute names and write the video, at ``fps`` (None: the
    file's ``fps`` attribute, else 8)."""

    if Path(out).suffix not in VIDEO_SUFFIXES:  # before any decoding
        raise DataError(f"{out}: the video must end in one of {', '.join(VIDEO_SUFFIXES)}")
    check_output(out, "--out", {"file": path})
    if Path(out).exists() and not overwrite:
        raise DataError(f"{out}: already there (--overwrite replaces it)")
    info = inspect_h5(path)
    with h5py.File(path, "r") as f:
        attr = f.attrs.get("codec")
        latents = np.asarray(f[info.key][...], dtype=np.float32)
        fps = fps or file_fps(f)
    codec = codec_from_attr(attr, str(path), vae, device, tiling)
    if codec is None:
        raise DataError(f"{path}: cannot decode to pixels: {missing_codec(attr, str(path))}")
    return write_video(out, codec.decode(latents), fps)


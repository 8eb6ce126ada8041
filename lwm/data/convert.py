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
from lwm.utils.errors import first_line, refuse_first
from lwm.utils.files import remove_stale_temp_files, temp_path
from lwm.utils.video import check_output, VIDEO_SUFFIXES, write_video

CODECS = ("pixel", "wan", "cogvideox", "hunyuan")
ENCODE_CHUNK = 256  # frames a frame-by-frame codec encodes at a time
SOURCE_ATTR = "source_video"  # the file name of the video an encoded h5 file holds


def size_problem(codec: str, size: int | None) -> str | None:
    """Why a ``--size`` gives latents the model cannot train on (sides not multiples of 4), else None."""
    cell = 2 if codec == "pixel" else SPATIAL  # pixels per latent cell
    step = cell * MODEL_MULTIPLE
    if size is None or codec not in CODECS or (size > 0 and size % step == 0):
        return None
    below = size // step * step
    return (f"--size {size}: the {codec} codec needs a positive multiple of {step} ({cell}x{cell} pixels per latent, "
            f"and the model needs latents in multiples of {MODEL_MULTIPLE}: the tokenizer downsamples by "
            f"{MODEL_MULTIPLE}): use --size {f'{below} or {below + step}' if below > 0 else step}")


def stretch(frames: np.ndarray, size: int) -> np.ndarray:
    """``uint8 [T, H, W, 3]`` -> ``[T, size, size, 3]``, each frame resized bilinearly (aspect not kept)."""
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(f).resize((size, size), Image.BILINEAR)) for f in frames])


def square_resize(frames: np.ndarray, size: int) -> np.ndarray:
    """``uint8 [T, H, W, 3]`` -> ``[T, size, size, 3]``: centre crop to a square, then :func:`stretch`."""
    T, H, W, _ = frames.shape
    side = min(H, W)
    top, left = (H - side) // 2, (W - side) // 2
    crop = frames[:, top : top + side, left : left + side]
    return np.ascontiguousarray(crop) if side == size else stretch(crop, size)


def framing(source: tuple[int, int], size: int) -> str:
    """What :func:`square_resize` did to frames of ``(height, width)`` ``source``, for a log line."""
    H, W = source
    side = min(H, W)
    steps = [f"centre-cropped to {side}x{side}"] if H != W else []
    if side != size:
        steps.append(f"{'then ' if steps else ''}resized to {size}x{size}")
    return f"; {W}x{H} frames {', '.join(steps)}" if steps else ""


def iter_video(path: str | Path, stride: int = 1) -> Iterator[np.ndarray]:
    """Every ``stride``-th frame of a video file, ``uint8 [H, W, 3]`` (grey as grey RGB, RGBA's colour without the
    alpha, 16-bit's high byte)."""
    import imageio.v3 as iio

    index = -1
    try:
        for index, frame in enumerate(iio.imiter(path)):
            if index % stride == 0:
                frame = np.repeat(frame[..., None], 3, axis=-1) if frame.ndim == 2 else frame[..., :3]
                yield frame if frame.dtype == np.uint8 else (frame >> 8).astype(np.uint8)
    except Exception as e:  # imageio/PyAV raise many kinds
        raise DataError(f"{path}: cannot be read as a video at frame {index + 1} ({first_line(e)})") from None
    if index < 0:
        raise DataError(f"{path}: the video has no frames")


def source_fps(path: str | Path) -> float | None:
    """The frame rate a video's container declares (None: none, or a GIF, whose delays PyAV reports as 100 fps)."""
    import imageio.v3 as iio

    if Path(path).suffix.lower() == ".gif":
        return None
    try:
        fps = iio.immeta(path, plugin="pyav").get("fps")
    except Exception:  # not a container PyAV reads
        return None
    return float(fps) if fps and np.isfinite(fps) and fps > 0 else None


def make_codec(codec: str = "pixel", vae: str | Path | None = None, size: int | None = None,
               device: str = "cpu", dtype: torch.dtype = torch.float32, tiling: bool = False):
    """The codec ``--codec`` names: the built-in pixel codec, or a diffusers VAE loaded from ``vae``."""
    refuse_first(  # before a VAE (or diffusers) is loaded
        (f"--codec {codec}: unknown (known: {', '.join(CODECS)})", codec not in CODECS),
        (size_problem(codec, size), size_problem(codec, size) is not None),
        (f"--vae {vae}: the pixel codec has no weights (--vae is for --codec {', '.join(CODECS[1:])})",
         codec == "pixel" and vae is not None),
        (f"--codec {codec} needs --vae PATH, a local folder with the VAE's diffusers weights",
         codec != "pixel" and vae is None), error=DataError)
    if codec == "pixel":
        return PixelCodec(size=size or 128)
    return VAECodec.load(codec, vae, size or 512, device, dtype, tiling)


def write_latents(target: Path, codec, frames: np.ndarray, actions: np.ndarray | None = None,
                  world_label: int | None = None, attrs: dict | None = None) -> tuple[int, list[int]]:
    """Encode ``uint8 [F, S, S, 3]`` frames into the h5 file ``target`` (``actions`` subsampled to latent steps) ->
    ``(values clipped to [-1, 1], the latents' shape)``; a frame codec in chunks, a VAE the clip whole."""
    tmp, step = temp_path(target), ENCODE_CHUNK if codec.frames_per_latent == 1 else max(1, len(frames))
    clipped, n, ds = 0, 0, None
    try:
        with h5py.File(tmp, "w") as f:
            for i in range(0, len(frames), step):
                latents, count = (codec.encode_counting(frames[i : i + step]) if hasattr(codec, "encode_counting")
                                  else (codec.encode(frames[i : i + step]), 0))
                if ds is None:
                    total = len(frames) if codec.frames_per_latent == 1 else len(latents)
                    ds = f.create_dataset("latents", shape=(total, *latents.shape[1:]), dtype=np.float16,
                                          chunks=(1, *latents.shape[1:]))
                ds[n : n + len(latents)] = latents.astype(np.float16)
                n, clipped = n + len(latents), clipped + count
            if actions is not None:
                f.create_dataset("actions", data=np.asarray(actions)[:: codec.frames_per_latent][:n].astype(np.int64))
            if world_label is not None:
                f.attrs["world_label"] = np.int64(world_label)
            f.attrs.update({"codec": codec.attr, **(attrs or {})})
            shape = list(ds.shape)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return clipped, shape


def source_video(path: Path) -> str | None:
    """The video an h5 file was encoded from (its :data:`SOURCE_ATTR`; None: unreadable, or none recorded)."""
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
    """Encode each video to ``out/<name>.h5``, or with ``segment`` to ``out/<name>_0000.h5``, ...; a video's files
    replace its earlier ones once it is encoded whole."""
    out = Path(out)
    seen: dict[str, str] = {}
    earlier: dict[str, list[Path]] = {}
    for video in videos:  # each there and to out/<name>.h5 of its own, before a VAE loads
        other, paths = seen.get(Path(video).stem), earlier_outputs(out, video, segment is not None)
        if not Path(video).is_file() or other is not None or (paths and not overwrite):
            more = f" and {len(paths) - 1} more of that name" if len(paths) > 1 else ""
            raise DataError(
                f"{video}: video not found" if not Path(video).is_file() else
                (f"{video}: given twice" + (f" (as {other} too)" if other != video else "")
                 if os.path.samefile(other, video) else f"{video}: same name as {other}, both would be written to "
                 f"{out / Path(video).stem}.h5 (encode them into different --out folders)") if other is not None else
                f"{paths[0]}{more}: already there, where {Path(video).name} would be encoded (--overwrite replaces "
                f"them, or encode into another --out)")
        seen[Path(video).stem], earlier[video] = video, paths
    if segment is not None and codec in CODECS[1:] and ((segment - 1) % TEMPORAL or segment == 1):
        raise DataError(f"--segment {segment}: a VAE codec encodes 1 + {TEMPORAL}k frames, k >= 1 (the rest of each "
                        f"file would be dropped; one frame is one latent, no transition); "
                        f"e.g. --segment {1 + TEMPORAL * max(1, (segment - 1) // TEMPORAL)}")
    c = make_codec(codec, vae, size, device, dtype, tiling)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out)  # of encodes killed mid-way
    written: list[Path] = []
    staged: list[tuple[Path, Path, str]] = []  # this video's (temporary file, target, log line)

    def write(target: Path, frames: list[np.ndarray], video: str, fps: float | None, source: tuple[int, int]) -> None:
        taken = target in written or target in [t for _, t, _ in staged]  # by another video's segment, this run
        other = source_video(target) if not taken and target.is_file() and target not in earlier[video] else None
        if taken or other not in (None, Path(video).name):  # a file of another video under this name: kept
            raise DataError(f"{video}: would overwrite {target}, encoded from {other or 'another video'} (rename one, "
                            f"or encode into another --out)")
        tmp = temp_path(target)  # (write_latents leaves nothing there where it fails)
        clipped, shape = write_latents(tmp, c, np.stack(frames),
                                       attrs={SOURCE_ATTR: Path(video).name, **({"fps": fps / stride} if fps else {})})
        note = f", {clipped} values clipped to [-1, 1]" if clipped else ""
        staged.append((tmp, target, f"wrote {target} ({frames_note(c, len(frames))}, latents {shape}{note}"
                                    f"{framing(source, c.size)})"))

    columns = (TextColumn("{task.description}"), SpinnerColumn(), TextColumn("{task.completed} frames read"),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        for video in videos:
            stem, frames, part, fps, source = Path(video).stem, [], 0, source_fps(video), (0, 0)
            task = progress.add_task(f"encoding {Path(video).name}", total=None)
            try:
                for frame in iter_video(video, stride):
                    frames.append(square_resize(frame[None], c.size)[0])
                    source = frame.shape[:2]
                    progress.advance(task)
                    if segment is not None and len(frames) == segment:
                        write(out / f"{stem}_{part:04d}.h5", frames, video, fps, source)
                        frames, part = [], part + 1
                if frames:
                    write(out / (f"{stem}_{part:04d}.h5" if segment is not None else f"{stem}.h5"), frames, video,
                          fps, source)
                progress.remove_task(task)
                for tmp, target, line in staged:  # the whole video encoded: its files moved in
                    tmp.replace(target)
                    written.append(target)
                    log(line)
            finally:  # a failure's files so far, under temporary names, removed
                for tmp, _, _ in staged:
                    tmp.unlink(missing_ok=True)
                staged.clear()
                if made and not any(out.iterdir()):
                    out.rmdir()
            for stale in earlier[video]:  # old segments would be indexed beside the new ones
                if stale not in written:
                    stale.unlink(missing_ok=True)
    return written


def frames_note(codec, frames: int) -> str:
    """``"N frames"`` encoded, for a log line (through a VAE: the latent frames, and the trailing frames dropped)."""
    what = f"{frames} frames"
    if codec.frames_per_latent > 1:
        latents, dropped = latent_frames(frames), frames - video_frames(latent_frames(frames))
        what += f" -> {latents} latent frame{'s' if latents > 1 else ''}" + (
            f", the last {dropped} dropped (no whole group of {TEMPORAL})" if dropped else "")
    return what


def decode_file(path: str | Path, out: str | Path, fps: float | None = None, vae: str | Path | None = None,
                tiling: bool = False, device: str = "cpu", overwrite: bool = False) -> Path:
    """Decode an h5 file through the codec its ``codec`` attribute names and write the video at ``fps`` (None: the
    file's)."""
    check_output(out, "--out", {"file": path}, VIDEO_SUFFIXES, overwrite)  # before any decoding
    info = inspect_h5(path)
    with h5py.File(path, "r") as f:
        attr = f.attrs.get("codec")
        latents = np.asarray(f[info.key][...], dtype=np.float32)
        fps = fps or file_fps(f)
    codec = codec_from_attr(attr, str(path), vae, device, tiling)
    if codec is None:
        raise DataError(f"{path}: cannot decode to pixels: {missing_codec(attr, str(path))}")
    return write_video(out, codec.decode(latents), fps)

"""Reading and checking lwm's HDF5 latent files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from lwm.utils.errors import DataError, first_line, refuse_first

LATENTS_KEY = "latents"
ACTIONS_KEY = "actions"
FLOAT_DTYPES = (np.float16, np.float32, np.float64)
MODEL_MULTIPLE = 4  # lwm's model trains on latents of heights and widths multiples of this
SLOW_CHUNK_FRAMES = 8  # a compressed dataset chunked over more frames decompresses that many per window read
GENERATED_ATTRS = ("source", "start", "context")  # what `lwm generate` records in its latents file
VIDEO_FILES = (".mp4", ".gif", ".mkv", ".avi", ".mov", ".webm", ".m4v")  # given where an h5 file belongs: said
DEFAULT_FPS = 8.0  # for files that record no frame rate


class GeneratedFile(DataError):
    """The file is the rollout latents ``lwm generate`` writes beside its video (``VIDEO.mp4.h5``), not a clip."""


@dataclass(frozen=True)
class H5Info:
    key: str  # name of the latents dataset
    frames: int  # T
    channels: int  # C
    height: int  # H
    width: int  # W
    has_actions: bool
    world_label: int | None
    filtered_chunk_frames: int | None = None  # frames per chunk of a compressed dataset


def find_latents_key(f: h5py.File, path: str | Path, key: str | None = None) -> str:
    """``key`` (a manifest's) if given, else ``latents`` if present, else the file's only 4-D dataset."""
    datasets = {n: o for n, o in f.items() if isinstance(o, h5py.Dataset)}
    four_d = [n for n, o in datasets.items() if o.ndim == 4]
    name = key if key is not None else four_d[0] if len(four_d) == 1 and LATENTS_KEY not in datasets else LATENTS_KEY
    if isinstance(f.get(name), h5py.Dataset):
        return name
    nested: list[str] = []  # datasets inside groups
    f.visititems(lambda n, o: nested.append(f"{n}{o.shape}") if isinstance(o, h5py.Dataset) and "/" in n else None)
    what = (f"no '{LATENTS_KEY}' dataset and not exactly one 4-D dataset (" if key is None else
            f"no dataset '{key}' (the key the manifest names; ")
    inside = f"; inside groups: {', '.join(nested[:5])}, where lwm does not look" if nested else ""
    raise DataError(f"{path}: {what}datasets: {', '.join(f'{n}{o.shape}' for n, o in datasets.items()) or 'none'}"
                    f"{inside})")


def inspect_h5(path: str | Path, channels: int | None = None, height: int | None = None, width: int | None = None,
               tolerance: float = 1e-3, check_values: bool = True, chunk_frames: int = 64,
               key: str | None = None) -> H5Info:
    """Check ``path``: latents 4-D float of the given ``C, H, W``, finite in [-1, 1] up to ``tolerance``, attributes."""
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        hint = f"; a video: encode it first, lwm data encode {path} --out DIR" if path.suffix.lower() in VIDEO_FILES \
            else ""
        raise DataError(f"{path}: " + (f"cannot be opened as HDF5 ({first_line(e)}{hint})" if path.is_file() else
                                       "a folder, not an h5 file" if path.is_dir() else "file not found")) from None
    with f:
        key = find_latents_key(f, path, key)
        ds, act = f[key], f.get(ACTIONS_KEY)
        if ds.ndim == 5 and all(a in f.attrs for a in GENERATED_ATTRS):
            raise GeneratedFile(f"{path}: rollouts written by `lwm generate` ('{key}' {ds.shape}: [rollouts, T, C, "
                                f"H, W]), not a clip")
        refuse_first(
            (f"{path}: dataset '{key}' must be 4-D [T, C, H, W], got shape {ds.shape}", ds.ndim != 4),
            (f"{path}: dataset '{key}' must be float16/32/64, got {ds.dtype}", ds.dtype.type not in FLOAT_DTYPES),
            *((f"{path}: dataset '{key}' has {name} {got}, expected {want} (shape {ds.shape})",
               want is not None and want != got)
              for name, want, got in zip(("channels", "height", "width"), (channels, height, width), ds.shape[1:])),
            (f"{path}: dataset '{key}' is empty (shape {ds.shape}: frames, channels, height and width must be >= 1)",
             0 in ds.shape),
            (f"{path}: '{ACTIONS_KEY}' must be integers of shape {ds.shape[:1]}, got {getattr(act, 'shape', None)} "
             f"{getattr(act, 'dtype', '')}", act is not None and not (
                 isinstance(act, h5py.Dataset) and act.shape == ds.shape[:1] and act.dtype.kind in "iu")),
            (f"{path}: 'world_label' is a dataset; lwm reads an integer attribute (h5py: f.attrs['world_label'] = k)",
             "world_label" in f and "world_label" not in f.attrs), error=DataError)
        T, C, H, W = ds.shape
        if check_values:
            for start in range(0, T, chunk_frames):
                try:  # in the file's own float type
                    block = np.asarray(ds[start : start + chunk_frames])
                except OSError as e:  # truncated or corrupt chunk
                    raise DataError(f"{path}: dataset '{key}' unreadable at frames {start}.. ({first_line(e)})") from None
                check_frames(block, path, key, start, tolerance)
            if act is not None and (act[...].min() < 0 or act[...].max() > np.iinfo(np.int64).max):
                raise DataError(f"{path}: '{ACTIONS_KEY}' must be >= 0 (and fit int64), got values in "
                                f"[{act[...].min()}, {act[...].max()}]")  # -1 means "no label" in batches
        label = f.attrs.get("world_label")
        label = None if label is None else parse_world_label(label, path)
        _check_codec(f.attrs.get("codec"), path, C, H, W)
        file_fps(f)  # (a malformed fps refused)
        filtered = ds.chunks is not None and ds.id.get_create_plist().get_nfilters() > 0
        return H5Info(key, T, C, H, W, act is not None, label, ds.chunks[0] if filtered else None)


def check_frames(block: np.ndarray, path: str | Path, key: str, start: int = 0, tolerance: float = 1e-3) -> None:
    """Refuse frames ``block`` (from frame ``start`` of ``key``) unless finite within [-1 - tolerance, 1 + tolerance]."""
    finite = np.isfinite(block)
    lo, hi = float(block.min()), float(block.max())  # (NaN where any is)
    if not finite.all() or lo < -1 - tolerance or hi > 1 + tolerance:
        raise DataError(f"{path}: dataset '{key}' has NaN/inf values (first at frame "
                        f"{start + int(np.argwhere(~finite)[0][0])})" if not finite.all() else
                        f"{path}: dataset '{key}' has values in [{lo:.4g}, {hi:.4g}], outside [-1, 1]")


def _check_codec(attr: object, path: Path, C: int, H: int, W: int) -> None:
    """A ``codec`` attribute must parse, and one lwm runs (pixel, the VAEs) must fit the latents with every field it
    decodes by (else the run would stop at its first validation video, hours in)."""
    from lwm.data.codecs import codec_spec
    from lwm.data.vae import CLASSES, SPATIAL

    spec = codec_spec(attr, str(path))
    if spec is None or (spec["name"] != "pixel" and spec["name"] not in CLASSES):
        return  # none, or one lwm does not run
    pixel = spec["name"] == "pixel"
    try:  # as the decoders read them
        size = int(spec.get("size", 128 if pixel else None))
        side = size // (2 if pixel else int(spec.get("spatial", SPATIAL)))
    except (TypeError, ValueError, ZeroDivisionError):
        side = size = 0
    per_channel = pixel or all(isinstance(spec.get(k), list) and len(spec[k]) == C and all(
        isinstance(v, (int, float)) and not (k == "scale" and v == 0) for v in spec[k]) for k in ("shift", "scale"))
    fields = ("an integer 'size' (frame pixels)" if pixel else
              f"an integer 'size' and 'spatial', and {C} 'shift' and {C} nonzero 'scale' numbers")
    got = str({k: spec[k] for k in ("size", "spatial", "shift", "scale") if k in spec})[:120]
    channels = 16 if pixel else C
    refuse_first(
        (f"{path}: attribute 'codec' ({spec['name']}) needs {fields}, got {got}",
         size < 1 or side < 1 or not per_channel),
        (f"{path}: attribute 'codec' names the {spec['name']} codec of size {size}, for [{channels}, {side}, {side}] "
         f"latents, but the dataset holds [{C}, {H}, {W}]", (C, H, W) != (channels, side, side)), error=DataError)


def parse_world_label(value: object, path: str | Path) -> int:
    """The attribute ``world_label``: an integer >= 0 fitting int64 (-1 means no label in batches)."""
    number = np.asarray(value)
    if number.shape != () or number.dtype.kind not in "iu" or not 0 <= number <= np.iinfo(np.int64).max:
        raise DataError(f"{path}: attribute 'world_label' must be an integer >= 0 (fitting int64; -1 means no label "
                        f"in batches), got {value!r}")
    return int(number)


def file_fps(f: h5py.File) -> float:
    """The frame rate an open h5 file records (``fps``, written by ``lwm data encode``), else :data:`DEFAULT_FPS`."""
    number = np.asarray(f.attrs.get("fps", DEFAULT_FPS))
    if number.shape != () or number.dtype.kind not in "iuf" or not (np.isfinite(number) and number > 0):
        raise DataError(f"{f.filename}: attribute 'fps' must be a number > 0 (frames per second), got "
                        f"{f.attrs['fps']!r}")
    return float(number)

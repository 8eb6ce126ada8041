"""Reading and checking lwm's HDF5 latent files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from lwm.utils.errors import DataError, first_line

LATENTS_KEY = "latents"
ACTIONS_KEY = "actions"
FLOAT_DTYPES = (np.float16, np.float32, np.float64)
MODEL_MULTIPLE = 4  # lwm's model trains on latents of heights and widths multiples of this


class GeneratedFile(DataError):
    """The file is the rollout latents ``lwm generate`` writes beside its video (``VIDEO.mp4.h5``), not a clip."""


GENERATED_ATTRS = ("source", "start", "context")  # what `lwm generate` records in its latents file


@dataclass(frozen=True)
class H5Info:
    key: str  # name of the latents dataset
    frames: int  # T
    channels: int  # C
    height: int  # H
    width: int  # W
    has_actions: bool
    world_label: int | None
    filtered_chunk_frames: int | None = None  # frames per chunk of a compressed


SLOW_CHUNK_FRAMES = 8  # a compressed dataset chunked over more frames decompresses that many per window read


def find_latents_key(f: h5py.File, path: str | Path) -> str:
    """``latents`` if present, else the file's only 4-D dataset."""
    if LATENTS_KEY in f and isinstance(f[LATENTS_KEY], h5py.Dataset):
        return LATENTS_KEY
    four_d = [name for name, obj in f.items() if isinstance(obj, h5py.Dataset) and obj.ndim == 4]
    if len(four_d) != 1:
        found = ", ".join(f"{n}{tuple(o.shape)}" for n, o in f.items() if isinstance(o, h5py.Dataset)) or "none"
        nested: list[str] = []  # datasets inside groups
        f.visititems(lambda name, obj: nested.append(f"{name}{tuple(obj.shape)}")
                     if isinstance(obj, h5py.Dataset) and "/" in name else None)
        inside = f"; inside groups: {', '.join(nested[:5])}, where lwm does not look" if nested else ""
        raise DataError(f"{path}: no '{LATENTS_KEY}' dataset and not exactly one 4-D dataset (datasets: {found}"
                        f"{inside})")
    return four_d[0]


def inspect_h5(
    path: str | Path,
    channels: int | None = None,
    height: int | None = None,
    width: int | None = None,
    tolerance: float = 1e-3,
    check_values: bool = True,
    chunk_frames: int = 64,
    key: str | None = None,
) -> H5Info:
    """Open ``path`` and check it: the latents (the dataset ``key``, e.g. a manifest's; None: found by
    :func:`find_latents_key`) are 4-D float of the expected ``C, H, W`` (when given), none of them 0, finite and
    within [-1 - tolerance, 1 + tolerance] (read in chunks)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: a folder, not an h5 file")
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        video = path.suffix.lower() in VIDEO_FILES
        hint = f"; a video: encode it first, lwm data encode {path} --out DIR" if video else ""
        raise DataError(f"{path}: cannot be opened as HDF5 ({first_line(e)}{hint})") from None
    with f:
        if key is None:
            key = find_latents_key(f, path)
        elif not isinstance(f.get(key), h5py.Dataset):
            found = ", ".join(f"{n}{tuple(o.shape)}" for n, o in f.items() if isinstance(o, h5py.Dataset)) or "none"
            raise DataError(f"{path}: no dataset '{key}' (the key the manifest names; datasets: {found})")
        ds = f[key]
        if ds.ndim == 5 and all(a in f.attrs for a in GENERATED_ATTRS):
            raise GeneratedFile(f"{path}: rollouts written by `lwm generate` ('{key}' {ds.shape}: [rollouts, T, C, "
                                f"H, W]), not a clip")
        if ds.ndim != 4:
            raise DataError(f"{path}: dataset '{key}' must be 4-D [T, C, H, W], got shape {ds.shape}")
        T, C, H, W = ds.shape
        if ds.dtype.type not in FLOAT_DTYPES:
            raise DataError(f"{path}: dataset '{key}' must be float16/32/64, got {ds.dtype}")
        for name, want, got in (("channels", channels, C), ("height", height, H), ("width", width, W)):
            if want is not None and want != got:
                raise DataError(f"{path}: dataset '{key}' has {name} {got}, expected {want} (shape {ds.shape})")
        if T == 0:
            raise DataError(f"{path}: dataset '{key}' has no frames")
        if 0 in (C, H, W):
            raise DataError(f"{path}: dataset '{key}' has an empty frame (shape {ds.shape}: channels, height and "
                            f"width must be >= 1)")
        if check_values:
            for start in range(0, T, chunk_frames):
                try:  # in the file's own float type
                    block = np.asarray(ds[start : start + chunk_frames])
                except OSError as e:  # truncated or corrupt chunk
                    raise DataError(f"{path}: dataset '{key}' unreadable at frames {start}.. ({first_line(e)})") from None
                check_frames(block, path, key, start, tolerance)
        has_actions = ACTIONS_KEY in f
        if has_actions:
            act = f[ACTIONS_KEY]
            if not isinstance(act, h5py.Dataset) or act.shape != (T,) or act.dtype.kind not in "iu":
                shape = getattr(act, "shape", None)
                raise DataError(f"{path}: '{ACTIONS_KEY}' must be integers of shape ({T},), got {shape} {getattr(act, 'dtype', '')}")
            if check_values:
                values = act[...]
                if values.min() < 0 or values.max() > np.iinfo(np.int64).max:  # -1 means "no label" in batches
                    raise DataError(f"{path}: '{ACTIONS_KEY}' must be >= 0 (and fit int64), got values in "
                                    f"[{values.min()}, {values.max()}]")
        label = f.attrs.get("world_label")
        if label is not None:
            label = parse_world_label(label, path)
        elif "world_label" in f:  # written as a dataset
            raise DataError(f"{path}: 'world_label' is a dataset; lwm reads an integer attribute "
                            f"(h5py: f.attrs['world_label'] = k)")
        _check_codec(f.attrs.get("codec"), path, C, H, W)
        if "fps" in f.attrs:
            parse_fps(f.attrs["fps"], path)
        filtered = ds.chunks is not None and ds.id.get_create_plist().get_nfilters() > 0
        return H5Info(key, T, C, H, W, has_actions, label, ds.chunks[0] if filtered else None)


def check_frames(block: np.ndarray, path: str | Path, key: str, start: int = 0, tolerance: float = 1e-3) -> None:
    """Raise :class:`DataError` naming the file unless the frames ``block`` (frame ``start`` on of dataset ``key``)
    are finite and within [-1 - tolerance, 1 + tolerance]."""
    finite = np.isfinite(block)
    if not finite.all():
        frame = start + int(np.argwhere(~finite)[0][0])
        raise DataError(f"{path}: dataset '{key}' has NaN/inf values (first at frame {frame})")
    lo, hi = float(block.min()), float(block.max())
    if lo < -1 - tolerance or hi > 1 + tolerance:
        raise DataError(f"{path}: dataset '{key}' has values in [{lo:.4g}, {hi:.4g}], outside [-1, 1]")


def _check_codec(attr: object, path: Path, C: int, H: int, W: int) -> None:
    """A ``codec`` attribute must parse, and the codecs lwm runs (the pixel codec, the diffusers VAEs) must fit the
    latents' shape with every field they decode by (else the run would stop at its first validation video, hours
    in, or decoding at a traceback)."""
    from lwm.data.codecs import codec_spec
    from lwm.data.vae import CLASSES, SPATIAL

    spec = codec_spec(attr, str(path))
    if spec is None or (spec["name"] != "pixel" and spec["name"] not in CLASSES):
        return  # none, or one lwm does not run
    pixel = spec["name"] == "pixel"
    try:  # as the decoders read them
        size = int(spec.get("size", 128 if pixel else None))
        spatial = 2 if pixel else int(spec.get("spatial", SPATIAL))
    except (TypeError, ValueError):
        size = spatial = 0
    if size < 1 or spatial < 1:
        raise DataError(f"{path}: attribute 'codec' ({spec['name']}) needs an integer 'size' (frame pixels)" + (
            f", got {spec.get('size')!r}" if pixel else
            f" and 'spatial' (compression), got {spec.get('size')!r}, {spec.get('spatial')!r}"))
    side = size // spatial
    channels = 16 if pixel else C
    if (C, H, W) != (channels, side, side):
        raise DataError(f"{path}: attribute 'codec' names the {spec['name']} codec of size {size}, for "
                        f"[{channels}, {side}, {side}] latents, but the dataset holds [{C}, {H}, {W}]")
    if not pixel:
        for field in ("shift", "scale"):
            values = spec.get(field)
            if not isinstance(values, list) or len(values) != C or not all(isinstance(v, (int, float)) for v in values):
                raise DataError(f"{path}: attribute 'codec' ({spec['name']}) needs '{field}': {C} numbers, one per "
                                f"channel, got {str(values)[:60]}")
        if any(v == 0 for v in spec["scale"]):
            raise DataError(f"{path}: attribute 'codec' ({spec['name']}) has a zero 'scale'")


def parse_world_label(value: object, path: str | Path) -> int:
    """The ``world_label`` attribute as an int; anything but an integer (a float, a string, a bool) is refused."""
    value = np.asarray(value)
    if value.shape != () or value.dtype.kind not in "iu":
        raise DataError(f"{path}: attribute 'world_label' must be an integer, got {value!r}")
    if value < 0 or value > np.iinfo(np.int64).max:  # -1 means "no label" in batches
        raise DataError(f"{path}: attribute 'world_label' must be >= 0 (and fit int64), got {value}")
    return int(value)


VIDEO_FILES = (".mp4", ".gif", ".mkv", ".avi", ".mov", ".webm", ".m4v")  # given where an h5 file belongs: said
DEFAULT_FPS = 8.0  # for files that record no frame rate


def parse_fps(value: object, path: str | Path) -> float:
    """The ``fps`` attribute as a float; anything but a finite number > 0 is refused."""
    number = np.asarray(value)
    if number.shape != () or number.dtype.kind not in "iuf" or not np.isfinite(number) or number <= 0:
        raise DataError(f"{path}: attribute 'fps' must be a number > 0 (frames per second), got {value!r}")
    return float(number)


def file_fps(f: h5py.File) -> float:
    """The frame rate an open h5 file records (``fps``, written by ``lwm data encode``), else :data:`DEFAULT_FPS`."""
    return parse_fps(f.attrs["fps"], f.filename) if "fps" in f.attrs else DEFAULT_FPS

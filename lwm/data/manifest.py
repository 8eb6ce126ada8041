"""The manifest: a JSON list of checked h5 files (paths relative to the manifest), frame counts and split.

    {"version": 1, "channels": 16, "height": 64, "width": 64,
     "files": [{"path": "ep_0001.h5", "key": "latents", "frames": 240, "split": "train"}, ...]}

:func:`index_directory` checks every file first (:func:`lwm.data.h5.inspect_h5`) and refuses to write a
manifest while any file is bad, naming each one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
from rich.console import Console
from rich.progress import track

from lwm.data.h5 import DataError, inspect_h5

T = TypeVar("T")
SPLITS = ("train", "val")
MANIFEST_VERSION = 1
PROGRESS_MIN_FILES = 100  # show a progress bar when checking at least this many files


def checking(items: Sequence[T], description: str, show: bool = True) -> Iterable[T]:
    """``items``, with a rich progress bar on stderr when there are many (file checks take minutes on big sets)."""
    if not show or len(items) < PROGRESS_MIN_FILES:
        return items
    return track(items, description=description, console=Console(stderr=True), transient=True)


@dataclass(frozen=True)
class ManifestEntry:
    path: str  # relative to the manifest's folder (or absolute)
    frames: int
    split: str
    key: str = "latents"


@dataclass
class Manifest:
    path: Path  # where the manifest lives; entry paths resolve against its folder
    channels: int
    height: int
    width: int
    entries: list[ManifestEntry] = field(default_factory=list)

    def split(self, name: str) -> list[ManifestEntry]:
        return [e for e in self.entries if e.split == name]

    def resolve(self, entry: ManifestEntry) -> Path:
        return (self.path.parent / entry.path).resolve()

    def to_json(self) -> dict:
        return {
            "version": MANIFEST_VERSION, "channels": self.channels, "height": self.height, "width": self.width,
            "files": [asdict(e) for e in self.entries],
        }

    def save(self, path: str | Path | None = None) -> Path:
        """Write atomically (temp file + rename) so an interrupted write never leaves a broken manifest."""
        path = Path(path or self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, path)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: manifest not found (make one with `lwm data index DIR --out {path}`)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: manifest is not valid JSON ({e})") from None
        try:
            entries = [ManifestEntry(str(f["path"]), int(f["frames"]), str(f["split"]), str(f.get("key", "latents")))
                       for f in raw["files"]]
            manifest = cls(path, int(raw["channels"]), int(raw["height"]), int(raw["width"]), entries)
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{path}: manifest field missing or malformed ({type(e).__name__}: {e})") from None
        for e in entries:
            if e.split not in SPLITS:
                raise DataError(f"{path}: file {e.path} has split {e.split!r}, expected one of {SPLITS}")
            if e.frames < 1:
                raise DataError(f"{path}: file {e.path} has frames={e.frames}")
        return manifest


def index_directory(
    directory: str | Path,
    out: str | Path | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    tolerance: float = 1e-3,
) -> Manifest:
    """Check every ``*.h5``/``*.hdf5`` under ``directory`` and write a manifest (default ``DIR/manifest.json``).

    All files must share ``C, H, W``. ``val_fraction`` of the files (at least one when there are two or more
    files and the fraction is positive) go to the validation split, chosen by a seeded shuffle. Raises
    :class:`DataError` naming every bad file (one line each) and writes nothing in that case.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"{directory}: not a directory")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    out = Path(out) if out else directory / "manifest.json"
    files = sorted(p for p in directory.rglob("*") if p.suffix in (".h5", ".hdf5") and p.is_file())
    if not files:
        raise DataError(f"{directory}: no .h5/.hdf5 files found")
    infos, problems = {}, []
    shape = None
    for p in checking(files, f"checking {len(files)} files"):
        try:
            info = inspect_h5(p, *(shape or (None, None, None)), tolerance=tolerance)
        except DataError as e:
            problems.append(str(e))
            continue
        shape = shape or (info.channels, info.height, info.width)
        infos[p] = info
    if problems:
        raise DataError(f"{len(problems)} of {len(files)} files refused:\n" + "\n".join(problems))
    good = list(infos)
    n_val = int(round(val_fraction * len(good)))
    if val_fraction > 0 and len(good) >= 2:
        n_val = min(max(n_val, 1), len(good) - 1)
    order = np.random.default_rng(seed).permutation(len(good))
    val = {good[i] for i in order[:n_val]}
    base = out.parent.resolve()
    entries = [
        ManifestEntry(os.path.relpath(p.resolve(), base), infos[p].frames, "val" if p in val else "train", infos[p].key)
        for p in good
    ]
    manifest = Manifest(out, *shape, entries)
    manifest.save(out)
    return manifest

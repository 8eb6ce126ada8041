"""The manifest: a JSON list of checked h5 files (paths relative to the manifest), frame counts and split.

    {"version": 1, "channels": 16, "height": 64, "width": 64,
     "files": [{"path": "ep_0001.h5", "key": "latents", "frames": 240, "split": "train"}, ...]}

:func:`index_directory` checks every file first (:func:`lwm.data.h5.inspect_h5`) and refuses to write a
manifest while any file is bad, naming each one.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
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
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.to_json(), indent=1))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise DataError(f"{path}: cannot write the manifest ({e.strerror or e})") from None
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
        if not isinstance(raw, dict):
            raise DataError(f"{path}: manifest field missing or malformed (not a JSON object)")
        version = raw.get("version", MANIFEST_VERSION)
        if not isinstance(version, int) or version > MANIFEST_VERSION:
            raise DataError(f"{path}: manifest version {version!r}; this lwm reads version {MANIFEST_VERSION} (index "
                            f"the folder again, or update lwm)")
        bad = [f for f in raw.get("files") or [] if not isinstance(f, dict) or not isinstance(f.get("path"), str)
               or not f["path"]]
        if bad:
            raise DataError(f"{path}: manifest field missing or malformed (a file entry without a path: {bad[0]!r})")
        try:
            entries = [ManifestEntry(str(f["path"]), int(f["frames"]), str(f["split"]), str(f.get("key", "latents")))
                       for f in raw["files"]]
            manifest = cls(path, int(raw["channels"]), int(raw["height"]), int(raw["width"]), entries)
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{path}: manifest field missing or malformed ({type(e).__name__}: {e})") from None
        seen: set[str] = set()
        for e in entries:
            if e.path in seen:  # in both splits, it would be validated on what it trained on
                raise DataError(f"{path}: file {e.path} is listed twice")
            seen.add(e.path)
            if e.split not in SPLITS:
                raise DataError(f"{path}: file {e.path} has split {e.split!r}, expected one of {SPLITS}")
            if e.frames < 1:
                raise DataError(f"{path}: file {e.path} has frames={e.frames}")
        return manifest


def find_h5_files(directory: Path) -> list[Path]:
    """Every ``*.h5``/``*.hdf5`` file under ``directory`` (any case; linked folders followed), each physical file
    once: a link to a file already found is left out with a note (listed twice, it could land in both splits)."""
    found: dict[Path, Path] = {}  # resolved -> the first path found
    visited: set[Path] = set()
    for root, dirs, names in os.walk(directory, followlinks=True):
        real = Path(root).resolve()
        if real in visited:  # a link back up the tree
            dirs[:] = []
            continue
        visited.add(real)
        dirs.sort()
        for name in sorted(names):
            p = Path(root) / name
            if p.suffix.lower() not in (".h5", ".hdf5") or not p.is_file():
                continue
            target = p.resolve()
            if target in found:
                print(f"note: {p} is the same file as {found[target]}: indexed once", file=sys.stderr)
                continue
            found[target] = p
    return sorted(found.values())


def _previous_splits(path: Path, shape: tuple[int, int, int] | None) -> dict[str, str]:
    """``{relative path: split}`` of the manifest at ``path`` if there is one of the same frame shape, read
    leniently: a file it lists twice (as earlier versions could, for a linked file) is ``val`` if either entry is,
    so re-indexing never moves a validation file into training. Anything unreadable is said, and ignored."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        if (int(raw["channels"]), int(raw["height"]), int(raw["width"])) != shape:
            return {}
        splits: dict[str, str] = {}
        for f in raw["files"]:
            name, split = str(f["path"]), str(f["split"])
            splits[name] = "val" if "val" in (split, splits.get(name)) else split
        return splits
    except (ValueError, KeyError, TypeError) as e:
        print(f"note: {path}: the existing manifest is unreadable ({type(e).__name__}: {e}); splits drawn afresh",
              file=sys.stderr)
        return {}


def index_directory(
    directory: str | Path,
    out: str | Path | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    tolerance: float = 1e-3,
    resplit: bool = False,
) -> Manifest:
    """Check every ``*.h5``/``*.hdf5`` under ``directory`` and write a manifest (default ``DIR/manifest.json``).

    All files must share ``C, H, W`` (those of most files; the others are named). ``val_fraction`` of the files
    (at least one when there are two or more files and the fraction is positive) go to the validation split,
    chosen by a seeded shuffle. Indexing again where a manifest already is keeps every file it lists in its
    split (a run continued on the new manifest never validates on files it trained on) and draws the new
    files' splits towards ``val_fraction`` (``resplit``: draw every file's split again). Raises
    :class:`DataError` naming every bad file (one line each) and writes nothing in that case.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"{directory}: not a directory")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    if not 0.0 <= tolerance < math.inf:  # NaN too: it would switch the range check off
        raise DataError(f"tolerance must be a finite value >= 0, got {tolerance}")
    out = Path(out) if out else directory / "manifest.json"
    if out.is_dir():
        raise DataError(f"--out {out}: a directory; give the manifest's file name (e.g. {out / 'manifest.json'})")
    if out.exists():  # only a manifest (JSON) is ever overwritten, not an h5 file given by mistake
        with open(out, "rb") as f:
            head = f.read(1024).lstrip(b"\xef\xbb\xbf \t\r\n")
        if head and not head.startswith(b"{"):
            raise DataError(f"--out {out}: exists and is not a JSON manifest; not overwritten")
    files = find_h5_files(directory)
    if not files:
        raise DataError(f"{directory}: no .h5/.hdf5 files found")
    infos, problems = {}, []
    for p in checking(files, f"checking {len(files)} files"):
        try:
            infos[p] = inspect_h5(p, tolerance=tolerance)
        except DataError as e:
            problems.append(str(e))
    shapes = Counter((i.channels, i.height, i.width) for i in infos.values())
    shape = shapes.most_common(1)[0][0] if shapes else None
    for p, info in list(infos.items()):  # the odd files out are named, not the majority
        got = (info.channels, info.height, info.width)
        if got != shape:
            odd = ", ".join(f"{name} {g}, expected {w}" for name, g, w in zip(("channels", "height", "width"), got, shape)
                            if g != w)
            problems.append(f"{p}: dataset '{info.key}' has {odd} (the [C, H, W] of most files: {list(shape)})")
            del infos[p]
    if problems:
        raise DataError(f"{len(problems)} of {len(files)} files refused:\n" + "\n".join(sorted(problems)))
    good = list(infos)
    base = out.parent.resolve()
    relative = {p: os.path.relpath(p.resolve(), base) for p in good}
    kept = {} if resplit else _previous_splits(out, shape)  # relative path -> split, of a manifest already there
    new = [p for p in good if relative[p] not in kept]
    n_val = int(round(val_fraction * len(good)))
    if val_fraction > 0 and len(good) >= 2:
        n_val = min(max(n_val, 1), len(good) - 1)
    kept_val = sum(kept.get(relative[p]) == "val" for p in good)
    n_val_new = min(max(n_val - kept_val, 0), len(new))
    if n_val_new and kept_val + n_val_new >= len(good):
        n_val_new -= 1  # at least one training file
    order = np.random.default_rng(seed).permutation(len(new))
    val = {new[i] for i in order[:n_val_new]} | {p for p in good if kept.get(relative[p]) == "val"}
    entries = [
        ManifestEntry(relative[p], infos[p].frames, "val" if p in val else "train", infos[p].key)
        for p in good
    ]
    manifest = Manifest(out, *shape, entries)
    manifest.save(out)
    return manifest

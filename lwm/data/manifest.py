"""The manifest: a JSON list of checked h5 files (paths relative to the manifest), frame counts and split."""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import track

from lwm.utils.files import atomic_write
from lwm.utils.errors import refuse_first, refused
from lwm.data.h5 import (LATENTS_KEY, MODEL_MULTIPLE, SLOW_CHUNK_FRAMES, DataError, GeneratedFile, H5Info,
                         inspect_h5)

SPLITS = ("train", "val")
MANIFEST_VERSION = 1
PROGRESS_MIN_FILES = 100  # show a progress bar when checking at least this many files


def checking(items: Sequence, description: str, show: bool = True) -> Iterable:
    """``items``, with a progress bar on stderr when there are many (file checks take minutes on big sets)."""
    if not show or len(items) < PROGRESS_MIN_FILES:
        return items
    return track(items, description=description, console=Console(stderr=True), transient=True)


@dataclass(frozen=True)
class ManifestEntry:
    path: str  # relative to the manifest's folder (or absolute)
    frames: int
    split: str
    key: str = "latents"
    bytes: int | None = None  # the file's size when `lwm data index` checked its values
    mtime: float | None = None  # its modification time then

    def changed_since_checked(self, st: os.stat_result) -> bool:
        """Whether the file's size or mtime differ from the index's (one cut to the second, by a copy, is the same)."""
        if self.bytes is None or self.mtime is None:
            return False
        same_time = abs(st.st_mtime - self.mtime) < 1e-6 or st.st_mtime == math.floor(self.mtime)
        return st.st_size != self.bytes or not same_time


@dataclass
class Manifest:
    path: Path  # where the manifest lives
    channels: int
    height: int
    width: int
    entries: list[ManifestEntry] = field(default_factory=list)

    def split(self, name: str) -> list[ManifestEntry]:
        return [e for e in self.entries if e.split == name]

    def resolve(self, entry: ManifestEntry) -> Path:
        """The entry's file under the manifest's real folder, as written (a link keeps its name; no system call)."""
        return Path(os.path.normpath(os.path.join(self._base, entry.path)))

    @cached_property
    def _base(self) -> str:
        return os.path.realpath(self.path.parent)

    def to_json(self) -> dict:
        return {"version": MANIFEST_VERSION, "channels": self.channels, "height": self.height, "width": self.width,
                "files": [{k: v for k, v in asdict(e).items() if v is not None} for e in self.entries]}

    def save(self, path: str | Path | None = None) -> Path:
        """Write atomically (temp file + rename): an interrupted write never leaves a broken manifest."""
        self.path = atomic_write(Path(path or self.path), lambda f: f.write(json.dumps(self.to_json(), indent=1)),
                                 mode="w")
        return self.path

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        """The manifest at ``path``; anything `lwm data index` would not have written is one line naming the field."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
            hint = (f"a folder; `lwm data index {path}` writes {path / 'manifest.json'}" if path.is_dir() else
                    f"make one with `lwm data index DIR --out {path}`")
            raise DataError(f"{path}: manifest is not valid JSON ({e})" if path.is_file() else
                            f"{path}: manifest not found ({hint})") from None
        raw = {"version": MANIFEST_VERSION, **raw} if isinstance(raw, dict) else {}
        _check_fields(path, raw, ("version", "channels", "height", "width", "files"), "")
        entries = []
        for f in raw["files"]:
            _check_fields(path, f, ("path",))
            f = {"key": LATENTS_KEY, **f}
            _check_fields(path, f, ("frames", "split", "key"), f"file {f['path']}: ")
            size, mtime = f.get("bytes"), f.get("mtime")  # optional: a malformed stamp is as none (nothing compared)
            stamped = type(size) is int and type(mtime) in (int, float)
            entries.append(ManifestEntry(f["path"], f["frames"], f["split"], f["key"],
                                         *((size, float(mtime)) if stamped else ())))
        manifest = cls(path, raw["channels"], raw["height"], raw["width"], entries)
        manifest.check_duplicates()
        return manifest

    def check_duplicates(self, files: bool = False) -> None:
        """Refuse two entries of one file, naming both (``files``: links and hard links too, by a stat each)."""
        seen: dict[object, ManifestEntry] = {}
        for e in self.entries:
            ids = [os.path.normpath(os.path.join(os.path.abspath(self.path.parent), e.path))]
            if files:  # (a missing file is named by the file checks)
                ids += [self.resolve(e), _identity(self.resolve(e))]
            other = next((seen[i] for i in ids if i in seen), None)
            if other is not None:
                what = (f"file {e.path} is listed twice ({other.split} and {e.split})" if other.path == e.path else
                        f"files {other.path} ({other.split}) and {e.path} ({e.split}) are the same file, listed twice")
                both = ": it would be validated on what it trained on" if other.split != e.split else ""
                raise DataError(f"{self.path}: {what}{both} (index the folder again)")
            seen.update((i, e) for i in ids if i is not None)


_FIELDS = {  # a manifest's field: its test, and what it must be (a JSON integer: type int, not bool, 16.0 or "16")
    "version": (lambda v: type(v) is int and v == MANIFEST_VERSION,
                f"{MANIFEST_VERSION}, the version this lwm reads (index the folder again, or update lwm)"),
    **dict.fromkeys(("channels", "height", "width", "frames"),
                    (lambda v: type(v) is int and v >= 1, "an integer >= 1")),
    "files": (lambda v: isinstance(v, list) and all(isinstance(f, dict) for f in v), "a list of file entries"),
    "path": (lambda v: isinstance(v, str) and v != "", "the file's path"),
    "split": (lambda v: v in SPLITS, f"one of {', '.join(SPLITS)}"),
    "key": (lambda v: isinstance(v, str) and v != "", "the name of the latents dataset"),
}


def _check_fields(path: Path, raw: dict, names: tuple[str, ...], where: str | None = None) -> None:
    """Refuse the first field of ``names`` missing or malformed in ``raw`` (a file entry unless ``where`` says)."""
    for name in names:
        ok, rule = _FIELDS[name]
        if not ok(raw.get(name)):
            got = repr(raw[name])[:80] if name in raw else "nothing"
            where = f"file entry {str(raw)[:80]}: " if where is None else where
            raise DataError(f"{path}: manifest field missing or malformed ({where}'{name}' must be {rule}, got {got})")


def existing_h5(out: Path, ours: set[str], then: str, remedy: str | None = None) -> list[str]:
    """The h5 files under ``out`` (relative paths, sorted), refused where any is not one of ``ours``, and with a
    ``remedy`` (no overwrite) where any is there at all, or a manifest."""
    h5 = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.suffix in (".h5", ".hdf5") and p.is_file())
    others = [name for name in h5 if name not in ours]
    taken = h5 + ["manifest.json"] * (out / "manifest.json").exists() if remedy else []
    if others or taken:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise DataError(f"{out}: already holds other h5 files ({shown}){then}" if others else
                        f"{out / taken[0]}: exists ({remedy})")
    return h5


def find_h5_files(directory: Path) -> tuple[list[Path], list[str]]:
    """Every ``*.h5``/``*.hdf5`` under ``directory`` (any case; linked folders followed) once, and the problems."""
    found: dict[tuple[int, int], Path] = {}  # (device, inode) -> the first path found
    visited: set[Path] = set()
    problems: list[str] = []

    def unreadable(e: OSError) -> None:
        problems.append(f"{e.filename}: a folder that cannot be read ({e.strerror or e})")

    for root, dirs, names in os.walk(directory, followlinks=True, onerror=unreadable):
        if Path(root).resolve() in visited:  # a link back up the tree
            dirs[:] = []
            continue
        visited.add(Path(root).resolve())
        dirs.sort()
        for name in sorted(names):
            p = Path(root) / name
            h5 = p.suffix.lower() in (".h5", ".hdf5")
            if p.is_symlink() and not p.exists():
                if h5:
                    problems.append(f"{p}: a link to {os.readlink(p)}, which is not there")
                else:
                    print(f"note: {p}: a link to {os.readlink(p)}, which is not there (a folder not mounted?): "
                          f"skipped", file=sys.stderr)
            elif h5 and p.is_file():
                first = found.setdefault(_identity(p), p)
                if first != p:
                    print(f"note: {p} is the same file as {first}: indexed once", file=sys.stderr)
    return sorted(found.values()), problems


def _identity(path: Path) -> tuple[int, int] | None:
    """The file ``path`` names, ``(device, inode)`` (None: not there)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _previous_splits(path: Path, shape: tuple[int, int, int]) -> dict[object, str]:
    """``{relative path or file identity: split}`` of a manifest at ``path`` of frames ``shape`` (val wins)."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        if (int(raw["channels"]), int(raw["height"]), int(raw["width"])) != shape:
            return {}
        splits: dict[object, str] = {}
        for f in raw["files"]:
            name, split = str(f["path"]), str(f["split"])
            for key in (name, _identity(path.parent / name)):
                if key is not None:
                    splits[key] = "val" if "val" in (split, splits.get(key)) else split
        return splits
    except (ValueError, KeyError, TypeError) as e:
        print(f"note: {path}: the existing manifest is unreadable ({type(e).__name__}: {e}); splits drawn afresh",
              file=sys.stderr)
        return {}


def _checked_files(directory: Path, tolerance: float) -> tuple[dict[Path, H5Info], dict[Path, os.stat_result],
                                                                 tuple[int, int, int]]:
    """Every h5 file under ``directory`` checked (`lwm generate`'s rollouts skipped) -> ``({file: info}, {file: its
    stat before the check}, the [C, H, W] they share)``; every bad file named in one refusal."""
    files, problems = find_h5_files(directory)
    unfound = len(problems)  # links to nothing, unreadable folders
    infos, stats = {}, {}
    for p in checking(files, f"checking {len(files)} files"):
        try:
            stats[p] = p.stat()  # before reading
            infos[p] = inspect_h5(p, tolerance=tolerance)
        except GeneratedFile as e:  # `lwm generate`'s output, beside its video in the data folder
            print(f"note: {e}: skipped", file=sys.stderr)
        except DataError as e:
            problems.append(str(e))
    if not infos and not problems:
        raise DataError(f"{directory}: no .h5/.hdf5 files to index" + (" (only `lwm generate`'s rollouts, skipped)"
                                                                        if files else ""))
    slow = [(p, i) for p, i in infos.items() if (i.filtered_chunk_frames or 0) > SLOW_CHUNK_FRAMES]
    if slow:
        p, i = slow[0]
        print(f"warning: {len(slow)} of {len(infos)} files store compressed latents in chunks of many frames (first: "
              f"{p}, '{i.key}' in chunks of {i.filtered_chunk_frames} frames): each training window decompresses "
              f"whole chunks, which can starve the GPU; chunks of one frame read fast (`h5repack -l "
              f"{i.key}:CHUNK=1x{i.channels}x{i.height}x{i.width} IN OUT`), as do uncompressed files", file=sys.stderr)
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
        raise refused(sorted(problems), len(files) + unfound)
    return infos, stats, shape


def val_count(val_fraction: float, files: int) -> int:
    """The val files ``val_fraction`` of ``files`` asks for: one at least of two or more, never every file."""
    n_val = int(round(val_fraction * files))
    if val_fraction > 0 and files >= 2:
        n_val = max(n_val, 1)
    return min(n_val, max(files - 1, 0))


def index_directory(directory: str | Path, out: str | Path | None = None, val_fraction: float = 0.1, seed: int = 0,
                    tolerance: float = 1e-3, resplit: bool = False) -> Manifest:
    """Check every ``*.h5``/``*.hdf5`` under ``directory`` and write a manifest (default ``DIR/manifest.json``); the
    files an existing manifest lists keep their split, new files are drawn towards ``val_fraction``."""
    directory = Path(directory)
    out = Path(out) if out else directory / "manifest.json"
    head = b""
    if out.is_file():  # an existing --out is replaced only if it is a manifest
        with open(out, "rb") as f:
            head = f.read(1024).lstrip(b"\xef\xbb\xbf \t\r\n")
    refuse_first(  # before any file is read
        (f"{directory}: not a directory", not directory.is_dir()),
        (f"--out {out}: exists and is not a JSON manifest; not overwritten",
         out.exists() and not (out.is_file() and (not head or head.startswith(b"{")))), error=DataError)
    # paths below the real folders, a linked file under its link's name (a copy that follows links, cp -rL, keeps them)
    infos, stats, shape = _checked_files(Path(os.path.realpath(directory)), tolerance)
    good = list(infos)
    base = os.path.realpath(out.parent)
    relative = {p: os.path.relpath(p, base) for p in good}
    previous = {} if resplit else _previous_splits(out, shape)  # relative path (and file identity) -> split
    kept = {p: split for p in good  # a file an older manifest listed under its link's target too
            if (split := previous.get(relative[p], previous.get(_identity(p)))) is not None}
    new = [p for p in good if p not in kept]
    n_val_new = min(max(val_count(val_fraction, len(good)) - list(kept.values()).count("val"), 0), len(new))
    val = {new[i] for i in np.random.default_rng(seed).permutation(len(new))[:n_val_new]} | \
        {p for p, split in kept.items() if split == "val"}
    if val and len(val) == len(good):  # (kept val files, their train files gone)
        raise DataError(f"{out}: every file would be a val file: the files the existing manifest lists keep their "
                        f"split, and its train files are gone; --resplit draws the splits again")
    manifest = Manifest(out, *shape, [ManifestEntry(relative[p], infos[p].frames, "val" if p in val else "train",
                                                    infos[p].key, stats[p].st_size, stats[p].st_mtime) for p in good])
    manifest.save(out)
    C, H, W = shape
    if H % MODEL_MULTIPLE or W % MODEL_MULTIPLE:  # valid latents, perhaps for another tool
        print(f"warning: {out}: the files' latents are {list(shape)}, and lwm's model cannot train on them (it needs a "
              f"height and width that are multiples of {MODEL_MULTIPLE}: its tokenizer downsamples by "
              f"{MODEL_MULTIPLE}); indexed all the same (to train on them, encode them again at another --size)",
              file=sys.stderr)
    if C == H != W:  # [T, H, W, C] of square frames read as [T, C, H, W]: C == H, W the channels
        print(f"warning: {out}: the files' latents are read as [T, C, H, W] = [T, {C}, {H}, {W}]: {C} channels of "
              f"{H}x{W}; if they are channels-last [T, H, W, C] ({C}x{H} frames of {W} channels), transpose them to "
              f"[T, C, H, W] first (numpy: x.transpose(0, 3, 1, 2))", file=sys.stderr)
    if not val:  # not an error
        why = ("a single file is never split" if len(good) == 1 else "--val-fraction 0" if val_fraction == 0 else
               "the files the existing manifest lists keep their train split (--resplit draws them again)")
        print(f"warning: {out}: no val files ({why}); `lwm fit` needs some: index more files, give a larger "
              f"--val-fraction, or cut long videos into several files (`lwm data encode VIDEO --segment N`); or "
              f"train without validation (data.val_size_percent=0)", file=sys.stderr)
    return manifest

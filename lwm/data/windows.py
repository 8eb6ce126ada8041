"""Frame windows from h5 files: a dataset indexed by ``(file, start)``, a sampler of a different file per element."""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, default_collate

from lwm.data.h5 import ACTIONS_KEY, DataError, parse_world_label
from lwm.utils.errors import first_line
from lwm.data.manifest import Manifest, ManifestEntry

MISSING = -1  # value of `actions` / `world_label` in a batch when the file has none
MAX_OPEN_FILES = 128  # h5 handles one process keeps open (each holds HDF5's caches: about 0.6 MB)
LOAD_WINDOWS = 16  # a file of at most this many windows is read whole once: many short clips cost one open each
LOADED_BYTES = 256 * 2**20  # the most a process keeps of such files in memory
LABEL_DRAW = 0x1abe1  # the seed of the fixed draw of which actions stay labelled (label_fraction)
SHORT_NAMED = 10  # short files named in the warning


class _Open(NamedTuple):
    file: h5py.File | None  # None: read whole into memory
    latents: h5py.Dataset | np.ndarray
    actions: h5py.Dataset | np.ndarray | None
    label: int  # world_label, or MISSING


class H5WindowDataset(Dataset):
    """``dataset[(file_index, start)] -> {"latents": [T, C, H, W], "actions": [T] int64, "world_label": int64 scalar,
    "file_index": int64, "start": int64}``."""

    def __init__(self, manifest: Manifest, split: str, window: int, float16: bool = True,
                 max_open: int = MAX_OPEN_FILES, label_fraction: float = 1.0, loaded_bytes: int | None = None) -> None:
        entries = manifest.split(split)
        self.entries: list[ManifestEntry] = [e for e in entries if e.frames >= window]
        if not self.entries:
            hint = (" (index more files, or with a larger --val-fraction; or train without validation: "
                    "data.val_size_percent=0)" if split == "val" else "")
            raise DataError(f"{manifest.path}: the '{split}' split is empty{hint}" if not entries else
                            f"{manifest.path}: window {window} is longer than every '{split}' file (longest: "
                            f"{max(e.frames for e in entries)} frames)")
        short = [e for e in entries if e.frames < window]
        if short:  # one warning for all, naming the first few
            named = ", ".join(f"{manifest.resolve(e)} ({e.frames} frames)" for e in short[:SHORT_NAMED])
            more = f" and {len(short) - SHORT_NAMED} more" if len(short) > SHORT_NAMED else ""
            warnings.warn(f"{len(short)} '{split}' file(s) shorter than the window of {window} frames, left out: "
                          f"{named}{more}", stacklevel=2)
        self.window, self.float16, self.max_open, self.label_fraction = window, float16, max_open, label_fraction
        self.paths = [str(manifest.resolve(e)) for e in self.entries]
        self.frames = [e.frames for e in self.entries]
        self.loaded_bytes = LOADED_BYTES if loaded_bytes is None else loaded_bytes  # (read at run time: tests patch it)
        self._labelled: dict[int, torch.Tensor] = {}  # per file: which actions label_fraction keeps
        self._handles: OrderedDict[int, _Open] = OrderedDict()
        self._loaded: OrderedDict[int, _Open] = OrderedDict()  # files read whole (LOAD_WINDOWS)
        self._pid: int | None = None

    def __len__(self) -> int:
        """Non-overlapping windows in the split: the number of samples in one epoch."""
        return sum(f // self.window for f in self.frames)

    def _file(self, index: int) -> _Open:
        """The open file ``index`` (datasets and label looked up once per opening); a short file read whole."""
        if self._pid != os.getpid():  # a new worker process
            self._handles, self._loaded, self._pid = OrderedDict(), OrderedDict(), os.getpid()
        for cache in (self._loaded, self._handles):
            if index in cache:
                cache.move_to_end(index)
                return cache[index]
        while len(self._handles) >= self.max_open:
            self._handles.popitem(last=False)[1].file.close()
        f = h5py.File(self.paths[index], "r")
        label = f.attrs.get("world_label")
        opened = _Open(f, f[self.entries[index].key], f.get(ACTIONS_KEY),
                       MISSING if label is None else parse_world_label(label, self.paths[index]))
        if self.frames[index] <= LOAD_WINDOWS * self.window and self.loaded_bytes > 0:
            try:
                whole = opened._replace(file=None, latents=opened.latents[:],
                                        actions=None if opened.actions is None else opened.actions[:])
            except OSError:  # damaged somewhere: read window by window, which names the frames
                pass
            else:
                f.close()
                self._loaded[index] = whole
                while sum(o.latents.nbytes for o in self._loaded.values()) > self.loaded_bytes and len(self._loaded) > 1:
                    self._loaded.popitem(last=False)
                return whole
        self._handles[index] = opened
        return opened

    def __getitem__(self, item: tuple[int, int]) -> dict[str, torch.Tensor]:
        index, start = item
        stop, key, path = start + self.window, self.entries[index].key, self.paths[index]
        try:  # (np.array copies: a window of a file read whole is not a view of it)
            opened = self._file(index)
            keep = self.float16 and opened.latents.dtype == np.float16
            latents = torch.from_numpy(np.array(opened.latents[start:stop], dtype=np.float16 if keep else np.float32))
            actions = None if opened.actions is None else np.array(opened.actions[start:stop], dtype=np.int64)
        except (OSError, KeyError) as e:  # changed or damaged since `lwm data index` checked it
            raise DataError(f"{path}: '{key}' unreadable at frames {start}..{stop - 1} ({first_line(e)}); run "
                            f"`lwm data index` on the folder again") from None
        short = [(name, len(a)) for name, a in ((key, latents), (ACTIONS_KEY, actions))
                 if a is not None and len(a) != self.window]  # h5py cuts a slice past the end short, as numpy does
        if short:  # a file rewritten shorter since setup checked it
            raise DataError(f"{path}: '{short[0][0]}' has {start + short[0][1]} frames, the manifest says "
                            f"{self.frames[index]} (changed since it was indexed); run `lwm data index` on the folder "
                            f"again")
        actions = torch.full((self.window,), MISSING) if actions is None else torch.from_numpy(actions)
        if opened.actions is not None and self.label_fraction < 1.0:
            actions = torch.where(self.labelled(index)[start:stop], actions, MISSING)
        return {"latents": latents, "actions": actions, "world_label": torch.tensor(opened.label),
                "file_index": torch.tensor(index), "start": torch.tensor(start)}

    def labelled(self, index: int) -> torch.Tensor:
        """``[frames]`` bool: the actions of file ``index`` kept under ``label_fraction`` (the same in every run)."""
        if index not in self._labelled:
            draw = np.random.default_rng([LABEL_DRAW, index]).random(self.frames[index])
            self._labelled[index] = torch.from_numpy(draw < self.label_fraction)
        return self._labelled[index]

    def close(self) -> None:
        for opened in self._handles.values():
            opened.file.close()
        self._handles, self._loaded = OrderedDict(), OrderedDict()

    def __getstate__(self) -> dict:  # spawn workers receive a pickled copy, without handles
        return {**self.__dict__, "_handles": OrderedDict(), "_loaded": OrderedDict(), "_pid": None}


def collate_windows(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``default_collate``; a batch mixing float16 and float32 windows is float32."""
    if len({item["latents"].dtype for item in items}) > 1:
        items = [{**item, "latents": item["latents"].float()} for item in items]
    return default_collate(items)


def inclusion_probabilities(weights: np.ndarray, n: int) -> np.ndarray:
    """Inclusion probabilities of ``n`` distinct draws, proportional to ``weights`` and capped at 1 (the rest shared
    in proportion among the others)."""
    pi, fixed = np.zeros(len(weights)), np.zeros(len(weights), dtype=bool)
    while True:  # at most len(weights) rounds
        free = ~fixed
        pi[free] = (n - fixed.sum()) * weights[free] / weights[free].sum()
        over = free & (pi >= 1.0)
        if not over.any():
            return pi
        fixed |= over
        pi[over] = 1.0


def systematic_pps(pi: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``round(sum(pi))`` distinct item indices, item ``i`` among them with probability ``pi[i]`` (each <= 1)."""
    order = rng.permutation(len(pi))
    edges = np.cumsum(pi[order])
    n = int(round(edges[-1]))
    edges *= n / edges[-1]
    edges[-1] = n  # exactly: the last point, < n, always lands on an item
    points = rng.random() + np.arange(n)
    return order[np.searchsorted(edges, points, side="right")]


class FileBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of ``(file_index, start)``: each element of the global batch from a different file while there are
    enough files (else of each rank's batch), each start uniform in the file."""

    def __init__(self, frames: Sequence[int], window: int, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, batches_per_epoch: int | None = None) -> None:
        self.frames = np.asarray(frames, dtype=np.int64)
        self.window, self.batch_size = window, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        windows = self.frames // window
        rest = batch_size * world_size % len(self.frames)  # the places after whole rounds of every file
        self.pi = inclusion_probabilities(windows / windows.sum(), rest) if rest else None  # a file's chance of one
        self.num_batches = batches_per_epoch or max(1, int(windows.sum()) // (batch_size * world_size))
        self.epoch = 0
        self.start_batch = 0  # first batch of the next iteration

    def __len__(self) -> int:
        return self.num_batches

    def batch(self, epoch: int, index: int) -> list[tuple[int, int]]:
        """This rank's slice of the global batch ``index`` of ``epoch`` (every rank draws the same global batch)."""
        rng = np.random.default_rng([self.seed, epoch, index])
        n_files, total = len(self.frames), self.batch_size * self.world_size
        rounds, rest = divmod(total, n_files)
        picks = [f for _ in range(rounds) for f in rng.permutation(n_files).tolist()]  # whole rounds
        if rest:
            picks.extend(systematic_pps(self.pi, rng).tolist())
        if rounds and self.world_size > 1:  # a file twice in the global batch: grouped, dealt as equal slices
            order = rng.permutation(n_files)  # each file's place in the grouping
            grouped = sorted(picks, key=lambda f: order[f])
            picks = [f for r in range(self.world_size) for f in rng.permutation(grouped[r::self.world_size]).tolist()]
        starts = rng.integers(0, self.frames[picks] - self.window + 1)
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return [(int(f), int(s)) for f, s in zip(picks[mine], starts[mine])]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> FileBatchSampler:
        """Itself: Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler`` at each epoch start."""
        return self

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, first = self.epoch, self.start_batch
        self.start_batch = 0
        for b in range(first, self.num_batches):
            yield self.batch(epoch, b)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])


def nonfinite_windows(batch: dict[str, torch.Tensor], paths: list[str]) -> list[str]:
    """The windows of a batch whose latents hold NaN or inf, as ``"PATH (frames a..b)"``."""
    x = batch["latents"]
    bad = nonfinite_mask(x).nonzero().flatten().tolist()
    return [window_name(paths, int(batch["file_index"][i]), int(batch["start"][i]), x.shape[1]) for i in bad]


def nonfinite_mask(latents: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool on the latents' device (no sync): which windows ``[B, T, ...]`` hold NaN or inf."""
    return ~torch.isfinite(latents).flatten(1).all(1)


def window_name(paths: Sequence[str], file_index: int, start: int, frames: int) -> str:
    return f"{paths[file_index]} (frames {start}..{start + frames - 1})"

"""The LightningDataModule: random train windows, fixed val windows, a share per rank, the sampler in checkpoints."""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import h5py
import lightning as L
import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch.utils.data import DataLoader

from lwm.data.codecs import codec_from_attr
from lwm.data.h5 import DataError, inspect_h5
from lwm.data.manifest import checking, Manifest
from lwm.data.windows import collate_windows, FileBatchSampler, H5WindowDataset
from lwm.utils.errors import refuse_first, refused


def ignore_requeue_signal(worker_id: int) -> None:
    """In a DataLoader worker: leave SLURM's signals and Ctrl-C to the main process, which saves at the next batch
    end (:class:`~lwm.callbacks.SlurmRequeue`); a SIGTERM ends the worker only from its parent."""
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        starter = multiprocessing.parent_process()  # the DataLoader's process (not a forkserver)
        parent = starter.pid if starter is not None else os.getppid()

        def take_sigterm() -> None:
            while True:
                if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                    os._exit(0)

        threading.Thread(target=take_sigterm, name="lwm-sigterm", daemon=True).start()


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`FileBatchSampler` that knows how many batches it has handed out this epoch."""

    batch_sampler: FileBatchSampler

    def __init__(self, *args: Any, stream: dict[str, Any], on_seed: Callable[[int], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream, self.on_seed = stream, on_seed
        self._consumed = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batch) to start the next iteration at

    def __iter__(self) -> Iterator[Any]:
        sampler = self.batch_sampler
        if self._resume is not None and self._resume[0] == sampler.epoch:
            sampler.start_batch = min(self._resume[1], len(sampler))  # in batches of this run's global batch
        self._resume = None
        self._consumed = sampler.start_batch
        for batch in super().__iter__():
            self._consumed += 1
            yield batch

    @property
    def global_batch(self) -> int:
        """Windows per step over every rank."""
        return self.batch_sampler.batch_size * self.batch_sampler.world_size

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.batch_sampler.epoch, "batches": self._consumed, **self.batch_sampler.state_dict(),
                "global_batch": self.global_batch, "stream": dict(self.stream)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        seed, epoch, batches = self.batch_sampler.seed, int(state["epoch"]), int(state["batches"])
        self.batch_sampler.load_state_dict(state)
        if self.batch_sampler.seed != seed:
            rank_zero_warn(f"data.seed={seed} differs from the checkpoint's sampler seed {self.batch_sampler.seed}: "
                           "the resumed run keeps drawing the checkpoint's batches (its seed)")
        self.on_seed(self.batch_sampler.seed)
        changed = stream_changes(state.get("stream"), self.stream)
        if changed:
            rank_zero_warn(f"resuming with {'; '.join(changed)}: epoch {epoch} continues at batch {batches} with "
                           f"other batches than an uninterrupted run's")
        saved = int(state.get("global_batch", self.global_batch))  # (a checkpoint without it: taken as the same)
        if saved != self.global_batch:
            rank_zero_warn(f"resuming with a global batch of {self.global_batch} windows (batch_size x ranks), the "
                           f"checkpoint's run had {saved}: epoch {epoch} continues at batch {batches} of this run's "
                           f"{len(self.batch_sampler)}, with other batches than an uninterrupted run's")
        self._resume = (epoch, batches)


def stream_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's :meth:`LatentDataModule.stream` and this run's, a few words each."""
    if not saved:
        return []
    changed = [f"data.{k} {json.dumps(saved[k])} -> {json.dumps(current.get(k))}"
               for k in ("window", "batches_per_epoch") if k in saved and saved[k] != current.get(k)]
    if "train_digest" in saved and saved["train_digest"] != current.get("train_digest"):
        (f0, f1), (n0, n1) = ((int(saved[k]), current[k]) for k in ("train_files", "train_frames"))
        what = (f"{f0} files -> {f1} files" if f0 != f1 else f"{n0} frames -> {n1} frames in {f1} files" if n0 != n1
                else "other files or frame counts")
        changed.append(f"the train split changed since the checkpoint ({what})")
    return changed


class LatentDataModule(L.LightningDataModule):
    """Windows of ``window`` frames from the h5 files listed in ``manifest``."""

    def __init__(self, manifest: str, window: int = 16, batch_size: int = 32, val_batch_size: int | None = None,
                 num_workers: int = 4, val_size_percent: float = 1.0, seed: int = 0,
                 batches_per_epoch: int | None = None, check_files: bool = True,
                 multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = None,
                 prefetch_factor: int = 2, pin_memory: bool = True,
                 float16_batches: bool = True, label_fraction: float = 1.0) -> None:
        super().__init__()
        refuse_first(
            (f"data.window must be >= 2 (a transition; the model needs more), got {window}", window < 2),
            (f"data.batch_size and data.val_batch_size must be >= 1, got {batch_size}, {val_batch_size}",
             batch_size < 1 or (val_batch_size is not None and val_batch_size < 1)),
            (f"data.val_size_percent must lie in [0, 1], got {val_size_percent}", not 0.0 <= val_size_percent <= 1.0),
            (f"data.seed must be an integer >= 0, got {seed!r}", type(seed) is not int or seed < 0),  # (numpy's rule)
            (f"data.label_fraction must lie in [0, 1], got {label_fraction}", not 0.0 <= label_fraction <= 1.0),
            (f"data.num_workers must be >= 0 and data.prefetch_factor >= 1, got {num_workers}, {prefetch_factor}",
             num_workers < 0 or prefetch_factor < 1),  # (torch takes a prefetch_factor of 0, then loads nothing)
            (f"data.batches_per_epoch must be >= 1 (or null: the windows / the global batch), got {batches_per_epoch}",
             batches_per_epoch is not None and batches_per_epoch < 1), error=DataError)
        self.save_hyperparameters()
        vars(self).update(self.hparams)  # every setting as an attribute (self.window, ...)
        self.manifest_path, self.val_batch_size = Path(manifest), val_batch_size or batch_size
        self.manifest: Manifest | None = None
        self.train_set: H5WindowDataset | None = None
        self.val_set: H5WindowDataset | None = None

    def load_manifest(self) -> Manifest:
        """The manifest, each file's header checked (``check_files``: the values of those changed since indexing)."""
        if self.manifest is not None:
            return self.manifest
        manifest = Manifest.load(self.manifest_path)
        entries, shape = manifest.entries, (manifest.channels, manifest.height, manifest.width)
        if self.check_files:
            manifest.check_duplicates(files=True)  # links and hard links too
            problems, changed = [], []
            rank_zero = (self.trainer.global_rank if self.trainer is not None else rank_zero_only.rank) == 0
            for e in checking(entries, f"checking {len(entries)} files", show=rank_zero):
                path = manifest.resolve(e)
                values = path.is_file() and e.changed_since_checked(path.stat())  # checked again
                try:
                    info = inspect_h5(path, *shape, check_values=values, key=e.key)
                except DataError as err:
                    problems.append(f"{err} (changed since `lwm data index` checked it)" if values else str(err))
                    continue
                if info.frames < e.frames:
                    problems.append(f"{path}: {info.frames} frames, the manifest says {e.frames} (truncated?)")
                elif values:
                    changed.append(path)
            if problems:
                raise refused(problems, len(entries), f" in {manifest.path}")
            if changed:  # the others' values were checked by `lwm data index`: headers only here
                rank_zero_warn(f"{len(changed)} of {len(entries)} files in {manifest.path} changed since `lwm data "
                               f"index` checked their values (size or modification time; first: {changed[0]}): their "
                               f"values were checked again, at every start until `lwm data index` on their folder "
                               f"records them (a copy that did not keep modification times shows as changed)")
        self.manifest = manifest
        return manifest

    def codec(self):
        """The pixel decoder of the validation files (their ``codec`` attribute, read from the first one), or None."""
        manifest = self.load_manifest()
        path = manifest.resolve((manifest.split("val") or manifest.entries)[0])
        with h5py.File(path, "r") as f:
            return codec_from_attr(f.attrs.get("codec"), str(path))

    @property
    def frame_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of every file."""
        m = self.load_manifest()
        return m.channels, m.height, m.width

    def setup(self, stage: str) -> None:
        manifest = self.load_manifest()
        if stage == "fit" and self.train_set is None:
            self.train_set = H5WindowDataset(manifest, "train", self.window, self.float16_batches,
                                             label_fraction=self.label_fraction)
        validating = stage in ("fit", "validate") and self.val_size_percent > 0
        if (validating or stage in ("test", "predict")) and self.val_set is None:
            self.val_set = H5WindowDataset(manifest, "val", self.window, self.float16_batches)
        if validating:
            self.val_windows()  # refuse now, before training, a split too small for the ranks

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _loader_kwargs(self) -> dict[str, Any]:
        on_gpu = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        workers = dict(persistent_workers=True, multiprocessing_context=self.multiprocessing_context,
                       prefetch_factor=self.prefetch_factor, worker_init_fn=ignore_requeue_signal)
        return dict(collate_fn=collate_windows, num_workers=self.num_workers, pin_memory=self.pin_memory and on_gpu,
                    **(workers if self.num_workers > 0 else {}))

    def train_dataloader(self) -> ResumableDataLoader:
        if self.train_set is None:  # called outside a fit (benchmarks/data_loader.py)
            self.setup("fit")
        rank, world_size = self._rank()
        sampler = FileBatchSampler(self.train_set.frames, self.window, self.batch_size, seed=self.seed, rank=rank,
                                   world_size=world_size, batches_per_epoch=self.batches_per_epoch)
        return ResumableDataLoader(self.train_set, batch_sampler=sampler, stream=self.stream(),
                                   on_seed=lambda seed: setattr(self, "seed", seed), **self._loader_kwargs())

    def stream(self) -> dict[str, Any]:
        """What decides the training batches besides the seed and the global batch, for the loader's state."""
        manifest = self.load_manifest()
        entries = manifest.split("train")
        paths = [os.path.normpath(os.path.join(os.path.abspath(manifest.path.parent), e.path)) for e in entries]
        shared = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])  # (the split is not empty)
        listed = json.dumps([[os.path.relpath(p, shared), int(e.frames)] for p, e in zip(paths, entries)]).encode()
        return {"train_files": len(entries), "train_frames": sum(int(e.frames) for e in entries),
                "train_digest": hashlib.sha256(listed).hexdigest()[:16], "window": self.window,
                "batches_per_epoch": self.batches_per_epoch}

    def state_dict(self) -> dict[str, Any]:
        """The seed of the training stream and validation subset, restored before any loader is made."""
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") is None or int(state["seed"]) == self.seed:
            return
        seed, saved = self.seed, int(state["seed"])
        fn = getattr(getattr(self.trainer, "state", None), "fn", None)  # (no trainer: as in a fit)
        if fn in ("fit", None):
            rank_zero_warn(f"data.seed={seed} differs from the checkpoint's sampler seed {saved}: the resumed run "
                           "keeps drawing the checkpoint's batches and validation windows (its seed)")
        elif fn == "validate" and self.val_size_percent < 1:
            rank_zero_warn(f"data.seed={seed} differs from the checkpoint's {saved}: validating on the checkpoint "
                           f"run's validation windows (its seed)")
        self.seed = saved  # the training stream, validation subset and code dictionaries' windows

    def keep_checkpoint_seed(self, checkpoint: dict[str, Any]) -> None:
        """The seed of a checkpoint read outside a Trainer (``lwm codes``), where it holds one, taken silently."""
        seed = (checkpoint.get(type(self).__qualname__) or {}).get("seed")
        if seed is not None:
            self.seed = int(seed)

    def fixed_windows(self, dataset: H5WindowDataset, limit: int | None = None) -> list[tuple[int, int]]:
        """This rank's share (round-robin) of the first ``limit`` non-overlapping windows of ``dataset``, seeded."""
        every = [(i, s) for i, f in enumerate(dataset.frames) for s in range(0, f - self.window + 1, self.window)]
        order = np.random.default_rng([self.seed, 1]).permutation(len(every))[:limit]
        rank, world_size = self._rank()
        return [every[i] for i in order][rank::world_size]

    def code_loader(self, max_windows: int | None = None) -> DataLoader:
        """Fixed training windows (at most ``max_windows`` over all ranks), for the code dictionaries."""
        return DataLoader(self.train_set, batch_size=self.val_batch_size,
                          sampler=self.fixed_windows(self.train_set, max_windows), **self._loader_kwargs())

    def val_windows(self, fraction: float | None = None) -> list[tuple[int, int]]:
        """This rank's validation windows ``(file_index, start)``."""
        count = self._val_window_count(fraction, self._rank()[1])
        return self.fixed_windows(self.val_set, count) if count else []

    def _val_window_count(self, fraction: float | None, world_size: int) -> int:
        """How many validation windows all ranks together use at ``fraction`` (default ``val_size_percent``)."""
        fraction = self.val_size_percent if fraction is None else fraction
        if self.val_set is None or fraction == 0:
            return 0
        total = len(self.val_set)  # non-overlapping windows
        if total < world_size:
            raise DataError(f"{self.manifest_path}: {total} validation windows of {self.window} frames for "
                            f"{world_size} ranks; every rank needs one (more val files, a shorter data.window, "
                            f"or data.val_size_percent=0)")
        return min(total, max(world_size, math.ceil(fraction * total)))

    def val_batches_per_rank(self, world_size: int, fraction: float | None = None) -> list[int]:
        """Each rank's number of validation batches at ``fraction`` (default ``val_size_percent``)."""
        count = self._val_window_count(fraction, world_size)
        return [math.ceil(len(range(rank, count, world_size)) / self.val_batch_size) for rank in range(world_size)]

    def val_dataloader(self) -> DataLoader | list:
        if self.val_size_percent == 0:
            return []  # Lightning runs no validation
        return self._fixed_loader(self.val_windows())

    def test_dataloader(self) -> DataLoader:
        """Every validation window (the manifest has no test split)."""
        return self._fixed_loader(self.val_windows(1.0))

    predict_dataloader = test_dataloader  # every validation window, for ``lwm predict``

    def _fixed_loader(self, windows: list[tuple[int, int]]) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size, sampler=windows, **self._loader_kwargs())

    def teardown(self, stage: str) -> None:
        for ds in (self.train_set, self.val_set):
            if ds is not None:
                ds.close()

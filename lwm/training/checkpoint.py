"""Checkpoint files that are always complete, and that load without unpickling arbitrary objects.

Lightning's own atomic save moves an fsspec temp file, which is atomic only when ``$TMPDIR`` is on the
checkpoint's filesystem. :class:`AtomicCheckpointIO` writes ``.NAME.tmp-HOST-PID`` beside the target, fsyncs it
and ``os.replace``s it over the target: a run killed at any moment leaves either the previous checkpoint or
the new one, never a torn file (a leftover temp file is ignored, and the next save in its folder removes it:
of this host, once its process is gone; of another host, an hour after its last write).
Loading always uses ``torch.load(weights_only=True)``.

:class:`ModelCheckpoint` is Lightning's, except that the end of training always leaves ``last.ckpt`` at the
final step (Lightning's writes it at the end only when nothing was saved during the run), and a run that ends
at ``max_steps`` writes it from the last batch, mid-epoch: a later ``--ckpt_path last`` with a larger
``max_steps`` then continues exactly as an uninterrupted longer run (the same batches, the same logged steps),
where an end-of-training checkpoint would start a fresh epoch. A step checkpoint due at a batch a validation follows
is written at the end of that validation, mid-epoch as at an epoch's end (Lightning writes it before a mid-epoch
one, so a kill during that validation resumed after it and the validation was never logged); one due on an
epoch's last batch is written there where no validation follows it (Lightning defers it to one, which may not come
for a long time).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import lightning as L
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lwm.training.loggers import CSVLogger
from lwm.training.module import WorldModelModule
from lwm.utils.errors import DataError, first_line, LwmError, torch_load_failure
from lwm.utils.files import atomic_write, fsync_dir, fsync_file, remove_stale_temp_files


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to ``.NAME.tmp-HOST-PID`` beside ``path``, fsynced, then renamed over it: readers see the
    old file or the new one, never a torn one."""
    path = atomic_write(path, lambda f: torch.save(obj, f))
    fsync_dir(path.parent)
    return path


LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict", "global_step")  # what every Lightning checkpoint holds


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint directory (Lightning's ``last.ckpt/`` with ``latest`` or
    ``checkpoint/`` in it)."""
    folder = Path(path)
    return folder.is_dir() and ((folder / "latest").is_file() or (folder / "checkpoint").is_dir())


# A DeepSpeed checkpoint directory is rewritten in place, file by file, by every rank (the model states, then each
# rank's optimizer shard, then ``latest``): a kill between two of its writes leaves whole files of two different
# steps, which DeepSpeed would load as one (the fp32 master weights in the shards of the older). lwm marks a
# directory complete: rank 0 moves the mark aside (DEEPSPEED_WRITING, which keeps its time: when the directory was
# last whole) before DeepSpeed writes anything and writes a new one, with the step, after every rank's files are
# written (:func:`mark_deepspeed_saves_complete`).
DEEPSPEED_MARK = "lwm_complete.json"
DEEPSPEED_WRITING = "lwm_writing.json"


def deepspeed_files(path: str | Path) -> tuple[Path, list[Path]]:
    """A DeepSpeed checkpoint directory's model states (Lightning's client state, the global step among it; ZeRO
    stage 3: rank 0's) and every file of it (model states, each rank's optimizer shard), in the folder its
    ``latest`` file names (Lightning's tag: ``checkpoint``)."""
    path = Path(path)
    latest = path / "latest"
    folder = path / (latest.read_text().strip() if latest.is_file() else "checkpoint")
    model = folder / "mp_rank_00_model_states.pt"
    if not model.is_file():
        model = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return model, sorted(folder.glob("*_states.pt"))


def deepspeed_step(path: str | Path) -> int | None:
    """The global step of a DeepSpeed checkpoint directory that lwm marked complete, its files whole (``latest``,
    which DeepSpeed's load reads, among them), with that step in its model states; None for any other (cut short
    by a kill, or not written by lwm)."""
    import json
    import zipfile

    path = Path(path)
    try:
        mark = json.loads((path / DEEPSPEED_MARK).read_text())
        if not (path / "latest").is_file():
            return None
        model, files = deepspeed_files(path)
        if not all(zipfile.is_zipfile(f) for f in files):  # a zip's directory is at its end: a file cut short
            return None
        step = int(torch.load(model, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
        return step if step == int(mark["global_step"]) else None
    except Exception:  # no mark (a write cut short), a foreign or torn file
        return None


def deepspeed_written(path: str | Path) -> float | None:
    """When a DeepSpeed checkpoint directory was last whole: its completion mark's time; while a write is cut
    short, its previous mark's (moved aside); None if it never was."""
    for name in (DEEPSPEED_MARK, DEEPSPEED_WRITING):
        if (Path(path) / name).is_file():
            return (Path(path) / name).stat().st_mtime
    return None


def mark_deepspeed_saves_complete(strategy: Any) -> None:
    """Make ``strategy``'s (a DeepSpeedStrategy's) saves mark their directory complete (:data:`DEEPSPEED_MARK`):
    rank 0 moves the mark aside before the save (DeepSpeed's begins with a barrier of every rank, so no rank writes
    a file before it is gone); after it, every rank fsyncs the directory's files (its own writes are in its own
    node's cache), and once all have (a barrier) rank 0 writes the mark with the step. (The mark does not list the
    files: on a shared filesystem a node's listing of a folder may not show another node's new file yet.)"""
    import json
    import os

    save = strategy.save_checkpoint

    def save_and_mark(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        path = Path(strategy.broadcast(filepath))  # (rank 0's: each rank names its own hpc file)
        if strategy.is_global_zero and (path / DEEPSPEED_MARK).exists():
            os.replace(path / DEEPSPEED_MARK, path / DEEPSPEED_WRITING)  # (a rename keeps the file's time)
            fsync_dir(path)
        save(checkpoint, path, storage_options)
        _, files = deepspeed_files(path)
        for f in [*files, path / "latest"]:
            if f.is_file():
                fsync_file(f)
        fsync_dir(files[0].parent if files else path)
        strategy.barrier("lwm: a DeepSpeed checkpoint's files on disk")
        if strategy.is_global_zero:
            atomic_write(path / DEEPSPEED_MARK, lambda f: json.dump({"global_step": int(checkpoint["global_step"])}, f),
                         mode="w")
            (path / DEEPSPEED_WRITING).unlink(missing_ok=True)
            fsync_dir(path)

    strategy.save_checkpoint = save_and_mark


def read_checkpoint(path: str | Path, label: str = "", what: str = "checkpoint") -> dict[str, Any]:
    """The dict of a Lightning checkpoint file (``weights_only=True``, memory-mapped: the tensors are not read); a
    missing, unreadable (torn) or foreign file (another program's tensors, a code dictionary), a folder or a
    DeepSpeed checkpoint directory is a one-line :class:`~lwm.errors.DataError` naming ``label`` and the path."""

    where = f"{label} {path}".strip()
    folder = Path(path)
    if is_deepspeed_checkpoint(folder):
        raise DataError(f"{where}: a DeepSpeed checkpoint directory; convert it to one file first (Lightning's "
                        f"lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict)")
    if folder.is_dir():
        raise DataError(f"{where}: a folder without a checkpoint (a run's folder holds checkpoints/last.ckpt); give a "
                        f"checkpoint file")
    if not folder.is_file():
        raise DataError(f"{where}: checkpoint not found")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise DataError(f"{where}: not a readable {what} ({torch_load_failure(e, path)})") from None
    missing = [k for k in LIGHTNING_KEYS if k not in checkpoint] if isinstance(checkpoint, dict) else list(LIGHTNING_KEYS)
    if missing:
        raise DataError(f"{where}: not a readable {what} (not a Lightning checkpoint: it has no {', '.join(missing)})")
    return checkpoint


def trained_window(checkpoint: dict[str, Any]) -> int | None:
    """The frames per window the checkpoint's run trained on (its data module's hyperparameters), None if unknown."""
    window = (checkpoint.get("datamodule_hyper_parameters") or {}).get("window")
    return None if window is None else int(window)


def warn_window_mismatch(checkpoint: dict[str, Any], window: int, path: str | Path) -> None:
    """Warn (one line) where ``data.window`` differs from the window the checkpoint's run trained on
    (:func:`trained_window`): validation metrics and code dictionaries depend on it, and a command given no
    ``--config`` has the default, 16."""
    trained = trained_window(checkpoint)
    if trained is not None and int(trained) != int(window):
        rank_zero_warn(f"data.window = {window}, but {path} was trained on {trained}-frame windows: working on "
                       f"{window}-frame windows (--data.window={trained}, or the run's --config RUN_DIR/config.yaml, "
                       f"to match)")


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> tuple[dict[str, Any], Any]:
    """``(the checkpoint's dict, its WorldModelModule)`` of an lwm checkpoint file (``weights_only=True``), for the
    verbs that take a model from one (``lwm codes``, ``lwm generate``). A missing, foreign or unreadable file, or
    a DeepSpeed checkpoint directory, is a one-line :class:`~lwm.errors.DataError` naming it."""

    raw = read_checkpoint(path, what="lwm checkpoint")  # (a folder, DeepSpeed's or not: refused there)
    try:
        module = WorldModelModule.load_from_checkpoint(path, map_location=map_location, weights_only=True)
    except (LwmError, torch.OutOfMemoryError):  # a config problem says itself; memory is not the file's fault
        raise
    except Exception as e:  # a torn, foreign or non-checkpoint file: what failed, in one line
        raise DataError(f"{path}: not a readable lwm checkpoint ({type(e).__name__}: {first_line(e)[:200]})") from None
    return raw, module


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves through :func:`atomic_save` (a remote ``fsspec`` path: Lightning's own save), sweeping the temp files
    of killed writes in the folder first; loads with ``weights_only=True`` whatever the caller asks."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(path.parent)  # from runs killed mid-write (any checkpoint's name)
        atomic_save(checkpoint, path)

    @override
    def load_checkpoint(
        self, path: str | Path, map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)


class ModelCheckpoint(_LightningModelCheckpoint):
    """Lightning's ModelCheckpoint with the module docstring's changes. It reaches into Lightning's private state
    (checked against lightning 2.6.x): ``_save_topk_checkpoint``, ``_save_last_checkpoint``,
    ``_monitor_candidates``, ``_last_global_step_saved``, ``_every_n_train_steps``, ``_train_time_interval``,
    ``_should_skip_saving_checkpoint``, ``_defer_save_until_validation``, ``_legacy_state_key``, and the fit
    loop's ``_should_check_val_fx``, ``_skip_next_val``, ``_data_fetcher``, ``_should_accumulate`` and
    ``_batches_that_stepped`` (:func:`_validation_follows`, :func:`_count_the_validated_batch`)."""

    @property
    @override
    def state_key(self) -> str:
        """This callback's state's key in a checkpoint: the files it ranks (folder, name pattern, monitor, mode), not
        Lightning's intervals: a run resumed with another ``every_n_train_steps`` keeps its step files' ranking
        (Lightning's key changed with it: the older files were never removed, and Lightning asked for the old
        callback); two callbacks writing other files keep their own states."""
        return self._generate_state_key(monitor=self.monitor, mode=self.mode, dirpath=self.dirpath,
                                        filename=self.filename)

    @property
    @override
    def _legacy_state_key(self) -> str:  # type: ignore[override]
        """Where Lightning also looks for the state: its own key, as checkpoints of earlier lwm versions hold it."""
        return super().state_key

    _at_validation_end = False  # this save is the one at a validation's end, after a batch that stepped
    _resumed_at_validation_end = False  # the checkpoint this fit resumed from was such a save

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "at_validation_end": self._at_validation_end}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._resumed_at_validation_end = bool(state_dict.get("at_validation_end", False))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self._resumed_at_validation_end:
            self._resumed_at_validation_end = False
            _count_the_validated_batch(trainer)

    def _step_due(self, trainer: L.Trainer) -> bool:
        """A step checkpoint is due at this training batch (``every_n_train_steps``)."""
        return self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0

    def save_last_now(self, trainer: L.Trainer) -> None:
        """Write ``last.ckpt`` now (from a training-batch hook: the state a step checkpoint would hold); not under
        ``trainer.fast_dev_run`` (Lightning's: a trial that leaves no checkpoint)."""
        if self.save_last and not trainer.fast_dev_run:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def save_stop_now(self, trainer: L.Trainer) -> None:
        """The run stops at this training batch (``max_steps``, a preemption): write its step checkpoint if one is
        due, then ``last.ckpt``. Lightning defers a due step checkpoint on an epoch's last batch to the end of the
        validation after it, where the ``last.ckpt`` write would make it skip the step as saved already. (Ranked
        by the step, the default monitor; a validation metric's ranking keeps Lightning's deferral.)"""
        step = trainer.global_step
        if trainer.fast_dev_run:
            return
        if self._step_due(trainer) and self.monitor in (None, "step") and self._last_global_step_saved != step:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
            self._defer_save_until_validation = False
        self.save_last_now(trainer)

    def _waits_for_validation(self, trainer: L.Trainer) -> bool:
        """This batch's step checkpoint is due and waits for the validation right after it: saved at its end
        (:meth:`on_validation_end`), it holds that validation's metrics, and a kill during the validation resumes
        from the checkpoint before and redoes the steps and the validation. Not at the final step (written at the
        batch's end, :meth:`save_stop_now`), nor with timed validation or checkpoints (each rank's own clock)."""
        return (self._step_due(trainer) and self._train_time_interval is None
                and getattr(trainer, "_val_check_time_interval", None) is None
                and not 0 < trainer.max_steps <= trainer.global_step
                and not self._should_skip_saving_checkpoint(trainer)
                and trainer.lightning_module.automatic_optimization
                and _validation_follows(trainer))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        if self._waits_for_validation(trainer):
            self._defer_save_until_validation = True
        else:
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        step = trainer.global_step
        if self._defer_save_until_validation and self._last_global_step_saved != step and self._step_due(trainer):
            # Lightning deferred this step's checkpoint (an epoch's last batch) to the validation it assumes follows
            # (its metrics fresh; a kill during it then redoes the steps and the validation). Where none follows
            # (step-based validation, check_val_every_n_epoch: null; an epoch whose length val_check_interval does
            # not divide) every checkpoint would wait for the next validation: it is written here.
            candidates = self._monitor_candidates(trainer)
            if self.monitor in candidates and not _validation_follows(trainer):
                self._save_topk_checkpoint(trainer, candidates)
                self._save_last_checkpoint(trainer, candidates)
                self._defer_save_until_validation = False
        if 0 < trainer.max_steps <= trainer.global_step and self._last_global_step_saved != trainer.global_step:
            self.save_stop_now(trainer)  # the run stops here

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (self._defer_save_until_validation and trainer.state.fn == "fit" and not trainer.sanity_checking
                and not trainer.fast_dev_run):
            # a step checkpoint deferred to this validation (by _waits_for_validation, or by Lightning: an epoch's
            # last batch, a validation metric not logged yet). At the final step save_stop_now wrote last.ckpt
            # (the batch-end state, kept) and Lightning would skip the step as saved already: the top-k file only.
            final = self._last_global_step_saved == trainer.global_step
            stepped = not trainer.fit_loop.epoch_loop._should_accumulate()  # (else no training row at this step)
            for logger in trainer.loggers if stepped else ():  # the step's row (training scalars and this
                if isinstance(logger, CSVLogger):  # validation) is complete: written before the checkpoint, which
                    logger.flush()  # a resume starts after
            candidates = self._monitor_candidates(trainer)
            self._at_validation_end = stepped
            try:
                self._save_topk_checkpoint(trainer, candidates)
                if not final:
                    self._save_last_checkpoint(trainer, candidates)
            finally:
                self._at_validation_end = False
            self._defer_save_until_validation = False
            return
        super().on_validation_end(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step and not trainer.sanity_checking:
            self.save_last_now(trainer)
        else:
            super().on_train_end(trainer, pl_module)


def _count_the_validated_batch(trainer: L.Trainer) -> None:
    """A checkpoint written at a validation's end holds the fit loop before it counted that batch's logged step
    (Lightning counts it after the validation). Resumed where that validation is due again, Lightning skips it and
    counts the step then; where it is not (another ``val_check_interval``, another epoch length), Lightning trains
    on at the stale count and logs every later step one too low: counted here."""
    loop = trainer.fit_loop.epoch_loop
    try:
        due = loop.restarting and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
    except (AttributeError, TypeError):  # Lightning's private API moved: its own count
        return
    if not due:
        loop._batches_that_stepped += 1


def _validation_follows(trainer: L.Trainer) -> bool:
    """Whether the fit loop validates after the current training batch (Lightning's own decision, asked early; where
    its private API has moved, ``True``: Lightning's assumption). Timed validation (``val_check_interval`` a
    duration) may fall due during the save, on each rank's own clock: ``True`` too (Lightning's deferral to the
    next validation, at most that interval away)."""
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return True
    loop = trainer.fit_loop.epoch_loop
    try:
        follows = loop._should_check_val_fx(trainer.fit_loop._data_fetcher) and not loop._skip_next_val
    except (AttributeError, TypeError):
        return True
    batches = trainer.num_val_batches
    return bool(follows and trainer.enable_validation and sum(batches if isinstance(batches, list) else [batches]))

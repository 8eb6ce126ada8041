"""Checkpoint files that are always complete, and that load without unpickling arbitrary objects."""

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
    """``torch.save`` to ``.NAME.tmp-HOST-PID`` beside ``path``, fsynced, then renamed over it: readers see the old
    file or the new one, never a torn one."""
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
# rank's optimizer shard, then ``latest``).
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
    which DeepSpeed's load reads, among them), with that step in its model states."""
    import json
    import zipfile

    path = Path(path)
    try:
        mark = json.loads((path / DEEPSPEED_MARK).read_text())
        if not (path / "latest").is_file():
            return None
        model, files = deepspeed_files(path)
        if not all(zipfile.is_zipfile(f) for f in files):  # a zip's directory is at its end
            return None
        step = int(torch.load(model, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
        return step if step == int(mark["global_step"]) else None
    except Exception:  # no mark (a write cut short), a foreign or torn file
        return None


def deepspeed_written(path: str | Path) -> float | None:
    """When a DeepSpeed checkpoint directory was last whole."""
    for name in (DEEPSPEED_MARK, DEEPSPEED_WRITING):
        if (Path(path) / name).is_file():
            return (Path(path) / name).stat().st_mtime
    return None


def mark_deepspeed_saves_complete(strategy: Any) -> None:
    """Make ``strategy``'s (a DeepSpeedStrategy's) saves mark their directory complete (:data:`DEEPSPEED_MARK`)."""
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
    """The dict of a Lightning checkpoint file (``weights_only=True``, memory-mapped: the tensors are not read)."""

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
    (:func:`trained_window`)."""
    trained = trained_window(checkpoint)
    if trained is not None and int(trained) != int(window):
        rank_zero_warn(f"data.window = {window}, but {path} was trained on {trained}-frame windows: working on "
                       f"{window}-frame windows (--data.window={trained}, or the run's --config RUN_DIR/config.yaml, "
                       f"to match)")


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> tuple[dict[str, Any], Any]:
    """``(the checkpoint's dict, its WorldModelModule)`` of an lwm checkpoint file (``weights_only=True``), for the
    verbs that take a model from one (``lwm codes``, ``lwm generate``)."""

    raw = read_checkpoint(path, what="lwm checkpoint")  # (a folder, DeepSpeed's or not: refused there)
    try:
        module = WorldModelModule.load_from_checkpoint(path, map_location=map_location, weights_only=True)
    except (LwmError, torch.OutOfMemoryError):  # a config problem says itself
        raise
    except Exception as e:  # a torn, foreign or non-checkpoint file
        raise DataError(f"{path}: not a readable lwm checkpoint ({type(e).__name__}: {first_line(e)[:200]})") from None
    return raw, module


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves through :func:`atomic_save` (a remote ``fsspec`` path: Lightning's own save), sweeping the temp files of
    killed writes in the folder first."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(path.parent)  # from runs killed mid-write
        atomic_save(checkpoint, path)

    @override
    def load_checkpoint(
        self, path: str | Path, map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)


class ModelCheckpoint(_LightningModelCheckpoint):
    """Lightning's ModelCheckpoint with the module docstring's changes."""

    @property
    @override
    def state_key(self) -> str:
        """This callback's state's key in a checkpoint."""
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
        """Write ``last.ckpt`` now (from a training-batch hook: the state a step checkpoint would hold)."""
        if self.save_last and not trainer.fast_dev_run:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def save_stop_now(self, trainer: L.Trainer) -> None:
        """The run stops at this training batch (``max_steps``, a preemption): write its step checkpoint if one is
        due, then ``last.ckpt``."""
        step = trainer.global_step
        if trainer.fast_dev_run:
            return
        if self._step_due(trainer) and self.monitor in (None, "step") and self._last_global_step_saved != step:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
            self._defer_save_until_validation = False
        self.save_last_now(trainer)

    def _waits_for_validation(self, trainer: L.Trainer) -> bool:
        """This batch's step checkpoint is due and waits for the validation right after it."""
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
            # (its metrics fresh; a kill during it then redoes the steps and the validation).
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
            # a step checkpoint deferred to this validation (by _waits_for_validation, or by Lightning: an epoch's last
            # batch, a validation metric not logged yet).
            final = self._last_global_step_saved == trainer.global_step
            stepped = not trainer.fit_loop.epoch_loop._should_accumulate()  # (else no training row at this step)
            for logger in trainer.loggers if stepped else ():  # the step's row (training scalars and this
                if isinstance(logger, CSVLogger):
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
    (Lightning counts it after the validation)."""
    loop = trainer.fit_loop.epoch_loop
    try:
        due = loop.restarting and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
    except (AttributeError, TypeError):  # Lightning's private API moved: its own count
        return
    if not due:
        loop._batches_that_stepped += 1


def _validation_follows(trainer: L.Trainer) -> bool:
    """Whether the fit loop validates after the current training batch (Lightning's own decision, asked early; where
    its private API has moved, ``True``: Lightning's assumption)."""
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return True
    loop = trainer.fit_loop.epoch_loop
    try:
        follows = loop._should_check_val_fx(trainer.fit_loop._data_fetcher) and not loop._skip_next_val
    except (AttributeError, TypeError):
        return True
    batches = trainer.num_val_batches
    return bool(follows and trainer.enable_validation and sum(batches if isinstance(batches, list) else [batches]))

"""Checkpoint files that are always complete, and that load without unpickling arbitrary objects."""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from fsspec.utils import get_protocol
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lwm.training.loggers import CSVLogger
from lwm.training.module import WorldModelModule
from lwm.training.trainer_state import accumulating, validation_follows
from lwm.utils.errors import DataError, first_line, LwmError, torch_load_failure
from lwm.utils.files import atomic_write, fsync_dir, fsync_file, remove_stale_temp_files

LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict", "global_step")  # what every Lightning checkpoint holds
# A DeepSpeed checkpoint directory is rewritten in place, file by file, by every rank: lwm marks it whole.
DEEPSPEED_MARK = "lwm_complete.json"
DEEPSPEED_WRITING = "lwm_writing.json"


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to a temp file beside ``path``, fsynced, then renamed over it: never a torn file."""
    path = atomic_write(path, lambda f: torch.save(obj, f))
    fsync_dir(path.parent)
    return path


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    folder = Path(path)
    return folder.is_dir() and ((folder / "latest").is_file() or (folder / "checkpoint").is_dir())


def deepspeed_files(path: str | Path) -> tuple[Path, list[Path]]:
    """A DeepSpeed checkpoint directory's model states (rank 0's under ZeRO 3) and all its ``*_states.pt`` files."""
    path = Path(path)
    latest = path / "latest"
    folder = path / (latest.read_text().strip() if latest.is_file() else "checkpoint")
    model = folder / "mp_rank_00_model_states.pt"
    if not model.is_file():
        model = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return model, sorted(folder.glob("*_states.pt"))


def deepspeed_step(path: str | Path) -> int | None:
    """The global step of a DeepSpeed checkpoint directory marked complete, its files whole (else None)."""
    path = Path(path)
    try:
        mark = json.loads((path / DEEPSPEED_MARK).read_text())
        model, files = deepspeed_files(path)
        if not (path / "latest").is_file() or not all(zipfile.is_zipfile(f) for f in files):  # a zip ends in its index
            return None
        step = int(torch.load(model, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
        return step if step == int(mark["global_step"]) else None
    except Exception:  # no mark (a write cut short), a foreign or torn file
        return None


def deepspeed_written(path: str | Path) -> float | None:
    """When a DeepSpeed checkpoint directory was last whole."""
    marks = [Path(path) / name for name in (DEEPSPEED_MARK, DEEPSPEED_WRITING) if (Path(path) / name).is_file()]
    return marks[0].stat().st_mtime if marks else None


def mark_deepspeed_saves_complete(strategy: Any) -> None:
    """Make a DeepSpeedStrategy's saves mark their directory whole (:data:`DEEPSPEED_MARK`) once all is on disk."""
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
    where, folder = f"{label} {path}".strip(), Path(path)
    if not folder.is_file():
        raise DataError(f"{where}: " + (
            "a DeepSpeed checkpoint directory; convert it to one file first (Lightning's lightning.pytorch.utilities."
            "deepspeed.convert_zero_checkpoint_to_fp32_state_dict)" if is_deepspeed_checkpoint(folder) else
            "a folder without a checkpoint (a run's folder holds checkpoints/last.ckpt); give a checkpoint file"
            if folder.is_dir() else "checkpoint not found"))
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        missing = [k for k in LIGHTNING_KEYS if not isinstance(checkpoint, dict) or k not in checkpoint]
        why = f"not a Lightning checkpoint: it has no {', '.join(missing)}" if missing else None
    except Exception as e:
        why = torch_load_failure(e, path)
    if why:
        raise DataError(f"{where}: not a readable {what} ({why})") from None
    return checkpoint


def trained_window(checkpoint: dict[str, Any]) -> int | None:
    """The frames per window the checkpoint's run trained on, None if unknown."""
    window = (checkpoint.get("datamodule_hyper_parameters") or {}).get("window")
    return None if window is None else int(window)


def warn_window_mismatch(checkpoint: dict[str, Any], window: int, path: str | Path) -> None:
    trained = trained_window(checkpoint)
    if trained is not None and int(trained) != int(window):
        rank_zero_warn(f"data.window = {window}, but {path} was trained on {trained}-frame windows: working on "
                       f"{window}-frame windows (--data.window={trained}, or the run's --config RUN_DIR/config.yaml, "
                       f"to match)")


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> tuple[dict[str, Any], Any]:
    """``(the checkpoint's dict, its WorldModelModule)`` of an lwm checkpoint file (``weights_only=True``)."""
    raw = read_checkpoint(path, what="lwm checkpoint")
    try:
        module = WorldModelModule.load_from_checkpoint(path, map_location=map_location, weights_only=True)
    except (LwmError, torch.OutOfMemoryError):  # a config problem says itself
        raise
    except Exception as e:  # a torn, foreign or non-checkpoint file
        raise DataError(f"{path}: not a readable lwm checkpoint ({type(e).__name__}: {first_line(e)[:200]})") from None
    return raw, module


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves local files through :func:`atomic_save` (killed writes' temp files swept); loads ``weights_only``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if get_protocol(str(path)) != "file":
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(path.parent)
        atomic_save(checkpoint, path)

    def load_checkpoint(self, path: str | Path, map_location: Callable | None = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)


class ModelCheckpoint(_LightningModelCheckpoint):
    """Lightning's ModelCheckpoint whose step checkpoints are written at the end of their batch, or, where a
    validation follows it (or ``monitor`` is not logged yet), at the end of that validation, so that a kill during it
    redoes the validation. A stop writes the due step file and ``last.ckpt``. The state key leaves the intervals out:
    a resume with another interval keeps ranking the run's step files."""

    def __init__(self, *args: Any, every_n_train_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, every_n_train_steps=every_n_train_steps, **kwargs)
        self.every_n_train_steps = every_n_train_steps or 0  # 0: Lightning's epoch or time triggers
        self.saved_step = 0  # the global step written last (as Lightning: none at step 0)
        self.waiting = False  # a due step checkpoint waits for the end of a validation
        self._after_validation = False  # the save under way is at a validation's end

    @property
    def state_key(self) -> str:
        keys = {"monitor": self.monitor, "mode": self.mode, "dirpath": self.dirpath, "filename": self.filename}
        return f"{type(self).__qualname__}{keys!r}"

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """At a validation's end, the fit loop as at the end of the batch before: a resume skips the validation done
        and counts that batch whatever its own validation schedule."""
        if self._after_validation:
            progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
            progress["total"]["completed"] -= 1
            progress["current"]["completed"] -= 1

    def _metrics(self, trainer: L.Trainer) -> dict[str, Any]:  # what the file name and ``monitor`` read
        return {**trainer.callback_metrics, "epoch": torch.tensor(trainer.current_epoch),
                "step": torch.tensor(trainer.global_step)}

    def _due(self, trainer: L.Trainer) -> bool:
        """A step checkpoint not written yet falls due at this training batch (one that stepped)."""
        step = trainer.global_step
        return (bool(self.every_n_train_steps) and step % self.every_n_train_steps == 0 and step != self.saved_step
                and not accumulating(trainer))

    def save_step(self, trainer: L.Trainer, last: bool = True) -> None:
        """This step's checkpoint (kept while among the ``save_top_k`` best by ``monitor``), then ``last.ckpt``."""
        self._save_topk_checkpoint(trainer, self._metrics(trainer))  # Lightning's ranking, naming, removals (private)
        if last:
            self.save_last_now(trainer)

    def save_last_now(self, trainer: L.Trainer) -> None:
        if self.save_last:  # (the path first: part of the state)
            self.last_model_path = self.format_checkpoint_name(self._metrics(trainer), self.CHECKPOINT_NAME_LAST)
            trainer.save_checkpoint(self.last_model_path, self.save_weights_only)
        self.saved_step = trainer.global_step

    def save_stop_now(self, trainer: L.Trainer) -> None:
        """A stop at this batch: its step checkpoint if due and ranked by the step, then ``last.ckpt``."""
        if trainer.fast_dev_run:
            return
        if self._due(trainer) and self.monitor in (None, "step"):
            self.save_step(trainer)
        else:
            self.save_last_now(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.saved_step = trainer.global_step  # (a resume's: its checkpoint is written)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        if not self.every_n_train_steps:
            return super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if trainer.fast_dev_run:
            return
        stops = 0 < trainer.max_steps <= trainer.global_step
        if self._due(trainer):
            unranked = self.monitor is not None and self.monitor not in self._metrics(trainer)
            if unranked or (validation_follows(trainer) and not (stops and self.monitor in (None, "step"))):
                self.waiting = True
            else:
                self.save_step(trainer)
        if stops and self.saved_step != trainer.global_step:
            self.save_stop_now(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.every_n_train_steps:
            return super().on_validation_end(trainer, pl_module)
        if not self.waiting or trainer.state.fn != "fit" or trainer.sanity_checking or trainer.fast_dev_run:
            return
        self.waiting = False
        if not accumulating(trainer):  # the step's row (training and validation) before the checkpoint a resume
            for logger in trainer.loggers:  # starts after (a batch that did not step: no row yet)
                if isinstance(logger, CSVLogger):
                    logger.flush()
        self._after_validation = True
        try:  # (last.ckpt written already at this step's stop: the step file only)
            self.save_step(trainer, last=self.saved_step != trainer.global_step)
        finally:
            self._after_validation = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.every_n_train_steps:
            return super().on_train_end(trainer, pl_module)
        if self.save_last and self.saved_step != trainer.global_step and not trainer.fast_dev_run:
            self.save_last_now(trainer)

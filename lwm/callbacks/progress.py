"""The rich progress bar, labelled with the global step for step-based runs, with plain progress lines where the
output is not a terminal (a log file, SLURM's output), and the one-line summary at the end of a fit."""

from __future__ import annotations

import datetime
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from typing_extensions import override

from lwm.utils.errors import ConfigError

VAL_KEYS = ("Val_Total/loss", "Val_Dynamics_Predictor/tf_loss", "Val_Dynamics_Predictor/copy_last_loss")


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


def _metrics(trainer: L.Trainer, keys: tuple[str, ...]) -> str:
    """``key value`` of those of ``keys`` the trainer has logged, `` · ``-separated (one host read each)."""
    metrics = trainer.callback_metrics
    return " · ".join(f"{key} {float(metrics[key]):.4g}" for key in keys if key in metrics)


def _step(trainer: L.Trainer) -> str:
    """``step 1200/100000`` (``step 1200`` without ``max_steps``)."""
    limit = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None
    return f"step {trainer.global_step}" + (f"/{limit}" if limit else "")


def _skipped(trainer: L.Trainer) -> str:
    """``12 steps skipped (non-finite loss or gradient)`` over the run so far, or "" (a host read of the count)."""
    skipped = getattr(trainer.lightning_module, "skipped_steps", 0) if trainer.lightning_module is not None else 0
    return f"{skipped} step{'s' * (skipped != 1)} skipped (non-finite loss or gradient)" if skipped else ""


def fit_summary(trainer: L.Trainer, seconds: float) -> str:
    """One line at the end of a fit: where it got, how long it took, its last losses, the steps it skipped and where
    its checkpoint is."""
    parts = [f"fit done: {_step(trainer)} in {_clock(seconds)}", _metrics(trainer, ("Train_Total/loss", *VAL_KEYS)),
             _skipped(trainer)]
    checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
    if checkpoint:
        parts.append(f"checkpoint {checkpoint}")
    return " · ".join(p for p in parts if p)


class StepProgressBar(RichProgressBar):
    """``Epoch 3 · step 1200/100000`` instead of Lightning's ``Epoch 3/-2`` when only ``max_steps`` is set, and one
    validation task at a time (Lightning's bar keeps each finished validation's hidden task: over days of
    training, thousands, each one more to render at every refresh), and an epoch resumed mid-way counted to its
    end (its total set at its first batch)."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False,
                 theme: RichProgressBarTheme = RichProgressBarTheme(), console_kwargs: dict[str, Any] | None = None,
                 text_every_s: float = 60.0) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, theme=theme, console_kwargs=console_kwargs)

        if not text_every_s >= 0:
            raise ConfigError(f"progress_bar.text_every_s must be >= 0 (0: no plain progress lines), got "
                              f"{text_every_s}")
        if refresh_rate < 0:
            raise ConfigError(f"progress_bar.refresh_rate must be >= 0 (batches between refreshes; 0: no bar), got "
                              f"{refresh_rate}")
        self.text_every_s = text_every_s
        self._start: tuple[float, int] | None = None
        self._last_text = 0.0
        self._epoch_sized: int | None = None  # the epoch whose bar total was set at its first batch in this process
        self._epoch_total: int | float | None = None  # that total, set on the bar at the batch's end

    def _plain(self) -> bool:
        """Whether this rank's progress goes, as plain lines, to output that is not a terminal."""
        return bool(self.text_every_s) and self.is_enabled and self.progress is not None \
            and not self.progress.console.is_terminal

    def _say(self, line: str) -> None:
        self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def progress_line(self, trainer: L.Trainer, now: float) -> str:
        """``step 1200/100000 · epoch 3 · 2.14 steps/s · Train_Total/loss 0.0123 · 0:09:20 elapsed, 12:48:00 to go``
        (with ``· 3 steps skipped (non-finite loss or gradient)`` before the time where there are)."""
        t0, step0 = self._start if self._start is not None else (now, trainer.global_step)
        done, seconds = trainer.global_step - step0, max(now - t0, 1e-9)
        text = f"{_step(trainer)} · epoch {trainer.current_epoch} · {done / seconds:.3g} steps/s"
        loss = _metrics(trainer, ("Train_Total/loss",))
        text += f" · {loss}" if loss else ""
        skipped = _skipped(trainer)
        text += f" · {skipped}" if skipped else ""
        text += f" · {_clock(seconds)} elapsed"
        if done and trainer.max_steps is not None and trainer.max_steps > 0:
            text += f", {_clock((trainer.max_steps - trainer.global_step) * seconds / done)} to go"
        return text

    @staticmethod
    def epoch_batches(trainer: L.Trainer, batch_idx: int) -> int | float:
        """The batches the current epoch runs, counted at its batch ``batch_idx``: all of them, or as far as
        ``max_steps`` ends it."""
        total = trainer.num_training_batches
        if trainer.max_steps is not None and trainer.max_steps > 0:
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            total = min(total, batch_idx + left)
        return total

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._start is None:
            self._start = (time.monotonic(), trainer.global_step)
            self._last_text = self._start[0]
        if self._epoch_sized != trainer.current_epoch:  # its first batch here: as far as max_steps lets it run
            self._epoch_sized, self._epoch_total = trainer.current_epoch, self.epoch_batches(trainer, batch_idx)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._plain() and not trainer.sanity_checking and trainer.state.fn == "fit":
            losses = _metrics(trainer, VAL_KEYS)
            if losses:
                self._say(f"validation at step {trainer.global_step}: {losses}")

    def train_description(self, trainer: L.Trainer) -> str:
        """``Epoch 3 · step 1200/100000`` (Lightning's ``Epoch 3/-2`` where only ``max_steps`` is set)."""
        text = f"Epoch {trainer.current_epoch}"
        if trainer.max_epochs is not None and trainer.max_epochs > 0:
            text += f"/{trainer.max_epochs - 1}"
        if trainer.max_steps is not None and trainer.max_steps > 0:
            text += f" · step {trainer.global_step}/{trainer.max_steps}"
        if len(self.validation_description) > len(text):
            text = f"{text:{len(self.validation_description)}}"
        return text

    def _describe(self, trainer: L.Trainer, **fields: Any) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=self.train_description(trainer), **fields)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._describe(trainer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._describe(trainer, **({"total": self._epoch_total} if self._epoch_total is not None else {}))
        self._epoch_total = None
        now = time.monotonic()
        if self._plain() and now - self._last_text >= self.text_every_s:
            self._last_text = now
            self._say(self.progress_line(trainer, now))

    @override
    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        previous = self.val_progress_bar_id
        super().on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        if self.progress is not None and previous is not None and self.val_progress_bar_id != previous:
            self.progress.remove_task(previous)

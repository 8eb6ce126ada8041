"""The rich progress bar labelled with the global step, plain progress lines where the output is not a terminal (a
log file, SLURM's output), and the one-line summary at the end of a fit."""

from __future__ import annotations

import datetime
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme

from lwm.utils.errors import refuse_first

VAL_KEYS = ("Val_Total/loss", "Val_Dynamics_Predictor/tf_loss", "Val_Dynamics_Predictor/copy_last_loss")


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


def _metrics(trainer: L.Trainer, keys: tuple[str, ...]) -> str:
    """``key value`` of those of ``keys`` the trainer has logged, `` · ``-separated."""
    metrics = trainer.callback_metrics
    return " · ".join(f"{key} {float(metrics[key]):.4g}" for key in keys if key in metrics)


def _max_steps(trainer: L.Trainer) -> int | None:
    return trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None


def _skipped(trainer: L.Trainer) -> str:
    skipped = getattr(trainer.lightning_module, "skipped_steps", 0) if trainer.lightning_module is not None else 0
    return f"{skipped} step{'s' * (skipped != 1)} skipped (non-finite loss or gradient)" if skipped else ""


def fit_summary(trainer: L.Trainer, seconds: float) -> str:
    """Where the fit got, how long it took, its last losses, the steps it skipped and where its checkpoint is."""
    step = f"step {trainer.global_step}" + (f"/{_max_steps(trainer)}" if _max_steps(trainer) else "")
    checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
    parts = [f"fit done: {step} in {_clock(seconds)}", _metrics(trainer, ("Train_Total/loss", *VAL_KEYS)),
             _skipped(trainer), checkpoint and f"checkpoint {checkpoint}"]
    return " · ".join(p for p in parts if p)


class StepProgressBar(RichProgressBar):
    """``Epoch 3 · step 1200/100000`` (Lightning's ``Epoch 3/-2`` where only ``max_steps`` is set), one validation
    task at a time (Lightning keeps each finished one hidden: thousands over days, each rendered at every refresh),
    and an epoch resumed mid-way counted to its end."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False,
                 theme: RichProgressBarTheme = RichProgressBarTheme(), console_kwargs: dict[str, Any] | None = None,
                 text_every_s: float = 60.0) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, theme=theme, console_kwargs=console_kwargs)
        refuse_first(
            (f"progress_bar.text_every_s must be >= 0 (0: no plain progress lines), got {text_every_s}",
             not text_every_s >= 0),
            (f"progress_bar.refresh_rate must be >= 0 (batches between refreshes; 0: no bar), got {refresh_rate}",
             refresh_rate < 0))
        self.text_every_s = text_every_s
        self._start: tuple[float, int] | None = None  # (time, global step) of this process's first batch
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
        (with the skipped steps before the time, if any)."""
        t0, step0 = self._start if self._start is not None else (now, trainer.global_step)
        done, seconds, limit = trainer.global_step - step0, max(now - t0, 1e-9), _max_steps(trainer)
        parts = [f"step {trainer.global_step}" + (f"/{limit}" if limit else ""), f"epoch {trainer.current_epoch}",
                 f"{done / seconds:.3g} steps/s", _metrics(trainer, ("Train_Total/loss",)), _skipped(trainer),
                 f"{_clock(seconds)} elapsed" + (f", {_clock((limit - trainer.global_step) * seconds / done)} to go"
                                                 if done and limit else "")]
        return " · ".join(p for p in parts if p)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._start is None:
            self._start = (time.monotonic(), trainer.global_step)
            self._last_text = self._start[0]
        if self._epoch_sized != trainer.current_epoch:  # its first batch here: as far as max_steps lets it run
            total = trainer.num_training_batches
            if _max_steps(trainer):
                left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
                total = min(total, batch_idx + left)
            self._epoch_sized, self._epoch_total = trainer.current_epoch, total

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._plain() and not trainer.sanity_checking and trainer.state.fn == "fit":
            if losses := _metrics(trainer, VAL_KEYS):
                self._say(f"validation at step {trainer.global_step}: {losses}")

    def train_description(self, trainer: L.Trainer) -> str:
        text = f"Epoch {trainer.current_epoch}"
        if trainer.max_epochs is not None and trainer.max_epochs > 0:
            text += f"/{trainer.max_epochs - 1}"
        if _max_steps(trainer):
            text += f" · step {trainer.global_step}/{trainer.max_steps}"
        return f"{text:{len(self.validation_description)}}"

    def _describe(self, trainer: L.Trainer, **fields: Any) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=self.train_description(trainer), **fields)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._describe(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._describe(trainer, **({"total": self._epoch_total} if self._epoch_total is not None else {}))
        self._epoch_total = None
        now = time.monotonic()
        if self._plain() and now - self._last_text >= self.text_every_s:
            self._last_text = now
            self._say(self.progress_line(trainer, now))

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        previous = self.val_progress_bar_id
        super().on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        if self.progress is not None and previous is not None and self.val_progress_bar_id != previous:
            self.progress.remove_task(previous)

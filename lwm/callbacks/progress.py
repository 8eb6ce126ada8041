"""The rich progress bar, labelled with the global step for step-based runs."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class StepProgressBar(RichProgressBar):
    """``Epoch 3 · step 1200/100000`` instead of Lightning's ``Epoch 3/-2`` when only ``max_steps`` is set, and one
    validation task at a time (Lightning's bar keeps each finished validation's hidden task: over days of training,
    thousands, each one more to render at every refresh)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        text = f"Epoch {current_epoch}"
        if trainer.max_epochs is not None and trainer.max_epochs > 0:
            text += f"/{trainer.max_epochs - 1}"
        if trainer.max_steps is not None and trainer.max_steps > 0:
            text += f" · step {trainer.global_step}/{trainer.max_steps}"
        if len(self.validation_description) > len(text):
            text = f"{text:{len(self.validation_description)}}"
        return text

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=self._get_train_description(trainer.current_epoch))

    @override
    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        previous = self.val_progress_bar_id
        super().on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        if self.progress is not None and previous is not None and self.val_progress_bar_id != previous:
            self.progress.remove_task(previous)

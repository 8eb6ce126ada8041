"""The learning rate in the logs: Lightning's LearningRateMonitor, quiet where a run has no logger."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor as _LightningLearningRateMonitor
from typing_extensions import override


class LearningRateMonitor(_LightningLearningRateMonitor):
    """Lightning's LearningRateMonitor (``Train_Total/lr/pg1``, ``/pg2``), which does nothing under ``trainer.logger:
    false`` instead of refusing the run (Lightning's raises: the callback is always on here)."""

    @override
    def on_train_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        self._off = not trainer.loggers
        if not self._off:
            super().on_train_start(trainer, *args, **kwargs)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if not getattr(self, "_off", False):
            super().on_train_batch_start(trainer, *args, **kwargs)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if not getattr(self, "_off", False):
            super().on_train_epoch_start(trainer, *args, **kwargs)

"""The learning rate in the logs: Lightning's LearningRateMonitor, quiet where a run has no logger."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor as _LightningLearningRateMonitor


class LearningRateMonitor(_LightningLearningRateMonitor):
    """Lightning's (``Train_Total/lr/pg1``, ``/pg2``) without its refusal of a run with no logger (``trainer.logger:
    false``; the callback is always on here): its other hooks then log to none."""

    def on_train_start(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.loggers:
            super().on_train_start(trainer, *args, **kwargs)

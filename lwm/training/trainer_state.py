"""When the periodic callbacks act."""

from __future__ import annotations

import lightning as L
import torch.distributed as dist
from typing import Any


def is_logging_step(trainer: L.Trainer) -> bool:
    """Whether Lightning writes this training step's logs (values logged on other steps are dropped), as seen from
    ``on_train_batch_end``."""
    if accumulating(trainer):
        return False
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return bool(connector.should_update_logs)
    return trainer.global_step % max(1, trainer.log_every_n_steps) == 0


def logs_at_this_step(trainer: L.Trainer) -> bool:
    """Whether Lightning writes the logs of the optimizer step this training batch belongs to, at the logging
    interval, asked from ``training_step`` or ``on_train_batch_start`` (Lightning counts ``_batches_that_stepped``
    up after it writes them)."""
    every = trainer.log_every_n_steps
    return bool(every) and (trainer.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0


def accumulating(trainer: L.Trainer) -> bool:
    """Whether this training batch, seen from ``on_train_batch_end``, is inside a gradient-accumulation window (the
    optimizer has not stepped after it)."""
    fit_loop = getattr(trainer, "fit_loop", None)
    return fit_loop is not None and trainer.training and fit_loop._should_accumulate()


def every_rank(trainer: L.Trainer, obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (``[obj]`` in a single process)."""
    if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
        parts: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(parts, obj)
        return parts
    return [obj]

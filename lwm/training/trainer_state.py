"""When the periodic callbacks act, read from the trainer's public counters."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch.distributed as dist


def accumulating(trainer: L.Trainer) -> bool:
    """Whether the optimizer does not step after the current (or latest) training batch (Lightning's rule)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.current.ready % trainer.accumulate_grad_batches == 0:
        return False
    final = progress.current.ready == trainer.num_training_batches or progress.is_last_batch
    return not final or trainer.strategy.handles_gradient_accumulation  # (Lightning steps on an epoch's last batch)


def step_of_batch(trainer: L.Trainer) -> int:
    """The optimizer step (from 1) the current training batch belongs to, before or after that step is taken."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    stepped = progress.processed == progress.ready and not accumulating(trainer)
    return trainer.global_step + 1 - stepped


def is_logging_step(trainer: L.Trainer) -> bool:
    """Whether Lightning writes the logs of this batch's step, asked at or after its optimizer step."""
    return not accumulating(trainer) and (trainer.should_stop
                                          or step_of_batch(trainer) % max(1, trainer.log_every_n_steps) == 0)


def logs_at_this_step(trainer: L.Trainer) -> bool:
    """Whether the step of this batch (any batch of its accumulation window) is at the logging interval."""
    every = trainer.log_every_n_steps
    return bool(every) and step_of_batch(trainer) % every == 0


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether the fit loop validates after the current training batch (Lightning's rule; timed: true)."""
    batches = trainer.num_val_batches
    if not (trainer.enable_validation and sum(batches if isinstance(batches, list) else [batches])):
        return False  # (none yet: a first validation whose data Lightning has not loaded)
    every = trainer.check_val_every_n_epoch
    if every is not None and (trainer.current_epoch + 1) % every:
        return False
    if trainer.should_stop or trainer.val_check_batch is None:  # a stop validates first; None: timed validation
        return True
    loop = trainer.fit_loop.epoch_loop
    if trainer.val_check_batch == float("inf"):
        return loop.batch_progress.is_last_batch
    return (1 + (loop.total_batch_idx if every is None else loop.batch_idx)) % trainer.val_check_batch == 0


def every_rank(trainer: L.Trainer, obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (``[obj]`` in a single process)."""
    if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
        parts: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(parts, obj)
        return parts
    return [obj]

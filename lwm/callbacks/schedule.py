"""When the periodic callbacks act."""

from __future__ import annotations

import lightning as L


def is_logging_step(trainer: L.Trainer) -> bool:
    """Whether Lightning writes this training step's logs (values logged on other steps are dropped), as seen
    from ``on_train_batch_end``: with gradient accumulation, only the batch that ends the step (Lightning writes
    no logs after the others). Callbacks that sync with the host do it only then."""
    if accumulating(trainer):
        return False
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return bool(connector.should_update_logs)
    return trainer.global_step % max(1, trainer.log_every_n_steps) == 0


def accumulating(trainer: L.Trainer) -> bool:
    """Whether this training batch, seen from ``on_train_batch_end``, is inside a gradient-accumulation window
    (the optimizer has not stepped after it): per-step work waits for the batch that ends the step."""
    fit_loop = getattr(trainer, "fit_loop", None)
    return fit_loop is not None and trainer.training and fit_loop._should_accumulate()

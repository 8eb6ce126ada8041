"""Training: the LightningModule, its optimiser, the non-finite guard, trainer-state helpers, checkpoints, loggers
and the run directory."""

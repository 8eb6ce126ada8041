"""Training: the LightningModule, its optimiser, non-finite guard, checkpoints, loggers and run directory."""

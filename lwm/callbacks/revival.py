"""Dead-code revival: codes unused for ``dead_code_steps`` updates are replaced by recent encoder outputs."""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

from lwm.callbacks.schedule import accumulating, is_logging_step


class DeadCodeRevival(L.Callback):
    """At the logging interval (or every ``every_n_steps`` optimizer steps), right after the step's EMA
    update, call each quantizer's ``revive`` and log the codes revived per level
    (``Train_<Quantizer>/revived_codes_level_<l>``).

    The rows are drawn from the step's own generator (``WorldModelModule.step_generator``, stream 1), so a
    resumed run revives exactly what an uninterrupted one would; rank 0's draws are broadcast under DDP.
    Each check costs one host sync per quantizer, hence not every step by default.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"revival.every_n_steps must be >= 1 (or null: the logging interval), got {every_n_steps}")
        self.every_n_steps = every_n_steps

    def _due(self, trainer: L.Trainer) -> bool:
        """After the batch that ends an optimizer step (never inside an accumulation window: a revival there
        would depend on where a resumed run restarted), at the interval."""
        if self.every_n_steps is None:
            return is_logging_step(trainer)
        return not accumulating(trainer) and trainer.global_step % self.every_n_steps == 0

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._due(trainer):
            return
        generator = pl_module.step_generator(pl_module.device, batch_idx, stream=1)
        logs = {}
        for name, quantizer in pl_module.model.quantizers.items():
            for level, n in enumerate(quantizer.revive(generator=generator)):
                logs[f"Train_{name}/revived_codes_level_{level}"] = float(n)
        pl_module.log_dict(logs, on_step=True, on_epoch=False)

"""Dead-code revival: codes unused for ``dead_code_steps`` updates are replaced by recent encoder outputs."""

from __future__ import annotations

from typing import Any

import lightning as L

from lwm.training.trainer_state import accumulating, is_logging_step
from lwm.utils.errors import ConfigError


class DeadCodeRevival(L.Callback):
    """Every ``every_n_steps`` optimizer steps (None: at the logging interval), right after the step's EMA update,
    each quantizer's ``revive``; never inside an accumulation window (a resume would revive elsewhere)."""

    def __init__(self, every_n_steps: int | None = 10) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ConfigError(f"revival.every_n_steps must be >= 1 (or null: the logging interval), got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._revived: dict[str, int] = {}  # codes revived per quantizer and level since the last logged step

    def state_dict(self) -> dict[str, Any]:  # the counts not yet logged travel with a checkpoint
        return {"revived": dict(self._revived)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._revived = {str(k): int(v) for k, v in state_dict.get("revived", {}).items()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        quantizers = pl_module.model.quantizers
        key = "Train_{}/revived_codes_level_{}".format
        if not self._revived:
            self._revived = {key(name, level): 0 for name, q in quantizers.items() for level in range(q.num_levels)}
        if (is_logging_step(trainer) if self.every_n_steps is None else
                not accumulating(trainer) and trainer.global_step % self.every_n_steps == 0):
            generator = pl_module.step_generator(pl_module.device, batch_idx, stream=1)
            for name, quantizer in quantizers.items():
                for level, n in enumerate(quantizer.revive(generator=generator)):
                    self._revived[key(name, level)] += int(n)
        if is_logging_step(trainer):
            pl_module.log_dict({k: float(n) for k, n in self._revived.items()}, on_step=True, on_epoch=False)
            self._revived = {k: 0 for k in self._revived}

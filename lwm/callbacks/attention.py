"""Action-encoder attention diagonality per transformer block, as a distribution over clips (training and
validation)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lwm.training.loggers import log_distribution
from lwm.training.trainer_state import every_rank, logs_at_this_step
from lwm.utils.errors import ConfigError
from lwm.utils.metrics import attention_diagonality


class AttentionDiagonality(L.Callback):
    """``{Train,Val}_Action_Encoder/attention_diagonality_block_k`` for every action-encoder block ``k``: of the
    training batch at the logging interval (before its update), and of the first ``batches`` validation batches."""

    def __init__(self, batches: int = 1) -> None:
        if batches < 1:
            raise ConfigError(f"diagonality.batches must be >= 1, got {batches}")
        self.batches = batches
        self._values: list[list[torch.Tensor]] = []
        self._train_step_done = -1  # the optimizer step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if logs_at_this_step(trainer) and trainer.global_step != self._train_step_done:
            self._train_step_done = trainer.global_step  # (accumulation: once, at the window's first batch)
            self._log(trainer, pl_module, "Train", [self._diagonality(trainer, pl_module, batch["latents"])])

    @staticmethod
    def _diagonality(trainer: L.Trainer, pl_module: L.LightningModule, x: torch.Tensor) -> list[torch.Tensor]:
        """Per block, each clip's diagonality ``[B]`` over the queries that give actions (the last is never trained)."""
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            attn = pl_module.model.action_attention(x)  # per block [B, heads, T, T]
        return [attention_diagonality(a[..., :-1, :]) for a in attn]

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._values = []

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx < self.batches and not trainer.sanity_checking:
            self._values.append(self._diagonality(trainer, pl_module, batch["latents"]))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log(trainer, pl_module, "Val", self._values)

    @staticmethod
    def _log(trainer: L.Trainer, pl_module: L.LightningModule, prefix: str, batches: list[list[torch.Tensor]]) -> None:
        """Every rank's clips' values per block (``batches``: this rank's, per batch and block; [] without any)."""
        parts = every_rank(trainer, [torch.cat(values).cpu() for values in zip(*batches)])
        blocks = [torch.cat(values).to(pl_module.device) for values in zip(*[p for p in parts if p])]
        for block, values in enumerate(blocks):
            log_distribution(pl_module, f"{prefix}_Action_Encoder/attention_diagonality_block_{block}", values)

"""Action-encoder attention diagonality per transformer block, as a distribution over clips (training and
validation)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lwm.callbacks.ranks import every_rank
from lwm.callbacks.schedule import is_logging_step
from lwm.errors import ConfigError
from lwm.loggers import log_distribution
from lwm.metrics import attention_diagonality


class AttentionDiagonality(L.Callback):
    """``{Train,Val}_Action_Encoder/attention_diagonality_block_k`` for every action-encoder block ``k``: the
    share of each query's temporal attention on itself and the next frame (1.0: a pure one-step-lookahead
    transition encoder), one value per clip, logged as a distribution (wandb histogram; min/mean/max in the
    CSV): of the training batch at the logging interval, and of the first ``batches`` validation batches
    after each validation. One extra action-encoder pass (no gradient) per such batch."""

    def __init__(self, batches: int = 1) -> None:
        if batches < 1:
            raise ConfigError(f"diagonality.batches must be >= 1, got {batches}")
        self.batches = batches
        self._values: list[list[torch.Tensor]] = []

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not is_logging_step(trainer):
            return
        with torch.no_grad():
            attn = pl_module.model.action_attention(batch["latents"])
        for block, a in enumerate(attn):
            log_distribution(pl_module, f"Train_Action_Encoder/attention_diagonality_block_{block}",
                             attention_diagonality(a))

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._values = []

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx >= self.batches or trainer.sanity_checking:
            return
        with torch.no_grad():
            attn = pl_module.model.action_attention(batch["latents"])  # per block [B, heads, T, T]
        self._values.append([attention_diagonality(a) for a in attn])

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        blocks = [torch.cat(values) for values in zip(*self._values)]  # per block [clips]; [] on a rank without any
        if trainer.world_size > 1:  # every rank's clips (a collective: every rank gets here)
            parts = every_rank(trainer, [b.cpu() for b in blocks])
            blocks = [torch.cat(values).to(pl_module.device) for values in zip(*[p for p in parts if p])]
        for block, values in enumerate(blocks):
            log_distribution(pl_module, f"Val_Action_Encoder/attention_diagonality_block_{block}", values)

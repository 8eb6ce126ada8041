"""Codebook monitoring: usage per level (codes used in a batch of ``data.batch_size`` windows: the logged training
batch's, the mean over validation's runs of that many windows), coverage of the validation set, diversity per level
(pairwise MSE between the codes), and the EMA decay of both quantizers."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lwm.training.loggers import log_distribution
from lwm.training.trainer_state import is_logging_step
from lwm.utils.metrics import WeightedMean, codebook_diversity, codebook_usage, used_codes


def _diversity(prefix: str, name: str, quantizer) -> dict[str, torch.Tensor]:
    logs = {}
    for level in range(quantizer.num_levels):
        for stat, value in zip(("min", "max", "mean"), codebook_diversity(quantizer.codebook(level))):
            logs[f"{prefix}_{name}/codebook_diversity_{stat}_level_{level}"] = value
    return logs


class CodebookMonitor(L.Callback):
    def __init__(self) -> None:
        self._val_used: dict[str, list[torch.Tensor]] = {}  # per quantizer and level: codes used
        self._val_usage: dict[str, list[WeightedMean]] = {}  # per quantizer and level: mean per-batch usage
        self._val_pending: dict[str, torch.Tensor | None] = {}  # per quantizer: windows' codes not yet in a run
        self._val_runs = 0  # full runs of batch_size windows counted in this validation

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not is_logging_step(trainer):
            return
        for name, quantizer in pl_module.model.quantizers.items():
            # [L], the mean over ranks of each one's batch of data.batch_size, as in validation
            usage = trainer.strategy.reduce(codebook_usage(outputs[name], quantizer.codebook_sizes), reduce_op="mean")
            logs = {f"Train_{name}/codebook_usage_level_{l}": u for l, u in enumerate(usage)}
            logs.update(_diversity("Train", name, quantizer))
            logs[f"Train_{name}/ema_decay"] = float(quantizer.decay_at(trainer.global_step - 1))  # this step's update
            pl_module.log_dict(logs, on_step=True, on_epoch=False)
            log_distribution(pl_module, f"Train_{name}/codebook_usage", usage)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        quantizers = pl_module.model.quantizers
        self._val_used = {name: [torch.zeros(k, dtype=torch.bool, device=pl_module.device) for k in q.codebook_sizes]
                          for name, q in quantizers.items()}
        self._val_usage = {name: [WeightedMean().to(pl_module.device) for _ in q.codebook_sizes]
                           for name, q in quantizers.items()}
        self._val_pending = {name: None for name in quantizers}
        self._val_runs = 0

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        size = getattr(getattr(trainer, "datamodule", None), "batch_size", None)  # windows per training batch
        full = 0
        for name, used in self._val_used.items():
            sizes = pl_module.model.quantizers[name].codebook_sizes
            for mask, in_batch in zip(used, used_codes(outputs[name], sizes)):
                mask |= in_batch
            pending = outputs[name] if self._val_pending[name] is None else torch.cat([self._val_pending[name],
                                                                                       outputs[name]])
            size = size or len(outputs[name])  # (no datamodule: the batches' own size)
            full = len(pending) // size  # runs of `size` windows complete now
            for i in range(full):
                self._count_usage(name, pending[i * size: (i + 1) * size], sizes)
            self._val_pending[name] = pending[full * size:]
        self._val_runs += full

    def _count_usage(self, name: str, indices: torch.Tensor, sizes) -> None:
        for metric, usage in zip(self._val_usage[name], codebook_usage(indices, sizes)):
            metric.update(usage)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self._val_used:
            return
        for name, used in self._val_used.items():
            quantizer = pl_module.model.quantizers[name]
            pending = self._val_pending.get(name)
            if self._val_runs == 0 and pending is not None and len(pending):  # fewer windows than one batch
                self._count_usage(name, pending, quantizer.codebook_sizes)
            masks = torch.cat(used).to(torch.uint8)
            if trainer.world_size > 1:  # codes used on any rank
                masks = trainer.strategy.reduce(masks.float(), reduce_op="max").to(torch.uint8)
            coverage = torch.stack([m.float().mean() for m in masks.split(list(quantizer.codebook_sizes))])
            usage = torch.stack([metric.compute() for metric in self._val_usage[name]])  # synced across ranks
            logs = {f"Val_{name}/codebook_usage_level_{l}": u for l, u in enumerate(usage)}
            logs.update({f"Val_{name}/codebook_coverage_level_{l}": c for l, c in enumerate(coverage)})
            logs.update(_diversity("Val", name, quantizer))
            pl_module.log_dict(logs, on_step=False, on_epoch=True, rank_zero_only=True)
            log_distribution(pl_module, f"Val_{name}/codebook_usage", usage)

"""Action and world sensitivity (Delta-PSNR at frame t) on validation clips."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lwm.utils.errors import ConfigError
from lwm.utils.metrics import WeightedMean, sensitivity
from lwm.utils.seeds import seeded_generator


class Sensitivity(L.Callback):
    """After each validation, ``Val_Action_Encoder/{dPSNR,PSNR_seq,PSNR_rand}`` and the same under
    ``Val_World_Encoder/``, over the first ``batches`` validation batches of each rank."""

    NAMES = ("dPSNR", "PSNR_seq", "PSNR_rand")

    def __init__(self, t: int = 4, batches: int = 1, seed: int = 0) -> None:
        bad = [f"sensitivity.{name} must be >= 1, got {value}" for name, value in (("t", t), ("batches", batches))
               if value < 1]
        if seed < 0:
            bad.append(f"sensitivity.seed must be >= 0, got {seed}")
        if bad:
            raise ConfigError("\n".join(bad))
        self.t, self.batches, self.seed = t, batches, seed
        self._means = {f"{q}/{n}": WeightedMean() for q in ("Action_Encoder", "World_Encoder") for n in self.NAMES}

    def check_window(self, window: int) -> None:
        """Refuse a frame ``t`` outside validation windows of ``window`` frames (nothing would be logged; the CLI
        asks before a run)."""
        if self.t >= window:
            raise ConfigError(f"sensitivity.t must be < data.window ({window}: frames 0..{window - 1}; frame t is "
                              f"generated from frame 0), got {self.t}")

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for m in self._means.values():
            m.to(pl_module.device).reset()

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        x = batch["latents"]
        if batch_idx >= self.batches or trainer.sanity_checking or x.shape[1] <= self.t:
            return
        # one stream per (seed, batch, rank): the same draws at every validation, none shared between ranks
        generator = seeded_generator(x.device, self.seed, batch_idx, trainer.global_rank)
        with torch.no_grad(), trainer.precision_plugin.forward_context():  # as validation runs (bf16 autocast)
            result = sensitivity(pl_module.model, x, self.t, generator, pl_module.weights_world_phase)
        for quantizer, values in result.items():
            for name, value in zip(self.NAMES, values):
                self._means[f"{quantizer}/{name}"].update(value, weight=x.shape[0])

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and any(m.update_count for m in self._means.values()):
            logs = {f"Val_{key}": m.compute() for key, m in self._means.items()}  # synced across ranks
            pl_module.log_dict(logs, on_step=False, on_epoch=True, rank_zero_only=True)

"""Ground-truth probes at validation: do the latent codes carry the true actions and world labels?"""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch

from lwm.training.trainer_state import every_rank
from lwm.utils.errors import ConfigError
from lwm.utils.metrics import code_ids, linear_probe_accuracy, nmi, probe_train_size

NAMES = ("Action_Encoder", "World_Encoder")


class GroundTruthProbes(L.Callback):
    """Where validation batches carry true ``actions`` (the one of transition ``t -> t+1``, which ``a_t`` summarises)
    and ``world_label`` (-1: none): NMI and a linear probe of each quantizer's codes against them, over the first
    ``max_samples`` samples in a fixed pseudo-random order of their file and frame (whatever the ranks and batches)."""

    def __init__(self, max_samples: int = 20000) -> None:
        if max_samples < 4:
            raise ConfigError(f"probes.max_samples must be >= 4 (the probe trains on half of them and tests on the "
                              f"rest), got {max_samples}")
        self.max_samples = max_samples
        self._codes: dict[str, list[torch.Tensor]] = {}
        self._labels: dict[str, list[torch.Tensor]] = {}
        self._keys: dict[str, list[torch.Tensor]] = {}  # per sample, its place in the canonical order
        self._arrivals = 0  # samples seen, the order of batches without file_index

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._codes, self._labels, self._keys = ({name: [] for name in NAMES} for _ in range(3))
        self._arrivals = 0

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not isinstance(outputs, dict) or "actions" not in batch:
            return
        B, T = batch["actions"].shape
        pairs = {  # codes [B, T-1, L] / [B, L], labels and keys [B, T-1] / [B]
            "Action_Encoder": (outputs["Action_Encoder"], batch["actions"][:, :-1], self._order(batch, T - 1)),
            "World_Encoder": (outputs["World_Encoder"], batch["world_label"], self._order(batch, 1)[:, 0]),
        }
        self._arrivals += B * T
        for name, (codes, labels, keys) in pairs.items():
            keep = labels >= 0
            if keep.any():
                self._codes[name].append(codes[keep].cpu())
                self._labels[name].append(labels[keep].cpu())
                self._keys[name].append(keys[keep.cpu()])
                if sum(len(k) for k in self._keys[name]) > 2 * self.max_samples:
                    self._compact(name)

    def _order(self, batch: dict[str, torch.Tensor], frames: int) -> torch.Tensor:
        """``[B, frames]`` int64 keys of a batch's samples: a hash (splitmix64) of their file and frame."""
        B = batch["actions"].shape[0]
        if "file_index" not in batch or "start" not in batch:
            return self._arrivals + torch.arange(B * frames).reshape(B, frames)
        files = batch["file_index"].cpu().numpy().astype(np.uint64)[:, None]
        frame = (batch["start"].cpu().numpy()[:, None] + np.arange(frames)).astype(np.uint64)
        z = (files << np.uint64(32)) + frame + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return torch.from_numpy((z ^ (z >> np.uint64(31))).view(np.int64))

    def _compact(self, name: str) -> None:
        """Keep this rank's first ``max_samples`` samples in the canonical order (those the cut of all ranks keeps)."""
        keys = torch.cat(self._keys[name])
        first = keys.argsort()[: self.max_samples]
        self._keys[name] = [keys[first]]
        self._codes[name] = [torch.cat(self._codes[name])[first]]
        self._labels[name] = [torch.cat(self._labels[name])[first]]

    def _gathered(self, trainer: L.Trainer, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first ``max_samples`` samples of every rank in the canonical order: ``(codes, labels)``."""
        if self._keys[name]:
            self._compact(name)
        mine = (self._codes[name][0], self._labels[name][0], self._keys[name][0]) if self._keys[name] else None
        parts = [p for p in every_rank(trainer, mine) if p is not None]
        if not parts:
            return None
        codes, labels, keys = (torch.cat([p[i] for p in parts]) for i in range(3))
        first = keys.argsort()[: self.max_samples]
        return codes[first], labels[first]

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self._codes:
            return
        logs = {}
        for name, quantizer in pl_module.model.quantizers.items():
            data = self._gathered(trainer, name)  # a collective under DDP: every rank calls it
            if data is None or not trainer.is_global_zero:
                continue
            codes, labels = data
            features = quantizer.decode_indices(codes.to(quantizer.codebook(0).device)).cpu()
            accuracy, chance = linear_probe_accuracy(features, labels)
            logs.update({f"Val_{name}/nmi": float(nmi(code_ids(codes, quantizer.codebook_sizes), labels)),
                         f"Val_{name}/probe_accuracy": accuracy, f"Val_{name}/probe_chance": chance,
                         f"Val_{name}/probe_samples": float(len(labels) - probe_train_size(len(labels)))})
        logs = trainer.strategy.broadcast(logs, src=0)  # every rank logs them
        if logs:
            pl_module.log_dict(logs, on_step=False, on_epoch=True, rank_zero_only=True)

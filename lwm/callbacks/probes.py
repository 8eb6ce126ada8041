"""Ground-truth probes at validation: do the latent codes carry the true actions and world labels?"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lwm.callbacks.ranks import every_rank
from lwm.errors import ConfigError
from lwm.metrics import code_ids, linear_probe_accuracy, nmi, probe_train_size


class GroundTruthProbes(L.Callback):
    """When validation batches carry true ``actions`` (the action after frame ``t``, so the one of transition
    ``t -> t+1`` that ``a_t`` summarises) or a ``world_label`` (``-1``: none), logs after each validation:

    * ``Val_Action_Encoder/nmi``: normalised mutual information between the action-code tuples and the true
      actions (1: the codes are the actions up to renaming; about 0: unrelated);
    * ``Val_Action_Encoder/probe_accuracy`` and ``.../probe_chance``: held-out accuracy of a linear classifier
      from the quantized action vector to the true action, and the majority-class rate to beat, on
      ``.../probe_samples`` held-out samples;
    * the same under ``Val_World_Encoder/`` for world codes and world labels.

    Up to ``max_samples`` codes per quantizer, gathered from every rank; the probe trains on half of them
    (at least 4: fewer give no held-out accuracy).
    """

    def __init__(self, max_samples: int = 20000) -> None:
        if max_samples < 4:
            raise ConfigError(f"probes.max_samples must be >= 4 (the probe trains on half of them and tests on the "
                              f"rest), got {max_samples}")
        self.max_samples = max_samples
        self._codes: dict[str, list[torch.Tensor]] = {}
        self._labels: dict[str, list[torch.Tensor]] = {}

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._codes = {"Action_Encoder": [], "World_Encoder": []}
        self._labels = {"Action_Encoder": [], "World_Encoder": []}

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not isinstance(outputs, dict) or "actions" not in batch:
            return
        pairs = {
            "Action_Encoder": (outputs["Action_Encoder"], batch["actions"][:, :-1]),  # [B, T-1, L], [B, T-1]
            "World_Encoder": (outputs["World_Encoder"], batch["world_label"]),  # [B, L], [B]
        }
        for name, (codes, labels) in pairs.items():
            keep = labels >= 0
            if keep.any() and sum(len(c) for c in self._codes[name]) < self.max_samples:
                self._codes[name].append(codes[keep].cpu())
                self._labels[name].append(labels[keep].cpu())

    def _gathered(self, trainer: L.Trainer, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        codes = torch.cat(self._codes[name]) if self._codes[name] else None
        labels = torch.cat(self._labels[name]) if self._labels[name] else None
        parts = [p for p in every_rank(trainer, (codes, labels)) if p[0] is not None]
        if not parts:
            return None
        codes, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        return codes[: self.max_samples], labels[: self.max_samples]

    @override
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
        if logs:
            pl_module.log_dict(logs, on_step=False, on_epoch=True, rank_zero_only=True)

"""``lwm predict``'s output: the action and world codes of every validation window, written to
``RUN_DIR/predict/codes_per_window[_rank<r>].pt`` (plain tensors and strings; loads with ``weights_only=True``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from lwm.training.checkpoint import atomic_save
from lwm.training.loggers import run_log_dir


class PredictionWriter(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__(write_interval="epoch")
        self.path: Path | None = None

    def write_on_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any,
                           batch_indices: Any) -> None:
        batches = predictions[0] if predictions and isinstance(predictions[0], list) else predictions  # 1 loader
        if not batches or trainer.fast_dev_run:  # (Lightning's trial run: no files)
            return
        files = trainer.datamodule.val_set.paths if trainer.datamodule is not None else None
        file_index = torch.cat([b["file_index"] for b in batches]).cpu()
        out = {
            "action_indices": torch.cat([b["action_indices"] for b in batches]).cpu(),
            "world_indices": torch.cat([b["world_indices"] for b in batches]).cpu(),
            "file": [files[i] for i in file_index.tolist()] if files is not None else file_index,
            "start": torch.cat([b["start"] for b in batches]).cpu(),
            "global_step": int(getattr(pl_module, "weights_step", trainer.global_step)),
        }
        suffix = f"_rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        self.path = atomic_save(out, run_log_dir(trainer) / f"codes_per_window{suffix}.pt")
        print(f"wrote {self.path} ({len(out['start'])} windows)")

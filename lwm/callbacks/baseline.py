"""The copy-last-frame baseline at validation, so that a prediction loss means something."""

from __future__ import annotations

from typing import Any

import lightning as L

from lwm.utils.metrics import WeightedMean, copy_last_loss, psnr_from_mse


class CopyLastBaseline(L.Callback):
    """``Val_Dynamics_Predictor/copy_last_loss`` and ``copy_last_psnr``."""

    def __init__(self) -> None:
        self._mean = WeightedMean()

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mean.to(pl_module.device).reset()

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._mean.update(copy_last_loss(batch["latents"]), weight=batch["latents"].shape[0])

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self._mean.update_count:
            mse = self._mean.compute()
            pl_module.log_dict({"Val_Dynamics_Predictor/copy_last_loss": mse,
                                "Val_Dynamics_Predictor/copy_last_psnr": psnr_from_mse(mse)},
                               on_step=False, on_epoch=True, rank_zero_only=True)

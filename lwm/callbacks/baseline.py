"""The copy-last-frame baseline at validation, so that a prediction loss means something."""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

from lwm.utils.metrics import WeightedMean, copy_last_loss, psnr_from_mse


class CopyLastBaseline(L.Callback):
    """``Val_Dynamics_Predictor/copy_last_loss``."""

    def __init__(self) -> None:
        self._mean = WeightedMean()

    @override
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mean = self._mean.to(pl_module.device)
        self._mean.reset()

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        x = batch["latents"]
        self._mean.update(copy_last_loss(x), weight=x.shape[0])

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self._mean.update_count == 0:
            return
        mse = self._mean.compute()
        pl_module.log("Val_Dynamics_Predictor/copy_last_loss", mse, on_step=False, on_epoch=True, rank_zero_only=True)
        pl_module.log("Val_Dynamics_Predictor/copy_last_psnr", psnr_from_mse(mse), on_step=False,
                      on_epoch=True, rank_zero_only=True)

"""FLOP accounting: the training step's FLOPs measured once on the real model and batch, then cumulative training
TFLOPs (all ranks), to plot validation losses against, and the FLOP rate and MFU over training time."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lwm.modules.flops import count_flops
from lwm.training.trainer_state import is_logging_step
from lwm.utils.errors import ConfigError

PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


class FlopCounter(L.Callback):
    """Counts the useful FLOPs of one training step (forward with every rollout pass, and backward) on the first
    training batch, without updating anything."""

    def __init__(self, peak_tflops: float | None = None) -> None:
        if peak_tflops is not None and not (math.isfinite(peak_tflops) and peak_tflops > 0):
            raise ConfigError(f"flops.peak_tflops must be a finite number > 0 (the device's peak TFLOP/s; null: "
                              f"Lightning's figure for the device), got {peak_tflops}")
        self.peak_tflops = peak_tflops
        self.flops_per_step: int | None = None  # per device
        self._last: tuple[float, int] | None = None  # (time, global step) at the last log
        self._validation_started: float | None = None
        self._paused = 0.0  # seconds spent validating since the last log
        self._tflops = 0.0  # cumulative over all ranks, up to global step _counted_step
        self._counted_step: int | None = None  # None: nothing counted yet

    def state_dict(self) -> dict[str, Any]:
        return {"tflops": self._tflops, "counted_step": self._counted_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._tflops, self._counted_step = float(state_dict["tflops"]), state_dict["counted_step"]

    def _measure(self, trainer: L.Trainer, pl_module: L.LightningModule, x: torch.Tensor) -> int:
        """One sample's step times the batch (every counted op is linear in it), without activation checkpointing's
        recomputation and with attention in its SDPA form (the useful work, whichever kernel runs)."""
        model = pl_module.model
        backward = "deepspeed" not in type(trainer.strategy).__name__.lower()
        generator = torch.Generator(device=x.device).manual_seed(0)  # leave the run's own RNG streams alone

        def step() -> None:
            with trainer.precision_plugin.forward_context():
                loss = model.compute(x[:1], step=None, generator=generator).loss  # step=None: no codebook update
            if backward:
                loss.backward()
            pl_module.zero_grad(set_to_none=True)

        with model.counting_form():  # (as benchmarks/train_step.py counts it)
            flops = count_flops(step, dense=False).useful * x.shape[0]
        return int(flops if backward else 3 * flops)

    def _peak(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float | None:
        if self.peak_tflops is not None:
            return self.peak_tflops * 1e12
        dtype = PRECISION_DTYPES.get(str(trainer.precision).split("-")[0], torch.float32)
        return get_available_flops(pl_module.device, dtype)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.flops_per_step is None:
            self.flops_per_step = self._measure(trainer, pl_module, batch["latents"]) * trainer.accumulate_grad_batches
            rank_zero_info(f"FLOPs of a training step: {self.flops_per_step / 1e9:.4g} GFLOP per device (measured on "
                           f"the first batch; Train_Total/tflops, tflops_per_s, mfu in the logs)")

    def _cumulative_tflops(self, trainer: L.Trainer) -> float:
        """The sum up to this global step: the steps since the last count, at this run's world size."""
        counted = self._counted_step or 0
        if self.flops_per_step is not None and trainer.global_step > counted:
            self._tflops += self.flops_per_step * trainer.world_size * (trainer.global_step - counted) / 1e12
            self._counted_step = trainer.global_step
        return self._tflops

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        tflops = self._cumulative_tflops(trainer)  # every step (host arithmetic): a checkpoint saves the sum
        if self.flops_per_step is None or not is_logging_step(trainer):
            return
        logs = {"Train_Total/tflops": tflops}
        now, step = time.perf_counter(), trainer.global_step
        if self._last is not None and step > self._last[1]:  # the rate over the logging interval, less validation
            rate = self.flops_per_step * (step - self._last[1]) / max(now - self._last[0] - self._paused, 1e-9)
            logs["Train_Total/tflops_per_s"] = rate / 1e12  # per device
            if peak := self._peak(trainer, pl_module):
                logs["Train_Total/mfu"] = rate / peak
        self._last, self._paused = (now, step), 0.0
        pl_module.log_dict(logs, on_step=True, on_epoch=False, rank_zero_only=True)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._validation_started is not None:
            self._paused += time.perf_counter() - self._validation_started
            self._validation_started = None

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self.flops_per_step is not None:
            pl_module.log("Val_Total/tflops", self._cumulative_tflops(trainer), on_step=False, on_epoch=True,
                          rank_zero_only=True)

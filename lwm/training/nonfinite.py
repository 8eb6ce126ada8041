"""The count of optimizer steps skipped for a non-finite loss or gradient, and of those in a row (what stops a run)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lwm.utils.errors import ConfigError


class SkippedSteps:
    """Skipped steps over the run (``total``) and in a row, counted on the host, on the device (no sync) or from a
    DeepSpeed engine; checkpointed through :meth:`state`."""

    def __init__(self, total: int = 0, in_a_row: int = 0, longest_unread: int = 0) -> None:
        self._host_total = total
        self.in_a_row = in_a_row  # host verdicts and engine counts
        self._device_total: Tensor | None = None
        self._device_in_a_row: Tensor | None = None
        self._device_longest: Tensor | None = None  # the longest run in a row since the last host read
        self._longest_unread = longest_unread  # a checkpoint's, not yet read
        self._engine_seen: int | None = None  # the DeepSpeed engine's count as last read

    @property
    def total(self) -> int:
        return self._host_total + (int(self._device_total) if self._device_total is not None else 0)

    def state(self) -> dict[str, int]:
        in_a_row = int(self._device_in_a_row) if self._device_in_a_row is not None else self.in_a_row
        longest = int(self._device_longest) if self._device_longest is not None else 0
        return {"total": self.total, "in_a_row": in_a_row, "longest_unread": max(longest, self._longest_unread)}

    def as_tensor(self, device: torch.device) -> Tensor:
        """``total`` as a device tensor, without the host-to-device copy (a stream sync) of ``torch.tensor``."""
        if self._device_total is None:
            self._device_total = torch.zeros((), device=device)
        return self._device_total + self._host_total

    def finite(self) -> None:
        self.in_a_row = 0

    def skipped(self, count: int = 1, in_a_row: bool = True) -> int:
        """``count`` more skips; ``in_a_row=False``: a loss scaler's routine overflow, not towards the stop."""
        self._host_total += count
        self.in_a_row += in_a_row
        return self.in_a_row

    def on_device(self, nonfinite: Tensor) -> None:
        """A step's verdict as a device bool, counted on the device."""
        zero = torch.zeros((), device=nonfinite.device)
        self._device_total = (self._device_total if self._device_total is not None else zero) + nonfinite
        in_a_row = self._device_in_a_row if self._device_in_a_row is not None else zero + self.in_a_row
        self._device_in_a_row = torch.where(nonfinite, in_a_row + 1, 0.0)
        longest = self._device_longest if self._device_longest is not None else zero
        self._device_longest = torch.maximum(longest, self._device_in_a_row)

    def in_a_row_on_device(self) -> int:
        """The device path's longest run in a row since the last call (a host read)."""
        longest, self._longest_unread = self._longest_unread, 0
        if self._device_longest is not None:
            longest = max(longest, int(self._device_longest))
        self._device_longest = None
        return longest

    def engine_start(self, count: int | None) -> None:
        """The engine's count when training starts (a resumed engine's skips are not new)."""
        self._engine_seen = count

    @property
    def reading_engine(self) -> bool:
        return self._engine_seen is not None

    def engine_count(self, count: int, scaling_loss: bool) -> int:
        """The engine's count after a step; ``scaling_loss``: its overflows are a loss scaler's routine."""
        new = count - self._engine_seen
        self._engine_seen = count
        if new <= 0:
            self.finite()
            return 0
        return self.skipped(new, in_a_row=not scaling_loss)


def deepspeed_skipped_steps(trainer: Any) -> int | None:
    """The DeepSpeed engine's count of skipped steps (None without DeepSpeed)."""
    skipped = getattr(getattr(trainer.strategy, "deepspeed_engine", None), "skipped_steps", None)
    return int(skipped) if skipped is not None else None


def deepspeed_scaling_loss(engine: Any) -> bool:
    """Whether the engine scales the loss dynamically (fp16) at a scale still >= 1 (an overflow only lowers it)."""
    optimizer = getattr(engine, "optimizer", None)
    config = getattr(optimizer, "loss_scale_config", optimizer)  # DeepSpeed >= 0.18 keeps them in a config
    dynamic, scale = getattr(config, "dynamic_loss_scale", False), getattr(config, "cur_scale", None)
    return bool(dynamic) and scale is not None and float(scale) >= 1.0


def check_deepspeed_skips_overflow(trainer: Any) -> None:
    """Refuse a DeepSpeed bf16 engine that would apply a non-finite gradient."""
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    if getattr(getattr(engine, "optimizer", None), "check_grad_overflow", True) is False and engine.bfloat16_enabled():
        raise ConfigError("DeepSpeed bf16 with check_grad_overflow off: a NaN/inf gradient would update the weights "
                          "(lwm skips such steps); set bf16.check_grad_overflow: true in the DeepSpeed config")


def deepspeed_checks_overflow(strategy: Any) -> None:
    """Have a bf16 DeepSpeed strategy skip steps with a non-finite gradient (off by default in DeepSpeed 0.19.2)."""
    precision = getattr(getattr(strategy, "precision_plugin", None), "precision", None)
    config = getattr(strategy, "config", None)
    if isinstance(config, dict) and precision in ("bf16-mixed", "bf16-true"):
        config.setdefault("bf16", {"enabled": True}).setdefault("check_grad_overflow", True)

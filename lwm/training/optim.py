"""AdamW and its schedule (``model.optim.*``): linear warmup, then a cosine to ``lr * min_lr_ratio``."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lwm.utils.errors import ConfigError


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its schedule."""

    lr: float = 3e-4
    """peak learning rate"""
    weight_decay: float = 0.05
    """decoupled weight decay on matrices and conv kernels (not biases, norms, mask token)"""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)"""
    eps: float = 1e-8
    """AdamW epsilon"""
    warmup_steps: int = 1000
    """linear warmup over this many optimizer steps: lr * (step + 1) / (warmup_steps + 1)"""
    min_lr_ratio: float = 0.1
    """the cosine ends at lr * min_lr_ratio at trainer.max_steps"""
    fused: bool | None = None
    """fused AdamW kernel (None: on when the parameters are on a CUDA device, except fp16)"""

    def __post_init__(self) -> None:
        """Refuse invalid values, one line per problem naming the field (``model.optim.X``)."""
        # (betas and min_lr_ratio: their ranges refuse inf and nan as they are)
        nonfinite = [name for name in ("lr", "eps", "weight_decay") if not math.isfinite(getattr(self, name))]
        problems = [f"{name} must be a finite number, got {getattr(self, name)}" for name in nonfinite]
        problems += [f"{name} must be > 0, got {getattr(self, name)}" for name in ("lr", "eps")
                     if name not in nonfinite and getattr(self, name) <= 0]
        if "weight_decay" not in nonfinite and self.weight_decay < 0:
            problems.append(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            problems.append(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(f"betas must be two values in [0, 1), got {tuple(self.betas)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if problems:
            raise ConfigError("\n".join(f"model.optim.{p}" for p in problems))

    def adamw(self, parameters: Iterable[nn.Parameter], **implementation: Any) -> torch.optim.AdamW:
        """AdamW over ``parameters`` in two groups: weight decay on matrices and conv kernels (``ndim >= 2``), none
        on biases, norms and the mask token."""
        decay, no_decay = [], []
        for p in parameters:  # a frozen parameter too
            (decay if p.ndim >= 2 else no_decay).append(p)  # and the groups keep their sizes across versions
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr, betas=tuple(self.betas), eps=self.eps, **implementation,
        )

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of ``lr`` at an optimizer step: linear warmup, then cosine to ``min_lr_ratio``."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(1, total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

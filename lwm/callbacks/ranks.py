"""Objects from every rank, for the callbacks that reduce what each rank saw in validation or at the end of fit."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch.distributed as dist


def every_rank(trainer: L.Trainer, obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (``[obj]`` in a single process). Under DDP a collective: every rank must
    call it, the same number of times, or the others wait forever."""
    if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
        parts: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(parts, obj)
        return parts
    return [obj]

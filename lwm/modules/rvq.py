"""Residual vector quantizer with EMA codebooks, written for lwm (the requirement asks us to own it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class RVQOutput:
    quantized: Tensor  # [..., dim] sum of the level codes, straight-through to the input
    indices: Tensor  # [..., L] int64 code index per level
    commit_loss: Tensor  # scalar: the levels' sum of the mean squared residual-to-code distance (to the encoder)
    codebook_loss: Tensor  # scalar: the same, detached (monitored; the EMA moves the codes)
    level_commit_losses: Tensor  # [L] each level's commit loss
    inputs: Tensor  # [..., dim] the encoder output before quantization


class Codebook(nn.Module):
    """One level: codes ``embed [K, dim]``, EMA accumulators and the per-code unused-step counter."""

    embed: Tensor
    ema_count: Tensor
    ema_sum: Tensor
    unused_steps: Tensor

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        embed = torch.randn(size, dim, dtype=torch.float32) / dim**0.5  # fp32 whatever the default dtype
        self.register_buffer("embed", embed)  # e   [K, dim]
        self.register_buffer("ema_count", torch.ones(size, dtype=torch.float32))  # N   [K]
        self.register_buffer("ema_sum", embed.clone())  # M   [K, dim]
        self.register_buffer("unused_steps", torch.zeros(size, dtype=torch.long))  # updates since last use

    @property
    def size(self) -> int:
        return self.embed.shape[0]

    def reset(self, mask: Tensor, codes: Tensor) -> None:
        """Set the codes selected by ``mask [K]`` to ``codes [n, dim]`` with fresh EMA state (N=1, M=e)."""
        self.embed[mask] = codes
        self.ema_sum[mask] = codes
        self.ema_count[mask] = 1.0
        self.unused_steps[mask] = 0

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        before = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:  # a dtype cast: keep fp32, follow the device only
                self._buffers[name] = old.to(device=new.device)
        return self


def _distinct_rows(rows: Tensor, wanted: int, generator: torch.Generator | None = None,
                   exclude: Tensor | None = None) -> Tensor:
    """Up to ``wanted`` random distinct finite rows of ``rows [M, dim]``, none of them an ``exclude`` row."""
    rows = rows[torch.isfinite(rows).all(dim=-1)]
    if rows.shape[0] > 1:
        rows = torch.unique(rows, dim=0)
    if exclude is not None and exclude.shape[0] and rows.shape[0]:
        rows = rows[~(rows[:, None, :] == exclude[None, :, :]).all(dim=-1).any(dim=1)]
    pick = torch.randperm(rows.shape[0], device=rows.device, generator=generator)[:wanted]
    return rows[pick]


RVQ_EPS = 1e-5  # the requirement's epsilon in e = M / (N + eps)


def _sync() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class ResidualVectorQuantizer(nn.Module):
    """Residual VQ over the last axis of ``z [..., dim]`` with one EMA codebook per level."""

    def __init__(
        self,
        dim: int,
        codebook_sizes: Sequence[int] = (12, 64, 256),
        decay_start: float = 0.9,
        decay_end: float = 0.99,
        decay_steps: int = 5000,
        eps: float = RVQ_EPS,
        dead_code_steps: int = 100,
        init_from_data: bool = True,
    ) -> None:
        super().__init__()  # (WorldModelConfig checks the sizes and decays)
        self.dim, self.codebook_sizes, self.eps = dim, tuple(int(k) for k in codebook_sizes), eps
        self.decay_start, self.decay_end, self.decay_steps = decay_start, decay_end, decay_steps
        self.dead_code_steps = dead_code_steps
        self.levels = nn.ModuleList(Codebook(k, dim) for k in self.codebook_sizes)
        self.register_buffer("initialized", torch.tensor(not init_from_data))
        self._init_known = False  # host-side cache of `initialized`: no device sync per step once True
        self._last_residuals: list[Tensor] | None = None  # per level, from the last EMA update (for revive)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def codebook(self, level: int) -> Tensor:
        """The codes of one level, ``[K_level, dim]``."""
        return self.levels[level].embed

    def decay_at(self, step: int | Tensor) -> float | Tensor:
        """EMA decay at a global step: linear from ``decay_start`` to ``decay_end`` over ``decay_steps``."""
        if self.decay_steps == 0:
            return self.decay_end
        if isinstance(step, Tensor):
            frac = (step.to(torch.float32) / self.decay_steps).clamp(0.0, 1.0)
        else:
            frac = min(max(step / self.decay_steps, 0.0), 1.0)
        return self.decay_start + (self.decay_end - self.decay_start) * frac

    @torch.compiler.disable
    def forward(self, z: Tensor, step: int | Tensor | None = None) -> RVQOutput:
        """Quantize ``z [..., dim]``; in training with a ``step``, update the EMA codebooks."""
        update = self.training and step is not None
        lead = z.shape[:-1]
        with torch.autocast(device_type=z.device.type, enabled=False):
            flat = z.reshape(-1, self.dim).float()  # [M, dim]
            if update and self._needs_init() and self._all_finite(flat):  # syncs only until init
                self._init_from(flat.detach())
            residual = flat
            q_sum = torch.zeros_like(flat)
            indices, commits, residuals = [], [], []
            for cb in self.levels:
                idx = self._nearest(residual.detach(), cb.embed)  # [M]
                q = cb.embed[idx]  # [M, dim], a buffer: no gradient
                commits.append(F.mse_loss(residual, q))
                residuals.append(residual.detach())
                indices.append(idx)
                q_sum = q_sum + q
                residual = residual - q
            # straight-through; without a gradient to pass, the codes' sum itself
            quantized = flat + (q_sum - flat).detach() if torch.is_grad_enabled() and flat.requires_grad else q_sum
            if update:
                self._ema_update(residuals, indices, step)
            with torch.no_grad():
                level_codebook = torch.stack([F.mse_loss(r, cb.embed[i])
                                              for r, cb, i in zip(residuals, self.levels, indices)])
            level_commit = torch.stack(commits)
        return RVQOutput(quantized.reshape(*lead, self.dim).to(z.dtype),
                         torch.stack(indices, dim=-1).reshape(*lead, self.num_levels), level_commit.sum(),
                         level_codebook.sum(), level_commit.detach(), z.detach())

    @torch.no_grad()
    def decode_indices(self, indices: Tensor) -> Tensor:
        """Codes of given indices ``[..., L] -> [..., dim]`` (the sum over levels); validates the indices."""
        if indices.shape[-1] != self.num_levels:
            raise ValueError(f"indices: expected {self.num_levels} levels in the last dim, got shape {tuple(indices.shape)}")
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise ValueError(f"indices: expected an integer tensor, got {indices.dtype}")
        for level, k in enumerate(self.codebook_sizes):
            col = indices[..., level]
            if col.numel() and (int(col.min()) < 0 or int(col.max()) >= k):
                raise ValueError(f"indices: level {level} takes codes 0..{k - 1}, got {int(col.min())}..{int(col.max())}")
        return sum(cb.embed[indices[..., level]] for level, cb in enumerate(self.levels))

    def _all_finite(self, flat: Tensor) -> bool:
        """Whether ``flat`` is finite on every rank (so that the ranks agree about initialising, which broadcasts)."""
        finite = torch.isfinite(flat).all().to(torch.int32)
        if _sync():
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite)

    def _needs_init(self) -> bool:
        if not self._init_known:
            self._init_known = bool(self.initialized)  # one host sync, until the codebooks are initialised
        return not self._init_known

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[override]
        self._init_known = False  # the loaded `initialized` flag decides again
        super()._load_from_state_dict(*args, **kwargs)

    @staticmethod
    def _nearest(x: Tensor, codes: Tensor) -> Tensor:
        dist2 = x.pow(2).sum(-1, keepdim=True) - 2.0 * x @ codes.t() + codes.pow(2).sum(-1)  # [M, K]
        return dist2.argmin(dim=-1)

    @torch.no_grad()
    def _init_from(self, flat: Tensor) -> None:
        """Data-dependent init: level ``l``'s codes are random distinct rows of the residuals at level ``l``."""
        residual = self._every_rank_rows(flat)
        for cb in self.levels:
            rows = _distinct_rows(residual, cb.size)
            cb.reset(torch.arange(cb.size, device=flat.device) < rows.shape[0], rows)  # the first codes
            residual = residual - cb.embed[self._nearest(residual, cb.embed)]
        self.initialized.fill_(True)
        self._init_known = True  # no host read of the flag on the next step
        if _sync():
            self._broadcast_levels()

    @torch.no_grad()
    def _ema_update(self, residuals: list[Tensor], indices: list[Tensor], step: int | Tensor) -> None:
        decay = self.decay_at(step)
        stats = []
        for r, idx, cb in zip(residuals, indices, self.levels):
            ones_and_r = torch.cat([torch.ones_like(r[:, :1]), r], dim=1)  # [N, 1 + dim]
            stats.append(r.new_zeros(cb.size, 1 + r.shape[1]).index_add_(0, idx, ones_and_r))  # [K, 1 + dim]
        packed = torch.cat(stats)  # one all-reduce for every level
        if _sync():
            dist.all_reduce(packed)
        # a non-finite batch leaves the codebooks as they were: decided on the device, the same on every rank
        finite = torch.isfinite(packed).all()
        packed = torch.nan_to_num(packed, nan=0.0, posinf=0.0, neginf=0.0)
        decay = torch.where(finite, decay, 1.0).to(torch.float32)
        for cb, level in zip(self.levels, packed.split(self.codebook_sizes)):
            counts, sums = level[:, 0], level[:, 1:]
            cb.ema_count.mul_(decay).add_((1.0 - decay) * counts)
            cb.ema_sum.mul_(decay).add_((1.0 - decay) * sums)
            cb.embed.copy_(torch.where(finite, cb.ema_sum / (cb.ema_count[:, None] + self.eps), cb.embed))
            cb.unused_steps.add_(finite.to(cb.unused_steps.dtype)).masked_fill_((counts > 0) & finite, 0)
        self._last_residuals = residuals

    def dead_codes(self) -> list[Tensor]:
        """Boolean mask per level of codes unused for ``dead_code_steps`` updates: a list of ``[K_l]``."""
        return [cb.unused_steps >= self.dead_code_steps for cb in self.levels]

    @torch.no_grad()
    def revive(self, generator: torch.Generator | None = None) -> list[int]:
        """Replace dead codes by random distinct finite residuals of their level from the last training batch, with
        fresh EMA state (after the EMA update) -> how many per level."""
        if self._last_residuals is None:
            return [0] * self.num_levels
        dead = self.dead_codes()
        counts = torch.stack([d.sum() for d in dead]).tolist()
        revived = []
        for cb, mask, n, r in zip(self.levels, dead, counts, self._last_residuals):
            rows = _distinct_rows(self._every_rank_rows(r), n, generator, exclude=cb.embed[~mask]) if n else r[:0]
            if rows.shape[0]:
                cb.reset(mask & (mask.cumsum(0) <= rows.shape[0]), rows)  # the first dead codes
            revived.append(int(rows.shape[0]))
        if sum(counts) and _sync():  # decided on the all-reduced counts
            self._broadcast_levels()
        return revived

    def _every_rank_rows(self, rows: Tensor) -> Tensor:
        """``rows [M, dim]`` of every rank in rank order under DDP (this rank's alone otherwise)."""
        if not _sync():
            return rows
        world = dist.get_world_size()
        count = torch.tensor([rows.shape[0]], device=rows.device)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count)
        sizes = [int(c) for c in counts]
        padded = rows.new_zeros(max(sizes), rows.shape[1])
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    def _broadcast_levels(self) -> None:
        for cb in self.levels:
            for buf in (cb.embed, cb.ema_sum, cb.ema_count, cb.unused_steps):
                dist.broadcast(buf, src=0)

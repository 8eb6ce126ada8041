"""Building blocks of the three parts: CNN tokenizer/detokenizer, sinusoidal PEs, the spatio-temporal transformer."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

TemporalMask = Literal["none", "causal", "shifted_causal"]


def sinusoidal_embedding(positions: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """Transformer sinusoidal embedding of (possibly fractional) positions: ``[...] -> [..., dim]``."""
    half = dim // 2
    freqs = torch.exp(-math.log(base) * torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * freqs  # [..., half]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)  # [..., dim]


def spatial_pos_embedding(height: int, width: int, dim: int, device: torch.device | None = None) -> Tensor:
    """2-D sinusoidal embedding of a ``height x width`` patch grid, row-major: ``[height*width, dim]``."""
    rows = torch.arange(height, device=device).repeat_interleave(width)  # [N]
    cols = torch.arange(width, device=device).repeat(height)  # [N]
    return torch.cat([sinusoidal_embedding(rows, dim // 2), sinusoidal_embedding(cols, dim // 2)], dim=-1)


def temporal_pos_embedding(length: int, dim: int, t0: int | Tensor = 0, device: torch.device | None = None) -> Tensor:
    """1-D sinusoidal embedding of frames ``t0 .. t0+length-1``."""
    steps = torch.arange(length, device=device)
    if isinstance(t0, Tensor):
        positions = t0.to(device=steps.device).reshape(-1, 1) + steps  # [B, length]
    else:
        positions = steps + int(t0)  # [length]
    return sinusoidal_embedding(positions, dim)


def _cnn(conv: type[nn.Module], c_in: int, hidden: int, c_out: int) -> nn.Sequential:
    """Three convolutions, the outer two ``conv`` of stride 2, with GroupNorm (``gcd(32, hidden)`` groups) and SiLU."""
    norm = lambda: nn.GroupNorm(math.gcd(32, hidden), hidden)  # noqa: E731
    return nn.Sequential(conv(c_in, hidden, 4, 2, 1), norm(), nn.SiLU(), nn.Conv2d(hidden, hidden, 3, padding=1),
                         norm(), nn.SiLU(), conv(hidden, c_out, 4, 2, 1))


class Tokenizer(nn.Module):
    """CNN tokenizer: frames ``[B*T, C, H, W] -> [B*T, D, H/4, W/4]``."""

    DOWNSAMPLE: ClassVar[int] = 4

    def __init__(self, in_channels: int = 16, d_model: int = 512, hidden: int | None = None) -> None:
        super().__init__()
        self.net = _cnn(nn.Conv2d, in_channels, hidden or max(d_model // 2, 16), d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Detokenizer(nn.Module):
    """CNN detokenizer, the mirror of :class:`Tokenizer`: ``[B*T, D, H/4, W/4] -> [B*T, C, H, W]``."""

    def __init__(self, out_channels: int = 16, d_model: int = 512, hidden: int | None = None) -> None:
        super().__init__()
        self.net = _cnn(nn.ConvTranspose2d, d_model, hidden or max(d_model // 2, 16), out_channels)

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z)


def to_sequence(maps: Tensor, batch: int) -> Tensor:
    """Tokenizer maps ``[B*T, D, h, w]`` -> ST layout ``[B, T, h*w, D]``."""
    return rearrange(maps, "(b t) d h w -> b t (h w) d", b=batch)


def to_maps(tokens: Tensor, height: int, width: int) -> Tensor:
    """ST layout ``[B, T, h*w, D]`` -> detokenizer maps ``[B*T, D, h, w]``."""
    return rearrange(tokens, "b t (h w) d -> (b t) d h w", h=height, w=width)


def temporal_mask(
    kind: TemporalMask, length: int, device: torch.device | None = None, window: int | None = None
) -> Tensor | None:
    """Boolean ``[length, length]`` mask, True where query ``i`` may attend key ``j``; None for ``none``."""
    if kind == "none":
        return None
    ones = torch.ones(length, length, dtype=torch.bool, device=device)
    if kind == "shifted_causal":
        return torch.tril(ones, diagonal=1)  # j <= i + 1
    causal = torch.tril(ones)  # j <= i
    return causal if window is None else causal & torch.triu(ones, diagonal=1 - window)


KV = tuple[Tensor, Tensor]  # one attention's keys and values [n, heads, positions, e]


def _sdpa_mask(kind: TemporalMask, queries: int, keys: int, device: torch.device,
               window: int | None) -> tuple[Tensor | None, bool]:
    """``(attn_mask, is_causal)`` for SDPA of the last ``queries`` of ``keys`` positions (the others from a cache)."""
    whole = window is None or window >= keys
    if kind == "none" or (kind == "causal" and queries == 1 and whole):
        return None, False  # every key allowed
    if kind == "causal" and queries == keys and whole:
        return None, True
    return temporal_mask(kind, keys, device, window)[keys - queries:], False


AttentionKernel = Literal["sdpa", "matmul"]
ATTENTION_KERNELS: tuple[str, ...] = ("sdpa", "matmul")


class Attention(nn.Module):
    """Multi-head self-attention over the second-to-last axis of ``[batch, L, D]``."""

    def __init__(self, d_model: int, n_heads: int, kernel: AttentionKernel = "sdpa") -> None:
        super().__init__()
        self.n_heads = n_heads
        self.kernel: AttentionKernel = kernel
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(
        self, x: Tensor, mask: TemporalMask = "none", return_weights: bool = False, window: int | None = None,
        past: KV | None = None,
    ) -> tuple[Tensor, Tensor | None, KV]:
        """``x [n, l, D]`` -> ``(out [n, l, D], weights [n, heads, l, p + l] or None, (keys, values))``."""
        q, k, v = rearrange(self.qkv(x), "n l (three h e) -> three n h l e", three=3, h=self.n_heads)  # views
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        queries, keys = q.shape[2], k.shape[2]
        weights = None
        if self.kernel == "sdpa" and not return_weights:
            attn_mask, is_causal = _sdpa_mask(mask, queries, keys, x.device, window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
            out = rearrange(out, "n h l e -> n l (h e)")
        else:  # explicit softmax
            scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # [n, h, l, p + l]
            allowed = temporal_mask(mask, keys, x.device, window)
            if allowed is not None:
                scores = scores.masked_fill(~allowed[keys - queries:], float("-inf"))
            probabilities = scores.softmax(dim=-1)  # float32 under autocast
            out = rearrange(probabilities.to(v.dtype) @ v, "n h l e -> n l (h e)")
            weights = probabilities if return_weights else None
        return self.proj(out), weights, (k, v)


class TransformerBlock(nn.Module):
    """One pre-norm ST block on ``[B, T, N, D]``."""

    def __init__(self, d_model: int, n_heads: int, mask: TemporalMask = "none", mlp_ratio: float = 4.0,
                 temporal_attention: AttentionKernel = "sdpa") -> None:
        super().__init__()
        self.mask: TemporalMask = mask
        self.norm_spatial = nn.LayerNorm(d_model)
        self.spatial = Attention(d_model, n_heads)
        self.norm_temporal = nn.LayerNorm(d_model)
        self.temporal = Attention(d_model, n_heads, temporal_attention)
        self.norm_mlp = nn.LayerNorm(d_model)
        hidden = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d_model))

    def forward(
        self, x: Tensor, return_attn: bool = False, window: int | None = None, past: KV | None = None
    ) -> tuple[Tensor, Tensor | None, KV]:
        """``x [B, t, N, D] -> ([B, t, N, D], temporal weights [B, heads, t, p + t] averaged over patches or None,
        the temporal keys/values of all p + t positions)``; ``past``: a causal block's cached p earlier frames."""
        B = x.shape[0]
        x = x + self.spatial_update(x)
        update, weights, kv = self.temporal(rearrange(self.norm_temporal(x), "b t n d -> (b n) t d"), self.mask,
                                            return_attn, window, past)
        if weights is not None:
            weights = rearrange(weights, "(b n) h i j -> b n h i j", b=B).mean(dim=1)
        x = x + rearrange(update, "(b n) t d -> b t n d", b=B)
        return x + self.mlp(self.norm_mlp(x)), weights, kv

    def spatial_update(self, x: Tensor) -> Tensor:
        """The spatial branch: attention over the ``N`` patches of each frame."""
        s, _, _ = self.spatial(rearrange(self.norm_spatial(x), "b t n d -> (b t) n d"))
        return rearrange(s, "(b t) n d -> b t n d", b=x.shape[0])


class STTransformer(nn.Module):
    """A stack of :class:`TransformerBlock` (one temporal mask per block) with a final LayerNorm."""

    def __init__(self, d_model: int, n_heads: int, masks: list[TemporalMask], mlp_ratio: float = 4.0,
                 checkpointing: bool = False, temporal_attention: AttentionKernel = "sdpa") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, m, mlp_ratio, temporal_attention) for m in masks)
        self.norm_out = nn.LayerNorm(d_model)
        self.checkpointing = checkpointing  # recompute each block's activations in the backward

    def forward(
        self, x: Tensor, return_attn: bool = False, window: int | None = None, past: list[KV] | None = None
    ) -> tuple[Tensor, list[Tensor], list[KV]]:
        """``x [B, t, N, D] -> ([B, t, N, D], per-block temporal weights [B, heads, t, p + t] if return_attn,
        per-block temporal keys/values of all p + t frames)``."""
        weights, cache = [], []
        for i, block in enumerate(self.blocks):
            kv = None if past is None else past[i]
            if self.checkpointing and torch.is_grad_enabled() and not return_attn:
                x, w, kv = checkpoint(block, x, False, window, kv, use_reentrant=False)
            else:
                x, w, kv = block(x, return_attn, window, kv)
            if w is not None:
                weights.append(w)
            cache.append(kv)
        return self.norm_out(x), weights, cache

    def step(self, x: Tensor, cache: list[KV] | None, window: int | None = None) -> tuple[Tensor, list[KV]]:
        """One new frame ``x [B, 1, N, D]`` through every (causal) block with its key/value cache (None: the first
        frame), each block attending to its last ``window`` frames (None: all)."""
        if cache is not None and window is not None:  # keep the window - 1 frames before this one
            cache = None if window == 1 else [(k[:, :, 1 - window:], v[:, :, 1 - window:]) for k, v in cache]
        out, _, cache = self(x, past=cache)
        return out, cache

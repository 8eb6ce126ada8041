"""The world model's three parts, pure PyTorch: the action encoder (one frame of lookahead), the world encoder
(bidirectional) and the dynamics predictor (causal), each an ST transformer; the RVQ of each encoder."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lwm.modules.rvq import ResidualVectorQuantizer, RVQOutput
from lwm.modules.st_transformer import KV, STTransformer


def to_weight_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in the weights' ``dtype`` where that is not fp32 (next to fp32 weights autocast casts what it needs)."""
    return x if dtype == torch.float32 or x.dtype == dtype else x.to(dtype)


def code_projection(layer: nn.Linear, h: Tensor) -> Tensor:
    """``layer(h)`` in fp32 under any autocast or weight dtype: the fp32 quantizer reads it, not a bf16 rounding."""
    with torch.autocast(device_type=h.device.type, enabled=False):
        return nn.functional.linear(h.float(), layer.weight.float(), layer.bias.float())


class ActionEncoder(nn.Module):
    """ST transformer with one frame of lookahead (or, ``per_transition``, each frame alone), spatial mean-pool (or
    ``max_pool``), RVQ: tokens -> ``[B, T-1, Da]``. ``st``, ``rvq_kwargs``: the STTransformer's and quantizer's."""

    def __init__(
        self, d_model: int, n_heads: int, depth: int, d_code: int, codebook_sizes: Sequence[int],
        mlp_ratio: float = 4.0, st: dict | None = None, per_transition: bool = False, max_pool: bool = False,
        **rvq_kwargs,
    ) -> None:
        super().__init__()
        # the shift once (each transition alone: none): stacked shifted masks would let output i see frame i + depth
        masks = ["causal" if per_transition else "shifted_causal"] + ["causal"] * (depth - 1)
        self.per_transition, self.max_pool = per_transition, max_pool
        self.transformer = STTransformer(d_model, n_heads, masks, mlp_ratio, **(st or {}))
        self.to_code = nn.Linear(d_model, d_code)
        self.rvq = ResidualVectorQuantizer(d_code, codebook_sizes, **rvq_kwargs)

    def embed(self, tokens: Tensor) -> Tensor:
        """Pre-quantization action vectors ``[B, T-1, Da]`` in fp32."""
        if self.per_transition:
            h = self.transformer(tokens.flatten(0, 1)[:, None])[0][:, 0].unflatten(0, tokens.shape[:2])
        else:
            h, _, _ = self.transformer(tokens)  # [B, T, N, D]; position i has seen frames 0..i+1
        h = h[:, :-1].float().amax(dim=2) if self.max_pool else h[:, :-1].mean(dim=2, dtype=torch.float32)
        return code_projection(self.to_code, h)  # [B, T-1, Da]

    def attention(self, tokens: Tensor) -> list[Tensor]:
        """Per-block temporal attention ``[B, heads, T, T]`` averaged over patches (per transition: the identity)."""
        if self.per_transition:
            B, T = tokens.shape[:2]
            eye = torch.eye(T, device=tokens.device).expand(B, self.transformer.blocks[0].temporal.n_heads, T, T)
            return [eye] * len(self.transformer.blocks)
        return self.transformer(tokens, return_attn=True)[1]

    def forward(self, tokens: Tensor, step: int | Tensor | None = None) -> RVQOutput:
        return self.rvq(self.embed(tokens), step)


class WorldEncoder(nn.Module):
    """Bidirectional ST transformer, mean-pool over space and time, RVQ: tokens -> ``[B, Dh]``."""

    def __init__(
        self, d_model: int, n_heads: int, depth: int, d_code: int, codebook_sizes: Sequence[int],
        mlp_ratio: float = 4.0, st: dict | None = None, **rvq_kwargs,
    ) -> None:
        super().__init__()
        self.transformer = STTransformer(d_model, n_heads, ["none"] * depth, mlp_ratio, **(st or {}))
        self.to_code = nn.Linear(d_model, d_code)
        self.rvq = ResidualVectorQuantizer(d_code, codebook_sizes, **rvq_kwargs)

    def embed(self, tokens: Tensor) -> Tensor:
        """Pre-quantization world vector ``[B, Dh]`` in fp32."""
        h, _, _ = self.transformer(tokens)  # [B, T, N, D]
        return code_projection(self.to_code, h.mean(dim=(1, 2), dtype=torch.float32))  # [B, Dh]

    def forward(self, tokens: Tensor, step: int | Tensor | None = None) -> RVQOutput:
        return self.rvq(self.embed(tokens), step)


class DynamicsPredictor(nn.Module):
    """Causal ST transformer on state tokens plus ``W_a a + W_h h`` (the quantized codes) broadcast over patches."""

    def __init__(self, d_model: int, n_heads: int, depth: int, d_action: int, d_world: int, mlp_ratio: float = 4.0,
                 st: dict | None = None) -> None:
        super().__init__()
        self.action_proj = nn.Linear(d_action, d_model)  # W_a^z
        self.world_proj = nn.Linear(d_world, d_model)  # W_h^z
        self.transformer = STTransformer(d_model, n_heads, ["causal"] * depth, mlp_ratio, **(st or {}))

    def condition(self, actions: Tensor, world: Tensor) -> Tensor:
        """``W_a a + W_h h`` for ``actions [B, t, Da]``, ``world [B, Dh]``: ``[B, t, 1, D]``."""
        actions = to_weight_dtype(actions, self.action_proj.weight.dtype)
        world = to_weight_dtype(world, self.world_proj.weight.dtype)
        return self.action_proj(actions)[:, :, None] + self.world_proj(world)[:, None, None]

    def forward(
        self, tokens: Tensor, actions: Tensor, world: Tensor, window: int | None = None, past: list[KV] | None = None
    ) -> tuple[Tensor, list[KV]]:
        """``tokens [B, t, N, D]``, ``actions [B, t, Da]``, ``world [B, Dh]`` -> (``[B, t, N, D]``, per-block
        temporal keys/values); output ``i`` predicts frame ``p + i + 1`` after the ``p`` frames of ``past``.
        ``window``: each block attends to the last ``window`` frames only."""
        out, _, cache = self.transformer(tokens + self.condition(actions, world), window=window, past=past)
        return out, cache

    def step(
        self, token: Tensor, action: Tensor, world: Tensor, cache: list[KV] | None, window: int | None = None
    ) -> tuple[Tensor, list[KV]]:
        """One new frame: ``token [B, 1, N, D]``, ``action [B, 1, Da]`` -> (its output, the updated cache)."""
        return self.transformer.step(token + self.condition(action, world), cache, window)

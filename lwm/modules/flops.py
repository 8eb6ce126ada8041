"""FLOP counts of a training step: ``FlopCounterMode`` with the CPU attention kernel counted and, for the useful
count, the pairs a mask drops and the backward's recomputed scores left out."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count


aten = torch.ops.aten


def allowed_pairs(q_len: int, k_len: int, is_causal: bool, attn_mask: torch.Tensor | None) -> tuple[int, int]:
    """``(allowed, of)``: the share of the ``q_len x k_len`` query/key pairs a mask allows, as integers (so that a
    count is exact, and linear in the batch)."""
    if attn_mask is not None:
        allowed = attn_mask if attn_mask.dtype == torch.bool else torch.isfinite(attn_mask)  # additive: -inf
        return int(allowed.sum()), allowed.numel()
    if is_causal:  # SDPA's causal mask is aligned top-left
        return sum(min(i + 1, k_len) for i in range(q_len)), q_len * k_len
    return 1, 1


def _counter(causal: Callable, mask: Callable, useful: bool, backward: bool):
    """A FlopCounterMode formula of one SDPA op; ``causal``, ``mask``: its is_causal and mask from (args, kwargs)."""
    def count(*args, out_val=None, **kwargs) -> int:
        q, k, v = args[1:4] if backward else args[:3]
        if backward:
            flops = sdpa_backward_flop_count(args[0].shape, q.shape, k.shape, v.shape)
            flops -= 2 * math.prod(q.shape) * k.shape[-2] if useful else 0  # the recomputed scores q k^T
        else:
            flops = sdpa_flop_count(q.shape, k.shape, v.shape)
        if not useful:
            return flops
        allowed, of = allowed_pairs(q.shape[-2], k.shape[-2], causal(args, kwargs), mask(args, kwargs))
        return flops * allowed // of

    count._get_raw = True  # FlopCounterMode passes tensors, not shapes
    return count


def _arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def attention_mapping(useful: bool = True) -> dict:
    """``custom_mapping`` for :class:`FlopCounterMode` covering every SDPA kernel, the CPU one included."""
    def is_causal(index: int):
        return lambda a, kw: bool(_arg(a, kw, index, "is_causal", False))

    forward = {  # op: (its is_causal position, where its mask is)
        # CPU flash: (q, k, v, dropout_p, is_causal, *, attn_mask, scale)
        aten._scaled_dot_product_flash_attention_for_cpu: (is_causal(4), lambda a, kw: kw.get("attn_mask")),
        # CUDA flash: (q, k, v, dropout_p, is_causal, return_debug_mask, *, scale)
        aten._scaled_dot_product_flash_attention: (is_causal(4), lambda a, kw: None),
        # memory-efficient: (q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale)
        aten._scaled_dot_product_efficient_attention: (is_causal(6), lambda a, kw: _arg(a, kw, 3, "attn_bias")),
    }
    backward = {
        # (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
        aten._scaled_dot_product_flash_attention_for_cpu_backward: (is_causal(7), lambda a, kw: kw.get("attn_mask")),
        # (grad_out, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, ...)
        aten._scaled_dot_product_flash_attention_backward: (is_causal(11), lambda a, kw: None),
        # (grad_out, q, k, v, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal, ...)
        aten._scaled_dot_product_efficient_attention_backward: (is_causal(11), lambda a, kw: _arg(a, kw, 4, "attn_bias")),
    }
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        # (q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale)
        forward[aten._scaled_dot_product_cudnn_attention] = (is_causal(6), lambda a, kw: _arg(a, kw, 3, "attn_bias"))
    if hasattr(aten, "_scaled_dot_product_cudnn_attention_backward"):
        # (grad_out, q, k, v, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, ...)
        backward[aten._scaled_dot_product_cudnn_attention_backward] = (is_causal(14), lambda a, kw: _arg(a, kw, 8, "attn_bias"))
    return {op: _counter(causal, mask, useful, ops is backward)
            for ops in (forward, backward) for op, (causal, mask) in ops.items()}


@dataclass
class StepFlops:
    """FLOPs of one counted region: ``useful`` (masked attention pairs left out) and ``dense`` (PyTorch's convention,
    with the CPU attention kernel counted), in total and per module name prefix."""

    useful: int = 0
    dense: int = 0  # equals ``useful`` when not counted
    by_module: dict[str, int] = field(default_factory=dict)  # useful FLOPs per module (FlopCounterMode names;
    # its module attribution of backward FLOPs is not reliable in a large step: prefer by_op there)
    by_op: dict[str, int] = field(default_factory=dict)  # useful FLOPs per aten operator


def _eager():
    """Count the eager graph: compiled regions under a dispatch mode may not be counted."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def count_flops(fn: Callable[[], object], dense: bool = True) -> StepFlops:
    """Run ``fn`` (e.g. a forward and backward) under :class:`FlopCounterMode` counting useful attention FLOPs, with
    the per-module breakdown."""
    with _eager(), FlopCounterMode(display=False, custom_mapping=attention_mapping(useful=True)) as useful:
        fn()
    total = int(useful.get_total_flops())
    if dense:
        with _eager(), FlopCounterMode(display=False, custom_mapping=attention_mapping(useful=False)) as full:
            fn()
    counts = useful.get_flop_counts()
    by_module = {name: int(sum(ops.values())) for name, ops in counts.items()}
    by_op = {str(op): int(n) for op, n in counts.get("Global", {}).items()}
    return StepFlops(total, int(full.get_total_flops()) if dense else total, by_module, by_op)

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
    """``(allowed, of)``: the share of ``q_len x k_len`` query/key pairs a mask allows, in integers (counts exact)."""
    if attn_mask is not None:
        allowed = attn_mask if attn_mask.dtype == torch.bool else torch.isfinite(attn_mask)  # additive: -inf
        return int(allowed.sum()), allowed.numel()
    if is_causal:  # SDPA's causal mask is aligned top-left
        return sum(min(i + 1, k_len) for i in range(q_len)), q_len * k_len
    return 1, 1


SDPA_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")  # and their backward


def _reader(op, *names: str) -> Callable[[tuple, dict], object]:
    """A reader ``(args, kwargs) -> value`` of ``op``'s argument named one of ``names``, where its schema puts it."""
    for i, a in enumerate(op.default._schema.arguments):
        if a.name in names:
            return lambda args, kwargs: kwargs.get(a.name, args[i] if not a.kwarg_only and i < len(args) else None)
    return lambda args, kwargs: None


def _counter(op, useful: bool, backward: bool):
    """A FlopCounterMode formula of one SDPA op, reading its is_causal and mask where its schema puts them."""
    causal, mask = _reader(op, "is_causal"), _reader(op, "attn_mask", "attn_bias")

    def count(*args, out_val=None, **kwargs) -> int:
        q, k, v = args[1:4] if backward else args[:3]
        if backward:
            flops = sdpa_backward_flop_count(args[0].shape, q.shape, k.shape, v.shape)
            flops -= 2 * math.prod(q.shape) * k.shape[-2] if useful else 0  # the recomputed scores q k^T
        else:
            flops = sdpa_flop_count(q.shape, k.shape, v.shape)
        if not useful:
            return flops
        allowed, of = allowed_pairs(q.shape[-2], k.shape[-2], bool(causal(args, kwargs)), mask(args, kwargs))
        return flops * allowed // of

    count._get_raw = True  # FlopCounterMode passes tensors, not shapes
    return count


def attention_mapping(useful: bool = True) -> dict:
    """``custom_mapping`` for :class:`FlopCounterMode` covering every SDPA kernel of this torch, the CPU one too."""
    return {getattr(aten, name): _counter(getattr(aten, name), useful, name.endswith("_backward"))
            for name in (kernel + end for kernel in SDPA_KERNELS for end in ("", "_backward")) if hasattr(aten, name)}


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
    """Run ``fn`` (e.g. a forward and backward) under :class:`FlopCounterMode`: useful FLOPs, per module too."""
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

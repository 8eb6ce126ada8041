"""FLOP counts: the CPU attention kernel counted, masked attention counted for the pairs it allows."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from lwm.modules.flops import allowed_pairs, attention_mapping, count_flops
from lwm.modules.st_transformer import Attention, temporal_mask

N, L, D, HEADS = 4, 8, 32, 2


def allowed_fraction(*args) -> float:
    allowed, of = allowed_pairs(*args)
    return allowed / of


def _attention_step(mask: str):
    torch.manual_seed(0)
    attn = Attention(D, HEADS)
    x = torch.randn(N, L, D, requires_grad=True)

    def fn() -> None:
        out, _, _ = attn(x, mask)
        out.sum().backward()

    return fn


def test_known_fractions():
    assert allowed_fraction(8, 8, False, None) == 1.0
    assert allowed_fraction(8, 8, True, None) == pytest.approx(36 / 64)
    assert allowed_fraction(8, 8, False, temporal_mask("shifted_causal", 8)) == pytest.approx(43 / 64)
    additive = torch.zeros(4, 4).masked_fill(~temporal_mask("causal", 4), float("-inf"))
    assert allowed_fraction(4, 4, False, additive) == pytest.approx(10 / 16)


@pytest.mark.parametrize(("mask", "fraction"), [("none", 1.0), ("causal", 36 / 64), ("shifted_causal", 43 / 64)])
def test_attention_flops_on_the_cpu(mask, fraction):
    fn = _attention_step(mask)
    e = D // HEADS
    q = (N, HEADS, L, e)
    forward, backward = sdpa_flop_count(q, q, q), sdpa_backward_flop_count(q, q, q, q)  # PyTorch's formulas
    recompute = 2 * N * HEADS * L * L * e  # PyTorch's backward recomputes the scores q k^T: not useful work
    attention = forward + backward
    linear = 3 * (2 * N * L * D * 3 * D + 2 * N * L * D * D)  # qkv and proj, forward + 2x backward
    with FlopCounterMode(display=False) as plain:
        fn()
    assert plain.get_total_flops() == linear  # PyTorch alone counts the CPU attention kernel as zero
    counted = count_flops(fn)
    assert counted.dense == linear + attention
    assert counted.useful == linear + int(forward * fraction) + int((backward - recompute) * fraction)
    assert backward - recompute == 2 * forward  # the useful backward: the four gradient matmuls
    assert counted.by_module["Attention.qkv"] == 3 * 2 * N * L * D * 3 * D


def test_causal_fraction_with_more_queries_than_keys():
    # top-left aligned: query i sees keys 0..min(i, S-1); 3 queries over 2 keys see 1 + 2 + 2 of 6 pairs
    assert allowed_fraction(3, 2, True, None) == pytest.approx(5 / 6)
    assert allowed_fraction(3, 2, True, None) == pytest.approx(float(torch.ones(3, 2).tril().mean()))


def _schema_args(op, **named):
    """Positional args of an aten overload from its schema: given names take their value, others a falsy default."""
    args = []
    for a in op._schema.arguments:
        if a.kwarg_only:
            break
        args.append(named.get(a.name, named.get(a.name.rstrip("_"), None if "Tensor" in str(a.type) else 0)))
    return args


def _gpu_kernels():
    aten = torch.ops.aten
    ops = [("fwd", aten._scaled_dot_product_flash_attention.default),
           ("fwd", aten._scaled_dot_product_efficient_attention.default),
           ("bwd", aten._scaled_dot_product_flash_attention_backward.default),
           ("bwd", aten._scaled_dot_product_efficient_attention_backward.default)]
    for name, kind in (("_scaled_dot_product_cudnn_attention", "fwd"), ("_scaled_dot_product_cudnn_attention_backward", "bwd")):
        if hasattr(aten, name):
            ops.append((kind, getattr(aten, name).default))
    return ops


@pytest.mark.parametrize(("kind", "op"), _gpu_kernels(), ids=lambda x: str(x))
def test_every_gpu_attention_kernel_reads_is_causal_and_its_mask_where_the_schema_puts_them(kind, op):
    """The GPU kernels' counts, called on the CPU with arguments placed by PyTorch's own schema: causal counts
    36/64 of the square at L=8, a bias with -inf outside the causal triangle likewise (where the kernel takes one)."""
    q = torch.zeros(2, 2, 8, 4)
    forward = sdpa_flop_count(q.shape, q.shape, q.shape)
    dense = forward if kind == "fwd" else sdpa_backward_flop_count(*(q.shape,) * 4)
    square = forward if kind == "fwd" else 2 * forward  # useful: the backward's four gradient matmuls, no recompute
    useful = attention_mapping(useful=True)
    full = attention_mapping(useful=False)
    key = op if op in useful else op.overloadpacket
    common = dict(query=q, key=q, value=q, grad_out=q, out=q)
    assert useful[key](*_schema_args(op, is_causal=True, **common)) == square * 36 // 64
    assert full[key](*_schema_args(op, is_causal=True, **common)) == dense
    assert useful[key](*_schema_args(op, is_causal=False, **common)) == square
    if any(a.name == "attn_bias" for a in op._schema.arguments):
        bias = torch.zeros(8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
        assert useful[key](*_schema_args(op, is_causal=False, attn_bias=bias, **common)) == square * 36 // 64


def test_an_additive_mask_counts_its_finite_entries_whatever_their_value():
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    bias = torch.full((4, 4), -0.5).masked_fill(~causal, float("-inf"))  # e.g. a relative-position bias
    assert allowed_fraction(4, 4, False, bias) == pytest.approx(10 / 16)

"""FLOP counts: the CPU attention kernel counted, masked attention counted for the pairs it allows."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from lwm.flops import allowed_fraction, count_flops
from lwm.modules.st_transformer import Attention, temporal_mask

N, L, D, HEADS = 4, 8, 32, 2


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
    attention = forward + backward
    linear = 3 * (2 * N * L * D * 3 * D + 2 * N * L * D * D)  # qkv and proj, forward + 2x backward
    with FlopCounterMode(display=False) as plain:
        fn()
    assert plain.get_total_flops() == linear  # PyTorch alone counts the CPU attention kernel as zero
    counted = count_flops(fn)
    assert counted.dense == linear + attention
    assert counted.useful == linear + int(forward * fraction) + int(backward * fraction)
    assert counted.by_module["Attention.qkv"] == 3 * 2 * N * L * D * 3 * D


def test_causal_fraction_with_more_queries_than_keys():
    # top-left aligned: query i sees keys 0..min(i, S-1); 3 queries over 2 keys see 1 + 2 + 2 of 6 pairs
    assert allowed_fraction(3, 2, True, None) == pytest.approx(5 / 6)
    assert allowed_fraction(3, 2, True, None) == pytest.approx(float(torch.ones(3, 2).tril().mean()))

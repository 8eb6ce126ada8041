import math

import pytest
import torch
from einops import rearrange

from lwm.modules.st_transformer import (
    Attention,
    Detokenizer,
    STTransformer,
    Tokenizer,
    TransformerBlock,
    sinusoidal_embedding,
    spatial_pos_embedding,
    temporal_mask,
    temporal_pos_embedding,
    to_maps,
    to_sequence,
)


@pytest.mark.parametrize("d_model", [32, 512])
def test_tokenizer_shapes_at_requirement_size(d_model):
    x = torch.randn(2 * 3, 16, 64, 64)  # [B*T, C, H, W]
    z = Tokenizer(16, d_model)(x)
    assert z.shape == (6, d_model, 16, 16)
    y = Detokenizer(16, d_model)(z)
    assert y.shape == (6, 16, 64, 64)


def test_tokenizer_shapes_tiny():
    z = Tokenizer(4, 16, hidden=8)(torch.randn(5, 4, 8, 12))
    assert z.shape == (5, 16, 2, 3)
    assert Detokenizer(4, 16, hidden=8)(z).shape == (5, 4, 8, 12)


def test_sequence_layout_round_trip():
    B, T, D, h, w = 2, 3, 8, 4, 5
    maps = torch.randn(B * T, D, h, w)
    seq = to_sequence(maps, B)
    assert seq.shape == (B, T, h * w, D)
    # patch n = row * w + col of frame t of sample b
    assert torch.equal(seq[1, 2, 1 * w + 3], maps[1 * T + 2, :, 1, 3])
    assert torch.equal(to_maps(seq, h, w), maps)


def test_sinusoidal_embedding_known_values():
    pe = sinusoidal_embedding(torch.tensor([0.0, 1.0]), 4)
    # frequencies 1 and 1e-2 (10000^(-1/2)); layout [sin, sin, cos, cos]
    expected = torch.tensor([[0, 0, 1, 1], [math.sin(1), math.sin(0.01), math.cos(1), math.cos(0.01)]])
    assert torch.allclose(pe, expected.float(), atol=1e-6)


def test_temporal_pe_offset_is_a_shift():
    full = temporal_pos_embedding(20, 16)
    assert torch.allclose(temporal_pos_embedding(5, 16, t0=7), full[7:12])
    per_sample = temporal_pos_embedding(5, 16, t0=torch.tensor([0, 3, 15]))
    assert per_sample.shape == (3, 5, 16)
    for i, t0 in enumerate([0, 3, 15]):
        assert torch.allclose(per_sample[i], full[t0 : t0 + 5])


def test_spatial_pe_rows_and_columns():
    h, w, d = 3, 4, 16
    pe = spatial_pos_embedding(h, w, d)
    assert pe.shape == (h * w, d)
    assert len({tuple(r.tolist()) for r in pe}) == h * w  # every patch distinct
    # the first half encodes the row, the second the column
    assert torch.allclose(pe[1 * w + 2, : d // 2], pe[1 * w + 0, : d // 2])
    assert torch.allclose(pe[2 * w + 3, d // 2 :], pe[0 * w + 3, d // 2 :])


def test_temporal_masks():
    assert temporal_mask("none", 4) is None
    causal = temporal_mask("causal", 4)
    shifted = temporal_mask("shifted_causal", 4)
    for i in range(4):
        for j in range(4):
            assert causal[i, j] == (j <= i)
            assert shifted[i, j] == (j <= i + 1)


@pytest.mark.parametrize("mask", ["none", "causal", "shifted_causal"])
def test_attention_weights_path_equals_fast_path(mask):
    torch.manual_seed(0)
    attn = Attention(16, 4)
    x = torch.randn(3, 6, 16)
    fast, none, _ = attn(x, mask)
    slow, weights, _ = attn(x, mask, return_weights=True)
    assert none is None
    assert torch.allclose(fast, slow, atol=1e-5)
    assert weights.shape == (3, 4, 6, 6)
    assert torch.allclose(weights.sum(-1), torch.ones(3, 4, 6))
    allowed = temporal_mask(mask, 6)
    if allowed is not None:
        assert torch.all(weights[..., ~allowed] == 0)


def test_block_spatial_attention_stays_within_frame_and_temporal_within_patch():
    """A block with a causal temporal mask: perturbing frame 2 leaves frames 0, 1 untouched; the MLP and
    spatial attention never mix samples."""
    torch.manual_seed(0)
    block = TransformerBlock(16, 2, "causal").eval()
    x = torch.randn(2, 4, 5, 16)
    y, _, _ = block(x)
    x2 = x.clone()
    x2[0, 2] += 1.0
    y2, _, _ = block(x2)
    assert torch.equal(y2[1], y[1])  # other sample
    assert torch.allclose(y2[0, :2], y[0, :2], atol=1e-6)  # earlier frames
    assert not torch.allclose(y2[0, 2:], y[0, 2:], atol=1e-4)  # this and later frames


def test_st_transformer_returns_attention_per_block():
    st = STTransformer(16, 2, ["shifted_causal", "causal", "causal"])
    x = torch.randn(2, 5, 4, 16)
    y, attn, _ = st(x, return_attn=True)
    assert y.shape == x.shape and len(attn) == 3
    assert all(a.shape == (2, 2, 5, 5) for a in attn)
    assert torch.all(attn[0][..., torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=2)] == 0)
    assert torch.all(attn[1][..., torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)] == 0)
    y_fast, none, _ = st(x)
    assert none == [] and torch.allclose(y, y_fast, atol=1e-5)





def test_windowed_causal_mask_keeps_the_last_frames():
    from lwm.modules.st_transformer import temporal_mask

    m = temporal_mask("causal", 5, window=2).int()
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 0, 1, 1]])
    assert torch.equal(m, expected)
    assert torch.equal(temporal_mask("causal", 5, window=9), temporal_mask("causal", 5))


@pytest.mark.parametrize("window", [None, 2])
def test_causal_stack_after_cached_frames_equals_the_whole_sequence(window):
    """Frames fed after the keys/values of the earlier ones give the whole sequence's outputs there."""
    torch.manual_seed(0)
    st = STTransformer(16, 2, ["causal", "causal"]).eval()
    x = torch.randn(2, 6, 4, 16)
    whole, _, cache = st(x, window=window)
    for p in (1, 3, 5):
        past = [(k[:, :, :p], v[:, :, :p]) for k, v in cache]
        later, _, later_cache = st(x[:, p:], window=window, past=past)
        assert torch.allclose(later, whole[:, p:], atol=1e-5), p
        for (k, v), (k2, v2) in zip(cache, later_cache):
            assert torch.allclose(k2, k, atol=1e-5) and torch.allclose(v2, v, atol=1e-5)


@pytest.mark.parametrize(("mask", "window", "cached"), [("none", None, 0), ("causal", None, 0), ("shifted_causal", None, 0),
                                                        ("causal", 2, 0), ("causal", None, 2), ("causal", 3, 2)])
def test_attention_kernels_equal_sdpa(mask, window, cached):
    """The plain-matmul attention is the same function as SDPA: outputs, keys/values and gradients, also of the
    cached keys/values."""
    torch.manual_seed(0)
    sdpa = Attention(16, 4)
    other = Attention(16, 4, kernel="matmul")
    other.load_state_dict(sdpa.state_dict())
    x = torch.randn(3, 6, 16)
    past = (torch.randn(3, 4, cached, 4), torch.randn(3, 4, cached, 4)) if cached else None
    results = []
    for attn in (sdpa, other):
        xi = x.clone().requires_grad_(True)
        pi = tuple(t.clone().requires_grad_(True) for t in past) if past else None
        out, weights, kv = attn(xi, mask, window=window, past=pi)
        out.pow(2).sum().backward()
        assert weights is None
        results.append((out, kv, xi.grad, attn.qkv.weight.grad, [t.grad for t in pi] if pi else []))
    (o1, kv1, gx1, gw1, gp1), (o2, kv2, gx2, gw2, gp2) = results
    assert torch.allclose(o1, o2, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(kv1, kv2))
    assert torch.allclose(gx1, gx2, atol=1e-5) and torch.allclose(gw1, gw2, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(gp1, gp2))


@torch.no_grad()
def test_returned_temporal_attention_is_the_mean_over_patches():
    """A block's returned temporal weights equal its per-patch attention weights averaged over the patches."""
    torch.manual_seed(0)
    B, T, N, D, heads = 2, 5, 3, 16, 2
    block = TransformerBlock(D, heads, "shifted_causal").eval()
    x = torch.randn(B, T, N, D)
    _, w, _ = block(x, return_attn=True)
    h = x + block.spatial_update(x)
    seq = rearrange(block.norm_temporal(h), "b t n d -> (b n) t d")
    _, per_patch, _ = block.temporal(seq, "shifted_causal", return_weights=True)  # [(B N), heads, T, T]
    per_patch = per_patch.reshape(B, N, heads, T, T)
    assert not torch.allclose(per_patch[:, 0], per_patch[:, 1], atol=1e-4)  # premise: the patches differ
    torch.testing.assert_close(w, per_patch.mean(dim=1), rtol=0, atol=1e-6)

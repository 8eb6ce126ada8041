"""The Triton temporal-attention kernels equal the attention they replace: outputs and gradients of q, k, v and of
cached keys/values. On the CPU Triton's interpreter runs them (TRITON_INTERPRET=1, set in conftest); on a GPU
machine ``TRITON_INTERPRET=0 pytest tests/modules/test_triton_attention.py`` runs the compiled kernels (bf16 too)."""

import pytest
import torch

from lwm.modules import triton_attention
from lwm.modules.st_transformer import Attention, temporal_mask
from lwm.modules.triton_attention import temporal_attention

INTERPRETED = triton_attention.interpreting()
DEVICES = ["cpu"] if INTERPRETED else ["cuda"] if torch.cuda.is_available() and triton_attention.triton else []
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs a GPU, or triton with TRITON_INTERPRET=1 (the CPU)")
CPU = pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter on CPU tensors (TRITON_INTERPRET=1)")


def reference(qkv, past_k, past_v, mask, window):
    """Softmax attention in plain PyTorch: ``qkv [n, l, 3, h, e]`` after ``past [n, h, p, e]`` -> ``[n, l, h, e]``."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # [n, h, l, e] each
    if past_k is not None:
        k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
    queries, keys = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    allowed = temporal_mask(mask, keys, window=window or None)
    if allowed is not None:
        scores = scores.masked_fill(~allowed[keys - queries:], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


CASES = [  # (n, queries, heads, head size, cached, mask, window)
    (3, 16, 2, 64, 0, "causal", 0),  # the base shape (fewer sequences)
    (2, 5, 3, 8, 0, "none", 0),  # sizes under the 16-wide tiles: padded
    (2, 7, 2, 16, 0, "shifted_causal", 0),
    (2, 6, 2, 16, 3, "causal", 0),  # a rollout pass after 3 cached positions
    (2, 4, 2, 16, 5, "causal", 3),  # a sliding window over cached positions
    (2, 1, 2, 16, 9, "causal", 4),  # generation: one new frame
    (2, 17, 1, 20, 0, "causal", 0),  # past one tile: 32-wide
    (2, 5, 2, 16, 0, "none", 2),  # a window only limits causal masks (as temporal_mask)
    (2, 5, 2, 16, 0, "shifted_causal", 2),
    (2, 6, 2, 16, 12, "causal", 0),  # 18 keys: a 32-wide key tile over a 16-wide query tile
    (2, 6, 2, 16, 12, "causal", 5),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("n", "queries", "heads", "e", "cached", "mask", "window"), CASES)
def test_kernel_equals_softmax_attention_with_gradients(n, queries, heads, e, cached, mask, window, device):
    torch.manual_seed(0)
    qkv = torch.randn(n, queries, 3, heads, e, device=device, requires_grad=True)
    past = ([torch.randn(n, heads, cached, e, device=device, requires_grad=True) for _ in range(2)] if cached
            else [None, None])
    inputs = [t for t in (qkv, *past) if t is not None]
    out = temporal_attention(qkv, *past, mask, window)
    expected = reference(qkv, *past, mask, window)
    assert out.shape == (n, queries, heads, e)
    tolerance = 2e-6 if device == "cpu" else 1e-5  # the GPU's fp32 matmuls round differently
    assert torch.allclose(out, expected, atol=tolerance)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_reads_strided_inputs_and_cached_values_in_another_layout(device):
    """q, k, v as a view of a wider projection and cached keys/values with different strides (made one layout):
    outputs and gradients."""
    torch.manual_seed(1)
    wide = torch.randn(2, 5, 4, 2, 16, device=device)[:, :, 1:]  # [n, l, 3, h, e] view, not contiguous
    past_k = torch.randn(2, 3, 2, 16, device=device).transpose(1, 2)  # [n, h, p, e] with strides of [n, p, h, e]
    past_v = torch.randn(2, 2, 3, 16, device=device)
    wide.requires_grad_(), past_k.requires_grad_(), past_v.requires_grad_()
    out = temporal_attention(wide, past_k, past_v, "causal", 0)
    expected = reference(wide, past_k, past_v, "causal", 0)
    assert torch.allclose(out, expected, atol=1e-5)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (wide, past_k, past_v), grad),
                         torch.autograd.grad(expected, (wide, past_k, past_v), grad)):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(("device", "dtype"), [(d, torch.float16) for d in DEVICES]
                         + [("cuda", torch.bfloat16)] * ("cuda" in DEVICES))
def test_half_precision_kernel_is_close_to_fp32(device, dtype):
    """16-bit inputs: tiles cast to 16 bits between the two matmuls, fp32 softmax. bf16 on a GPU only: Triton's
    interpreter computes bf16 ``tl.dot`` wrongly (benchmarks/temporal_attention.py also checks it)."""
    torch.manual_seed(2)
    qkv = torch.randn(4, 16, 3, 2, 32, device=device, requires_grad=True)
    half = qkv.detach().to(dtype).requires_grad_()
    out = temporal_attention(half, None, None, "causal", 0)
    assert out.dtype == dtype
    expected = reference(qkv, None, None, "causal", 0)
    bound = 2e-3 if dtype == torch.float16 else 1.5e-2  # bf16 keeps 8 bits of mantissa, fp16 11
    assert ((out.float() - expected).norm() / expected.norm()) < bound
    grad = torch.randn_like(expected)
    out.backward(grad.to(dtype))
    expected.backward(grad)
    assert half.grad.dtype == dtype
    assert ((half.grad.float() - qkv.grad).norm() / qkv.grad.norm()) < 2.5 * bound


@pytest.mark.slow
@CPU
def test_op_registration_passes_torch_opcheck():
    """Schema, fake (meta) implementation and autograd registration, as torch.compile relies on them."""
    torch.manual_seed(3)
    qkv = torch.randn(2, 6, 3, 2, 16, requires_grad=True)
    past = [torch.randn(2, 2, 2, 16, requires_grad=True) for _ in range(2)]
    torch.library.opcheck(temporal_attention, (qkv, None, None, "shifted_causal", 0))
    torch.library.opcheck(temporal_attention, (qkv, *past, "causal", 3))
    strided = [torch.randn(2, 2, 2, 16).transpose(1, 2).requires_grad_() for _ in range(2)]  # not contiguous
    torch.library.opcheck(temporal_attention, (qkv[:, 1:], *strided, "causal", 0))
    grad = torch.randn(2, 5, 2, 16)
    wide = torch.randn(2, 5, 4, 2, 16)[:, :, 1:]  # a strided qkv: its gradient still comes out contiguous
    for args in ((grad, qkv[:, 1:].detach(), *(t.detach() for t in strided), "causal", 0),
                 (grad, wide, None, None, "none", 0)):
        torch.library.opcheck(triton_attention.temporal_attention_backward, args)


def test_fp32_precision_follows_pytorchs_tf32_setting():
    """TF32 in the kernel's fp32 matmuls exactly where PyTorch's own matmuls may use it (new and legacy API)."""
    matmul = torch.backends.cuda.matmul
    saved = torch.get_float32_matmul_precision(), matmul.fp32_precision
    try:
        matmul.fp32_precision = "ieee"
        assert triton_attention._precision(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("high")  # the legacy setter moves the new setting too
        assert triton_attention._precision(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(saved[0])
        matmul.fp32_precision = saved[1]
    assert triton_attention._precision(torch.bfloat16) == "tf32"  # ignored for 16-bit operands


def test_bad_mask_and_mismatched_dtypes_are_refused():
    qkv = torch.randn(1, 4, 3, 1, 16, device=DEVICES[0])
    with pytest.raises(ValueError, match="mask must be one of"):
        temporal_attention(qkv, None, None, "diagonal", 0)
    past = torch.randn(1, 1, 2, 16, dtype=torch.float64, device=DEVICES[0])
    with pytest.raises(ValueError, match="one dtype"):
        temporal_attention(qkv, past, past, "causal", 0)


@CPU
def test_cpu_tensors_without_the_interpreter_get_a_clear_error(monkeypatch):
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)  # as if the kernels had been compiled for CUDA
    assert not triton_attention.supported(torch.randn(1, device="cpu"), 16, 64)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        temporal_attention(torch.randn(1, 4, 3, 1, 16), None, None, "causal", 0)


@CPU
def test_attention_falls_back_to_the_matmul_formulation_where_the_kernel_does_not_apply(monkeypatch):
    """Where a sequence's tiles would not fit in registers (keys x head size over 64 x 64 in 16-bit, 32 x 64 in
    fp32, padded to powers of two), or in float64, the ``triton`` setting computes the same attention by matmuls."""
    calls = []
    monkeypatch.setattr(triton_attention, "temporal_attention", lambda *a: calls.append(a))
    assert not triton_attention.supported(torch.randn(1, dtype=torch.float64), 16, 64)
    assert triton_attention.supported(torch.randn(1), 32, 64) and not triton_attention.supported(torch.randn(1), 33, 64)
    assert triton_attention.supported(torch.randn(1).bfloat16(), 64, 64)
    assert not triton_attention.supported(torch.randn(1).bfloat16(), 64, 65)
    assert triton_attention.supported(torch.randn(1).half(), 16, 256)
    torch.manual_seed(4)
    fast, matmul = Attention(8, 2, kernel="triton"), Attention(8, 2, kernel="matmul")
    matmul.load_state_dict(fast.state_dict())
    for x in (torch.randn(2, 2049, 8), torch.randn(2, 5, 8, dtype=torch.float64)):  # 2049 keys x 4 (16): too many
        fast.to(x.dtype), matmul.to(x.dtype)
        assert torch.equal(fast(x, "causal")[0], matmul(x, "causal")[0])
    # fp32, head size 64: 16 queries fit, but after 17 cached positions the 33 keys do not
    fast, matmul = Attention(128, 2, kernel="triton"), Attention(128, 2, kernel="matmul")
    matmul.load_state_dict(fast.state_dict())
    x, past = torch.randn(2, 16, 128), tuple(torch.randn(2, 2, 17, 64) for _ in range(2))
    assert torch.equal(fast(x, "causal", past=past)[0], matmul(x, "causal", past=past)[0])
    assert not calls


@CPU
def test_attention_weights_for_diagnostics_come_from_the_explicit_softmax():
    """``return_weights`` (the attention-diagonality callback) takes the matmul path under the triton setting."""
    torch.manual_seed(6)
    fast, matmul = Attention(16, 2, kernel="triton"), Attention(16, 2, kernel="matmul")
    matmul.load_state_dict(fast.state_dict())
    x = torch.randn(3, 6, 16)
    (out, weights, _), (out2, weights2, _) = fast(x, "causal", return_weights=True), matmul(x, "causal", return_weights=True)
    assert weights is not None and torch.equal(weights, weights2) and torch.equal(out, out2)
    assert torch.allclose(weights.sum(-1), torch.ones(3, 2, 6))


def test_without_triton_the_triton_setting_warns_and_computes_the_same(monkeypatch):
    from lwm.modules.world_model import WorldModel

    monkeypatch.setattr(triton_attention, "triton", None)
    assert not triton_attention.supported(torch.randn(1), 16, 64)
    with pytest.warns(UserWarning, match="triton package is not installed"):
        WorldModel(in_channels=2, height=8, width=8, d_model=16, n_heads=2, temporal_attention="triton")


@pytest.mark.slow
@CPU
@pytest.mark.timeout(300)
def test_inductor_compiled_attention_equals_eager():
    """Under torch.compile (inductor: it lays out the op's inputs itself) the kernel gives eager's outputs and
    gradients, with cached keys/values."""
    import copy

    torch.manual_seed(5)
    eager = Attention(16, 2, kernel="triton")
    compiled = torch.compile(copy.deepcopy(eager), backend="inductor", fullgraph=True)
    x = torch.randn(4, 6, 16)
    past = [torch.randn(4, 2, 3, 8) for _ in range(2)]
    results = []
    for attn in (eager, compiled):
        xi, pi = x.clone().requires_grad_(), [t.clone().requires_grad_() for t in past]
        out = attn(xi, "causal", past=tuple(pi))[0]
        out.square().sum().backward()
        results.append((out, xi.grad, *(t.grad for t in pi)))
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(eager.qkv.weight.grad, compiled.qkv.weight.grad, atol=1e-6)

"""Temporal attention as one Triton kernel per direction (``temporal_attention: triton``)."""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch's CUDA wheels bring triton; CPU-only installs may not
    triton = None

MIN_BLOCK = 16  # tl.dot's smallest tile side
# Every tile of a sequence lives in registers.
MAX_TILE = {2: 4096, 4: 2048}  # element size
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SHIFTS = {"none": 0, "causal": 0, "shifted_causal": 1}  # mask -> the keys after its own a query may see


# Triton decides when a kernel is defined (at this import) whether its interpreter runs it.
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Triton's interpreter runs the kernels (``TRITON_INTERPRET=1`` when this module was imported)."""
    return INTERPRETED


def _device() -> str:
    return "cpu" if interpreting() else "cuda"


def fits(dtype: torch.dtype, keys: int, head_dim: int) -> bool:
    """Whether a sequence of ``keys`` positions and this head size fits the kernel's registers in ``dtype``."""
    return dtype in DTYPES and _block(keys) * _block(head_dim) <= MAX_TILE[dtype.itemsize]


def supported(x: Tensor, keys: int, head_dim: int) -> bool:
    """Whether the kernel can run for activations ``x`` (device, dtype), ``keys`` positions and this head size."""
    return triton is not None and fits(x.dtype, keys, head_dim) and x.device.type == _device()


def _block(n: int) -> int:
    return max(MIN_BLOCK, 1 << (n - 1).bit_length())


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for fp32 inputs."""
    if dtype != torch.float32:
        return "tf32"  # ignored for 16-bit operands
    matmul = torch.backends.cuda.matmul
    tf32 = matmul.fp32_precision == "tf32" if hasattr(matmul, "fp32_precision") else matmul.allow_tf32
    return "tf32" if tf32 else "ieee"


if triton is not None:

    @triton.jit
    def _probabilities(q, k, i, j, LQ, P, scale, CAUSAL: tl.constexpr, SHIFT: tl.constexpr,
                       WINDOW: tl.constexpr, PRECISION: tl.constexpr):
        """Softmax of the allowed scores ``[BQ, BK]`` (fp32); zero outside the allowed pairs and padded rows."""
        pos = i + P  # each query's position among the P + LQ keys
        ok = (i[:, None] < LQ) & (j[None, :] < P + LQ)
        if CAUSAL:
            ok = ok & (j[None, :] <= pos[:, None] + SHIFT)
        if WINDOW > 0:
            ok = ok & (j[None, :] > pos[:, None] - WINDOW)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (scale * 1.4426950408889634)  # log2 units
        s = tl.where(ok, s, float("-inf"))
        m = tl.max(s, 1)
        m = tl.where(m == float("-inf"), 0.0, m)  # padded query rows: no allowed key
        p = tl.where(ok, tl.math.exp2(s - m[:, None]), 0.0)
        total = tl.sum(p, 1)
        return p / tl.where(total > 0, total, 1.0)[:, None]

    @triton.jit
    def _offsets(z, h, i, j, e, LQ, P, E, s_n, s_l, s_3, s_h, s_e, sp_n, sp_h, sp_p, sp_e):
        """Element offsets and masks of one (sequence ``z``, head ``h``): its queries and this call's keys in the
        projection's layout (the keys' offsets are the queries' plus ``s_3``, the values' plus ``2 s_3``), its
        cached keys/values in theirs."""
        q_at = z * s_n + h * s_h + i[:, None] * s_l + e[None, :] * s_e  # [BQ, BE]
        in_q = (i[:, None] < LQ) & (e[None, :] < E)
        k_at = z * s_n + h * s_h + s_3 + (j[:, None] - P) * s_l + e[None, :] * s_e  # [BK, BE]
        new = (j[:, None] >= P) & (j[:, None] < P + LQ) & (e[None, :] < E)  # key j is this call's position j - P
        past_at = z * sp_n + h * sp_h + j[:, None] * sp_p + e[None, :] * sp_e
        old = (j[:, None] < P) & (e[None, :] < E)  # key j is cached
        return q_at, in_q, k_at, new, past_at, old

    @triton.jit
    def _tiles(QKV, PK, PV, q_at, in_q, k_at, new, s_3, past_at, old, HAS_PAST: tl.constexpr):
        """q ``[BQ, BE]``, k and v ``[BK, BE]``: cached positions first, then this call's; zero where padded."""
        q = tl.load(QKV + q_at, mask=in_q, other=0.0)
        k = tl.load(QKV + k_at, mask=new, other=0.0)
        v = tl.load(QKV + k_at + s_3, mask=new, other=0.0)
        if HAS_PAST:  # the two masks never overlap
            k += tl.load(PK + past_at, mask=old, other=0.0)
            v += tl.load(PV + past_at, mask=old, other=0.0)
        return q, k, v

    @triton.jit
    def _attention_fwd(
        QKV, PK, PV, O,
        s_n, s_l, s_3, s_h, s_e,  # qkv [n, LQ, 3, H, E]
        sp_n, sp_h, sp_p, sp_e,  # past keys and values [n, H, P, E]
        so_n, so_l, so_h, so_e,  # out [n, LQ, H, E]
        H, LQ, P, E, scale,
        CAUSAL: tl.constexpr, SHIFT: tl.constexpr, WINDOW: tl.constexpr, HAS_PAST: tl.constexpr,
        BQ: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        z, h = pid // H, pid % H
        i, j, e = tl.arange(0, BQ), tl.arange(0, BK), tl.arange(0, BE)
        q_at, in_q, k_at, new, past_at, old = _offsets(z, h, i, j, e, LQ, P, E, s_n, s_l, s_3, s_h, s_e,
                                                       sp_n, sp_h, sp_p, sp_e)
        q, k, v = _tiles(QKV, PK, PV, q_at, in_q, k_at, new, s_3, past_at, old, HAS_PAST)
        p = _probabilities(q, k, i, j, LQ, P, scale, CAUSAL, SHIFT, WINDOW, PRECISION)
        o = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        tl.store(O + z * so_n + h * so_h + i[:, None] * so_l + e[None, :] * so_e, o.to(O.dtype.element_ty), mask=in_q)

    @triton.jit
    def _attention_bwd(
        QKV, PK, PV, DO, DQKV, DPK, DPV,
        s_n, s_l, s_3, s_h, s_e,  # qkv and its gradient [n, LQ, 3, H, E]
        sp_n, sp_h, sp_p, sp_e,  # past keys/values and their gradients [n, H, P, E]
        so_n, so_l, so_h, so_e,  # the output's gradient [n, LQ, H, E]
        H, LQ, P, E, scale,
        CAUSAL: tl.constexpr, SHIFT: tl.constexpr, WINDOW: tl.constexpr, HAS_PAST: tl.constexpr,
        BQ: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        z, h = pid // H, pid % H
        i, j, e = tl.arange(0, BQ), tl.arange(0, BK), tl.arange(0, BE)
        q_at, in_q, k_at, new, past_at, old = _offsets(z, h, i, j, e, LQ, P, E, s_n, s_l, s_3, s_h, s_e,
                                                       sp_n, sp_h, sp_p, sp_e)
        q, k, v = _tiles(QKV, PK, PV, q_at, in_q, k_at, new, s_3, past_at, old, HAS_PAST)
        do = tl.load(DO + z * so_n + h * so_h + i[:, None] * so_l + e[None, :] * so_e, mask=in_q, other=0.0)
        p = _probabilities(q, k, i, j, LQ, P, scale, CAUSAL, SHIFT, WINDOW, PRECISION)  # [BQ, BK] fp32
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)  # [BK, BE]
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BQ, BK]
        ds = p * (dp - tl.sum(p * dp, 1)[:, None]) * scale  # softmax backward, times the score scale
        dq = tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)  # [BQ, BE]
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)  # [BK, BE]
        out_ty = DQKV.dtype.element_ty
        tl.store(DQKV + q_at, dq.to(out_ty), mask=in_q)
        tl.store(DQKV + k_at, dk.to(out_ty), mask=new)
        tl.store(DQKV + k_at + s_3, dv.to(out_ty), mask=new)
        if HAS_PAST:
            tl.store(DPK + past_at, dk.to(DPK.dtype.element_ty), mask=old)
            tl.store(DPV + past_at, dv.to(DPV.dtype.element_ty), mask=old)


def kernel_arguments(qkv: Tensor, past_k: Tensor | None, past_v: Tensor | None, mask: str, window: int,
                     tensors: tuple[Tensor, ...], out_strides: tuple[int, ...]) -> tuple[tuple, dict]:
    """``(positional arguments, keyword arguments with the grid)`` of either kernel."""
    n, lq, _, h, e = qkv.shape
    p = 0 if past_k is None else past_k.shape[2]
    if past_k is not None and (past_k.stride() != past_v.stride() or past_k.shape != past_v.shape):
        raise ValueError("temporal attention: cached keys and values need the same shape and strides")
    if mask not in SHIFTS:
        raise ValueError(f"temporal attention mask must be one of {tuple(SHIFTS)}, got {mask!r}")
    if any(t is not None and t.dtype != qkv.dtype for t in (past_k, past_v, *tensors)):
        raise ValueError("temporal attention: qkv, cached keys/values and gradients need one dtype")
    pasts = (qkv, qkv) if past_k is None else (past_k, past_v)  # unused pointers where there is no past
    past_strides = (0, 0, 0, 0) if past_k is None else past_k.stride()
    meta = dict(CAUSAL=mask != "none", SHIFT=SHIFTS[mask], WINDOW=window if mask == "causal" else 0,
                HAS_PAST=past_k is not None, BQ=_block(lq), BK=_block(p + lq), BE=_block(e),
                PRECISION=_precision(qkv.dtype))
    meta["num_warps"] = 4 if meta["BK"] * meta["BE"] >= 2048 else 2
    meta["enable_fp_fusion"] = True  # fused multiply-adds
    args = (qkv, *pasts, *tensors, *qkv.stride(), *past_strides, *out_strides, h, lq, p, e, 1.0 / math.sqrt(e))
    return args, {**meta, "grid": (n * h,)}


def _launch(kernel, *arguments) -> None:
    """Run ``kernel`` with :func:`kernel_arguments` of ``arguments`` on their device."""
    qkv = arguments[0]
    if triton is None:
        raise RuntimeError("temporal_attention=triton needs the triton package (pip install triton)")
    args, meta = kernel_arguments(*arguments)  # bad arguments are refused whatever the device
    if qkv.device.type != _device():
        raise RuntimeError("temporal_attention=triton: Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on "
                           "CPU tensors" if interpreting() else "temporal_attention=triton runs on CUDA tensors (or "
                           "on the CPU with TRITON_INTERPRET=1 set before lwm is imported)")
    grid = meta.pop("grid")
    with torch.cuda.device(qkv.device) if qkv.is_cuda else contextlib.nullcontext():
        kernel[grid](*args, **meta)


def _one_layout(past_k: Tensor | None, past_v: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Cached keys and values with one set of strides (the kernel reads both with one)."""
    if past_k is not None and past_k.stride() != past_v.stride():
        return past_k.contiguous(), past_v.contiguous()
    return past_k, past_v


@torch.library.custom_op("lwm::temporal_attention", mutates_args=())
def temporal_attention(qkv: Tensor, past_k: Tensor | None, past_v: Tensor | None, mask: str, window: int) -> Tensor:
    """Attention over the ``LQ`` positions of ``qkv [n, LQ, 3, heads, e]`` (the projection's output) after ``p``
    cached positions ``past_k``/``past_v [n, heads, p, e]`` (or None) -> ``[n, LQ, heads, e]``."""
    n, lq, _, h, e = qkv.shape
    out = qkv.new_empty(n, lq, h, e)
    past_k, past_v = _one_layout(past_k, past_v)
    _launch(_attention_fwd, qkv, past_k, past_v, mask, window, (out,), out.stride())
    return out


@temporal_attention.register_fake
def _(qkv: Tensor, past_k: Tensor | None, past_v: Tensor | None, mask: str, window: int) -> Tensor:
    n, lq, _, h, e = qkv.shape
    return qkv.new_empty(n, lq, h, e)


@torch.library.custom_op("lwm::temporal_attention_backward", mutates_args=())
def temporal_attention_backward(grad: Tensor, qkv: Tensor, past_k: Tensor | None, past_v: Tensor | None, mask: str,
                                window: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`temporal_attention` for ``grad [n, LQ, heads, e]``: ``(d qkv, d past_k, d past_v)`` (the
    last two empty without a past)."""
    # the kernel reads each input and writes its gradient with one set of strides: all contiguous (as the fake says)
    qkv = qkv.contiguous()
    dqkv = torch.empty_like(qkv)
    dpk, dpv = qkv.new_empty(0), qkv.new_empty(0)
    if past_k is not None:
        past_k, past_v = past_k.contiguous(), past_v.contiguous()
        dpk, dpv = torch.empty_like(past_k), torch.empty_like(past_v)
    _launch(_attention_bwd, qkv, past_k, past_v, mask, window, (grad, dqkv, dpk if past_k is not None else dqkv,
            dpv if past_v is not None else dqkv), grad.stride())
    return dqkv, dpk, dpv


@temporal_attention_backward.register_fake
def _(grad: Tensor, qkv: Tensor, past_k: Tensor | None, past_v: Tensor | None, mask: str,
      window: int) -> tuple[Tensor, Tensor, Tensor]:
    contiguous = torch.contiguous_format
    return (torch.empty_like(qkv, memory_format=contiguous),
            torch.empty_like(past_k, memory_format=contiguous) if past_k is not None else qkv.new_empty(0),
            torch.empty_like(past_v, memory_format=contiguous) if past_v is not None else qkv.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    qkv, past_k, past_v, mask, window = inputs
    ctx.save_for_backward(qkv, past_k, past_v)
    ctx.mask, ctx.window = mask, window


def _backward(ctx, grad: Tensor):
    qkv, past_k, past_v = ctx.saved_tensors
    dqkv, dpk, dpv = temporal_attention_backward(grad, qkv, past_k, past_v, ctx.mask, ctx.window)
    return dqkv, dpk if past_k is not None else None, dpv if past_v is not None else None, None, None


temporal_attention.register_autograd(_backward, setup_context=_setup_context)

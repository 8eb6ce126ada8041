"""Temporal attention at the base size: many short sequences (B*N patches x T frames). Compares
formulations side by side and reports achieved memory bandwidth against the bytes that must move, as a
share of the device's copy bandwidth measured in the same run (the issue's "70% of memory bandwidth").

    python benchmarks/temporal_attention.py [--batch 32] [--frames 16] [--patches 256] [--dim 512] [--heads 8]
                                            [--cached 2] [--backward]

Bytes that must move: forward, q, k, v read once and the output written once (4 x q's size); forward +
backward (``--backward``), also the output and its gradient read and dq, dk, dv written (12 x). The copy
bandwidth is a large ``dst.copy_(src)`` (2 x its size moved). Also timed: the shapes of a rollout pass that
reuses ``--cached`` positions (queries after cached keys: SDPA with a bool mask, as the model does now, and
with ``causal_lower_right``, which lets the fused kernels take the offset causal mask without a mask tensor).
The last column checks every formulation against fp32 SDPA.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lwm.modules.st_transformer import temporal_mask


SPEC_GBS = {"H100 80GB HBM3": 3350.0, "H200": 4800.0}  # by name: the H100 SXM's HBM3, the H200's HBM3e


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    n = (1 << 30) if device == "cuda" else (1 << 25)  # 2 GiB of bf16 on a GPU
    src = torch.empty(n, device=device, dtype=torch.bfloat16).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() * src.element_size() / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--patches", type=int, default=256)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--cached", type=int, default=2, help="cached positions of the rollout-pass shapes (0: skip)")
    p.add_argument("--backward", action="store_true", help="time forward + backward (training) instead of forward")
    p.add_argument("--spec-gbs", type=float, help="the device's specified memory bandwidth in GB/s (default: 3350 "
                                                   "on an H100 SXM, 4800 on an H200; else not shown)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n, h, t, e = args.batch * args.patches, args.heads, args.frames, args.dim // args.heads
    grad = args.backward
    q, k, v = (torch.randn(n, h, t, e, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
    leaves = [q, k, v]  # every input a variant differentiates: their gradients are reset before each backward
    allowed = temporal_mask("causal", t, q.device)
    bias = torch.zeros(t, t, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))

    def manual(q, k, v, bias=bias):
        w = (q @ k.transpose(-2, -1)) * e**-0.5 + bias
        return w.softmax(-1) @ v

    compiled_manual = torch.compile(manual) if device == "cuda" else manual
    variants = {
        "sdpa is_causal": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), q),
        "sdpa bool mask": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), q),
        "matmul+softmax (eager)": (lambda: manual(q, k, v), q),
        "matmul+softmax (compiled)": (lambda: compiled_manual(q, k, v), q),
    }
    c = args.cached
    if 0 < c < t:  # a rollout pass: t - c new queries after c cached keys
        from torch.nn.attention.bias import causal_lower_right

        qp = q.detach()[:, :, c:].contiguous().requires_grad_(grad)  # the same queries: the same answers
        leaves.append(qp)
        rows = allowed[c:]
        variants[f"pass: sdpa bool mask ({t - c} q, {c} cached)"] = (
            lambda: F.scaled_dot_product_attention(qp, k, v, attn_mask=rows), qp)
        variants[f"pass: sdpa causal_lower_right ({t - c} q, {c} cached)"] = (
            lambda: F.scaled_dot_product_attention(qp, k, v, attn_mask=causal_lower_right(t - c, t)), qp)
        pass_bias = bias[c:]
        variants[f"pass: matmul+softmax (compiled) ({t - c} q, {c} cached)"] = (
            lambda: compiled_manual(qp, k, v, pass_bias), qp)

    douts: dict[tuple, torch.Tensor] = {}  # the output gradient, made once per variant (in its warm-up calls)

    def run(fn):
        out = fn()
        if grad:
            for leaf in leaves:  # written, not added to the last repetition's (which would read and write them again)
                leaf.grad = None
            key = (out.shape, out.stride())
            if key not in douts:
                douts[key] = torch.ones_like(out)  # (ones_like keeps the layout)
            out.backward(douts[key])
        return out

    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    spec = args.spec_gbs or SPEC_GBS.get(next((k for k in SPEC_GBS if k in name), None))
    print(f"{name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; q/k/v [{n}, {h}, {t}, {e}] {dtype}; "
          f"{'forward + backward' if grad else 'forward'}; copy bandwidth {bandwidth / 1e9:.0f} GB/s"
          f"{f'; specified {spec:.0f} GB/s' if spec else ''}")
    print("variant | ms | GB/s (min bytes) | % of copy bandwidth | % of specified | TFLOP/s (full square) | "
          "rel. error vs fp32")
    for label, (fn, query) in variants.items():
        queries = query.shape[2]
        # forward: q, k, v read, out written; backward: q, k, v, out, dout read, dq, dk, dv written
        q_bytes, kv_bytes = query.numel() * query.element_size(), 2 * k.numel() * k.element_size()
        moved = 2 * q_bytes + kv_bytes if not grad else 6 * q_bytes + 3 * kv_bytes
        flops = 4 * n * h * queries * t * e * (3 if grad else 1)  # two matmuls (backward: twice the forward)
        with torch.no_grad():
            out = fn()
        expected = ref[:, :, t - queries:]
        err = ((out.float() - expected).norm() / expected.norm()).item()
        s = timed(lambda: run(fn))
        print(f"{label} | {s * 1e3:.3f} | {moved / s / 1e9:.0f} | {moved / s / bandwidth:.0%} | "
              f"{f'{moved / s / 1e9 / spec:.0%}' if spec else '-'} | {flops / s / 1e12:.1f} | {err:.2e}")


if __name__ == "__main__":
    main()

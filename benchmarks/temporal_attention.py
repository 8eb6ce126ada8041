"""Temporal attention at the base size: many short sequences (B*N patches x T frames). Compares
formulations side by side and reports achieved memory bandwidth against the bytes that must move
(q, k, v read once, output written once).

    python benchmarks/temporal_attention.py [--batch 32] [--frames 16] [--dim 512] [--heads 8]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lwm.modules.st_transformer import temporal_mask


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--patches", type=int, default=256)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n, h, t, e = args.batch * args.patches, args.heads, args.frames, args.dim // args.heads
    q, k, v = (torch.randn(n, h, t, e, device=device, dtype=dtype) for _ in range(3))
    allowed = temporal_mask("causal", t, q.device)
    bias = torch.zeros(t, t, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))

    def manual():
        w = (q @ k.transpose(-2, -1)) * e**-0.5 + bias
        return w.softmax(-1) @ v

    compiled_manual = torch.compile(manual) if device == "cuda" else manual
    variants = {
        "sdpa is_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
        "matmul+softmax (eager)": manual,
        "matmul+softmax (compiled)": compiled_manual,
    }
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    bytes_moved = 4 * q.numel() * q.element_size()  # q, k, v in, out written
    flops = 4 * n * h * t * t * e  # two matmuls, full (not halved for the mask)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; q/k/v [{n}, {h}, {t}, {e}] {dtype}")
    print("variant | ms | GB/s (min bytes) | TFLOP/s (full) | rel. error vs fp32 (norm)")
    for label, fn in variants.items():
        out = fn()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        s = timed(fn)
        print(f"{label} | {s * 1e3:.3f} | {bytes_moved / s / 1e9:.0f} | {flops / s / 1e12:.1f} | {err:.2e}")


if __name__ == "__main__":
    main()

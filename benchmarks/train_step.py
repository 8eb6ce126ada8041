"""Time one WorldModel training step (forward with TF + rollouts, backward, AdamW) in plain PyTorch.

    python benchmarks/train_step.py --size base --batch 8 16 32 --precision fp32 bf16 [--compile]

Prints one table (ms/step, frames/s, peak memory) and checks on the way that the quantizers stayed fp32
and the loss is finite. Sizes: ``tiny`` (CPU smoke) and ``base`` (D=512, 8 heads, 3 blocks each, T=16).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lwm.modules.world_model import WorldModel

SIZES = {
    "tiny": dict(model=dict(height=16, width=16, d_model=64, n_heads=4, d_code_action=16, d_code_world=16,
                            codebook_sizes_action=(4, 8), codebook_sizes_world=(4, 8)), frames=6),
    "base": dict(model=dict(d_model=512, n_heads=8), frames=16),
}


def bench(size: str, batch: int, precision: str, compile_: bool, steps: int, warmup: int, device: str) -> dict:
    cfg = SIZES[size]
    torch.manual_seed(0)
    model = WorldModel(**cfg["model"]).to(device)
    if compile_:
        model.compile()
    fused = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    C, H, W = model.in_channels, model.height, model.width
    x = torch.rand(batch, cfg["frames"], C, H, W, device=device) * 2 - 1
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step(i: int) -> torch.Tensor:
        with autocast:
            loss, _ = model(x, step=i)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for i in range(warmup):
        loss = step(i)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss = step(i)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    fp32_buffers = all(
        b.dtype == torch.float32 for q in model.quantizers.values() for b in q.buffers() if b.is_floating_point()
    )
    return dict(
        size=size, batch=batch, frames=cfg["frames"], precision=precision, compile=compile_,
        ms_per_step=round(elapsed * 1e3, 2), frames_per_s=round(batch * cfg["frames"] / elapsed, 1),
        peak_mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
        loss=round(loss.item(), 5), finite=bool(torch.isfinite(loss)), quantizers_fp32=fp32_buffers,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--batch", type=int, nargs="+", default=[2])
    p.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32"])
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd model")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for batch in args.batch:
        for precision in args.precision:
            for compile_ in [False, True] if args.compile else [False]:
                try:
                    rows.append(bench(args.size, batch, precision, compile_, args.steps, args.warmup, device))
                except torch.OutOfMemoryError:
                    rows.append(dict(size=args.size, batch=batch, precision=precision, compile=compile_, error="OOM"))
                    torch.cuda.empty_cache()
                print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    keys = ["size", "batch", "frames", "precision", "compile", "ms_per_step", "frames_per_s", "peak_mem_gb", "loss",
            "quantizers_fp32"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, r.get("error", ""))) for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

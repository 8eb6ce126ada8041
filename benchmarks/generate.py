"""Generation speed: frames per second of WorldModel.generate, cached vs uncached, by batch and rollout length.

    python benchmarks/generate.py [--size tiny|base] [--batch 1 32] [--frames 16 64 256] [--window 15]
                                  [--precision fp32|bf16] [--temporal-attention sdpa|matmul]

One context frame, random actions and world code; rollouts longer than ``--window`` slide it (the base
predictor is trained on 15-frame inputs). Prints a markdown table; the cached/uncached ratio is the result.
"""

from __future__ import annotations

import argparse
import time
from datetime import date

import torch

from lwm.modules.st_transformer import ATTENTION_KERNELS
from lwm.modules.world_model import WorldModel

SIZES = {
    "tiny": dict(in_channels=16, height=64, width=64, d_model=64, n_heads=4, depth_action=2, depth_world=2,
                 depth_dynamics=2, d_code_action=8, d_code_world=8, codebook_sizes_action=(4, 8),
                 codebook_sizes_world=(4, 8)),
    "base": dict(),
}


def time_generate(model: WorldModel, batch: int, frames: int, window: int, cached: bool, device: str) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    context = torch.rand(batch, 1, model.config.in_channels, model.config.height, model.config.width, device=device, generator=g) * 2 - 1
    actions = torch.randn(batch, frames, model.config.d_code_action, device=device, generator=g)
    world = torch.randn(batch, model.config.d_code_world, device=device, generator=g)
    model.generate(context, actions, world, steps=min(frames, 4), window=window, use_cache=cached)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(context, actions, world, steps=frames, window=window, use_cache=cached)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--frames", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--window", type=int, default=15)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--uncached-max", type=int, default=64, help="skip uncached rollouts longer than this (quadratic)")
    parser.add_argument("--temporal-attention", choices=ATTENTION_KERNELS, default="sdpa",
                        help="the temporal-attention kernel (model.net.temporal_attention)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = WorldModel(**SIZES[args.size], temporal_attention=args.temporal_attention).to(device).eval()
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{name}, torch {torch.__version__}, {date.today()}, size {args.size}, {args.precision}, window {args.window}, "
          f"temporal attention {args.temporal_attention}")
    print("| batch | frames | cached frames/s | uncached frames/s | speed-up |\n|---|---|---|---|---|")
    with autocast:
        for batch in args.batch:
            for frames in args.frames:
                fast = time_generate(model, batch, frames, args.window, True, device)
                if frames > args.uncached_max:
                    print(f"| {batch} | {frames} | {batch * frames / fast:.1f} | (skipped) | |")
                    continue
                slow = time_generate(model, batch, frames, args.window, False, device)
                print(f"| {batch} | {frames} | {batch * frames / fast:.1f} | {batch * frames / slow:.1f} | {slow / fast:.2f}x |")


if __name__ == "__main__":
    main()

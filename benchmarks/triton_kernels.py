"""Compile lwm's Triton temporal-attention kernels for a GPU architecture, with or without that GPU, and print
what each configuration costs: registers and local-memory spill per thread, shared memory per program, warps.

    python benchmarks/triton_kernels.py [--arch 90] [--dtype bf16 fp32] [--shapes 16,0,64 16,4,64 ...]

A shape is ``queries,cached,head size``; every mask (none, causal with and without a window, shifted_causal),
with and without cached keys as the shape says, forward and backward. Without a GPU Triton still compiles to a
cubin (its bundled ptxas) when told the target: this checks on any machine that the kernels compile for an H100
(sm_90), and that the largest tiles ``triton_attention.supported`` admits fit without spilling. Exit status 1 when a
configuration fails to compile, spills, or needs more shared memory than the architecture has; 2 when this
Triton cannot compile here.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":  # compiled kernels, not the interpreter's
    os.environ["TRITON_INTERPRET"] = "0"

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHARED_MEMORY = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}  # bytes per block


class OfflineDriver:
    """Just enough of Triton's driver to compile for ``arch`` on a machine without that GPU."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return None


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread of a cubin, from the cuobjdump Triton ships."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"lwm_kernel_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    try:
        text = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                              check=True).stdout
    finally:
        path.unlink(missing_ok=True)
    return int(re.search(r"REG:(\d+)", text).group(1)), int(re.search(r"STACK:(\d+)", text).group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--shapes", nargs="+", default=["16,0,64", "15,1,64", "1,15,64", "64,0,64", "32,0,64", "16,0,16"],
                   help="queries,cached,head size (the defaults: base training, a rollout pass, generation, the "
                        "largest bf16 and fp32 tiles admitted, the tiny configs)")
    args = p.parse_args(argv)

    from lwm.modules import triton_attention as ta

    offline = not torch.cuda.is_available()
    try:
        import triton
        from triton.runtime import driver

        if offline:
            driver.set_active(OfflineDriver(args.arch))
    except (ImportError, AttributeError) as error:  # no triton, or one whose driver API differs
        print(f"cannot compile here: {error}")
        return 2
    limit = SHARED_MEMORY.get(args.arch)
    print(f"triton {triton.__version__}, sm_{args.arch}{' (compiled offline: no GPU here)' if offline else ''}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("kernel | dtype | queries, cached, head | mask | warps | registers | spill bytes | shared bytes | s")
    failures = 0
    for shape in args.shapes:
        lq, cached, e = (int(v) for v in shape.split(","))
        for name in args.dtype:
            dtype, n, h = DTYPES[name], 2, args.heads
            if not ta.fits(dtype, lq + cached, e):
                print(f"- | {name} | {shape} | - | not admitted (the model uses the matmul form there)")
                continue
            qkv = torch.zeros(n, lq, 3, h, e, dtype=dtype)
            past = [torch.zeros(n, h, cached, e, dtype=dtype) for _ in range(2)] if cached else [None, None]
            out = qkv.new_empty(n, lq, h, e)
            masks = [("causal", 0), ("causal", 3), ("shifted_causal", 0), ("none", 0)]
            for mask, window in masks if not cached else masks[:2]:
                for kernel, tensors in (("fwd", (out,)), ("bwd", (out, torch.empty_like(qkv), *(past if cached else [qkv, qkv])))):
                    start = time.perf_counter()
                    try:
                        positional, meta = ta.kernel_arguments(qkv, *past, mask, window, tensors, out.stride())
                        fn = ta._attention_fwd if kernel == "fwd" else ta._attention_bwd
                        compiled = fn.warmup(*positional, **meta)
                        registers, spill = resources(compiled.asm["cubin"])
                        shared = compiled.metadata.shared
                    except Exception as error:  # noqa: BLE001 - reported per configuration
                        failures += 1
                        print(f"{kernel} | {name} | {shape} | {mask} w{window} | FAILED: {str(error).splitlines()[0][:200]}")
                        continue
                    bad = spill > 0 or (limit is not None and shared > limit)
                    failures += bad
                    print(f"{kernel} | {name} | {shape} | {mask} w{window} | {meta['num_warps']} | {registers} | {spill} | "
                          f"{shared} | {time.perf_counter() - start:.1f}{'  <- spills or too much shared memory' if bad else ''}")
    print("all compiled without spilling" if not failures else f"{failures} configuration(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

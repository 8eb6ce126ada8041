"""Training-loader throughput: windows/s that ``LatentDataModule.train_dataloader()`` delivers from h5 files.

    python benchmarks/data_loader.py [--workers 0 1 2] [--context fork spawn] [--layout contiguous [chunked]]
                                     [--cache hot cold] [--files 32 --frames 200 --dtype float16]
                                     [--window 16 --batch 32 --batches 50] [--dir DIR] [--json rows.json]

Writes a synthetic dataset in the real format (``latents [T, 16, 64, 64]`` in [-1, 1], ``actions [T]`` int64,
a ``world_label`` attribute) into a temp dir (or ``--dir``), indexes it with ``index_directory`` and times
``--batches`` batches of the train loader (rank 0 of 1, no pinning) after ``--warmup`` batches (default: enough
to start the workers and drain what they prefetched). The consumer does nothing with a batch (``--copy``: copies
it once, as ``pin_memory`` would), so the numbers are the loader's ceiling, not what it delivers beside a training
step sharing the same CPUs.

Cache: ``hot`` reads files already in the OS page cache (they are, after writing and indexing). ``cold`` evicts
them (``posix_fadvise(DONTNEED)``) after the warm-up, so the timed batches start from disk; the windows are
random, so later batches re-read cached pages: "cold-ish". A host below a VM may still cache the disk.

MB/s counts the bytes read from the files (``--dtype``). ``--batch-dtype file float32`` times the loader as lwm
runs it (float16 files give float16 batches, cast to float32 on the GPU) beside converting in the loader.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

import h5py
import numpy as np
import torch

from lwm.data.datamodule import LatentDataModule
from lwm.data.manifest import index_directory

C, H, W = 16, 64, 64
LAYOUTS = ("contiguous", "chunked")


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = ""
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        kb = int(next(ln for ln in meminfo if ln.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{model}, nproc {usable}{mem}, load avg {load} (1/5/15 min, at the end), {platform.system()} "
            f"{platform.release()}, torch {torch.__version__}, h5py {h5py.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def make_dataset(directory: Path, files: int, frames: int, dtype: str, layout: str, seed: int = 0) -> Path:
    """``files`` h5 files of ``frames`` frames under ``directory``; returns the manifest path."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    chunks = (1, C, H, W) if layout == "chunked" else None  # one frame per chunk
    for i in range(files):
        x = rng.uniform(-1, 1, size=(frames, C, H, W)).astype(dtype)
        with h5py.File(directory / f"ep{i:04d}.h5", "w") as f:
            f.create_dataset("latents", data=x, chunks=chunks)
            f["actions"] = rng.integers(0, 8, size=frames)
            f.attrs["world_label"] = i % 4
    os.sync()  # no writeback of the fresh files during the first timed row
    return index_directory(directory, val_fraction=0.1, seed=seed).path


def evict(paths: list[str]) -> None:
    """Drop the files' pages from the OS page cache (flushes dirty pages first; only clean pages can go)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of this process (all threads) and of the processes ``pids`` (the live workers)."""
    total = time.process_time()
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def bench(manifest: Path, workers: int, context: str | None, window: int, batch: int, batches: int,
          warmup: int | None, cold: bool, itemsize: int, copy: bool = False, float16_batches: bool = True) -> dict:
    prefetch = 4  # LatentDataModule's prefetch_factor
    if warmup is None:  # first batch (worker start) + what the workers prefetched meanwhile
        warmup = 2 + prefetch * workers
    dm = LatentDataModule(str(manifest), window=window, batch_size=batch, num_workers=workers,
                          val_size_percent=0.0, batches_per_epoch=warmup + batches, check_files=False,
                          multiprocessing_context=context, pin_memory=False, float16_batches=float16_batches)
    loader = dm.train_dataloader()
    t_start = time.perf_counter()
    it = iter(loader)
    first = None  # seconds to the first batch (measured within the warmup; none without one)
    for i in range(warmup):
        b = next(it)
        if i == 0:
            first = time.perf_counter() - t_start
    if cold:
        evict(dm.train_set.paths)
    inner = loader._iterator  # ResumableDataLoader iterates a generator over the (persistent) worker iterator
    pids = [w.pid for w in getattr(inner, "_workers", [])]
    buf = None
    c0, t0 = cpu_seconds(pids), time.perf_counter()
    for _ in range(batches):
        b = next(it)
        if copy:  # what pin_memory does on a GPU host: one copy of the batch in the main process
            if buf is None:
                buf = torch.empty_like(b["latents"])
            buf.copy_(b["latents"])
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pids) - c0
    assert b["latents"].shape == (batch, window, C, H, W)
    batch_dtype = str(b["latents"].dtype).removeprefix("torch.")
    it.close()
    if hasattr(inner, "_shutdown_workers"):
        inner._shutdown_workers()
    loader._iterator = None
    del it, inner, b
    dm.teardown("fit")
    del loader, dm
    gc.collect()  # else a cyclic leftover iterator is copied into the next forked workers and collected there
    windows_s = batches * batch / elapsed
    return dict(workers=workers, context=context or "-", cache="cold" if cold else "hot", batches=batch_dtype,
                windows_per_s=round(windows_s, 1), mb_per_s=round(windows_s * window * C * H * W * itemsize / 1e6, 1),
                ms_per_batch=round(elapsed / batches * 1e3, 1), cpu_ms_per_batch=round(cpu / batches * 1e3, 1),
                first_batch_s=round(first, 2) if first is not None else None, warmup=warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--context", nargs="+", choices=["fork", "spawn", "forkserver"], default=["fork", "spawn"],
                   help="start methods timed for workers > 0")
    p.add_argument("--layout", nargs="+", choices=LAYOUTS, default=["contiguous"],
                   help="h5 latents layout(s): contiguous, chunked (one frame per chunk); each adds a dataset")
    p.add_argument("--cache", nargs="+", choices=["hot", "cold"], default=["hot", "cold"])
    p.add_argument("--full-grid", action="store_true",
                   help="every (layout, workers, context, cache); default: only the first layout's hot rows "
                        "get every (workers, context), the others the fewest and most workers, first context")
    p.add_argument("--files", type=int, default=32)
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=50, help="timed batches per row")
    p.add_argument("--warmup", type=int, default=None, help="untimed batches (default: 2 + 4 * workers)")
    p.add_argument("--copy", action="store_true",
                   help="copy each batch's latents into a reused buffer in the main process (as pin_memory would)")
    p.add_argument("--need", type=float, default=100.0,
                   help="windows/s the GPU step consumes (base model, H100, compile: ~1600 frames/s = 100 windows/s)")
    p.add_argument("--dir", help="write the dataset here (kept) instead of a temp dir (removed)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--batch-dtype", nargs="+", choices=["file", "float32"], default=["file", "float32"],
                   help="file: float16 files give float16 batches (lwm's default, cast on the GPU); float32: "
                        "converted in the loader (before); both: side by side")
    args = p.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="lwm_loader_bench_")
    root = Path(args.dir or tmp.name)
    itemsize = np.dtype(args.dtype).itemsize
    rows = []
    try:
        for layout in args.layout:
            t = time.perf_counter()
            manifest = make_dataset(root / f"{layout}_{args.dtype}", args.files, args.frames, args.dtype, layout)
            size = sum(f.stat().st_size for f in manifest.parent.glob("*.h5")) / 1e6
            print(f"# {layout}: {args.files} files x {args.frames} frames, {size:.0f} MB, written and indexed in "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
            for workers in args.workers:
                for context in args.context if workers > 0 else [None]:
                    for cache in args.cache:
                        full = args.full_grid or (layout == args.layout[0] and cache == args.cache[0])
                        if not full and (workers not in (min(args.workers), max(args.workers))
                                         or context not in (None, args.context[0])):
                            continue
                        for batch_dtype in args.batch_dtype:
                            row = dict(layout=layout, **bench(manifest, workers, context, args.window, args.batch,
                                                              args.batches, args.warmup, cache == "cold", itemsize,
                                                              args.copy, batch_dtype == "file"))
                            row["x_need"] = round(row["windows_per_s"] / args.need, 1)
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()

    print(f"\n{machine()}")
    print(f"window T={args.window}, batch {args.batch}, {args.dtype} files ({args.files} x {args.frames} frames), "
          f"{args.batches} timed batches per row after warm-up; float32 batches are "
          f"{args.batch * args.window * C * H * W * 4 / 2**20:.0f} MiB, float16 half that; the consumer "
          + ("copies the latents into a reused buffer (as pin_memory would)." if args.copy else "does no work."))
    print("hot = files in the OS page cache (repeated reads are memory copies, not disk); cold = evicted with "
          "posix_fadvise(DONTNEED) after warm-up, random windows then re-hit cached pages (cold-ish).")
    print(f"x need = windows/s / {args.need:g} (base model on an H100 with compile, T={args.window}). "
          "CPU ms/batch = user+sys CPU of the main process and its workers per timed batch: the cost that "
          "other load on the machine cannot inflate as much as it does wall time.\n")
    keys = ["layout", "workers", "context", "cache", "batches", "windows_per_s", "mb_per_s", "ms_per_batch", "cpu_ms_per_batch",
            "x_need", "first_batch_s"]
    heads = ["layout", "workers", "context", "cache", "batches", "windows/s", "MB/s (file)", "ms/batch", "CPU ms/batch", "x need",
             "1st batch s"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "|".join("---" for _ in heads) + "|")
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

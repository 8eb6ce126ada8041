"""Time a config's training step side by side: the raw model step, the same step in `lwm fit`, the data loader.

    python benchmarks/train_step.py [--config configs/demo.yaml] [--manifest M] [--steps 20] [--warmup 5]
        [--kernels matmul] [--profile] [--raw-only] [--max-batch [--memory-gib G] [--batch-step S]]
        [--peak-tflops P] [--json OUT.json] [--section.key=value ...]

Rows (each the mean over --steps timed steps after --warmup untimed ones; CUDA events on a GPU, no sync between):
  raw          WorldModel forward + backward + AdamW step in a plain loop, no Lightning, on a random batch already
               on the device: the config's precision, compile, gradient clipping, AdamW (fused on a GPU)
  raw, eager   the same without compile, where the config compiles (the compile speed-up)
  raw, <kernel> the raw step with that temporal-attention kernel (--kernels)
  lwm fit      the real `lwm fit` run in this process for warmup + steps + 1 steps (Lightning, every callback,
               logging, checkpointing, the loader): each step from its batch start to the next, a validation's time
               left out (the StepTimer callback, added with --trainer.callbacks+=)
  loader       the config's LatentDataModule train loader alone: batches/s
then the fit's overhead over the raw step and the loader's share of a fit step (issue 44's targets: 10%, 5%).
FLOPs: one sample's useful count (lwm.modules.flops, as the ``flops`` callback logs it; Lightning's measure_flops
would count the CPU attention kernel as zero and every masked attention as dense) times the batch; MFU of the
device's peak for the precision (Lightning's get_available_flops, or --peak-tflops). Without --manifest the data is
a synthetic world made here at the config's size (lwm.data.synth; needs 16-channel square latents).
--profile prints torch.profiler's operator table of the raw step (and the host syncs it counts); graph breaks and
recompiles: run with TORCH_LOGS=graph_breaks,recompiles. --max-batch (GPU) finds the largest batch whose raw step
fits, doubling from data.batch_size then bisecting to --batch-step samples. --json writes every number, after
each row.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch

from lwm.cli.lightning_cli import read_config
from lwm.data.datamodule import LatentDataModule
from lwm.modules.flops import count_flops
from lwm.modules.world_model import WorldModel, WorldModelConfig
from lwm.training.optim import OptimConfig
from lwm.utils.errors import ConfigError, LwmError
from lwm.utils.threads import set_cpu_threads

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32}
TARGETS = {"fit": 0.10, "loader": 0.05}  # issue 44: the fit within 10% of the raw step, the loader <= 5% of a step


def mark(device: torch.device):
    """A point in time on ``device``'s stream (a CUDA event, else the host clock)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds(start, end) -> float:
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def intervals(marks: list) -> list[float]:
    return [seconds(a, b) for a, b in zip(marks, marks[1:])]


def timed(fn, steps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    marks = [mark(device)]
    for _ in range(steps):
        fn()
        marks.append(mark(device))
    return intervals(marks)


class StepTimer(L.Callback):
    """In ``lwm fit``: each step from ``warmup`` on (``steps`` of them), from its batch start to the next step's,
    less the time of a validation between them. The instances made in this process: :attr:`made`."""

    warmup, steps, made = 0, 0, []

    def __init__(self) -> None:
        self.marks: list = []
        self.validations: list[list] = []  # [start, end, the interval it falls in]
        StepTimer.made.append(self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step - self.warmup == len(self.marks) <= self.steps:  # (the first micro-batch of a step)
            self.marks.append(mark(pl_module.device))

    def on_validation_start(self, trainer, pl_module) -> None:
        if 0 < len(self.marks) <= self.steps:
            self.validations.append([mark(pl_module.device)])

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.validations and len(self.validations[-1]) == 1:
            self.validations[-1] += [mark(pl_module.device), len(self.marks) - 1]

    def times(self) -> list[float]:
        out = intervals(self.marks)
        for start, end, i in (v for v in self.validations if len(v) == 3):
            out[i] -= seconds(start, end)
        return out


class Bench:
    """The config read as ``lwm fit`` reads it, and its steps."""

    def __init__(self, args: argparse.Namespace, overrides: list[str]) -> None:
        self.args, self.overrides = args, overrides
        self.config = read_config(["--config", args.config, *overrides])
        model, trainer, self.data = self.config["model"], self.config["trainer"], self.config["data"]
        self.net, self.optim = WorldModelConfig(**model["net"]), OptimConfig(**model["optim"])
        self.compile, self.clip = bool(model.get("compile")), trainer.get("gradient_clip_val")
        self.batch, self.window = int(self.data["batch_size"]), int(self.data["window"])
        self.precision = str(trainer.get("precision") or "32-true")
        self.mixed = self.precision in ("16", "bf16") or self.precision.endswith("-mixed")  # autocast
        if not (self.mixed or self.precision.startswith("32")):
            raise ConfigError(f"trainer.precision {self.precision}: the raw step runs 32-true or a -mixed one")
        self.dtype = DTYPES[self.precision.split("-")[0]]
        cuda = torch.cuda.is_available() and str(trainer.get("accelerator", "auto")) != "cpu"
        self.device = torch.device("cuda" if cuda else "cpu")

    def step(self, net: WorldModelConfig | None = None, compile_: bool | None = None, batch: int | None = None):
        """The raw step: forward + backward + AdamW on a random batch on the device, as the Lightning module runs it."""
        net, batch = net or self.net, batch or self.batch
        torch.manual_seed(0)
        model = WorldModel(net).to(self.device).train()
        if self.compile if compile_ is None else compile_:
            torch._dynamo.reset()  # fresh caches: each compiled variant compiles anew
            model.compile_parts()
        fused = self.optim.fused if self.optim.fused is not None else self.device.type == "cuda"
        opt = self.optim.adamw(model.parameters(), fused=fused)
        c = net
        x = torch.rand(batch, self.window, c.in_channels, c.height, c.width, generator=torch.Generator().manual_seed(0))
        x = (x * 2 - 1).to(self.device)
        count = itertools.count()

        def step() -> None:
            i = next(count)
            with torch.autocast(self.device.type, self.dtype, enabled=self.mixed):
                loss = model.compute(x, i, world_phase=model.world_phase_at(i)).loss
            loss.backward()
            if self.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(self.clip))
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def flops(self) -> int:
        """Useful FLOPs of one training step: one sample's, times the batch (every counted op is linear in it)."""
        model = WorldModel(self.net).to(self.device).train()
        x = torch.rand(1, self.window, self.net.in_channels, self.net.height, self.net.width, device=self.device)

        def fn() -> None:
            with torch.autocast(self.device.type, self.dtype, enabled=self.mixed):
                loss = model.compute(x * 2 - 1, step=None).loss  # no codebook update
            loss.backward()

        with model.counting_form():  # the useful work, whichever kernel runs
            return count_flops(fn, dense=False).useful * self.batch

    def fit_times(self, manifest: str, root: str) -> list[float]:
        """The step times of the real ``lwm fit`` (in this process) of warmup + steps + 1 steps."""
        from lwm.cli.main import main as lwm

        StepTimer.warmup, StepTimer.steps, StepTimer.made = self.args.warmup, self.args.steps, []
        if self.compile:
            torch._dynamo.reset()  # the module compiles its parts anew
        rc = lwm(["fit", "--config", self.args.config, *self.overrides, f"--data.manifest={manifest}",
                  f"--trainer.default_root_dir={root}", f"--trainer.max_steps={self.args.warmup + self.args.steps + 1}",
                  f"--trainer.callbacks+={StepTimer.__module__}.StepTimer"])
        if rc:
            raise SystemExit(rc)
        return StepTimer.made[-1].times()

    def loader_times(self, manifest: str) -> list[float]:
        """Seconds of each batch of the config's train loader, alone (epochs one after another)."""
        dm = LatentDataModule(**{**self.data, "manifest": manifest})
        dm.setup("fit")
        batches = (b for _ in itertools.count() for b in dm.train_dataloader())
        return timed(lambda: next(batches), self.args.steps, self.args.warmup, torch.device("cpu"))

    def synth(self, out: Path) -> str:
        """A synthetic world at the config's latent size, with an epoch longer than the fit's steps."""
        from lwm.data.synth import make_dataset

        if self.net.in_channels != 16 or self.net.height != self.net.width:
            raise ConfigError(f"the synthetic world has [16, S, S] latents, this config [{self.net.in_channels}, "
                              f"{self.net.height}, {self.net.width}]: give --manifest")
        frames = max(16, 2 * self.window)
        windows = (self.args.warmup + self.args.steps + 2) * self.batch * 1.2  # (one file in 8 is held out)
        episodes = max(64, math.ceil(windows / (frames // self.window) / 0.875))
        manifest = make_dataset(out, episodes, frames, seed=0, size=2 * self.net.height)
        print(f"data: a synthetic world of {episodes} episodes x {frames} frames, made here", flush=True)
        return str(manifest)

    def fits(self, batch: int) -> bool:
        """Whether the raw step at ``batch`` runs in the GPU's memory (two steps: compiled, then warm)."""
        try:
            step = self.step(batch=batch)
            step(), step()
            torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            return False
        except RuntimeError as e:  # past CUDA's launch limits: too large too
            if "invalid configuration argument" not in str(e):
                raise
            return False
        finally:
            step = None
            gc.collect()
            torch.cuda.empty_cache()

    def max_batch(self, tried=lambda trials: None) -> tuple[int, list[dict]]:
        """The largest batch that fits (0: none), to ``--batch-step`` samples, and the trials (each told to
        ``tried``)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        if self.args.memory_gib:
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.args.memory_gib * 2**30 / total), self.device)
        limit = max(self.batch, 65535 // (self.net.grid[0] * self.net.grid[1]))  # temporal-attention sequences
        trials: list[dict] = []

        def fits(b: int) -> bool:
            trials.append({"batch": b, "fits": self.fits(b)})
            print(f"  batch {b}: {'fits' if trials[-1]['fits'] else 'does not fit'}", flush=True)
            tried(trials)
            return trials[-1]["fits"]

        try:
            low, high = 0, self.batch
            while fits(high):
                if high == limit:
                    return high, trials
                low, high = high, min(2 * high, limit)
            while high - low > self.args.batch_step:
                mid = (low + high) // 2
                low, high = (mid, high) if fits(mid) else (low, mid)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        return low, trials


def row(name: str, times: list[float], batch: int, window: int, flops: int | None = None, peak: float | None = None,
        memory: float | None = None) -> dict:
    mean = sum(times) / len(times)
    tflops = flops / mean / 1e12 if flops else None
    return {"variant": name, "steps": len(times), "ms_per_step": mean * 1e3,
            "ms_median": statistics.median(times) * 1e3, "steps_per_s": 1 / mean,
            "frames_per_s": batch * window / mean, "tflop_per_s": tflops,
            "mfu": tflops * 1e12 / peak if tflops and peak else None, "peak_memory_gib": memory}


def print_table(rows: list[dict]) -> None:
    cols = [("variant", "{}", 14), ("steps", "{}", 6), ("ms_per_step", "{:.2f}", 10), ("ms_median", "{:.2f}", 10),
            ("steps_per_s", "{:.2f}", 10), ("frames_per_s", "{:.0f}", 10), ("tflop_per_s", "{:.4f}", 10),
            ("mfu", "{:.1%}", 7), ("peak_memory_gib", "{:.1f}", 9)]
    heads = ["step", "steps", "ms/step", "median", "steps/s", "frames/s", "TFLOP/s", "MFU", "peak GiB"]
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, (_, _, w)) in enumerate(zip(heads, cols))))
    for r in rows:
        cells = ["-" if r.get(k) is None else f.format(r[k]) for k, f, _ in cols]
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, (_, _, w)) in enumerate(zip(cells, cols))))


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other --section.key=value arguments override the config (the raw step's and "
                                       "the fit's alike).")
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="a fit config (default: the demo's)")
    p.add_argument("--manifest", help="the data of the fit and the loader (default: a synthetic world made here)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first, compilation among them (default 5)")
    p.add_argument("--kernels", nargs="+", default=[], help="a raw row with each temporal-attention kernel")
    p.add_argument("--raw-only", action="store_true", help="only the raw step's rows: no data, no fit, no loader")
    p.add_argument("--profile", action="store_true", help="torch.profiler's operator table of the raw step")
    p.add_argument("--max-batch", action="store_true", help="the largest batch whose raw step fits (GPU only)")
    p.add_argument("--memory-gib", type=float, help="--max-batch holds the process to this much GPU memory")
    p.add_argument("--batch-step", type=int, default=1, help="--max-batch's precision in samples (default 1)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak, where Lightning does not know it")
    p.add_argument("--json", help="write every number here (after each row)")
    args, overrides = p.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch_step < 1:
        p.error("--steps and --batch-step must be >= 1, --warmup >= 0")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    b = Bench(args, overrides)
    cuda = b.device.type == "cuda"
    if not cuda:
        set_cpu_threads()  # as lwm fit sets them (the fit in this process keeps them)
    name = torch.cuda.get_device_name(b.device) if cuda else f"cpu, {torch.get_num_threads()} thread(s)"
    flops = b.flops()
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None and cuda:
        from lightning.fabric.utilities.throughput import get_available_flops

        peak = get_available_flops(b.device, b.dtype)
    c = b.net
    print(f"{args.config}: {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; batch "
          f"{b.batch} x {b.window} frames of [{c.in_channels}, {c.height}, {c.width}], D={c.d_model}, precision "
          f"{b.precision}, compile {b.compile}; {flops / 1e9:.3f} GFLOP per step", flush=True)
    out = {"config": args.config, "overrides": overrides, "device": name, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "batch": b.batch, "window": b.window, "precision": b.precision,
           "compile": b.compile, "flops": flops, "peak_flops": peak, "variants": [], "loader": None}

    def save(**numbers) -> None:
        out.update(numbers)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1))

    def add(r: dict, key: str = "variants") -> dict:
        save(**{key: r if key == "loader" else [*out[key], r]})
        print(f"  {r['variant']}: {r['ms_per_step']:.2f} ms each", flush=True)
        return r

    def raw(variant: str, **kwargs):
        if cuda:
            torch.cuda.reset_peak_memory_stats(b.device)
        step = b.step(**kwargs)
        times = timed(step, args.steps, args.warmup, b.device)
        memory = torch.cuda.max_memory_allocated(b.device) / 2**30 if cuda else None
        return add(row(variant, times, b.batch, b.window, flops, peak, memory)), step

    first, first_step = raw("raw")
    profile = None
    if args.profile:  # the raw step, compiled and warm (before another variant resets dynamo's caches)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                first_step()
            if cuda:
                torch.cuda.synchronize()
        ops = prof.key_averages()
        profile = ops.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=25)
        save(host_syncs_per_step=sum(e.count for e in ops if "Synchronize" in e.key) / args.steps)
    del first_step  # (its model's memory, for the rows after)
    if b.compile:
        raw("raw, eager", compile_=False)
    for kernel in args.kernels:
        raw(f"raw, {kernel}", net=replace(b.net, temporal_attention=kernel))
    fit = loader = None
    if not args.raw_only:
        with tempfile.TemporaryDirectory(prefix="lwm_train_step_") as tmp:
            manifest = args.manifest or b.config["data"].get("manifest") or b.synth(Path(tmp) / "data")
            fit = add(row("lwm fit", b.fit_times(manifest, str(Path(tmp) / "run")), b.batch, b.window, flops, peak))
            loader = add(row("loader", b.loader_times(manifest), b.batch, b.window), "loader")
    print()
    print_table([r for r in (*out["variants"], loader) if r])
    if b.compile:
        eager = next(r for r in out["variants"] if r["variant"] == "raw, eager")
        ratio = eager["ms_median"] / first["ms_median"]
        print(f"compile: the eager step takes {ratio:.2f}x the compiled one (medians)")
    if fit:
        overhead = fit["ms_per_step"] / first["ms_per_step"] - 1
        share = loader["ms_per_step"] / fit["ms_per_step"]
        save(fit_overhead=overhead, loader_share=share)
        print(f"lwm fit over the raw step: {overhead:+.1%} ms/step (target: at most {TARGETS['fit']:.0%}): "
              f"{'met' if overhead <= TARGETS['fit'] else 'not met'}")
        print(f"loader: {share:.1%} of a fit step (target: at most {TARGETS['loader']:.0%}): "
              f"{'met' if share <= TARGETS['loader'] else 'not met'}")
    if profile:
        print(f"{profile}host syncs (cuda*Synchronize calls) per raw step: {out['host_syncs_per_step']:g}")
    if args.max_batch:
        if not cuda:
            print("--max-batch: GPU only")
        else:
            save(max_batch=b.max_batch(lambda trials: save(max_batch_trials=trials))[0])
            print(f"largest batch that fits: {out['max_batch']} (to {args.batch_step} samples)")
    save()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LwmError as e:
        sys.exit(f"error: {e}")

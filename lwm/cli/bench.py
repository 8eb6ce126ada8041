"""``lwm bench``: how fast a training step of a config runs, measured side by side with a plain reference."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from lwm.cli.dynamo_watch import dynamo_note, DynamoWatch, fresh_compile_caches, ROOT, short_path
from lwm.cli.lightning_cli import read_config
from lwm.modules import triton_attention
from lwm.modules.flops import count_flops, StepFlops
from lwm.modules.st_transformer import ATTENTION_KERNELS
from lwm.modules.world_model import WorldModel, WorldModelConfig
from lwm.training.module import WorldModelModule
from lwm.training.optim import OptimConfig
from lwm.utils.args import ArgumentParser
from lwm.utils.errors import ConfigError
from lwm.utils.video import check_output

DEFAULT_CONFIG = ROOT / "configs" / "tiny.yaml"


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = ArgumentParser(prog="lwm bench", description=__doc__.split("\n\n")[0],
                       epilog="Other --section.key=value arguments override the config.")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="a fit config (default configs/tiny.yaml)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--no-breakdown", action="store_true", help="skip the per-part timings")
    p.add_argument("--no-reference", action="store_true", help="skip the eager fp32 reference")
    p.add_argument("--max-batch", action="store_true", help="also find the largest batch that fits (GPU only)")
    p.add_argument("--memory-gib", type=float, help="--max-batch on a card of this many GiB: the process is held to "
                                                     "it (e.g. 78.5 on an H200: an H100 80GB's answer)")
    p.add_argument("--batch-step", type=int, default=1, help="--max-batch's precision in samples (default 1; 8 "
                                                             "bisects fewer times, each trial compiles anew)")
    p.add_argument("--no-lightning", action="store_true", help="skip the Lightning variant")
    p.add_argument("--kernels", nargs="+", default=[], metavar="KERNEL",
                   help="also time the fast path with each of these temporal-attention kernels (sdpa matmul triton)")
    p.add_argument("--peak-tflops", type=float, help="the device's bf16 dense peak, where Lightning does not know "
                                                      "it (e.g. 989 for an H200)")
    args, rest = p.parse_known_args(argv)

    unknown = [k for k in args.kernels if k not in ATTENTION_KERNELS]
    if unknown:
        raise ConfigError(f"--kernels: {' '.join(unknown)}: not one of {' '.join(ATTENTION_KERNELS)}")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ConfigError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    if args.memory_gib is not None and not args.memory_gib > 0:
        raise ConfigError(f"--memory-gib must be > 0, got {args.memory_gib}")
    if args.batch_step < 1:
        raise ConfigError(f"--batch-step must be >= 1, got {args.batch_step}")
    if not Path(args.config).is_file():
        shipped = ROOT / "configs" / f"{Path(args.config).stem}.yaml"  # `--config tiny`
        hint = f" (did you mean {shipped.relative_to(ROOT)}?)" if shipped.is_file() else ""
        raise ConfigError(f"--config {args.config}: not found{hint}")
    if args.json is not None:  # before minutes of timing

        if Path(args.json).suffix != ".json":
            raise ConfigError(f"--json {args.json}: not a .json file name")
        check_output(args.json, "--json", inputs={"--config": args.config})
    return args, rest  # the config's overrides


def load_config(path: str, overrides: list[str]) -> dict[str, Any]:
    """The config as ``lwm fit`` reads and checks it (:func:`lwm.lightning_cli.read_config`; the step runs on random
    latents, so ``data.manifest`` may be left out), and the batch and window the step needs."""

    config = read_config(["--config", path, *overrides])
    data = config.get("data") or {}
    if data.get("batch_size") is not None and data["batch_size"] < 1:
        raise ConfigError(f"data.batch_size must be >= 1, got {data['batch_size']}")
    least = WorldModelConfig(**((config.get("model") or {}).get("net") or {})).min_frames
    if data.get("window") is not None and data["window"] < least:
        raise ConfigError(f"data.window = {data['window']}, but the model needs at least {least} frames")
    return config


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Marks between steps, read once at the end, with no sync in between (steps overlap as in training)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list = []

    def mark(self) -> None:
        if DynamoWatch.active is not None:  # the timed steps lie between the first mark and the last
            DynamoWatch.active.timed_step_mark()
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.device.type == "cuda":
            sync(self.device)
            return [start.elapsed_time(end) / 1e3 for start, end in zip(self.marks, self.marks[1:])]
        return [end - start for start, end in zip(self.marks, self.marks[1:])]


def step_times(fn: Callable[[], object], steps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each of ``steps`` calls of ``fn`` after ``warmup`` untimed calls (:class:`StepClock`)."""
    for _ in range(warmup):
        fn()
    clock = StepClock(device)
    clock.mark()
    for _ in range(steps):
        fn()
        clock.mark()
    return clock.intervals()


def timed(fn: Callable[[], object], steps: int, warmup: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` after ``warmup`` untimed calls (the mean of :func:`step_times`)."""
    return sum(step_times(fn, steps, warmup, device)) / steps


def matmul_tflops(device: torch.device) -> tuple[float, str]:
    """A large matmul's TFLOP/s on this device: bf16 8192^3 on a GPU, fp32 2048^3 on a CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, steps=100 if device.type == "cuda" else 3, warmup=5, device=device)
    return 2 * n**3 / seconds / 1e12, f"{str(dtype).removeprefix('torch.')} {n}^3"


class Setup:
    """The config's model, optimiser settings, precision and a random batch."""

    def __init__(self, cfg: dict, device: torch.device) -> None:

        model = cfg.get("model") or {}
        try:
            self.net = WorldModelConfig(**(model.get("net") or {}))
            self.optim = OptimConfig(**(model.get("optim") or {}))
        except TypeError as e:
            raise ConfigError(f"model: {e}") from None
        data, trainer = cfg.get("data") or {}, cfg.get("trainer") or {}
        self.batch, self.window = int(data.get("batch_size", 32)), int(data.get("window", 16))
        self.precision = str(trainer.get("precision", "32-true"))
        self.compile = bool(model.get("compile", False)) and device.type == "cuda"
        self.clip = trainer.get("gradient_clip_val")
        self.device = device
        c = self.net
        g = torch.Generator(device="cpu").manual_seed(0)
        self.x = (torch.rand(self.batch, self.window, c.in_channels, c.height, c.width, generator=g) * 2 - 1).to(device)
        self.patches = c.grid[0] * c.grid[1]

    @property
    def bf16(self) -> bool:
        return self.precision.startswith("bf16")

    def autocast(self, enabled: bool | None = None):
        on = self.bf16 if enabled is None else enabled
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=on)


def reference_net(s: Setup):
    """The reference's model: the config's, without the options under test (activation checkpointing, the
    temporal-attention kernel), so that every variant is compared with the same reference."""
    return replace(s.net, activation_checkpointing=False, temporal_attention="sdpa")


def plain_step(s: Setup, fast: bool, compile_: bool = True, micro: int = 1) -> tuple[
        Callable[[], torch.Tensor], torch.nn.Module, torch.optim.Optimizer]:
    """One training step in a plain loop: the fast path (the config's precision, compile unless ``compile_`` is
    False, fused AdamW on a GPU) or the reference (eager fp32, for-loop AdamW, :func:`reference_net`; its batch in
    ``micro`` micro-batches with accumulated gradients where it does not fit in memory at once)."""

    torch.manual_seed(0)
    model = WorldModel(s.net if fast else reference_net(s)).to(s.device).train()
    if fast and s.compile and compile_:
        fresh_compile_caches()
        model.compile_parts()
    cuda = s.device.type == "cuda"
    kwargs = dict(fused=True) if fast and cuda else dict(foreach=False)
    opt = s.optim.adamw(model.parameters(), **kwargs)  # the module's parameter groups and hyperparameters
    counter = iter(range(10**9))

    def step() -> torch.Tensor:
        i = next(counter)
        for x in s.x.chunk(micro):  # the batch mean
            with s.autocast(fast and s.bf16):
                loss = model.compute(x, i, reuse_prefix=fast).loss
            (loss * (x.shape[0] / s.x.shape[0])).backward()
        if s.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(s.clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, model, opt


def lightning_step_times(s: Setup, steps: int, warmup: int) -> list[float]:
    """Seconds of each timed step of the real Lightning training step (from batch start to batch start)."""
    import lightning as L


    class Timer(L.Callback):
        def __init__(self) -> None:
            self.clock = StepClock(s.device)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if warmup <= batch_idx <= warmup + steps:  # no sync in between: steps overlap as in training
                self.clock.mark()

    # as LatentDataModule delivers them: float16 in pinned memory (the module casts them on the device)
    latents = s.x.cpu().half()
    batch = {"latents": latents.pin_memory() if s.device.type == "cuda" else latents}
    loader = torch.utils.data.DataLoader([batch] * (warmup + steps + 1), batch_size=None)
    timer = Timer()
    if s.compile:
        fresh_compile_caches()  # the module compiles its parts when the Trainer sets it up
    torch.manual_seed(0)
    module = WorldModelModule(s.net, s.optim, compile=s.compile)
    trainer = L.Trainer(
        accelerator=s.device.type, devices=1, precision=s.precision, max_steps=warmup + steps + 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        gradient_clip_val=s.clip, num_sanity_val_steps=0, limit_val_batches=0,
    )
    with warnings.catch_warnings():  # the step alone, on purpose
        warnings.filterwarnings("ignore", message="You defined a `validation_step` but have no `val_dataloader`")
        trainer.fit(module, train_dataloaders=loader)
    return timer.clock.intervals()


def step_flops(s: Setup):
    """FLOPs of one training step (forward with every pass, backward) at the real batch's shapes."""

    model = WorldModel(s.net).to(s.device).train()

    def fn() -> None:
        with s.autocast():
            loss = model.compute(s.x[:1], step=None).loss  # no codebook update
        loss.backward()
        model.zero_grad(set_to_none=True)

    with model.counting_form():  # the useful work, whichever kernel runs
        one, b = count_flops(fn), s.x.shape[0]
    return StepFlops(one.useful * b, one.dense * b, {k: v * b for k, v in one.by_module.items()},
                     {k: v * b for k, v in one.by_op.items()})


def breakdown(s: Setup, steps: int, warmup: int) -> list[dict]:
    """Each part alone (forward + backward, eager, the step's shapes and precision): seconds and FLOPs per step."""

    torch.manual_seed(0)
    model = WorldModel(s.net).to(s.device).train()
    B, T = s.x.shape[:2]
    N, D = s.patches, s.net.d_model
    passes = len(s.net.rollout_weights)
    rows: list[dict] = []
    leaves: list[torch.Tensor] = []  # the parts' inputs that need a gradient

    def part(name: str, makes: list[Callable[[], torch.Tensor]], repeat: int = 1) -> None:
        """One row: each of ``makes`` (one per call in the step, shapes may differ), ``repeat`` times (the depth)."""
        seconds = flops = 0.0
        for fn in makes:
            def run(fn=fn) -> None:
                for leaf in leaves:  # gradients written, not added to the last call's
                    leaf.grad = None
                model.zero_grad(set_to_none=True)
                with s.autocast():
                    out = fn()
                out.float().sum().backward()

            seconds += timed(run, steps, warmup, s.device) * repeat
            with model.counting_form():  # the useful work, whichever kernel runs
                flops += count_flops(run).useful * repeat
        model.zero_grad(set_to_none=True)
        rows.append({"part": name, "ms": seconds * 1e3, "tflop": flops / 1e12, "calls": len(makes) * repeat})

    # Rollout pass k (0: teacher forcing) computes positions k..T-2 of the T-1 (see WorldModel.compute).
    tokens = torch.randn(B, T, N, D, device=s.device)
    predictions, detokenizer_input = s.x.clone().requires_grad_(True), tokens.clone().requires_grad_(True)
    leaves += [predictions, detokenizer_input]
    new = [T - 1 - k for k in range(passes)]
    part("tokenizer", [lambda: model.tokenize(s.x)] + [lambda n=n: model.tokenize(predictions[:, :n])
                                                       for n in new[1:]])
    part("detokenizer", [lambda n=n: model.detokenize(detokenizer_input[:, :n]) for n in new])
    heads = s.net.n_heads
    kv = torch.randn(B * N, heads, passes, D // heads, device=s.device, requires_grad=True)  # the earlier
    leaves.append(kv)  # passes' keys and values
    for name, transformer, lengths in (
        ("action encoder", model.action_encoder.transformer, [T]),
        ("world encoder", model.world_encoder.transformer, [T]),
        ("dynamics", model.dynamics.transformer, new),
    ):
        depth, block = len(transformer.blocks), transformer.blocks[0]  # every block has the same shapes
        hs = [tokens[:, :n].clone().requires_grad_(True) for n in lengths]
        leaves += hs
        pasts = [None] + [(kv[:, :, :k], kv[:, :, :k]) for k in range(1, len(lengths))]
        part(f"{name}: spatial attention", [lambda b=block, h=h: b.spatial_update(h) for h in hs], depth)
        masks = transformer.masks  # the action encoder's first block is shifted-causal
        for mask in dict.fromkeys(masks):
            b = transformer.blocks[masks.index(mask)]
            label = f"{name}: temporal attention" + (f" ({mask})" if len(set(masks)) > 1 else "")
            part(label, [lambda b=b, h=h, kv=kv: b.temporal_update(h, past=kv)[0] for h, kv in zip(hs, pasts)],
                 masks.count(mask))
        part(f"{name}: MLP", [lambda b=block, h=h: b.mlp_update(h) for h in hs], depth)
    za = torch.randn(B, T - 1, s.net.d_code_action, device=s.device, requires_grad=True)
    zh = torch.randn(B, s.net.d_code_world, device=s.device, requires_grad=True)
    leaves += [za, zh]
    counter = iter(range(10**9))
    part("quantizers (with EMA update)", [lambda: model.action_encoder.rvq(za, next(counter)).commit_loss
         + model.world_encoder.rvq(zh, next(counter)).commit_loss])
    _, full_model, opt = plain_step(s, fast=True, compile_=False)
    for p in full_model.parameters():
        p.grad = torch.zeros_like(p)
    seconds = timed(opt.step, steps, warmup, s.device)
    rows.append({"part": "optimizer", "ms": seconds * 1e3, "tflop": 0.0, "calls": 1})
    return rows


def largest_batch(fits: Callable[[int], bool], start: int = 1, limit: int = 4096, step: int = 1) -> int:
    """The largest batch ``b <= limit`` with ``fits(b)``, assuming fitting is monotone."""
    if not fits(start):
        return 0
    good, bad = start, None
    while bad is None:
        trial = min(good * 2, limit)
        if trial == good:
            return good
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad - good > step:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def runs_on_gpu(make: Callable[[], Callable[[], object]], calls: int = 1) -> bool:
    """Whether the step ``make()`` builds runs ``calls`` times without running out of GPU memory (or an allocation
    failure reported by cuBLAS/cuDNN, or a kernel's launch limit)."""
    step = None
    try:
        step = make()
        for _ in range(calls):
            step()
        return True
    except torch.OutOfMemoryError:
        return False
    except RuntimeError as e:
        if any(key in str(e) for key in ("CUDA", "CUBLAS", "CUDNN", "invalid configuration")):
            return False
        raise
    finally:
        step = None
        torch.cuda.empty_cache()


def fits_on_gpu(s: Setup) -> Callable[[int], bool]:
    """Whether a fast-path training step at batch ``b`` runs without running out of GPU memory."""
    def fits(batch: int) -> bool:
        x = s.x

        def make() -> Callable[[], object]:
            c = s.net
            s.x = torch.rand(batch, s.window, c.in_channels, c.height, c.width, device=s.device) * 2 - 1
            return plain_step(s, fast=True)[0]

        try:
            return runs_on_gpu(make, calls=2)
        finally:
            s.x = x

    return fits


class Progress:
    """One line per stage, with the seconds since the start: compiling and timing take minutes, in a log file too."""

    def __init__(self, console: Console) -> None:
        self.console, self.started = console, time.perf_counter()

    def __call__(self, text: str) -> None:
        self.console.print(f"[dim]{time.perf_counter() - self.started:6.1f} s  {text}[/]", soft_wrap=True,
                           highlight=False)


@dataclass
class Timings:
    """The seconds of each timed step of each variant, in the order timed, with its peak GPU memory and notes on what
    ran."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    memory: dict[str, float | None] = field(default_factory=dict)
    dynamo: dict[str, dict] = field(default_factory=dict)  # DynamoWatch.result() of each variant
    notes: list[str] = field(default_factory=list)
    host_syncs: list[dict] | None = None  # in one fast-path step (GPU only): sync_sites()

    def measure(self, label: str, run: Callable[[], list[float]], device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        with DynamoWatch.watching() as watch:
            self.seconds[label] = list(run())
        self.memory[label] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        self.dynamo[label] = watch.result()
        if (note := dynamo_note(label, self.dynamo[label])) is not None:
            self.notes.append(note)


def time_variants(s: Setup, args: argparse.Namespace, progress: Progress,
                  measured: Callable[[Timings], None] = lambda t: None) -> Timings:
    """The reference, the fast path (and its other kernels, with ``--kernels``) and the Lightning step, timed."""
    device, t = s.device, Timings()

    def measure(label: str, run: Callable[[], float]) -> None:
        progress(f"timing {label}: {args.warmup} warm-up + {args.steps} timed steps")
        t.measure(label, run, device)
        ms = statistics.median(t.seconds[label]) * 1e3
        progress(f"{label}: {ms:.1f} ms/step (median), {s.batch * s.window / ms * 1e3:.0f} frames/s")
        measured(t)

    micro = None if args.no_reference else reference_micro_batches(s)
    if not args.no_reference and micro is None:
        t.notes.append("the fp32 reference does not fit in GPU memory even one sample at a time: not measured")
    elif micro is not None:
        label = "reference" if micro == 1 else f"reference ({micro} micro-batches)"
        if micro > 1:
            t.notes.append(f"the fp32 reference does not fit at batch {s.batch}: it accumulates {micro} micro-batches")
        with fp32_matmuls():
            measure(label, lambda: step_times(plain_step(s, fast=False, micro=micro)[0], args.steps, args.warmup,
                                              device))
    fast_step = plain_step(s, fast=True)[0]
    measure("fast path", lambda step=fast_step: step_times(step, args.steps, args.warmup, device))
    t.host_syncs = host_syncs(fast_step, device)
    del fast_step  # its model and optimizer state would count in the next variant's peak memory
    configured = s.net
    for kernel in dict.fromkeys(k for k in args.kernels if k != configured.temporal_attention):
        s.net = replace(configured, temporal_attention=kernel)  # the same step but for the kernel, side by side
        label = f"fast path (temporal_attention={kernel})"
        activations = torch.empty(0, dtype=torch.bfloat16 if s.bf16 else torch.float32, device=device)
        if kernel == "triton" and not triton_attention.supported(activations, s.window, s.net.d_model // s.net.n_heads):
            t.notes.append(f"{label}: the Triton kernel does not run here (no GPU or triton, or tiles too large): "
                           "the row times its matmul fallback")
        try:
            other = plain_step(s, fast=True)[0]
            measure(label, lambda: step_times(other, args.steps, args.warmup, device))
        except (RuntimeError, torch.OutOfMemoryError) as error:  # one kernel failing keeps the other rows
            t.notes.append(f"{label}: failed ({str(error).splitlines()[0][:200]})")
        finally:
            other = None
            s.net = configured
    if not args.no_lightning:
        measure("lightning", lambda: lightning_step_times(s, args.steps, args.warmup))
    return t


NOISY_SPREAD = 1.5  # a variant whose slowest timed step takes this many times its fastest


def step_stats(seconds: list[float]) -> dict:
    """The spread of a variant's timed steps, in ms: mean, median, min, max, max / min and every step."""
    ms = [x * 1e3 for x in seconds]
    low, high = min(ms), max(ms)
    return {"ms_per_step": sum(ms) / len(ms), "ms_median": statistics.median(ms), "ms_min": low, "ms_max": high,
            "max_over_min": high / low if low > 0 else None, "ms_steps": ms}


def variant_rows(s: Setup, t: Timings, flops_useful: float, matmul: float, peak: float | None) -> list[dict]:
    """Each variant's step times (mean, median, min, max), rates and MFUs (of the mean: the throughput of the timed
    steps) and speed-up over the reference (of the medians: one step slowed by another process moves the mean, not
    the median)."""
    stats = {label: step_stats(seconds) for label, seconds in t.seconds.items()}
    reference = next((v["ms_median"] for k, v in stats.items() if k.startswith("reference")), None)
    frames, tokens = s.batch * s.window, s.batch * s.window * s.patches
    rows = []
    for label, st in stats.items():
        seconds = st["ms_per_step"] / 1e3
        achieved = flops_useful / seconds / 1e12
        rows.append({"variant": label, **st, "steps_per_s": 1 / seconds,
                     "frames_per_s": frames / seconds, "tokens_per_s": tokens / seconds, "tflop_per_s": achieved,
                     "mfu_peak": achieved * 1e12 / peak if peak else None, "mfu_matmul": achieved / matmul,
                     "speedup": reference / st["ms_median"] if reference else None,
                     "peak_memory_gib": t.memory.get(label), "dynamo": t.dynamo.get(label)})
    return rows


def lightning_overhead_ms(rows: list[dict]) -> float | None:
    """The Lightning step's median ms minus the fast path's (None without both)."""
    median = {row["variant"]: row["ms_median"] for row in rows}
    if "lightning" not in median or "fast path" not in median:
        return None
    return median["lightning"] - median["fast path"]


def noise_warning(rows: list[dict], overhead: float | None, warmup: int = 1) -> str | None:
    """One line when the timings cannot be trusted."""
    reasons = [f"Lightning overhead {overhead:+.1f} ms/step < 0"] if overhead is not None and overhead < 0 else []
    reasons += [f"{row['variant']}: slowest step {row['max_over_min']:.2f}x the fastest" for row in rows
                if row["max_over_min"] is not None and row["max_over_min"] > NOISY_SPREAD]
    if not reasons:
        return None
    if warmup < 1:
        return (f"warning: the timings are noisy ({'; '.join(reasons)}): with --warmup 0 the first timed step pays "
                "for compilation and first-call allocations; rerun with --warmup 1 or more")
    return (f"warning: the timings are noisy ({'; '.join(reasons)}): another process is probably competing for the "
            "device or the CPU; rerun on a quiet machine (more --steps steady the medians)")


def print_variants(console: Console, rows: list[dict], t: Timings, flops, matmul: float, matmul_what: str,
                   peak: float | None, overhead: float | None, warning: str | None) -> None:
    table = Table(title=f"training step: {flops.useful / 1e9:.2f} GFLOP useful ({flops.dense / 1e9:.2f} dense), "
                        f"matmul roofline {matmul:.2f} TFLOP/s ({matmul_what})")
    for col in ("variant", "ms/step", "median", "min", "max", "steps/s", "frames/s", "tokens/s", "TFLOP/s",
                "MFU peak", "MFU mm", "speed-up", "peak GiB"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for row in rows:
        table.add_row(row["variant"], f"{row['ms_per_step']:.1f}", f"{row['ms_median']:.1f}", f"{row['ms_min']:.1f}",
                      f"{row['ms_max']:.1f}", f"{row['steps_per_s']:.2f}",
                      f"{row['frames_per_s']:.0f}", f"{row['tokens_per_s']:.0f}", f"{row['tflop_per_s']:.3f}",
                      f"{row['mfu_peak']:.1%}" if row["mfu_peak"] else "-", f"{row['mfu_matmul']:.1%}",
                      f"{row['speedup']:.2f}x" if row["speedup"] else "-",
                      f"{row['peak_memory_gib']:.1f}" if row["peak_memory_gib"] is not None else "-")
    console.print(table)
    console.print("reference: eager fp32, for-loop AdamW; fast path: the config's precision and compile, fused AdamW "
                  "on a GPU, plain loop; lightning: the real training step. ms/step: the mean of the timed steps "
                  "(median, min, max beside it); the rates and MFUs are of the mean, the speed-up and the Lightning "
                  "overhead of the medians. MFU peak: of the bf16 dense peak; MFU mm: of the matmul roofline.",
                  soft_wrap=True)
    console.print(f"Lightning overhead: {'not measured' if overhead is None else f'{overhead:+.1f} ms/step (medians)'}"
                  f"; bf16 dense peak {f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown here (--peak-tflops)'}; "
                  f"host syncs in a fast-path step: {'-' if t.host_syncs is None else sync_count(t.host_syncs)}",
                  soft_wrap=True)
    if warning:
        console.print(warning, soft_wrap=True, highlight=False, markup=False)
    for note in t.notes:
        console.print(f"note: {note}", soft_wrap=True)


def rollout_passes(s: Setup, steps: int, warmup: int) -> list[dict]:
    """What each rollout pass adds to the eager step (all its parts, forward and backward: re-tokenizing, the
    predictor, the detokenizer, its loss), by difference."""
    configured, rows, before = s.net, [], (0.0, 0)
    try:
        for k in range(1, len(configured.rollout_weights) + 1):
            # every pass is computed whatever its weight: a positive one keeps a config starting with zeros valid
            weights = tuple(w or 1.0 for w in configured.rollout_weights[:k])
            s.net = replace(configured, rollout_weights=weights)
            seconds = timed(plain_step(s, fast=True, compile_=False)[0], steps, warmup, s.device)
            flops = step_flops(s).useful
            rows.append({"part": "teacher forcing (and all else)" if k == 1 else f"+ rollout pass {k - 1}",
                         "ms": (seconds - before[0]) * 1e3, "tflop": (flops - before[1]) / 1e12, "calls": 1,
                         "step_ms": seconds * 1e3})
            before = (seconds, flops)
    finally:
        s.net = configured
    return rows


def run_breakdown(s: Setup, args: argparse.Namespace, console: Console,
                  measured: Callable[[list[dict]], None] = lambda parts: None) -> tuple[list[dict], list[dict]]:
    """Each part timed alone, and ``other``: the eager step minus their sum."""
    steps, warmup = max(1, args.steps // 2), min(args.warmup, 2)
    parts = breakdown(s, steps, warmup)
    measured(parts)
    passes = rollout_passes(s, steps, max(1, warmup))
    eager = passes[-1]["step_ms"] / 1e3  # the whole eager step: every pass
    total = sum(r["ms"] for r in parts)
    parts.append({"part": "other (loss, masks, PE, glue)", "ms": eager * 1e3 - total, "tflop": None, "calls": 1})
    titles = (f"breakdown: each part alone, forward + backward, eager (step {eager * 1e3:.1f} ms)",
              "rollout passes: the eager step with teacher forcing only, then each pass added (differences)")
    for title, rows in zip(titles, (parts, passes)):
        table = Table(title=title)
        for col in ("part", "calls", "ms/step", "share", "TFLOP/s"):
            table.add_column(col, justify="left" if col == "part" else "right")
        for r in rows:
            rate = r["tflop"] / (r["ms"] / 1e3) if r["tflop"] and r["ms"] > 0 else None
            table.add_row(r["part"], str(r["calls"]), f"{r['ms']:.2f}", f"{r['ms'] / (eager * 1e3):.0%}",
                          f"{rate:.3f}" if rate else "-")
        console.print(table)
    if parts[-1]["ms"] < 0 or any(p["ms"] < 0 for p in passes):  # each part can take no longer than the whole
        console.print(f"warning: the breakdown is noisy (the parts alone took {total:.0f} ms, more than the whole "
                      f"eager step's {eager * 1e3:.0f} ms, or a rollout pass added negative time): another process "
                      "is probably competing for the device or the CPU; rerun on a quiet machine", soft_wrap=True,
                      highlight=False)
    return parts, passes


def run_max_batch(s: Setup, console: Console, progress: Progress, memory_gib: float | None = None, step: int = 1,
                  tried: Callable[[list[dict]], None] = lambda trials: None) -> int | None:
    """The largest batch whose fast-path step fits in GPU memory (None on the CPU), to ``step`` samples."""
    if s.device.type != "cuda":
        console.print("--max-batch: GPU only (the CPU has no memory limit to find)")
        return None
    total = torch.cuda.get_device_properties(s.device).total_memory
    held = total if memory_gib is None else min(total, memory_gib * 2**30)
    if held < total:
        torch.cuda.set_per_process_memory_fraction(held / total, s.device)
    limit = max(s.batch, 65535 // s.patches)  # temporal attention runs batch x patches sequences
    progress(f"searching the largest batch that fits in {held / 2**30:.1f} GiB (from {s.batch}, up to {limit}, "
             f"to {step} sample{'s' if step > 1 else ''})")  # at most 65535 such blocks
    fits, trials = fits_on_gpu(s), []

    def trial(batch: int) -> bool:
        ok = fits(batch)
        trials.append({"batch": batch, "fits": ok})
        progress(f"batch {batch}: {'fits' if ok else 'does not fit'}")
        tried(trials)
        return ok

    try:
        max_batch = largest_batch(trial, start=s.batch, limit=limit, step=step)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, s.device)
    capped = " (the search's limit: 65535 temporal sequences)" if max_batch == limit else ""
    within = f", within {step - 1} below the largest" if step > 1 and 0 < max_batch < limit else ""
    memory = f"{held / 2**30:.1f} GiB" + (f" of the card's {total / 2**30:.1f}" if held < total else "")
    console.print(f"largest batch that fits: {max_batch} x {s.window} frames{capped}{within} (fast path, {memory})")
    return max_batch


def main(argv: list[str]) -> int:
    args, overrides = parse(argv)
    cfg = load_config(args.config, overrides)
    accelerator = str((cfg.get("trainer") or {}).get("accelerator", "auto"))
    device = torch.device("cuda" if torch.cuda.is_available() and accelerator != "cpu" else "cpu")
    s = Setup(cfg, device)
    console = Console(width=None if sys.stdout.isatty() else 200)  # a log file gets the whole table, not 80 columns
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    console.print(f"[bold]lwm bench[/] {args.config}: {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
                  f"batch {s.batch} x {s.window} frames of [{s.net.in_channels}, {s.net.height}, {s.net.width}], "
                  f"D={s.net.d_model}, precision {s.precision}, compile {s.compile}", soft_wrap=True)
    progress = Progress(console)
    progress("counting the step's FLOPs")
    flops = step_flops(s)
    progress("timing a large matmul (the roofline)")
    matmul, matmul_what = matmul_tflops(device)
    from lightning.fabric.utilities.throughput import get_available_flops

    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
    else:
        peak = get_available_flops(device, torch.bfloat16) if device.type == "cuda" else None

    out = {"config": args.config, "overrides": overrides, "device": name, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "batch": s.batch, "window": s.window, "precision": s.precision,
           "compile": s.compile, "net": asdict(s.net), "flops_useful": flops.useful, "flops_dense": flops.dense,
           "flops_by_op": flops.by_op, "matmul_tflop_per_s": matmul, "matmul": matmul_what,
           "peak_tflop_per_s": peak / 1e12 if peak else None, "variants": [], "lightning_overhead_ms": None,
           "noise_warning": None, "host_syncs": None, "notes": [], "breakdown": [], "passes": [], "max_batch": None,
           "max_batch_trials": [], "max_batch_memory_gib": args.memory_gib, "max_batch_step": args.batch_step}

    def summarise(t: Timings) -> tuple[list[dict], float | None, str | None]:
        """The variants measured so far, into ``out`` and the JSON (now, and again with each later part: a later
        failure keeps what was measured)."""
        rows = variant_rows(s, t, flops.useful, matmul, peak)
        overhead = lightning_overhead_ms(rows)
        warning = noise_warning(rows, overhead, args.warmup)
        out.update(variants=rows, lightning_overhead_ms=overhead, noise_warning=warning, host_syncs=t.host_syncs,
                   notes=t.notes)
        write_json(args.json, out)
        return rows, overhead, warning

    timings = time_variants(s, args, progress, summarise)
    rows, overhead, warning = summarise(timings)
    print_variants(console, rows, timings, flops, matmul, matmul_what, peak, overhead, warning)
    if not args.no_breakdown:
        progress("timing each part alone (the breakdown)")
        def parts_timed(parts: list[dict]) -> None:
            out["breakdown"] = parts
            write_json(args.json, out)

        out["breakdown"], out["passes"] = run_breakdown(s, args, console, parts_timed)
        write_json(args.json, out)
    if args.max_batch:
        def tried(trials: list[dict]) -> None:
            out["max_batch_trials"] = trials
            write_json(args.json, out)

        out["max_batch"] = run_max_batch(s, console, progress, args.memory_gib, args.batch_step, tried)
        write_json(args.json, out)
    if args.json:
        console.print(f"wrote {args.json}")
    return 0


def write_json(path: str | None, out: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=1))


def reference_micro_batches(s: Setup) -> int | None:
    """How many micro-batches the fp32 reference needs to fit in GPU memory (1 on the CPU): the fewest of 1, 2, 4,
    ..."""
    if s.device.type != "cuda":
        return 1
    micro = 1
    with fp32_matmuls():
        while not runs_on_gpu(lambda: plain_step(s, fast=False, micro=micro)[0]):
            if micro >= s.batch:
                return None  # not even one sample at a time
            micro = min(2 * micro, s.batch)
    return len(s.x.chunk(micro))


@contextmanager
def fp32_matmuls() -> Iterator[None]:
    """True fp32 on a GPU (no TF32 in matmuls and convolutions) for the reference, restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def host_syncs(step: Callable[[], object], device: torch.device) -> list[dict] | None:
    """The host synchronisations one (warm) step makes on a GPU, as ``torch.cuda.set_sync_debug_mode`` reports them,
    by place (:func:`sync_sites`; None on the CPU)."""
    if device.type != "cuda":
        return None
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sync(device)
    return sync_sites(caught)


def sync_sites(caught: list[warnings.WarningMessage]) -> list[dict]:
    """The synchronisation warnings among ``caught``, one entry per place and message, in the order first met."""
    sites: Counter = Counter()
    for w in caught:
        text = str(w.message)
        if "synchroniz" in text:
            sites[(f"{short_path(str(w.filename))}:{w.lineno}", text.strip().splitlines()[0])] += 1
    return [{"where": where, "message": message, "count": n} for (where, message), n in sites.items()]


def sync_count(sites: list[dict]) -> str:
    """The host syncs of :func:`sync_sites`: their number, and at how many places."""
    total = sum(site["count"] for site in sites)
    return f"{total} (at {len(sites)} place{'s' if len(sites) != 1 else ''})" if total else "0"

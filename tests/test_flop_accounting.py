"""FLOP accounting and the benchmark's numbers (from a mutation review): the breakdown's parts add up to the step, counts
of the SDPA form whatever the kernel, rates of the mean step, the printed tables show the JSON's numbers, the CUDA
clock's units, the callback under DeepSpeed and with checkpointing, per-device rates, the peak's precision, and the
temporal-attention benchmark's bytes and FLOPs of a rollout pass."""

from __future__ import annotations

import contextlib
import json
import sys
from types import SimpleNamespace

import pytest
import torch

TINY = {"in_channels": 4, "height": 8, "width": 8, "d_model": 32, "n_heads": 2, "depth_action": 2, "depth_world": 2,
        "depth_dynamics": 2, "d_code_action": 8, "d_code_world": 8, "codebook_sizes_action": [4, 8],
        "codebook_sizes_world": [4, 8]}


# --- lwm/bench.py ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_breakdown_parts_add_up_to_the_steps_useful_flops(monkeypatch):
    """Identity: the parts timed alone (tokenizer, detokenizer, each sub-layer x depth x calls, quantizers) are every
    FLOP of the step but a few small projections: their sum is the step's useful count to 0.2% (0.1% left at this size)."""
    import lwm.cli.bench as bench

    monkeypatch.setattr(bench, "timed", lambda fn, steps, warmup, device: 0.5)
    s = bench.Setup({"model": {"net": TINY}, "data": {"batch_size": 2, "window": 6}}, torch.device("cpu"))
    parts = bench.breakdown(s, 1, 0)
    total = sum(p["tflop"] for p in parts) * 1e12
    assert total == pytest.approx(bench.step_flops(s).useful, rel=2e-3)  # the rest: W_a, the encoders' heads
    step = bench.step_flops(s)
    assert total <= step.useful
    assert sum(step.by_op.values()) == step.useful  # the JSON's flops_by_op adds up to flops_useful


def test_breakdown_temporal_attention_counts_the_sdpa_form_whatever_the_kernel(monkeypatch):
    """docs/performance.md: FLOPs are counted on the SDPA form whichever kernel runs; the breakdown's rows too."""
    import lwm.cli.bench as bench

    monkeypatch.setattr(bench, "timed", lambda fn, steps, warmup, device: 0.5)
    rows = {}
    for kernel in ("sdpa", "matmul"):
        s = bench.Setup({"model": {"net": {**TINY, "temporal_attention": kernel}}, "data": {"batch_size": 2, "window": 6}},
                        torch.device("cpu"))
        rows[kernel] = {p["part"]: p["tflop"] for p in bench.breakdown(s, 1, 0)}
    assert rows["matmul"] == rows["sdpa"]


def test_rates_are_of_the_mean_step(monkeypatch, tmp_path):
    """Unequal steps: TFLOP/s, frames/s and MFU are of the mean (0.5 s), the speed-up of the medians."""
    import lwm.cli.bench as bench

    monkeypatch.setattr(bench, "step_times", lambda fn, steps, warmup, device: [0.25, 0.25, 1.0])
    monkeypatch.setattr(bench, "matmul_tflops", lambda device: (4.0, "fake"))
    out = tmp_path / "b.json"
    assert bench.main(["--config", "configs/tiny.yaml", "--steps", "3", "--warmup", "0", "--json", str(out),
                       "--no-lightning", "--no-breakdown", "--peak-tflops", "10", "--data.batch_size=2",
                       "--data.window=5", "--model.net.height=8", "--model.net.width=8"]) == 0
    r = json.loads(out.read_text())
    for v in r["variants"]:
        assert v["ms_per_step"] == pytest.approx(500.0) and v["ms_median"] == pytest.approx(250.0)
        assert v["tflop_per_s"] == pytest.approx(r["flops_useful"] / 0.5 / 1e12)
        assert v["frames_per_s"] == pytest.approx(2 * 5 / 0.5)
        assert v["mfu_peak"] == pytest.approx(r["flops_useful"] / 0.5 / 10e12)


@pytest.mark.slow
def test_the_printed_tables_show_the_jsons_numbers(monkeypatch, tmp_path, capsys):
    """The printed TFLOP/s, MFU, the title's useful/dense GFLOP and the breakdown's TFLOP/s and share are the
    JSON's numbers (0.1 ms a step and a call of a part; the eager step with 1, 2, 3 rollout passes 1, 2, 3 ms)."""
    import lwm.cli.bench as bench

    monkeypatch.setattr(bench, "step_times", lambda fn, steps, warmup, device: [1e-4] * steps)
    passes = iter([1e-3, 2e-3, 3e-3])
    monkeypatch.setattr(bench, "timed", lambda fn, steps, warmup, device:
                        next(passes) if fn.__qualname__.startswith("plain_step") else 1e-4)
    monkeypatch.setattr(bench, "matmul_tflops", lambda device: (4.0, "fake"))
    out = tmp_path / "b.json"
    assert bench.main(["--config", "configs/tiny.yaml", "--steps", "1", "--warmup", "0", "--json", str(out),
                       "--no-lightning", "--peak-tflops", "1000", "--data.batch_size=128", "--data.window=5",
                       "--model.net.height=8", "--model.net.width=8"]) == 0
    r, printed = json.loads(out.read_text()), capsys.readouterr().out
    assert r["flops_dense"] - r["flops_useful"] > 0.02e9  # the title's two numbers differ at its precision
    assert f"training step: {r['flops_useful'] / 1e9:.2f} GFLOP useful ({r['flops_dense'] / 1e9:.2f} dense)" in printed
    fast = next(v for v in r["variants"] if v["variant"] == "fast path")
    row = next(line for line in printed.splitlines() if "fast path" in line and "│" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[8] == f"{fast['tflop_per_s']:.3f}" and cells[9] == f"{fast['mfu_peak']:.1%}", cells
    assert 0.1 < fast["tflop_per_s"] and 0.01 < fast["mfu_peak"] < 1  # the formats show something
    assert [p["step_ms"] for p in r["passes"]] == pytest.approx([1.0, 2.0, 3.0])
    assert r["breakdown"][-1]["ms"] == pytest.approx(3.0 - sum(p["ms"] for p in r["breakdown"][:-1]))
    for part in r["breakdown"][:-1]:
        if not part["tflop"]:
            continue
        line = next(line for line in printed.splitlines() if line.strip("│ ").startswith(part["part"]))
        cells = [c.strip() for c in line.split("│")[1:-1]]
        assert cells[3] == f"{part['ms'] / 3.0:.0%}", cells  # share of the whole eager step
        assert cells[4] == f"{part['tflop'] / (part['ms'] / 1e3):.3f}", cells


def test_cuda_step_clock_reads_event_milliseconds_as_seconds(monkeypatch):
    import lwm.cli.bench as bench

    class Event:
        clock = 0.0

        def __init__(self, enable_timing=False):
            pass

        def record(self):
            Event.clock += 250.0  # ms
            self.at = Event.clock

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(bench, "sync", lambda device: None)
    clock = bench.StepClock(torch.device("cuda"))
    for _ in range(3):
        clock.mark()
    assert clock.intervals() == [0.25, 0.25]


# --- lwm/callbacks/flops.py -----------------------------------------------------------------------------------

class _Trainer:
    strategy = object()
    accumulate_grad_batches = 1
    precision_plugin = SimpleNamespace(forward_context=contextlib.nullcontext)


def _module(**net):
    from lwm.training.module import WorldModelModule
    from tests.lightning.test_module import NET
    from dataclasses import replace

    torch.manual_seed(0)
    return WorldModelModule(net=replace(NET, **net)).train()


def test_under_deepspeed_the_step_counts_the_forward_three_times():
    """Known answer: DeepSpeed's step is counted as 3 x the useful forward (the backward as twice it); and the real
    backward is within 5% of that (2x the forward but the first convolution's input gradient)."""
    from lwm.callbacks.flop_counter import FlopCounter
    from lwm.modules.flops import count_flops

    module, x = _module(), torch.tanh(torch.randn(2, 6, 4, 16, 16))
    forward = count_flops(lambda: module.model.compute(x[:1], step=None, generator=torch.Generator().manual_seed(0)),
                          dense=False).useful
    deepspeed = SimpleNamespace(strategy=type("DeepSpeedStrategy", (), {})(), accumulate_grad_batches=1,
                                precision_plugin=_Trainer.precision_plugin)
    assert FlopCounter()._measure(deepspeed, module, x) == 3 * forward * 2
    measured = FlopCounter()._measure(_Trainer(), module, x)
    assert 0.95 * 3 * forward * 2 < measured <= 3 * forward * 2


def test_activation_checkpointing_does_not_change_the_logged_flops():
    from lwm.callbacks.flop_counter import FlopCounter

    x = torch.tanh(torch.randn(2, 6, 4, 16, 16))
    plain = FlopCounter()._measure(_Trainer(), _module(), x)
    checkpointed = _module(activation_checkpointing=True)
    assert FlopCounter()._measure(_Trainer(), checkpointed, x) == plain
    assert checkpointed.model.dynamics.transformer.checkpointing  # restored


def test_the_logged_flops_count_the_sdpa_form_whatever_the_kernel():
    """docs/performance.md: 'FLOPs are counted on the SDPA form (the useful work whichever kernel runs)' and the
    callback 'logs the same count' as lwm bench."""
    from lwm.callbacks.flop_counter import FlopCounter

    x = torch.tanh(torch.randn(2, 6, 4, 16, 16))
    assert FlopCounter()._measure(_Trainer(), _module(temporal_attention="matmul"), x) == \
        FlopCounter()._measure(_Trainer(), _module(), x)


def _interval(monkeypatch, world_size=1, validations=(10.0,)):
    from lwm.callbacks import flop_counter as flops_module
    from lwm.callbacks.flop_counter import FlopCounter

    clock = [0.0]
    monkeypatch.setattr(flops_module.time, "perf_counter", lambda: clock[0])
    logged = []
    module = SimpleNamespace(log_dict=lambda logs, **kwargs: logged.append(dict(logs)), device=torch.device("cpu"))
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=2, world_size=world_size, training=True,
                              precision="bf16-mixed")
    counter = FlopCounter(peak_tflops=1.0)
    counter.flops_per_step = int(3e12)
    counter.on_train_batch_end(trainer, module, None, None, 0)
    for interval in range(2):
        for _ in range(2):  # two steps of 1 s each, validations between them in the first interval
            clock[0] += 1.0
            if interval == 0 and trainer.global_step == 0:
                for seconds in validations:
                    counter.on_validation_start(trainer, module)
                    clock[0] += seconds
                    counter.on_validation_end(trainer, module)
            trainer.global_step += 1
        counter.on_train_batch_end(trainer, module, None, None, 1)
    return logged


def test_tflops_per_s_is_per_device_and_leaves_every_validation_out(monkeypatch):
    for world_size, validations in ((2, (10.0,)), (1, (10.0, 5.0))):
        logged = _interval(monkeypatch, world_size, validations)
        for logs in logged[1:]:  # both intervals: 2 steps x 3 TFLOP in 2 s of training, per device
            assert logs["Train_Total/tflops_per_s"] == pytest.approx(3.0)
            assert logs["Train_Total/mfu"] == pytest.approx(3.0)
        assert logged[-1]["Train_Total/tflops"] == pytest.approx(4 * 3.0 * world_size)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16),
                                                  ("32-true", torch.float32), ("bf16-true", torch.bfloat16)])
def test_mfu_is_of_the_peak_for_the_training_precision(monkeypatch, precision, dtype):
    from lwm.callbacks import flop_counter as flops_module
    from lwm.callbacks.flop_counter import FlopCounter

    asked = []
    monkeypatch.setattr(flops_module, "get_available_flops", lambda device, d: asked.append(d) or 2e12)
    trainer = SimpleNamespace(precision=precision)
    assert FlopCounter()._peak(trainer, SimpleNamespace(device=torch.device("cpu"))) == 2e12
    assert asked == [dtype]


# --- benchmarks/temporal_attention.py ---------------------------------------------------------------------------

@pytest.mark.slow
def test_temporal_attention_rollout_pass_bytes_and_flops(monkeypatch, capsys):
    """A rollout pass of t - c queries after c cached keys (timings 1 ns): forward moves q and out at t - c rows and k,
    v at t rows; its FLOPs are the (t - c) x t rectangle."""
    import benchmarks.temporal_attention as ta

    monkeypatch.setattr(ta, "timed", lambda fn, reps=20: (fn(), 1e-9)[1])
    n, h, t, e, c = 2 * 4, 2, 8, 8, 2
    row_bytes = n * h * e * 4
    for backward, flop_factor in ((False, 1), (True, 3)):
        q, kv = (t - c) * row_bytes, 2 * t * row_bytes
        moved = 6 * q + 3 * kv if backward else 2 * q + kv
        monkeypatch.setattr(ta, "copy_bandwidth", lambda device, moved=moved: 2 * moved / 1e-9)
        monkeypatch.setattr(sys, "argv", ["ta", "--batch", "2", "--patches", "4", "--frames", str(t), "--dim", "16",
                                          "--heads", "2", "--cached", str(c)] + (["--backward"] if backward else []))
        ta.main()
        rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("pass:")]
        assert rows
        for row in rows:
            assert float(row[2]) == pytest.approx(moved, abs=0.5), row
            assert row[3] == "50%", row  # the copy moved twice these bytes in the same time
            assert float(row[5]) == pytest.approx(4 * n * h * (t - c) * t * e * flop_factor / 1e3, abs=0.05), row

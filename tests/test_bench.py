"""benchmarks/train_step.py: a smoke run at a tiny size (no speed is asserted: machines here are shared and noisy),
and the numbers it prints following from its timings and FLOP counts."""

from __future__ import annotations

import json
import types

import pytest
import torch

import benchmarks.train_step as ts

TINY = ["--config", "configs/tiny.yaml", "--model.net.height=8", "--model.net.width=8", "--data.batch_size=2",
        "--data.window=5"]


def table_rows(printed: str) -> dict[str, list[str]]:
    """The printed table's rows by name: the cells after the name."""
    lines = printed.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["step", "steps", "ms/step"])
    rows = {}
    for line in lines[head + 1:]:
        name, _, rest = line.partition("  ")
        if not rest.strip():
            break
        rows[name.strip()] = rest.split()
    return rows


@pytest.mark.slow
def test_the_raw_step_the_fit_and_the_loader_side_by_side(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert ts.main([*TINY, "--steps", "3", "--warmup", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows, result = table_rows(printed), json.loads(out.read_text())
    assert set(rows) == {"raw", "lwm fit", "loader"}, rows
    for name, cells in rows.items():
        assert int(cells[0]) == 3 and all(float(c) > 0 for c in cells[1:5]), (name, cells)
    raw, fit = result["variants"]
    assert (raw["variant"], fit["variant"]) == ("raw", "lwm fit")
    assert raw["steps"] == fit["steps"] == result["loader"]["steps"] == 3  # the same number of timed steps
    assert len(ts.StepTimer.made) == 1 and len(ts.StepTimer.made[0].marks) == 4  # the fit ran past its last one
    assert result["flops"] > 0 and raw["tflop_per_s"] == pytest.approx(result["flops"] / raw["ms_per_step"] / 1e9)
    assert result["fit_overhead"] == pytest.approx(fit["ms_per_step"] / raw["ms_per_step"] - 1)
    assert result["loader_share"] == pytest.approx(result["loader"]["ms_per_step"] / fit["ms_per_step"])
    assert f"lwm fit over the raw step: {result['fit_overhead']:+.1%} ms/step" in printed
    assert f"loader: {result['loader_share']:.1%} of a fit step" in printed


def test_rates_are_of_the_mean_step():
    """Unequal steps (0.25, 0.25, 1 s): ms/step, steps/s, frames/s, TFLOP/s and MFU of the mean (0.5 s), the median
    beside it."""
    r = ts.row("raw", [0.25, 0.25, 1.0], batch=4, window=5, flops=int(2e12), peak=8e12)
    assert r["steps"] == 3 and r["ms_per_step"] == pytest.approx(500) and r["ms_median"] == pytest.approx(250)
    assert r["steps_per_s"] == pytest.approx(2) and r["frames_per_s"] == pytest.approx(4 * 5 / 0.5)
    assert r["tflop_per_s"] == pytest.approx(4) and r["mfu"] == pytest.approx(0.5)
    assert ts.row("loader", [0.5], 4, 5)["tflop_per_s"] is None


def test_timed_leaves_the_warmup_out(monkeypatch):
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(ts.time, "perf_counter", lambda: next(clock))
    calls = []
    assert ts.timed(lambda: calls.append(1), steps=3, warmup=2, device=torch.device("cpu")) == [1.0, 1.0, 1.0]
    assert len(calls) == 5


def test_cuda_marks_read_event_milliseconds_as_seconds(monkeypatch):
    class Event:
        clock = 0.0

        def __init__(self, enable_timing=False):
            pass

        def record(self):
            Event.clock += 250.0  # ms
            self.at = Event.clock

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    assert ts.intervals([ts.mark(torch.device("cuda")) for _ in range(3)]) == [0.25, 0.25]


def test_the_fit_timer_takes_each_step_after_the_warmup_less_its_validation(monkeypatch):
    """Warm-up 2, 3 steps of 1 s each (a step: two micro-batches), a 10 s validation after step 3: [1, 1, 1]."""
    clock = [0.0]
    monkeypatch.setattr(ts.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(ts.StepTimer, "warmup", 2)
    monkeypatch.setattr(ts.StepTimer, "steps", 3)
    timer, module = ts.StepTimer(), types.SimpleNamespace(device=torch.device("cpu"))
    trainer = types.SimpleNamespace(global_step=0)
    for step in range(7):
        trainer.global_step = step
        for micro in range(2):
            timer.on_train_batch_start(trainer, module, None, 0)
            clock[0] += 0.5
        if step == 3:
            timer.on_validation_start(trainer, module)
            clock[0] += 10.0
            timer.on_validation_end(trainer, module)
    assert len(timer.marks) == 4 and timer.times() == pytest.approx([1.0, 1.0, 1.0])


@pytest.mark.parametrize(("largest", "step", "start", "found"), [(37, 1, 4, 37), (37, 8, 4, 32), (3, 1, 4, 3),
                                                                 (0, 1, 4, 0), (5000, 1, 4, 4095)])
def test_the_largest_batch_search(monkeypatch, largest, step, start, found):
    """Doubling from the config's batch, then bisecting to ``--batch-step`` (the answer at most step - 1 below the
    largest), up to 65535 temporal-attention sequences (16 patches here: 4095 samples); the memory fraction
    released after."""
    b = object.__new__(ts.Bench)
    b.batch, b.device = start, torch.device("cuda")
    b.net = types.SimpleNamespace(grid=(4, 4))
    b.args = types.SimpleNamespace(memory_gib=None, batch_step=step)
    tried, fractions = [], []
    monkeypatch.setattr(b, "fits", lambda batch: tried.append(batch) or batch <= largest, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=2**36))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f))
    got, trials = b.max_batch()
    assert found - step < got <= found if step > 1 else got == found
    assert [t["batch"] for t in trials] == tried and len(tried) <= 2 * 12 + 2
    assert fractions == [1.0]


@pytest.mark.slow
def test_step_flops_are_linear_in_the_batch_and_leave_out_checkpointing_recompute():
    """The script and the flops callback count one sample's step and multiply by the batch: an identity for every
    counted op (matmuls, convolutions, attention, codebook distances); activation checkpointing's recomputed
    forward is not counted."""
    from lwm.modules.flops import count_flops
    from lwm.modules.world_model import WorldModel

    small = [*TINY, "--model.net.d_model=32", "--model.net.n_heads=2", "--data.batch_size=3"]
    b = ts.Bench(*ts.parse(small))
    model = WorldModel(b.net).train()
    x = torch.rand(3, 5, 16, 8, 8) * 2 - 1

    def full_batch() -> None:
        model.compute(x, step=None).loss.backward()

    assert b.flops() == count_flops(full_batch, dense=False).useful
    checkpointed = ts.Bench(*ts.parse([*small, "--model.net.activation_checkpointing=true"]))
    assert checkpointed.flops() == b.flops()
    model = WorldModel(checkpointed.net).train()
    with model.checkpointing(False):
        plain = count_flops(full_batch, dense=False).useful
    assert model.dynamics.transformer.checkpointing  # restored
    assert count_flops(full_batch, dense=False).useful > plain

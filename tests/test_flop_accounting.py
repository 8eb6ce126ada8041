"""FLOP accounting (from a mutation review): the callback under DeepSpeed and with checkpointing, counts of the SDPA
form whatever the kernel, per-device rates, the peak's precision, and the temporal-attention benchmark's bytes and
FLOPs of a rollout pass (benchmarks/train_step.py's rates and clocks: tests/test_bench.py)."""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import pytest
import torch


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
    callback 'logs the same count' as benchmarks/train_step.py."""
    from lwm.callbacks.flop_counter import FlopCounter

    x = torch.tanh(torch.randn(2, 6, 4, 16, 16))
    assert FlopCounter()._measure(_Trainer(), _module(temporal_attention="matmul"), x) == \
        FlopCounter()._measure(_Trainer(), _module(), x)


def _interval(monkeypatch, world_size=1, validations=(10.0,)):
    from lwm.callbacks import flop_counter as flops_module
    from lwm.callbacks.flop_counter import FlopCounter
    from tests.lightning.helpers import accumulation_counters

    clock = [0.0]
    monkeypatch.setattr(flops_module.time, "perf_counter", lambda: clock[0])
    logged = []
    module = SimpleNamespace(log_dict=lambda logs, **kwargs: logged.append(dict(logs)), device=torch.device("cpu"))
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=2, world_size=world_size, training=True,
                              precision="bf16-mixed", should_stop=False, **accumulation_counters())
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

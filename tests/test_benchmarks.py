"""benchmarks/*.py: the numbers each benchmark prints follow from its timings (timers and clocks replaced by
fakes: no timing is asserted), bytes and FLOPs are counted as documented, warm-up calls are left out."""

from __future__ import annotations

import sys
import types

import pytest


def test_temporal_attention_benchmark_counts_bytes_and_flops(monkeypatch, capsys):
    """With every timing 1 ns, GB/s is the bytes moved: forward 4x q's bytes, forward + backward 12x; TFLOP/s
    / 1000 is the FLOPs (4 n h t^2 e forward, 3x that with the backward); the copy moves 2x its bytes."""
    import benchmarks.temporal_attention as ta

    monkeypatch.setattr(ta, "timed", lambda fn, reps=20: (fn(), 1e-9)[1])
    assert ta.copy_bandwidth("cpu") == pytest.approx(2 * 2**25 * 2 / 1e-9)
    n, h, t, e = 2 * 4, 2, 8, 8  # --batch 2 --patches 4 --frames 8 --dim 16 --heads 2, fp32
    q_bytes = n * h * t * e * 4
    for backward, factor, flop_factor in ((False, 4, 1), (True, 12, 3)):
        monkeypatch.setattr(sys, "argv", ["ta", "--batch", "2", "--patches", "4", "--frames", "8", "--dim", "16",
                                          "--heads", "2", "--cached", "0"] + (["--backward"] if backward else []))
        ta.main()
        lines = capsys.readouterr().out.splitlines()
        rows = [line.split(" | ") for line in lines if line.startswith("sdpa is_causal")]
        assert len(rows) == 1
        assert float(rows[0][2]) == pytest.approx(factor * q_bytes, abs=0.5)
        assert rows[0][4] == "-"  # no specified bandwidth for a CPU
        assert float(rows[0][5]) == pytest.approx(4 * n * h * t * t * e * flop_factor / 1e3, abs=0.05)
        # lwm's Triton kernel (its interpreter here): the same bytes and FLOPs, and the same attention
        fused = [line.split(" | ") for line in lines if line.startswith("triton kernel")]
        assert len(fused) == ta.triton_attention.interpreting()
        for row in fused:
            assert row[2] == rows[0][2] and row[5] == rows[0][5] and float(row[6]) < 1e-5
    # a rollout pass after 2 cached positions: every formulation's answer is the fp32 SDPA's on those queries
    monkeypatch.setattr(sys, "argv", ["ta", "--batch", "2", "--patches", "4", "--frames", "8", "--dim", "16",
                                      "--heads", "2", "--cached", "2"])
    ta.main()
    passes = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("pass:")]
    assert len(passes) == 3 + ta.triton_attention.interpreting()
    assert all(float(row[6]) < 1e-5 for row in passes)
    # with a specified bandwidth: the GB/s as its share (here 1000x the bytes moved per ns / 1e6 GB/s)
    monkeypatch.setattr(sys, "argv", ["ta", "--batch", "2", "--patches", "4", "--frames", "8", "--dim", "16",
                                      "--heads", "2", "--cached", "0", "--spec-gbs", str(4 * q_bytes / 10)])
    ta.main()
    row = next(line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("sdpa is_causal"))
    assert row[4] == "1000%"


def test_temporal_attention_benchmark_times_after_its_warmup(monkeypatch):
    import benchmarks.temporal_attention as ta

    clock = {"t": 0.0, "calls": 0}

    def fn():  # 3 warm-up calls of 100 s, then 1 s each
        clock["t"] += 100.0 if clock["calls"] < 3 else 1.0
        clock["calls"] += 1

    monkeypatch.setattr(ta, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"]))
    assert ta.timed(fn, reps=5) == 1.0


def test_generate_benchmark_frames_per_second_and_ratio(monkeypatch, capsys):
    import benchmarks.generate as gen

    kernels = []

    def time_generate(model, batch, frames, window, cached, device):
        kernels.append({b.temporal.kernel for b in model.dynamics.transformer.blocks})
        return 1.0 if cached else 4.0

    monkeypatch.setattr(gen, "time_generate", time_generate)
    monkeypatch.setattr(sys, "argv", ["gen", "--batch", "2", "--frames", "8"])
    gen.main()
    assert "| 2 | 8 | 16.0 | 4.0 | 4.00x |" in capsys.readouterr().out
    assert kernels == [{"sdpa"}, {"sdpa"}]
    monkeypatch.setattr(sys, "argv", ["gen", "--batch", "2", "--frames", "8", "--temporal-attention", "triton"])
    gen.main()
    assert "temporal attention triton" in capsys.readouterr().out and kernels[2:] == [{"triton"}, {"triton"}]


def test_data_loader_benchmark_rates_follow_from_the_elapsed_time(tmp_path, monkeypatch):
    """With a clock that advances 1 s per reading, the timed batches take exactly 1 s: windows/s is batches x batch,
    MB/s those windows' bytes in the file's dtype, ms/batch 1000 / batches."""
    import time

    import benchmarks.data_loader as dl

    manifest = dl.make_dataset(tmp_path / "d", files=2, frames=12, dtype="float16", layout="contiguous")
    clock = iter(range(10**6))
    monkeypatch.setattr(dl, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock)),
                                                          process_time=time.process_time))
    row = dl.bench(manifest, workers=0, context=None, window=4, batch=2, batches=5, warmup=1, cold=False, itemsize=2)
    assert row["warmup"] == 1 and row["cache"] == "hot" and row["batches"] == "float16"
    assert row["windows_per_s"] == 5 * 2 and row["ms_per_batch"] == 200.0
    assert row["mb_per_s"] == round(10 * 4 * 16 * 64 * 64 * 2 / 1e6, 1)
    assert dl.bench(manifest, 0, None, 4, 2, 1, None, False, 2)["warmup"] == 2  # first batch + nothing prefetched


def test_monitoring_step_timer_skips_the_first_steps(monkeypatch):
    import benchmarks.monitoring as mon

    timer = mon.StepTimer(skip=3)
    for step in range(1, 7):  # global_step after each batch
        timer.on_train_batch_start(types.SimpleNamespace(global_step=step - 1))
        timer.on_train_batch_end(types.SimpleNamespace(global_step=step))
    assert len(timer.times) == 3


def test_gpu_recipe_parses_and_lists_exactly_its_stages(tmp_path):
    """benchmarks/gpu.sh: valid bash; "all" runs every stage it defines, and an unknown stage stops it at once."""
    import re
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    defined = re.findall(r"^stage_(\w+)\(\)", text, flags=re.M)
    listed = re.search(r'stages=\((check[^)]*)\)', text).group(1).split()
    assert listed == defined and len(defined) == 10
    run = subprocess.run(["bash", str(script), str(tmp_path / "out"), "nope"], capture_output=True, text=True)
    assert run.returncode == 2 and "unknown stage nope" in run.stderr


def test_gpu_recipe_runs_the_documented_commands(tmp_path):
    """Every stage with a stand-in python that records its arguments and environment: the commands the README
    describes (compiled kernels, both attention directions, bench with every kernel, the breakdown, max batch with
    and without checkpointing, generation with sdpa and triton, the loader, a DeepSpeed fit resumed from last)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.sh"
    record = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "TRITON_INTERPRET=$TRITON_INTERPRET $*" >> {record}\n'
                    f'[ "$*" = "-m pip --version" ] && [ -n "$NO_PIP" ] && exit 1\nexit 0\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "omegaconf-2.4.0-py3-none-any.whl").write_bytes(b"")
    run = subprocess.run(["bash", str(script), str(out), "all"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "WHEELS": str(wheels)})
    assert run.returncode == 0, run.stderr
    calls = [c for c in record.read_text().splitlines() if not c.endswith("-m pip --version")]
    assert all(c.startswith("TRITON_INTERPRET=0 ") for c in calls)  # compiled kernels, never the interpreter
    joined = "\n".join(calls)
    # the carried wheels first, into a folder on the path of every later command
    assert calls[0].startswith("TRITON_INTERPRET=0 -m pip install -q --no-index --no-deps") and str(wheels) in calls[0]
    for expected in ("-m pytest -q -p no:cacheprovider -o addopts=-ra tests/modules/test_triton_attention.py",
                     "benchmarks/triton_kernels.py", "benchmarks/temporal_attention.py --backward",
                     "-m lwm.cli bench --config configs/base.yaml --steps 20 --warmup 5 --kernels matmul triton "
                     "--no-breakdown",
                     "-m lwm.cli bench --config configs/base.yaml --steps 20 --warmup 5 --no-reference --no-lightning",
                     "--max-batch --no-reference --no-breakdown --no-lightning --steps 3 --warmup 2 "
                     "--model.net.activation_checkpointing=true",
                     "--precision bf16 --temporal-attention sdpa", "--precision bf16 --temporal-attention triton",
                     "benchmarks/data_loader.py --need 100 --workers 1 2 4",
                     "-m lwm.cli data synth", "-m lwm.cli fit --config configs/deepspeed.yaml",
                     "--trainer.max_steps 30 --ckpt_path last"):
        assert expected in joined, expected
    assert sorted(p.name for p in out.glob("*.log")) == sorted(
        f"{s}.log" for s in ("check", "kernels", "attention", "bench", "breakdown", "maxbatch", "maxbatch_ckpt",
                             "generate", "loader", "deepspeed"))
    # an image without pip: the wheels are unpacked (a wheel is a zip of the installed package)
    record.unlink()
    run = subprocess.run(["bash", str(script), str(tmp_path / "out2"), "check"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "WHEELS": str(wheels), "NO_PIP": "1"})
    assert run.returncode == 0, run.stderr
    calls = record.read_text().splitlines()
    assert calls[1] == f"TRITON_INTERPRET=0 -m zipfile -e {wheels}/omegaconf-2.4.0-py3-none-any.whl /tmp/lwm_site"

"""benchmarks/*.py: the numbers each benchmark prints follow from its timings (timers and clocks replaced by
fakes: no timing is asserted), bytes and FLOPs are counted as documented, warm-up calls are left out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
import types

import pytest
import torch


@pytest.mark.slow
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
    # a rollout pass after 2 cached positions: every formulation's answer is the fp32 SDPA's on those queries
    monkeypatch.setattr(sys, "argv", ["ta", "--batch", "2", "--patches", "4", "--frames", "8", "--dim", "16",
                                      "--heads", "2", "--cached", "2"])
    ta.main()
    passes = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("pass:")]
    assert len(passes) == 3
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
    monkeypatch.setattr(sys, "argv", ["gen", "--batch", "2", "--frames", "8", "--temporal-attention", "matmul"])
    gen.main()
    assert "temporal attention matmul" in capsys.readouterr().out and kernels[2:] == [{"matmul"}, {"matmul"}]


@pytest.mark.slow
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


GPU_SH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.sh"


def fake_python(tmp_path: Path, script: str = "") -> tuple[Path, Path]:
    """A stand-in python for benchmarks/gpu.sh that records each call's arguments, runs ``script`` (sh), and exits
    0; -> (its path, the record)."""
    record = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {record}\n'
                    f'[ "$*" = "-m pip --version" ] && [ -n "$NO_PIP" ] && exit 1\n{script}\nexit 0\n')
    fake.chmod(0o755)
    return fake, record


def unpacked(out: Path, tmp_path: Path) -> Path:
    """OUT_DIR holds exactly the summary and the archive (a device call returns at most 8 files): the archive
    unpacked."""
    import tarfile

    assert sorted(f.name for f in out.iterdir()) == ["gpu_results.tar.gz", "summary.txt"]
    where = tmp_path / "unpacked"
    with tarfile.open(out / "gpu_results.tar.gz") as tar:
        # (the "data" filter: Python 3.10.12 / 3.11.4 on; requires-python allows older 3.10s)
        tar.extractall(where, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return where


STAGES = ("check", "bench", "loader", "attention", "generate", "deepspeed", "bench_kernels", "profile", "maxbatch",
          "maxbatch_ckpt")  # `all`, the most wanted first


def gpu_recipe(out: Path, *args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU_SH), str(out), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def stand_in_env(tmp_path: Path, fake: Path, **extra: str) -> dict:
    return {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "WHEELS": str(tmp_path / "no_wheels"),
            "LWM_GPU_SCRATCH": str(tmp_path / "scratch"), **extra}


def test_gpu_recipe_parses_and_all_runs_every_stage_in_its_order():
    """benchmarks/gpu.sh: valid bash; `all` is every stage it defines, each has an estimate (MIN), the caps name
    stages; an unknown stage or a bad budget stops it at once."""
    import re

    assert subprocess.run(["bash", "-n", str(GPU_SH)]).returncode == 0
    text = GPU_SH.read_text()
    defined = re.findall(r"^stage_(\w+)\(\)", text, flags=re.M)
    assert tuple(re.search(r"^ALL=\(([^)]*)\)", text, flags=re.M).group(1).split()) == STAGES
    assert sorted(defined) == sorted(STAGES)
    for table in ("MIN", "CAP"):
        listed = re.findall(r"\[(\w+)\]=\d+", re.search(rf"^declare -A {table}=\(([^)]*)\)", text,
                                                         flags=re.M | re.S).group(1))
        assert set(listed) <= set(defined) and (table == "CAP" or set(listed) == set(defined)), table
    for args, message in ((["nope"], "unknown stage nope"), (["--budget", "5m", "check"], "--budget must be"),
                          ([], "usage")):
        run = subprocess.run(["bash", str(GPU_SH), "/nonexistent/out", *args], capture_output=True, text=True)
        assert run.returncode == 2 and message in run.stderr, (args, run.stderr)


@pytest.mark.slow
def test_gpu_recipe_runs_the_documented_commands(tmp_path):
    """Every stage with a stand-in python that records its arguments and environment: the commands
    docs/performance.md describes (the training step, the loader, both attention directions, generation, a DeepSpeed
    fit resumed from last, the step with every kernel, its profile, max batch on an 80 GB card with and without checkpointing); the logs and JSON packed into one archive, scratch data outside
    OUT_DIR; a second call of `all` leaves out what the first finished, a stage named on its own runs again."""
    fake, record = fake_python(tmp_path)
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "omegaconf-2.4.0-py3-none-any.whl").write_bytes(b"")
    env = stand_in_env(tmp_path, fake, WHEELS=str(wheels))
    run = gpu_recipe(out, "all", env=env)
    assert run.returncode == 0, run.stderr
    calls = [c for c in record.read_text().splitlines() if not c.endswith("-m pip --version")]
    joined = "\n".join(calls)
    # the carried wheels first, into a folder on the path of every later command
    assert calls[0].startswith("-m pip install -q --no-index --no-deps") and str(wheels) in calls[0]
    for expected in ("benchmarks/train_step.py --config configs/base.yaml --steps 10 --warmup 3 --json",
                     "benchmarks/data_loader.py --need 100 --workers 1 2 4",
                     "benchmarks/temporal_attention.py --backward",
                     "--precision bf16 --temporal-attention sdpa",
                     f"-m lwm.cli data synth --out {scratch}/synth", "-m lwm.cli fit --config configs/deepspeed.yaml",
                     "--trainer.max_steps 30 --ckpt_path last",
                     "--kernels matmul --raw-only",
                     "benchmarks/train_step.py --config configs/base.yaml --steps 5 --warmup 3 --raw-only --profile",
                     "--max-batch --memory-gib 78.5 --batch-step 8 --raw-only --steps 3 --warmup 2 "
                     "--model.net.activation_checkpointing=true"):
        assert expected in joined, expected
    assert str(out) not in joined  # scratch data, runs and JSON never in OUT_DIR (a call returns 8 files)
    results = unpacked(out, tmp_path)
    assert sorted(p.name for p in results.glob("*.log")) == sorted([f"{s}.log" for s in STAGES] + ["install.log"])
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("-- call of ") and summary[0].endswith(": all")
    assert [line.split(":")[0] for line in summary[1:]] == list(STAGES)  # in `all`'s order
    # a second call of `all` (on the same machine: the same scratch folder) leaves out what the first finished
    record.unlink()
    run = gpu_recipe(out, "all", env=env)
    assert run.returncode == 0, run.stderr
    assert all(c.endswith("-m pip --version") or "-m pip install" in c for c in record.read_text().splitlines())
    second = (out / "summary.txt").read_text().splitlines()[len(summary):]
    assert second[0].startswith("-- call of ") and second[1:] == [f"{s}: done in an earlier call" for s in STAGES]
    run = gpu_recipe(out, "check", env=env)  # named on its own: run again
    assert run.returncode == 0 and "import torch, lightning" in record.read_text()
    # an image without pip: the wheels are unpacked (a wheel is a zip of the installed package)
    record.unlink()
    run = gpu_recipe(tmp_path / "out2", "check", env={**env, "NO_PIP": "1"})
    assert run.returncode == 0, run.stderr
    calls = record.read_text().splitlines()
    assert calls[1] == f"-m zipfile -e {wheels}/omegaconf-2.4.0-py3-none-any.whl /tmp/lwm_site"


@pytest.mark.slow
def test_gpu_recipe_keeps_to_its_budget(tmp_path):
    """--budget 25 (10 s for stages, 15 kept for packing): check starts (it needs 5 s), its hanging command is
    stopped at the budget and the commands after it are not run (check is not done: a later `all` runs it again);
    attention (60 s) and bench (240 s) are skipped and said to be; the results are packed all the same."""
    import re
    import time

    fake, record = fake_python(tmp_path, 'case "$*" in *"import torch, lightning"*) sleep 60 ;; esac')
    out = tmp_path / "out"
    started = time.monotonic()
    run = gpu_recipe(out, "--budget", "25", "check", "attention", "bench", env=stand_in_env(tmp_path, fake))
    assert run.returncode == 0, run.stderr
    assert time.monotonic() - started < 25  # stopped at the stages' 10 s, not the command's 60
    assert "import torch, lightning" in record.read_text() and "import einops" not in record.read_text()
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].endswith(": check attention bench, budget 25 s")
    # (nvidia-smi fails too where there is none)
    assert summary[1].startswith("check: ") and re.search(r"\d command\(s\) failed, 1 of them stopped at the time "
                                                          r"limit, \d+ not run$", summary[1]), summary[1]
    assert summary[2].startswith("attention: skipped (") and "it needs about 60 s" in summary[2]
    assert summary[3].startswith("bench: skipped (") and "it needs about 240 s" in summary[3]
    results = unpacked(out, tmp_path)
    log = (results / "check.log").read_text()
    assert "(stopped at the stage's time limit)" in log and "(not run: the stage's time is up)" in log
    assert not (results / "check.done").exists()
    assert "summary" in run.stdout and summary[1] in run.stdout


def test_gpu_recipe_stopped_by_a_signal_stops_its_command_and_packs(tmp_path):
    """SIGTERM to the recipe (a call's own time limit) while a command runs: the command is stopped at once, not
    left running, and OUT_DIR still gets the summary and the archive of what was done."""
    import os
    import signal
    import time

    pid_file = tmp_path / "pid"
    fake, _ = fake_python(tmp_path, f'case "$*" in *"import torch, lightning"*) echo $$ > {pid_file}; exec sleep 60 ;; '
                                    'esac')
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(GPU_SH), str(out), "check"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=stand_in_env(tmp_path, fake), text=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # the stand-in's sleep is gone
        os.kill(int(pid_file.read_text()), 0)
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[-1] == "(stopped by a signal)"
    assert (unpacked(out, tmp_path) / "check.log").read_text().startswith("== check")


def test_gpu_recipe_says_what_the_loader_delivers_over_what_the_step_consumes(tmp_path):
    """With bench.json and loader.json from the same machine (the calls' shared scratch folder), the summary ends
    with the loader's best windows/s over the fastest measured step's consumption (steps/s x batch): issue 7's 3x
    target."""
    import json

    fake, _ = fake_python(tmp_path, f'case "$*" in *loader.json*) exec {sys.executable} "$@" ;; esac')
    results = tmp_path / "scratch" / "results"
    results.mkdir(parents=True)
    (results / "bench.json").write_text(json.dumps({"batch": 32, "variants": [{"steps_per_s": 2.5},
                                                                                {"steps_per_s": 3.0}]}))
    (results / "loader.json").write_text(json.dumps([{"windows_per_s": 300.0}, {"windows_per_s": 480.0}]))
    out = tmp_path / "out"
    run = gpu_recipe(out, "check", env=stand_in_env(tmp_path, fake))
    assert run.returncode == 0, run.stderr
    line = "loader: 480 windows/s, 5.0x the 96 windows/s of the fastest step measured"
    assert (out / "summary.txt").read_text().splitlines()[-1] == line and line in run.stdout


def test_action_readout_prints_each_games_accuracy_beside_its_most_frequent_action(tmp_path, capsys):
    import benchmarks.action_readout as readout
    from lwm.data.synth import make_dataset
    from lwm.inference.study import load_clips

    train = make_dataset(tmp_path / "train", episodes=4, frames=8, seed=0, size=64)  # footage.yaml's 32x32 latents
    test = make_dataset(tmp_path / "test", episodes=4, frames=8, seed=1, size=64)
    assert readout.main(["--train", str(train), "--test", str(test), "--steps", "1", "--games", "a", "b"]) == 0
    clips = load_clips(test, None, 8, per_file=16)
    rows = {line.split(" | ")[0][2:]: line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    for w in clips.worlds.unique().tolist():
        actions = clips.actions[clips.worlds == w][:, :-1].flatten()
        share = torch.bincount(actions).max().item() / len(actions)
        assert rows[["a", "b"][w] if w < 2 else str(w)].endswith(f"| {share:.3f} |")

"""The SLURM scripts end to end on a real SLURM: an array job (slurm/submit_array.sh, slurm/array.sbatch) and a
preempted training job (slurm/train.sbatch) that Lightning requeues and that resumes where it stopped.

These tests need a running SLURM whose jobs can read this repository and the test directories. They never
install or start one; without one (no ``sbatch`` on PATH, or ``scontrol ping`` not answering) they are skipped.
On one Debian/Ubuntu machine, as root:

    slurm/start_local_slurm.sh                # installs slurm-wlm + munge if missing; starts munged, slurmctld, slurmd
    .venv/bin/python -m pytest -q tests/slurm
    slurm/stop_local_slurm.sh                 # optional

The jobs are submitted from the repository root and run ``lwm`` from the Python running the tests. Their files
go under pytest's tmp_path, or under ``$LWM_SLURM_TEST_DIR`` when set (a directory every compute node sees, for a
multi-node cluster). The local cluster's slurm.conf starts a requeued job again after about 30 s; a cluster with
SLURM's defaults takes about 3 minutes (``AuthInfo=cred_expire``, 120 s, plus the scheduler interval).
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.lightning.helpers import REPO, make_dataset, tiny_args

pytestmark = pytest.mark.slow

TINY = "configs/tiny.yaml"
_STATUS: list[str | None] = []


def _slurm_unavailable() -> str | None:
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return "SLURM is not available: no sbatch/scontrol on PATH (start one with slurm/start_local_slurm.sh)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"SLURM is not available: `scontrol ping` failed ({e}); start it with slurm/start_local_slurm.sh"
    if "is UP" not in ping.stdout:
        text = ((ping.stdout + ping.stderr).strip().splitlines() or ["no answer"])[0]
        return f"SLURM is not available: slurmctld does not answer `scontrol ping` ({text}); start it with slurm/start_local_slurm.sh"
    return None


@pytest.fixture
def slurm() -> None:
    if not _STATUS:
        _STATUS.append(_slurm_unavailable())
    if _STATUS[0]:
        pytest.skip(_STATUS[0])


@pytest.fixture
def workdir(tmp_path, slurm):
    base = os.environ.get("LWM_SLURM_TEST_DIR")
    if not base:
        yield tmp_path
        return
    Path(base).mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="lwm-slurm-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _job_env() -> dict[str, str]:
    env = dict(os.environ)
    lwm = Path(sys.executable).with_name("lwm")
    env["LWM"] = str(lwm) if lwm.exists() else f"{sys.executable} -m lwm.cli"
    for k in ("RUN_DIR", "RUN_ROOT", "SBATCH_OPTS", "ARRAY_MAX", "LWM_REPO"):
        env.pop(k, None)
    return env


def _submit(cmd: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}{out.stderr}"
    m = re.search(r"Submitted batch job (\d+)", out.stdout) or re.match(r"(\d+)", out.stdout.strip())
    assert m, out.stdout
    return m.group(1)


def _queued(job: str) -> list[str]:
    """``STATE REASON`` of the job's (array) tasks still in the queue."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True, timeout=30)
    return out.stdout.split("\n")[:-1] if out.returncode == 0 else []


def _wait_gone(job: str, timeout: float, on_poll=None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = _queued(job)
        if on_poll:
            on_poll(states)
        if not states:
            return
        time.sleep(2)
    raise AssertionError(f"job {job} still queued after {timeout:.0f} s: {_queued(job)}")


def _job_records(job: str) -> list[dict[str, str]]:
    """``scontrol show job`` records (one per array task); empty once SLURM has forgotten the job (MinJobAge)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return []
    return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in out.stdout.splitlines() if line]


def _cancel(job: str) -> None:
    subprocess.run(["scancel", job], capture_output=True, timeout=30)


def _train_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("Train_Total/loss")]


def _global_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def _common(manifest: Path) -> list[str]:
    """tiny_args' overrides for the small frames, without the verb, config and run directory."""
    return [a for a in tiny_args(manifest, Path("unused"))[3:] if not a.startswith("--trainer.default_root_dir")]


def test_array_runs_one_task_per_line(workdir):
    manifest = make_dataset(workdir / "data")
    own_dir = workdir / "own_dir"
    taskfile = workdir / "tasks.txt"
    taskfile.write_text(
        "# config and overrides, one run per line\n"
        f"{TINY} --trainer.max_steps=6 --data.batch_size=2\n"
        "\n"
        f"{TINY} --trainer.max_steps=9 --model.optim.lr=0.0005 '--trainer.default_root_dir={own_dir}'\n"
    )
    env = _job_env() | {"RUN_ROOT": str(workdir / "runs"),
                        "SBATCH_OPTS": f"--output={workdir}/slurm-%A_%a.out --job-name=lwm-test-array"}
    t0 = time.monotonic()
    job = _submit(["slurm/submit_array.sh", str(taskfile), *_common(manifest)], env)
    try:
        _wait_gone(job, timeout=170)
    finally:
        _cancel(job)
    elapsed = time.monotonic() - t0
    logs = {p.name: p.read_text() for p in workdir.glob("slurm-*.out")}
    assert sorted(logs) == [f"slurm-{job}_0.out", f"slurm-{job}_1.out"], logs
    records = _job_records(job)
    if records:
        assert sorted(r["JobState"] for r in records) == ["COMPLETED", "COMPLETED"], (records, logs)

    for task, run_dir, steps, key, value in [(0, workdir / "runs" / "task_0", 6, "batch_size", "2"),
                                             (1, own_dir, 9, "lr", "0.0005")]:
        log = logs[f"slurm-{job}_{task}.out"]
        assert (run_dir / "metrics.csv").is_file() and (run_dir / "config.yaml").is_file(), log
        assert _global_step(run_dir / "checkpoints" / "last.ckpt") == steps, log
        assert sorted(set(_train_steps(run_dir))) == list(range(steps)), log
        assert re.search(rf"^\s+{key}: {value}$", (run_dir / "config.yaml").read_text(), re.M), log
        assert "starting fresh" in log
    assert not (workdir / "runs" / "task_1").exists()
    print(f"array job {job}: 2 tasks in {elapsed:.0f} s")


def test_preempted_job_is_requeued_and_resumes(workdir):
    manifest = make_dataset(workdir / "data")
    run_dir, out = workdir / "run", workdir / "job.out"
    max_steps, every = 40, 4
    env = _job_env() | {"RUN_DIR": str(run_dir)}
    args = [*_common(manifest), f"--trainer.max_steps={max_steps}", f"--checkpoint.every_n_train_steps={every}"]
    t0 = time.monotonic()
    job = _submit(["sbatch", f"--output={out}", "--job-name=lwm-test-requeue", "slurm/train.sbatch", TINY, *args], env)
    seen: set[str] = set()
    try:
        first = run_dir / "checkpoints" / f"step={every:07d}.ckpt"  # training is under way, signal handlers set
        end = time.monotonic() + 150
        while not first.exists():
            assert time.monotonic() < end, f"no {first.name} after 150 s:\n{out.read_text() if out.exists() else ''}"
            assert _queued(job), f"job ended before it was preempted:\n{out.read_text()}"
            time.sleep(0.5)
        t_signal = time.monotonic()
        # What SLURM does before a time limit with --signal=USR1@90 (and what a preempting scheduler can do):
        # SIGUSR1 to the job step's tasks. Lightning saves hpc_ckpt_1.ckpt and runs `scontrol requeue`.
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
        _wait_gone(job, timeout=400, on_poll=lambda states: seen.update(s.split()[0] for s in states))
    finally:
        _cancel(job)
    log = out.read_text()
    print(f"job {job}: signalled {t_signal - t0:.0f} s after submission, done after {time.monotonic() - t0:.0f} s; "
          f"states seen {sorted(seen)}")

    assert "PENDING" in seen, (seen, log)  # the job went back to the queue (Lightning ran `scontrol requeue`) ...
    assert "(restart 1)" in log, log      # ... and its batch script ran a second time
    records = _job_records(job)
    if records:
        assert records[0]["JobState"] == "COMPLETED" and records[0]["Restarts"] == "1", records

    hpc = run_dir / "hpc_ckpt_1.ckpt"
    assert hpc.is_file(), log
    assert _global_step(hpc) >= every
    resumed = re.findall(r"resuming from (\S+)", log)
    assert len(resumed) == 1, log  # only the second start found a checkpoint
    assert Path(resumed[0]).name in ("hpc_ckpt_1.ckpt", "last.ckpt"), log
    assert f"Restored all states from the checkpoint at {resumed[0]}" in log, log
    start = _global_step(Path(resumed[0])) if Path(resumed[0]).name == "hpc_ckpt_1.ckpt" else None
    assert start is None or start >= every

    assert _global_step(run_dir / "checkpoints" / "last.ckpt") == max_steps
    # metrics.csv: the first run's rows, then the resumed run's. lwm's SlurmRequeue saves the requeue checkpoint
    # at a batch end (not inside the signal handler, as Lightning does), so the resumed run continues at exactly
    # the next step: every step logged, none skipped, none shifted.
    steps = _train_steps(run_dir)
    assert steps.count(0) == 1, "the resumed run started again from step 0"
    assert sorted(set(steps)) == list(range(max_steps)), steps


def test_sigterm_saves_at_a_batch_end_and_stops(workdir):
    """SLURM's default preemption (and scancel) is SIGTERM: the run saves at the next batch end (the hpc
    checkpoint and last.ckpt at the same step, past the last periodic checkpoint) and stops without a requeue."""
    manifest = make_dataset(workdir / "data")
    run_dir, out = workdir / "run", workdir / "job.out"
    every = 4
    env = _job_env() | {"RUN_DIR": str(run_dir)}
    args = [*_common(manifest), "--trainer.max_steps=400", f"--checkpoint.every_n_train_steps={every}",
            "--data.num_workers=2"]  # SLURM signals the loader workers too: they must not fail the step
    job = _submit(["sbatch", f"--output={out}", "--job-name=lwm-test-sigterm", "slurm/train.sbatch", TINY, *args], env)
    try:
        first = run_dir / "checkpoints" / f"step={every:07d}.ckpt"
        end = time.monotonic() + 150
        while not first.exists():
            assert time.monotonic() < end, f"no {first.name} after 150 s:\n{out.read_text() if out.exists() else ''}"
            assert _queued(job), f"job ended early:\n{out.read_text()}"
            time.sleep(0.5)
        time.sleep(3)  # a few steps past the periodic checkpoint
        subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
        _wait_gone(job, timeout=200)
    finally:
        _cancel(job)
    log = out.read_text()
    hpc = run_dir / "hpc_ckpt_1.ckpt"
    assert hpc.is_file(), log
    step = _global_step(hpc)
    assert step == _global_step(run_dir / "checkpoints" / "last.ckpt") and step < 400, log
    assert "terminated:" in log and "scontrol requeue" not in log.split("terminated:")[1], log
    assert "(restart 1)" not in log, log

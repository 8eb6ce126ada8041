"""A run SIGKILLed at any moment (during start-up, between steps, in the middle of a checkpoint write) leaves only
complete checkpoints, and `--ckpt_path last` carries it on to exactly the run it would have been."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lwm.training.run_dir import latest_checkpoint
from tests.lightning.helpers import REPO, make_dataset, run, train_series
from tests.lightning.procs import check_checkpoints, lwm_command, lwm_env, one_thread, run_lwm


@pytest.fixture(autouse=True)
def _one_thread():  # in-process runs too (a busy 2-core machine; see procs.lwm_env)
    with one_thread():
        yield


MAX_STEPS = 30
COMMON = [f"--trainer.max_steps={MAX_STEPS}", "--checkpoint.every_n_train_steps=1", "--data.val_size_percent=0"]


def _kill_once(cmd: list[str], ckpt_dir: Path, mode: str, rng: random.Random) -> tuple[bool, list[str]]:
    """Start ``cmd`` and SIGKILL it: ``early`` after a random delay from the start (usually before any step),
    ``write`` as soon as its ``k``-th checkpoint temp file appears (mid-write), ``random`` a random delay after
    its ``k``-th checkpoint write. Returns ``(killed, the temp files it left behind: killed mid-write)``."""
    k = rng.randint(2, 6)  # checkpoint writes (a step file and last.ckpt per step) before the kill
    delay = rng.uniform(0.3, 2.5) if mode == "early" else rng.uniform(0.0, 0.15)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=lwm_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    suffix = f".tmp-{socket.gethostname()}-{proc.pid}"  # AtomicCheckpointIO writes .NAME.tmp-HOST-PID, then
    # os.replace()s it
    try:
        seen: set[str] = set()
        writes = 0
        while proc.poll() is None:
            if mode == "early":
                if time.monotonic() - start >= delay:
                    break
            else:
                try:
                    tmp = {n for n in os.listdir(ckpt_dir) if n.endswith(suffix)}
                except FileNotFoundError:
                    tmp = set()
                writes += len(tmp - seen)
                seen = tmp
                if writes >= k:
                    if mode == "random":
                        time.sleep(delay)
                    break
            time.sleep(0.0005)
    finally:  # the planned kill, or the cleanup when the loop failed
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode in (0, -signal.SIGKILL), proc.returncode  # 0: it finished before the kill
    killed = proc.returncode == -signal.SIGKILL
    left = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(suffix)) if ckpt_dir.is_dir() else []
    return killed, left


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_equals_uninterrupted(tmp_path):
    manifest = make_dataset(tmp_path / "data")
    run_lwm(manifest, tmp_path / "ref", *COMMON)  # uninterrupted, in a subprocess like the others (same threads)
    reference = train_series(tmp_path / "ref")
    assert sorted(reference) == list(range(MAX_STEPS))

    root = tmp_path / "run"
    ckpt_dir = root / "checkpoints"
    cmd = lwm_command(manifest, root, *COMMON, "--ckpt_path=last")
    rng = random.Random(1234)
    kills = mid_write = 0
    for mode in ["write", "random", "early", "write"]:
        killed, left_tmp = _kill_once(cmd, ckpt_dir, mode, rng)
        kills += killed
        mid_write += bool(killed and left_tmp)
        steps = check_checkpoints(ckpt_dir, MAX_STEPS) if ckpt_dir.is_dir() else {}
        print(f"{mode}: killed={killed} left={left_tmp} checkpoints={steps}")  # shown when the test fails
    assert kills == 4, "a run finished before it could be killed"
    assert mid_write >= 1, "no kill landed during a checkpoint write"
    left = check_checkpoints(ckpt_dir, MAX_STEPS)
    resumed = latest_checkpoint(root, ckpt_dir)  # what --ckpt_path last takes
    resumed_from = left[resumed.name] if resumed is not None else 0
    assert resumed_from < MAX_STEPS

    out = run_lwm(manifest, root, *COMMON, "--ckpt_path=last")
    if left:  # (not a fresh start that happens to compute the same numbers)
        assert f"Restored all states from the checkpoint at {ckpt_dir}" in out, out[-3000:]
    steps = check_checkpoints(ckpt_dir, MAX_STEPS)
    assert steps["last.ckpt"] == MAX_STEPS
    kept = {f"step={s:07d}.ckpt" for s in range(MAX_STEPS - 2, MAX_STEPS + 1)}
    if resumed is not None and resumed.name != "last.ckpt":  # Lightning keeps the checkpoint a fit resumed from
        kept.add(resumed.name)
    # A kill between Lightning's save of a step file and its removal of the one that fell out of the top k leaves
    # that one behind: only files there before the final run may be extra.
    names = {n for n in steps if n != "last.ckpt"}
    assert kept <= names and names - kept <= set(left), (sorted(names), sorted(kept), sorted(left))
    assert not [n for n in os.listdir(ckpt_dir) if ".tmp-" in n], "stale temp files were not cleaned up"

    # Every step's row (the last one where a resumed process logged a step again) matches the uninterrupted run: the
    # steps the final process trained after `resumed_from`, and those the killed processes logged before. A killed
    # process can lose the row of its last step: Lightning writes a step's checkpoint (on_train_batch_end) before it
    # logs and flushes that step's metrics, and a resume starts after the checkpoint. At most one row per kill.
    series = train_series(root)
    assert set(series) <= set(range(MAX_STEPS))
    assert set(range(resumed_from, MAX_STEPS)) <= set(series), sorted(series)
    assert MAX_STEPS - len(series) <= kills, sorted(series)
    got = torch.tensor([series[s] for s in sorted(series)])
    want = torch.tensor([reference[s] for s in sorted(series)])
    assert torch.equal(got, want), (sorted(series), got, want)

    a = torch.load(tmp_path / "ref/checkpoints/last.ckpt", weights_only=True)
    b = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == MAX_STEPS
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key


@pytest.mark.slow
def test_a_kill_during_a_last_ckpt_write_loses_one_metrics_row(tmp_path):
    """Killed while last.ckpt of step 5 is written (its step checkpoint done, the step's scalars not yet logged),
    resumed from that step checkpoint: only that step's row is missing from metrics.csv (logged as step 4); the
    row before it (held back until the next step's row began) was written."""
    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.max_steps=8", "--checkpoint.every_n_train_steps=5", "--trainer.val_check_interval=3",
              "--trainer.log_every_n_steps=1"]
    kill = ["--trainer.callbacks+=tests.lightning.helpers.KillAtLastCheckpoint", "--trainer.callbacks.step=5"]
    with pytest.raises(AssertionError, match=f"exited {-signal.SIGKILL}"):
        run_lwm(manifest, tmp_path / "run", *common, *kill)
    assert not (tmp_path / "run/checkpoints/last.ckpt").exists()
    run_lwm(manifest, tmp_path / "run", *common, "--ckpt_path=last")
    assert sorted(train_series(tmp_path / "run")) == [0, 1, 2, 3, 5, 6, 7]
    assert sorted(train_series(tmp_path / "run", "Val_Total/loss")) == [2, 7]  # after steps 3 and 8 (epochs of 5)


@pytest.mark.slow
def test_a_kill_during_a_later_last_ckpt_write_resumes_from_that_steps_checkpoint(tmp_path):
    """Killed while last.ckpt of step 10 is written (step=0000010.ckpt complete, last.ckpt still step 5's, a whole
    interval behind): --ckpt_path last continues from step 10, the latest complete checkpoint; only step 10's row
    (logged as 9) is missing, none redone."""
    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.max_steps=12", "--checkpoint.every_n_train_steps=5", "--data.val_size_percent=0",
              "--trainer.log_every_n_steps=1"]
    kill = ["--trainer.callbacks+=tests.lightning.helpers.KillAtLastCheckpoint", "--trainer.callbacks.step=10"]
    with pytest.raises(AssertionError, match=f"exited {-signal.SIGKILL}"):
        run_lwm(manifest, tmp_path / "run", *common, *kill)
    steps = check_checkpoints(tmp_path / "run/checkpoints", 10)
    assert steps["last.ckpt"] == 5 and steps["step=0000010.ckpt"] == 10, steps
    run_lwm(manifest, tmp_path / "run", *common, "--ckpt_path=last")
    assert sorted(train_series(tmp_path / "run")) == [*range(9), 10, 11]


@pytest.mark.slow
def test_a_corrupt_last_ckpt_beside_its_steps_checkpoint_resumes_from_that_one_with_a_warning(tmp_path):
    """last.ckpt damaged after the run (a bad disk, a copy cut short), step=0000004.ckpt of the same step whole:
    --ckpt_path last continues from the step file, says so, and the resumed run is the uninterrupted one."""
    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.max_steps=4", "--checkpoint.every_n_train_steps=4", "--data.val_size_percent=0"]
    assert run(manifest, tmp_path / "full", *common[1:], "--trainer.max_steps=6") == 0
    assert run(manifest, tmp_path / "run", *common) == 0
    last = tmp_path / "run/checkpoints/last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    with pytest.warns(UserWarning, match=rf"{last}: not a whole checkpoint .*taking .*step=0000004\.ckpt, the run's "
                                         rf"latest whole one \(step 4\)"):
        assert run(manifest, tmp_path / "run", *common[1:], "--trainer.max_steps=6", "--ckpt_path=last") == 0
    assert torch.load(last, weights_only=True)["global_step"] == 6
    assert train_series(tmp_path / "run") == pytest.approx(train_series(tmp_path / "full"), rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_a_kill_right_after_a_checkpoint_written_at_a_validations_end_keeps_that_validations_row(tmp_path):
    """The step-3 checkpoint waits for the validation after step 3 (logged as step 2, in the row of the step's
    training scalars); killed at the start of the next batch, before a later row began, the run resumes after that
    validation: its row was written with the checkpoint, and no step's row is missing."""
    manifest = make_dataset(tmp_path / "data")  # epochs of 5 batches; validation every 3 steps across them
    common = ["--trainer.max_steps=6", "--checkpoint.every_n_train_steps=3", "--trainer.val_check_interval=3",
              "--trainer.check_val_every_n_epoch=null", "--trainer.log_every_n_steps=1"]
    kill = ["--trainer.callbacks+=tests.lightning.helpers.CrashAtStep", "--trainer.callbacks.step=3",
            "--trainer.callbacks.kill=true"]
    with pytest.raises(AssertionError, match=f"exited {-signal.SIGKILL}"):
        run_lwm(manifest, tmp_path / "run", *common, *kill)
    assert torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["global_step"] == 3
    run_lwm(manifest, tmp_path / "run", *common, "--ckpt_path=last")
    assert sorted(train_series(tmp_path / "run")) == list(range(6))
    assert sorted(train_series(tmp_path / "run", "Val_Total/loss")) == [2, 5]


@pytest.mark.slow
def test_ckpt_path_last_in_an_empty_run_dir_starts_fresh(tmp_path):
    manifest = make_dataset(tmp_path / "data")
    common = ["--trainer.max_steps=4", "--checkpoint.every_n_train_steps=2", "--data.val_size_percent=0"]
    assert run(manifest, tmp_path / "ref", *common) == 0
    assert run(manifest, tmp_path / "empty", *common, "--ckpt_path=last") == 0

    # A run dir holding only the temp file of a process killed during its first checkpoint write starts fresh too,
    # and the next save removes that file.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "stale/checkpoints" / f".last.ckpt.tmp-{dead.pid}"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"torn")
    assert run(manifest, tmp_path / "stale", *common, "--ckpt_path=last") == 0
    assert not stale.exists()

    reference = train_series(tmp_path / "ref")
    assert sorted(reference) == list(range(4))
    for name in ("empty", "stale"):
        assert train_series(tmp_path / name) == reference, name
        steps = check_checkpoints(tmp_path / name / "checkpoints", 4)
        assert steps == {"last.ckpt": 4, "step=0000002.ckpt": 2, "step=0000004.ckpt": 4}, (name, steps)


def test_a_save_removes_only_the_temp_files_of_dead_writers(tmp_path):
    from lwm.training.checkpoint import AtomicCheckpointIO

    dead = subprocess.Popen(["true"])
    dead.wait()
    live = tmp_path / f".last.ckpt.tmp-{os.getppid()}"  # a live process: a writer still at work
    stale = tmp_path / f".last.ckpt.tmp-{dead.pid}"
    live.write_bytes(b"x")
    stale.write_bytes(b"x")
    host = socket.gethostname()
    stale_step = tmp_path / f".step=0005000.ckpt.tmp-{host}-{dead.pid}"  # another checkpoint's name (each is new)
    live_here = tmp_path / f".step=0006000.ckpt.tmp-{host}-{os.getppid()}"
    elsewhere_old = tmp_path / f".step=0004000.ckpt.tmp-other-node-7-{os.getppid()}"  # a requeue onto another node
    elsewhere_new = tmp_path / f".step=0007000.ckpt.tmp-other-node-7-{dead.pid}"  # maybe still writing there
    for path in (live, stale, stale_step, live_here, elsewhere_old, elsewhere_new):
        path.write_bytes(b"x")
    hour = time.time() - 3601
    os.utime(elsewhere_old, (hour, hour))
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, tmp_path / "last.ckpt")
    assert live.exists() and live_here.exists() and elsewhere_new.exists()
    assert not stale.exists() and not stale_step.exists() and not elsewhere_old.exists()
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in (live, live_here, elsewhere_new)) + ["last.ckpt"]


@pytest.mark.slow
def test_a_fit_sweeps_the_temp_files_killed_writes_left_in_its_folders(tmp_path, monkeypatch):
    """A kill during an hpc save leaves .hpc_ckpt_1.ckpt.tmp-HOST-PID, whose digits Lightning took for hpc
    checkpoint 199999 (under SLURM, a start with no --ckpt_path then failed to find it); one during a finished
    run's last video or checkpoint write has no later write to sweep it. The next fit removes them first (a
    live writer's and other files stay)."""
    from tests.lightning.test_resume import SLURM_ENV

    manifest = make_dataset(tmp_path / "data")
    root = tmp_path / "run"
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    stale = [root / f".hpc_ckpt_1.ckpt.tmp-{host}-{dead.pid}", root / f"videos/.step_0000004.mp4.tmp-{host}-{dead.pid}",
             root / f"checkpoints/.last.ckpt.tmp-{host}-{dead.pid}"]
    kept = [root / f"checkpoints/.step=0000002.ckpt.tmp-{host}-{os.getppid()}", root / f".notes.txt.tmp-{host}-{dead.pid}"]
    for path in stale + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"torn")
    for name, value in SLURM_ENV.items():
        monkeypatch.setenv(name, value)
    assert run(manifest, root, "--trainer.max_steps=2", "--data.val_size_percent=0") == 0
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)

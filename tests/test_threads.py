"""The CPU threads of a run: the cores not in use unless the user chose, said at the start."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

import lwm.utils.threads as threads
from tests.lightning.helpers import REPO, make_dataset
from tests.lightning.procs import lwm_command, lwm_env

needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs 2 CPUs and Linux")


@contextlib.contextmanager
def busy(cpu: int):
    """A process spinning on ``cpu``."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("idle", "cores", "n"), [(0.0, 2, 1), (0.9, 2, 1), (1.0, 2, 1), (1.5, 2, 2), (2.0, 2, 2),
                                                  (7.6, 4, 4), (2.4, 8, 2)])
def test_the_threads_are_the_idle_cores_rounded_at_least_one(idle, cores, n):
    assert threads.threads_for(idle, cores) == n


@needs_two_cpus
def test_a_cpu_spinning_in_another_process_is_not_idle():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    with busy(cpu):
        assert threads.idle_cpus({cpu}) < 0.5


@pytest.fixture
def fresh(monkeypatch):
    """No choice made in this process yet, torch's count put back after the test."""
    monkeypatch.setattr(threads, "_CHOSEN", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(before)


def test_lwm_takes_the_idle_cores_once_per_process_and_keeps_a_users_choice(fresh):
    monkeypatch = fresh
    monkeypatch.setattr(threads, "physical_cores", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "idle_cpus", lambda cpus: 2.2)
    torch.set_num_threads(3)  # the user's: kept, and said so
    assert threads.set_cpu_threads().startswith("3 (torch.set_num_threads before lwm") and torch.get_num_threads() == 3
    torch.set_num_threads(4)  # torch's own count: the idle cores instead
    assert threads.set_cpu_threads() == "2 (4 cores, 1.8 of them in use by other processes; OMP_NUM_THREADS=N sets them)"
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(threads, "idle_cpus", lambda cpus: 4.0)  # a validation after the fit: the fit's count
    assert threads.set_cpu_threads().startswith("2 (as the run before") and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert threads.set_cpu_threads() == "3 (OMP_NUM_THREADS)" and torch.get_num_threads() == 3


def test_ranks_on_one_machine_share_the_idle_cores_through_omp_num_threads(fresh):
    monkeypatch = fresh
    monkeypatch.setattr(threads, "physical_cores", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "idle_cpus", lambda cpus: 4.0)
    torch.set_num_threads(4)
    assert threads.set_cpu_threads(processes=2).startswith("2 (4 cores, 0.0 of them in use by other processes, shared "
                                                           "by 2 processes")
    assert os.environ["OMP_NUM_THREADS"] == "2"  # (Lightning's launcher keeps it, the ranks it starts inherit it)


@pytest.mark.slow
@needs_two_cpus
def test_a_cpu_fit_beside_a_busy_process_takes_one_thread_and_says_so(tmp_path):
    """On 2 cores with one busy with another process, torch's 2 threads made the demo's step 10x slower."""
    manifest = make_dataset(tmp_path / "data", files=4)
    env = lwm_env()
    del env["OMP_NUM_THREADS"]
    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    with busy(max(cpus)):
        done = subprocess.run(lwm_command(manifest, tmp_path / "run", "--trainer.max_steps=1"), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300,
                              preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CPU threads: 1 (2 cores, " in done.stdout + done.stderr

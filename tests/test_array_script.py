"""slurm/array.sbatch's own logic, without SLURM: which run a task line gets, and that a task directory
refuses a line other than the one it was made by (run with bash, train.sbatch replaced by a stand-in)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _task(repo: Path, taskfile: Path, task: int, *common: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(task), "LWM_REPO": str(repo)}
    env.pop("RUN_ROOT", None)
    return subprocess.run(["bash", str(repo / "slurm/array.sbatch"), str(taskfile), *common], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=60)


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "slurm").mkdir(parents=True)
    shutil.copy(REPO / "slurm/array.sbatch", repo / "slurm/array.sbatch")
    (repo / "slurm/train.sbatch").write_text('echo "train.sbatch $*"\n')  # what the task would run
    return repo


def test_each_task_runs_its_line_in_its_own_directory(tmp_path):
    repo = _repo(tmp_path)
    taskfile = repo / "sweep.txt"
    taskfile.write_text("# a comment\nconfigs/tiny.yaml --model.optim.lr=1e-3\n\nconfigs/tiny.yaml --model.optim.lr=3e-4\n")
    out = _task(repo, taskfile, 1, "--trainer.max_steps=5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == ("train.sbatch configs/tiny.yaml --trainer.max_steps=5 "
                                           "--model.optim.lr=3e-4 --trainer.default_root_dir=runs/sweep/task_1")
    assert (repo / "runs/sweep/task_1/array_task").read_text().splitlines() == [
        "sweep.txt", "configs/tiny.yaml --model.optim.lr=3e-4"]  # relative to the repository, which may move
    again = _task(repo, taskfile, 1, "--trainer.max_steps=50")  # the common overrides may change: same run
    assert again.returncode == 0, again.stderr
    moved = tmp_path / "moved"
    repo.rename(moved)
    assert _task(moved, moved / "sweep.txt", 1).returncode == 0


def test_a_task_directory_refuses_another_line(tmp_path):
    repo = _repo(tmp_path)
    taskfile = repo / "sweep.txt"
    taskfile.write_text("configs/tiny.yaml --model.optim.lr=1e-3\nconfigs/tiny.yaml --model.optim.lr=3e-4\n")
    assert _task(repo, taskfile, 0).returncode == 0
    taskfile.write_text("configs/tiny.yaml --model.optim.lr=3e-4\nconfigs/tiny.yaml --model.optim.lr=1e-3\n")  # reordered
    out = _task(repo, taskfile, 0)
    assert out.returncode == 2 and "train.sbatch" not in out.stdout
    error = out.stderr.strip()
    assert len(error.splitlines()) == 1 and error.startswith("[array.sbatch] error: runs/sweep/task_0 is the run of")
    assert "--model.optim.lr=1e-3" in error and "--model.optim.lr=3e-4" in error and "remove" in error
    other = repo / "other" / "sweep.txt"  # another task file of the same name: the same default directory
    other.parent.mkdir()
    other.write_text("configs/tiny.yaml --model.optim.lr=1e-3\n")
    assert _task(repo, other, 0).returncode == 2
    (repo / "runs/sweep/task_0/array_task").unlink()  # the user's way to continue the run with the new line
    assert _task(repo, taskfile, 0).returncode == 0


def test_a_config_in_the_line_comes_before_the_overrides_and_windows_line_ends_are_dropped(tmp_path):
    """A line that adds a config (every config sets default_root_dir) still runs in its task's directory: the
    directory comes after the line's arguments. A task file saved with CRLF line ends reads as with LF."""
    repo = _repo(tmp_path)
    taskfile = repo / "sweep.txt"
    taskfile.write_bytes(b"configs/base.yaml --config configs/ddp.yaml --model.optim.lr=1e-3\r\n"
                         b"configs/tiny.yaml\r\n")
    out = _task(repo, taskfile, 0, "--trainer.max_steps=9")
    assert out.returncode == 0, out.stderr
    # the configs first (an override before a config that sets the key is refused by lwm), then the common
    # overrides, the line's own, and the task's directory
    assert out.stdout.splitlines()[-1] == ("train.sbatch configs/base.yaml --config configs/ddp.yaml "
                                           "--trainer.max_steps=9 --model.optim.lr=1e-3 "
                                           "--trainer.default_root_dir=runs/sweep/task_0")
    out = _task(repo, taskfile, 1)  # no overrides at all: empty arrays under set -u
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "train.sbatch configs/tiny.yaml --trainer.default_root_dir=runs/sweep/task_1"
    assert (repo / "runs/sweep/task_1/array_task").read_text().splitlines() == ["sweep.txt", "configs/tiny.yaml"]

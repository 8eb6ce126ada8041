"""Running the real ``lwm`` CLI in subprocesses (DDP ranks, SIGKILLed runs), and the checks on what they leave."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch

from tests.lightning.helpers import REPO, tiny_args

STEP_FILE = re.compile(r"step=(\d+)\.ckpt")


def lwm_command(manifest: Path, root: Path, *extra: str, verb: str = "fit") -> list[str]:
    """``python -m lwm.cli VERB`` with the tiny test model (Lightning's DDP launcher re-runs the same command
    for the other ranks, so it has to be a command line, not an in-process call)."""
    return [sys.executable, "-m", "lwm.cli", *tiny_args(manifest, root, *extra, verb=verb)]


def lwm_env() -> dict[str, str]:
    """The environment of a CLI subprocess: the repo root on PYTHONPATH (for ``tests.lightning.*`` callbacks), and
    one intra-op thread. On a busy 2-core machine (2 pytest workers, DDP ranks) two OpenMP threads per process make
    a tiny step 5-10x slower; and runs compared bit for bit must use the same thread count."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PL_GLOBAL_SEED", None)  # seed_everything in the child sets its own
    for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(var, None)  # a fresh process group per run
    return env


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """In-process runs on one intra-op thread, as the subprocesses (see :func:`lwm_env`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_lwm(manifest: Path, root: Path, *extra: str, verb: str = "fit", timeout: float = 300) -> str:
    """Run the CLI to completion and return its output; fails the test with that output when it does not exit 0.
    It runs in a session of its own: on a timeout the whole group (rank 0 and the rank it launched) is killed."""
    proc = subprocess.Popen(lwm_command(manifest, root, *extra, verb=verb), cwd=REPO, env=lwm_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"lwm {verb} ran over {timeout} s:\n{out[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"lwm {verb} exited {proc.returncode}:\n{out[-6000:]}")
    return out


def check_checkpoints(directory: Path, max_steps: int) -> dict[str, int]:
    """Every ``*.ckpt`` in ``directory`` loads with ``weights_only=True``; ``step=N.ckpt`` holds global step N;
    what ``--ckpt_path last`` takes (:meth:`lwm.training.run_dir.RunDir.latest`) holds the highest step of them all
    (``last.ckpt`` lags where a run died between a step's two writes, the step file and then ``last.ckpt``).
    Returns ``{file name: global_step}``."""
    steps = {}
    for path in sorted(directory.glob("*.ckpt")):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a torn or unsafe file
            raise AssertionError(f"{path.name} does not load: {type(e).__name__}: {e}") from e
        assert {"state_dict", "global_step", "loops", "optimizer_states"} <= set(ckpt), path
        steps[path.name] = int(ckpt["global_step"])
        m = STEP_FILE.fullmatch(path.name)
        if m:
            assert steps[path.name] == int(m.group(1)), (path.name, steps[path.name])
    numbered = sorted(v for k, v in steps.items() if k != "last.ckpt")
    assert numbered == sorted(set(numbered))
    if "last.ckpt" in steps:
        assert 0 < steps["last.ckpt"] <= max_steps, steps
    if steps:
        from lwm.training.run_dir import latest_checkpoint

        assert steps[latest_checkpoint(directory.parent, directory).name] == max(steps.values()), steps
    return steps


class RecordMetrics(L.Callback):
    """Each rank writes its ``callback_metrics`` (what a ModelCheckpoint or EarlyStopping monitor reads) at the end
    of each validation to ``directory/rank{r}.json``, the last one kept."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_validation_end(self, trainer, pl_module) -> None:
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({k: float(v) for k, v in trainer.callback_metrics.items()}, f)


class RecordLosses(L.Callback):
    """Each rank writes ``{logged step: its own training loss}`` to ``directory/rank{r}.json`` (the step as
    metrics.csv numbers the row: optimizer steps taken before this batch's)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.fit_loop.epoch_loop._batches_that_stepped] = float(outputs["loss"])

    def on_train_end(self, trainer, pl_module) -> None:
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.losses, f)


class RecordBatches(L.Callback):
    """Each rank writes the ``(file_index, start)`` of every training window it drew to ``directory/rank{r}.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.windows: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.windows += [[int(f), int(s)] for f, s in zip(batch["file_index"], batch["start"])]

    def on_train_end(self, trainer, pl_module) -> None:
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.windows, f)

"""Small datasets, a tiny-config runner and test-only callbacks for the Lightning tests."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import h5py
import lightning as L
import numpy as np
import torch

from lwm.cli.main import main
from lwm.training.loggers import WandbLogger as LwmWandbLogger

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
C, H, W = 4, 16, 16  # small frames keep CPU steps fast; the model is told via model.net overrides


def make_dataset(directory: Path, files: int = 8, frames: int = 14, seed: int = 0, val_fraction: float = 0.25,
                 shape: tuple[int, int, int] = (C, H, W), labels: bool = False, dtype: type = np.float32) -> Path:
    """``files`` smooth random clips of ``frames`` (+ i) frames of ``dtype``, with random ``actions`` (3 of them) and
    a ``world_label`` (i mod 2) where ``labels``; returns the manifest path."""
    from lwm.data.manifest import index_directory

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        x = np.tanh(0.1 * rng.normal(size=(frames + i, *shape)).cumsum(0)).astype(dtype)
        with h5py.File(directory / f"ep{i:02d}.h5", "w") as f:
            f["latents"] = x
            if labels:  # drawn after the latents: the same latents as without labels
                f["actions"] = rng.integers(0, 3, size=frames + i)
                f.attrs["world_label"] = np.int64(i % 2)
    return index_directory(directory, val_fraction=val_fraction).path


def tiny_args(manifest: Path, root: Path, *extra: str, verb: str = "fit") -> list[str]:
    return [
        verb, "--config", str(TINY),
        f"--data.manifest={manifest}", f"--trainer.default_root_dir={root}",
        f"--model.net.in_channels={C}", f"--model.net.height={H}", f"--model.net.width={W}",
        "--model.net.d_model=32", "--model.net.n_heads=2",
        "--model.net.depth_action=1", "--model.net.depth_world=1", "--model.net.depth_dynamics=1",
        "--data.window=6", "--data.batch_size=3",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--wandb.mode=disabled",
        *extra,
    ]


def run(manifest: Path, root: Path, *extra: str, verb: str = "fit") -> int:
    return main(tiny_args(manifest, root, *extra, verb=verb))


def read_metrics(root: Path) -> list[dict[str, float]]:
    """Rows of RUN_DIR/metrics.csv (empty cells dropped), the last row per (step, key set) kept."""
    with open(root / "metrics.csv", newline="") as f:
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    return rows


def process_starts(root: Path, key: str = "Train_Total/loss") -> list[int]:
    """The step each process began logging ``key`` at, from metrics.csv's rows in file order: a process's steps
    increase, so a row whose step is not above the one before opens the next process's run. A run resumed where
    the last left off adds no start; one resumed from an earlier checkpoint starts at its step; a run that
    silently started afresh starts at 0 again."""
    steps = [int(r["step"]) for r in read_metrics(root) if key in r]
    return [s for i, s in enumerate(steps) if i == 0 or s <= steps[i - 1]]


def train_series(root: Path, key: str = "Train_Total/loss") -> dict[int, float]:
    """``{step: value}`` of a training metric; a step logged twice (before and after a resume) keeps the last."""
    return {int(r["step"]): r[key] for r in read_metrics(root) if key in r}


class SimulatedCrash(RuntimeError):
    pass


class CrashAtStep(L.Callback):
    """Raises :class:`SimulatedCrash` at the start of the batch after ``global_step`` reached ``step`` (after
    that step's checkpoint was written), like a process dying mid-epoch; ``during="validation"``: at the first
    batch of a fit's validation from that step on. ``kill``: SIGKILLs its own process instead (no exception
    handling, no logger finalize: a subprocess's run only), before any other callback's hook at that batch."""

    def __init__(self, step: int, during: str = "training", kill: bool = False) -> None:
        self.step, self.during, self.kill = step, during, kill

    def _crash(self, message: str) -> None:
        if self.kill:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        raise SimulatedCrash(message)

    def on_train_batch_start(self, trainer, *args) -> None:
        if self.during == "training" and trainer.global_step >= self.step:
            self._crash(f"simulated crash at global step {trainer.global_step}")

    def on_validation_batch_start(self, trainer, *args, **kwargs) -> None:
        if self.during == "validation" and trainer.global_step >= self.step and not trainer.sanity_checking:
            self._crash(f"simulated crash in the validation at global step {trainer.global_step}")


class DumpQuantizers(L.Callback):
    """At the end of fit, each rank writes its quantizer buffers to ``directory/rank{r}.pt``; and before the first
    optimizer step (the codebooks initialised from data and updated once, before any revival, whose broadcast
    would hide ranks that disagree) to ``directory/first_step_rank{r}.pt``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _dump(self, trainer, pl_module, prefix: str = "") -> None:
        state = {k: v.detach().cpu() for k, v in pl_module.model.state_dict().items() if ".rvq." in k}
        os.makedirs(self.directory, exist_ok=True)
        torch.save(state, os.path.join(self.directory, f"{prefix}rank{trainer.global_rank}.pt"))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            self._dump(trainer, pl_module, "first_step_")

    def on_train_end(self, trainer, pl_module) -> None:
        self._dump(trainer, pl_module)


class WandbLogger(LwmWandbLogger):
    """lwm's WandbLogger on a stand-in wandb run: each committed history row is appended to ``self.sent`` (what
    ``log(..., commit=False)`` gave joins the next one, as in wandb), whether each call committed to
    ``self.commits``."""

    def __init__(self) -> None:
        super().__init__(mode="disabled")
        self.sent: list[dict] = []
        self.commits: list[bool] = []
        row: dict = {}

        def log(data: dict, commit: bool | None = None) -> None:
            row.update(data)
            self.commits.append(commit is not False)
            if commit is not False:
                self.sent.append(dict(row))
                row.clear()

        self.run = type("Run", (), {"log": staticmethod(log), "config": {}})()

    @property
    def experiment(self):
        return self.run

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class SendSignal(L.Callback):
    """Sends this process ``name`` (SIGTERM, as SLURM preempts a job; SIGINT, as Ctrl-C): at the first validation
    batch of the fit's validation after ``step`` (``during="validation"``) or at the start of training batch
    ``step`` (``"training"``); ``"setup"``: the KeyboardInterrupt of a Ctrl-C at the fit's setup; ``validation_batches_after`` records the validation batches that started after it
    (class-wide, for the test)."""

    validation_batches_after: list[int] = []

    def __init__(self, step: int, during: str = "validation", name: str = "SIGTERM") -> None:
        self.step, self.during, self.name, self.sent = step, during, name, False
        SendSignal.validation_batches_after = []

    def _send(self) -> None:
        import signal

        self.sent = True
        os.kill(os.getpid(), getattr(signal, self.name))

    def setup(self, trainer, pl_module, stage) -> None:
        if self.during == "setup":  # Ctrl-C while the fit loads, before lwm's handler is in: Python's raises
            self.sent = True
            raise KeyboardInterrupt

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.during == "training" and not self.sent and trainer.global_step == self.step:
            self._send()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.sanity_checking:
            return
        if self.sent:
            SendSignal.validation_batches_after.append(batch_idx)
        elif self.during == "validation" and trainer.global_step == self.step and batch_idx == 0:
            self._send()


class KillAtLastCheckpoint(L.Callback):
    """SIGKILLs its own process while ``last.ckpt`` of global step ``step`` is being saved (after that step's
    ``step=N.ckpt``), before Lightning has logged the step's training scalars."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.saves = 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step == self.step:
            self.saves += 1
            if self.saves == 2:  # the step checkpoint, then last.ckpt
                import signal

                os.kill(os.getpid(), signal.SIGKILL)


class MarkStep(L.Callback):
    """Writes the file ``path`` at the start of training batch ``step`` (a test outside the process waits for it),
    and from then on sleeps ``seconds`` per batch (the run cannot finish before the test's signal reaches it)."""

    def __init__(self, path: str, step: int = 1, seconds: float = 0.2) -> None:
        self.path, self.step, self.seconds = path, step, seconds

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            Path(self.path).touch()
            import time

            time.sleep(self.seconds)


class _Window:
    """A fit loop's batch counters: its latest batch opens a gradient-accumulation window of 2 where ``inside()``,
    else closes one; ``ended``: as seen from ``on_train_batch_end`` (else from ``on_train_batch_start``)."""

    is_last_batch = False

    def __init__(self, inside, ended: bool) -> None:
        self.inside, self.ended = inside, ended

    @property
    def current(self):
        from types import SimpleNamespace

        ready = 1 if self.inside() else 2
        return SimpleNamespace(ready=ready, processed=ready if self.ended else ready - 1)


def accumulation_counters(inside=lambda: False, ended: bool = True) -> dict:
    """The public trainer fields ``lwm.training.trainer_state`` reads, for a stand-in trainer."""
    from types import SimpleNamespace

    return {"fit_loop": SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=_Window(inside, ended))),
            "accumulate_grad_batches": 2, "num_training_batches": 10}

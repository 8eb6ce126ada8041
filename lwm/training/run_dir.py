"""``lwm resume-info --config CFG [overrides]``: where a run lives and which checkpoint continues it, for the
SLURM scripts (``slurm/train.sbatch`` runs it at every start of a job, first or requeued).

Prints two lines: ``RUN_DIR`` (``trainer.default_root_dir`` as lwm resolves the config, overrides and
interpolations; ``.`` when unset) and the checkpoint to resume from, or an empty line when the run has none.
The candidates are ``CHECKPOINT_DIR/last.ckpt`` (``checkpoint.dirpath``, by default ``RUN_DIR/checkpoints``),
the step checkpoints beside it written after it (a kill between a step's two writes, the step file and then
``last.ckpt``, leaves the step file the newer; where there is no ``last.ckpt``, all of them) and
``RUN_DIR/hpc_ckpt_N.ckpt`` (written when SLURM preempts); the one at the highest global step wins (ties:
``last.ckpt``), read from the file (``weights_only``, memory-mapped; a DeepSpeed directory: from its model
states, where lwm marked it complete), not from its modification time, which a DeepSpeed checkpoint (a
directory rewritten in place) or a shared filesystem's clock skew would get wrong (the time only tells a step
file written after ``last.ckpt``, in the same folder by the same job, from one left by an abandoned branch: a
run resumed from an older checkpoint writes ``last.ckpt`` anew).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lwm.training.checkpoint import deepspeed_step, deepspeed_written, is_deepspeed_checkpoint
from lwm.utils.errors import ConfigError


def _step(path: Path) -> int | None:
    """The global step of a checkpoint file, or of a DeepSpeed checkpoint directory lwm marked complete
    (:func:`lwm.checkpoint.deepspeed_step`); None: unreadable, torn, a DeepSpeed write cut short."""
    import torch


    if path.is_dir():  # DeepSpeed's, rewritten in place: a kill during its write leaves files of two steps
        return deepspeed_step(path)
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
    except Exception:  # a torn or foreign file: not a candidate
        return None


def _written(path: Path) -> float | None:
    """When a checkpoint was last written whole (None: never): a file's time; a DeepSpeed directory's (rewritten in
    place: the folder's own time is not it), :func:`lwm.checkpoint.deepspeed_written`."""

    return deepspeed_written(path) if path.is_dir() else path.stat().st_mtime


def _number(path: Path) -> int:
    digits = re.findall(r"\d+", path.name)
    return int(digits[-1]) if digits else -1


def latest_checkpoint(run_dir: Path, checkpoint_dir: Path) -> Path | None:
    """The checkpoint that continues the run: the highest global step among ``last.ckpt``, the step checkpoints
    written after it was last whole (all of them where there is none: a kill during the first ``last.ckpt`` write
    leaves only a step one; a kill during a later one leaves the step file of that step newer than ``last.ckpt``,
    which is an interval behind or cut short; a ``last.ckpt`` file that does not load, all of them) and the hpc
    ones. A ``last.ckpt`` passed over for not being whole is said in a warning."""
    hpc = sorted(run_dir.glob("hpc_ckpt_*.ckpt"), key=_number)
    last = checkpoint_dir / "last.ckpt"
    steps = sorted((p for p in checkpoint_dir.glob("*.ckpt") if p.name != last.name), key=_number, reverse=True)
    last_step = _step(last) if last.exists() else None
    # a torn last.ckpt file was never whole: its time says nothing (a DeepSpeed one keeps its last whole time)
    since = _written(last) if last_step is not None or last.is_dir() else None
    if since is not None:  # (a step file older than last.ckpt: of a branch abandoned for an earlier checkpoint)
        steps = [p for p in steps if (written := _written(p)) is not None and written >= since]
    candidates = [p for p in (last, *reversed(hpc), *steps) if p.exists()]
    steps = {p: s for p in candidates if (s := _step(p)) is not None}
    if not steps:  # none readable: the first, for lwm fit to refuse loudly (never a silent fresh start)
        return candidates[0] if candidates else None
    found = max(steps, key=lambda p: steps[p])  # ties: last.ckpt (listed first)
    if last.exists() and last_step is None:
        rank_zero_warn(f"{last}: not a whole checkpoint (unreadable, or its write cut short): taking {found}, the "
                       f"run's latest whole one (step {steps[found]})")
    return found


def run_of(path: str | Path) -> Path | None:
    """The folder of the fit a checkpoint belongs to: ``RUN`` of ``RUN/checkpoints/X.ckpt``, or ``RUN`` given itself
    (a run's folder holds the fit's ``config.yaml`` and ``checkpoints/``); None for anything else."""
    path = Path(path)
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        return path
    return None

def checkpoint_file(path: str | Path, checkpoints: str | Path | None = None) -> Path:
    """A ``--ckpt_path`` as the file to read: a run's folder (RUN_DIR) or its checkpoint folder is the run's latest
    checkpoint (:func:`lwm.resume.latest_checkpoint`: ``last.ckpt``, or a newer step or hpc one), and so is
    ``last`` where the verb knows the run's checkpoint folder; else as given."""
    if str(path) == "last":
        if checkpoints is None:
            raise ConfigError("--ckpt_path last: this command has no run folder to look in; give the run's folder "
                              "(RUN_DIR) or a checkpoint file")
        folder = Path(checkpoints)
        found = latest_checkpoint(folder.parent, folder)
        return found if found is not None else folder / "last.ckpt"  # (missing: named by the loader)
    path = Path(path)
    if not path.is_dir() or is_deepspeed_checkpoint(path):  # a file; DeepSpeed's
        return path
    if (path / "checkpoints").is_dir():  # RUN_DIR
        run, folder = path, path / "checkpoints"
    else:  # its checkpoint folder (RUN_DIR/checkpoints: the hpc ones are in RUN_DIR), or a folder of checkpoints
        run, folder = (path.resolve().parent if path.resolve().name == "checkpoints" else path), path  # (`.` too)
    return latest_checkpoint(run, folder) or path


def fit_resumes(ckpt_path: str | None, root: str) -> bool:
    """Whether a fit continues a run: from ``ckpt_path`` (``last`` resolved) where that exists, or, given none, from
    a requeue's ``RUN_DIR/hpc_ckpt_N.ckpt`` under SLURM (where Lightning resumes from it)."""
    hpc = bool(glob.glob(os.path.join(root, "hpc_ckpt_*.ckpt")))
    if ckpt_path == "hpc":
        return hpc
    if ckpt_path:
        return os.path.exists(ckpt_path)
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return hpc and SLURMEnvironment.detect()

class _RunLock:
    """One fit at a time per RUN_DIR: an exclusive ``flock`` on ``RUN_DIR/.lwm.lock``, held by global rank 0 while
    the fit runs (two fits into one folder would write the same ``last.ckpt`` and ``metrics.csv``; say the same
    job submitted twice). The file names its holder (host, pid, SLURM job). Where the filesystem has no locks, none.
    A SLURM requeue of the holder's own job goes on (its previous start is over, whatever a network filesystem's
    lock says)."""

    def __init__(self, run_dir: str) -> None:
        import fcntl
        import socket

        self.path = os.path.join(run_dir, ".lwm.lock")
        self._made = None if os.path.isdir(run_dir) else run_dir  # removed again if left empty (a check refused)
        os.makedirs(run_dir, exist_ok=True)
        job = os.environ.get("SLURM_JOB_ID", "")
        self._file: Any = open(self.path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().split()
            self._file.close()
            self._file = None
            if job and len(holder) == 3 and holder[2] == job:
                rank_zero_warn(f"{self.path}: held by this SLURM job's previous start ({' '.join(holder[:2])}): "
                               f"going on")
                return
            who = f"pid {holder[1]} on {holder[0]}" + (f", SLURM job {holder[2]}" if len(holder) == 3 else "") \
                if len(holder) >= 2 else "another process"
            raise ConfigError(f"trainer.default_root_dir={run_dir}: another lwm fit is running in it ({who}; "
                              f"{self.path}); wait for it, or start this one in another folder") from None
        except OSError:  # no locks on this filesystem (some network ones): none taken
            self._file.close()
            self._file = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            return
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{socket.gethostname()} {os.getpid()}{' ' + job if job else ''}\n")
        self._file.flush()

    def release(self) -> None:
        """Removed, then unlocked (a fit started at that very moment may lock the removed file: as without one)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self._file.close()
            self._file = None
            if self._made is not None:
                with contextlib.suppress(OSError):  # (not empty: the run's files)
                    os.rmdir(self._made)

class _HoldRunLock(L.Callback):
    """Takes :class:`_RunLock` for a fit at its setup, once the ranks can talk: global rank 0 locks and every rank
    raises its refusal (a refusal on rank 0 alone before the process group exists leaves the others of an
    ``srun``/``torchrun`` start waiting for it). Released at teardown (and by the CLI after the fit, whatever
    happened)."""

    def __init__(self) -> None:
        self.lock: _RunLock | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        refusal = None
        if trainer.is_global_zero:
            try:
                self.lock = _RunLock(trainer.default_root_dir)
            except ConfigError as e:
                refusal = str(e)
        if trainer.world_size > 1:
            refusal = trainer.strategy.broadcast(refusal, src=0)
        if refusal is not None:
            raise ConfigError(refusal)
        for logger in trainer.loggers:  # held: their runs may start (a wandb run: not for a refused fit)
            if getattr(logger, "wait_for_lock", False):
                logger.wait_for_lock = False

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

"""The run directory: RUN_DIR (``trainer.default_root_dir``), its checkpoint folder, which checkpoint continues the
run (``--ckpt_path last``, a SLURM requeue, ``lwm resume-info``), the refusals that protect a run, and its lock."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import socket
import warnings
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning as L
import torch
from fsspec.utils import get_protocol
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lwm.training.checkpoint import (DEEPSPEED_MARK, deepspeed_step, deepspeed_written, is_deepspeed_checkpoint,
                                     read_checkpoint)
from lwm.utils.errors import ConfigError, DataError
from lwm.utils.files import remove_stale_temp_files
from lwm.utils.video import VIDEO_SUFFIXES

EVAL_VERBS = ("validate", "test", "predict")


def _step(path: Path) -> int | None:
    """A checkpoint's global step (a DeepSpeed directory's where lwm marked it whole); None: torn or foreign."""
    if path.is_dir():
        return deepspeed_step(path)
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
    except Exception:
        return None


def _written(path: Path) -> float | None:
    """When a checkpoint was last whole."""
    return deepspeed_written(path) if path.is_dir() else path.stat().st_mtime


def _number(path: Path) -> int:
    digits = re.findall(r"\d+", path.name)
    return int(digits[-1]) if digits else -1


def latest_checkpoint(run_dir: Path, checkpoint_dir: Path) -> Path | None:
    """The checkpoint that continues the run: the highest step among ``last.ckpt``, the step checkpoints written
    since it was last whole (all of them where it does not load) and the hpc ones."""
    hpc = sorted(run_dir.glob("hpc_ckpt_*.ckpt"), key=_number)
    last = checkpoint_dir / "last.ckpt"
    steps = sorted((p for p in checkpoint_dir.glob("*.ckpt") if p.name != last.name), key=_number, reverse=True)
    last_step = _step(last) if last.exists() else None
    since = _written(last) if last_step is not None or last.is_dir() else None  # a torn file was never whole
    if since is not None:
        steps = [p for p in steps if (written := _written(p)) is not None and written >= since]
    candidates = [p for p in (last, *reversed(hpc), *steps) if p.exists()]
    steps = {p: s for p in candidates if (s := _step(p)) is not None}
    if not steps:  # none readable
        return candidates[0] if candidates else None
    found = max(steps, key=lambda p: steps[p])
    if last.exists() and last_step is None:
        rank_zero_warn(f"{last}: not a whole checkpoint (unreadable, or its write cut short): taking {found}, the "
                       f"run's latest whole one (step {steps[found]})")
    return found


def run_of(path: str | Path) -> Path | None:
    """The fit's folder of ``RUN/checkpoints/X.ckpt``, or ``RUN`` itself (holding ``config.yaml`` and
    ``checkpoints/``); None for anything else."""
    path = Path(path)
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        return path
    return None


def checkpoint_file(path: str | Path, checkpoints: str | Path | None = None) -> Path:
    """A ``--ckpt_path`` as the file to read: a run's folder or checkpoint folder (and ``last``, given the
    checkpoint folder) is its latest checkpoint."""
    if str(path) == "last" and checkpoints is not None:
        folder = Path(checkpoints)
        return latest_checkpoint(folder.parent, folder) or folder / "last.ckpt"  # (missing: named by the loader)
    path = Path(path)
    if not path.is_dir() or is_deepspeed_checkpoint(path):
        return path
    if (path / "checkpoints").is_dir():  # RUN_DIR
        run, folder = path, path / "checkpoints"
    else:  # a checkpoint folder
        run, folder = (path.resolve().parent if path.resolve().name == "checkpoints" else path), path
    return latest_checkpoint(run, folder) or path


def check_deepspeed_checkpoint(path: Any, label: str) -> None:
    """Refuse a DeepSpeed directory without lwm's completion mark: its files may be of two steps."""
    if deepspeed_step(path) is None:
        raise DataError(f"{label} {path}: a DeepSpeed checkpoint that is not whole (no {DEEPSPEED_MARK} of its step: "
                        f"a kill cut its write short, or an lwm before completion marks wrote it: if you know it "
                        f"whole, write {{\"global_step\": N}} into its {DEEPSPEED_MARK}); give another of the run's "
                        f"checkpoints")


def read_checkpoint_arg(path: Any) -> bool:
    """Read a ``--ckpt_path`` naming a local checkpoint file (refused in one line if missing, torn or foreign)."""
    if path in ("best", "hpc", "registry") or str(path).startswith("registry:") or get_protocol(str(path)) != "file":
        return False
    if is_deepspeed_checkpoint(path):
        check_deepspeed_checkpoint(path, "--ckpt_path")
        return False
    read_checkpoint(path, "--ckpt_path")
    return True


class RunDir:
    """One run's folder: its paths, the checkpoint ``last`` names, whether a fit resumes, and the refusals that keep
    a run whole."""

    def __init__(self, root: str | Path, checkpoints: str | Path | None = None) -> None:
        self.root = str(root)
        self.checkpoints = str(checkpoints) if checkpoints else os.path.join(self.root, "checkpoints")

    @classmethod
    def of(cls, config: Any) -> RunDir:
        root = (config.get("trainer") or {}).get("default_root_dir") or "."
        return cls(root, (config.get("checkpoint") or {}).get("dirpath"))

    def latest(self) -> Path | None:
        return latest_checkpoint(Path(self.root), Path(self.checkpoints))

    @cached_property
    def last(self) -> str:
        """What ``--ckpt_path last`` names: the latest checkpoint, else ``CHECKPOINT_DIR/last.ckpt`` (read once)."""
        found = self.latest()
        return str(found) if found is not None else os.path.join(self.checkpoints, "last.ckpt")

    def resumes(self, ckpt_path: str | None) -> bool:
        """Whether a fit continues the run: from ``ckpt_path`` where it exists, or, given none, from a requeue's hpc
        checkpoint under SLURM (as Lightning does)."""
        hpc = bool(glob.glob(os.path.join(self.root, "hpc_ckpt_*.ckpt")))
        if ckpt_path == "hpc":
            return hpc
        if ckpt_path:
            return os.path.exists(self.last if ckpt_path == "last" else ckpt_path)
        return hpc and SLURMEnvironment.detect()

    def checked_ckpt_path(self, verb: str, ckpt_path: str | None, save_last: Any = True) -> str | None:
        """``--ckpt_path`` checked for ``verb``, ``last`` resolved to the run's latest whole checkpoint (Lightning's
        is ``last.ckpt``, cut short or behind a newer one); a SLURM requeue's fit resumes from it."""
        if verb == "fit":
            if save_last is not True:  # "link": stale after a stop on a signal or at the end
                raise ConfigError(f"checkpoint.save_last={save_last}: lwm needs true (last.ckpt written as a file of "
                                  f"its own at a stop, a signal and the end of fit: what --ckpt_path last and the "
                                  f"SLURM scripts resume from)")
            if os.path.exists(self.checkpoints) and not os.path.isdir(self.checkpoints):
                raise ConfigError(f"checkpoint.dirpath={self.checkpoints}: exists and is not a folder")
            if ckpt_path is None and self.resumes(None):
                ckpt_path = "last"
            elif ckpt_path is None:
                self.check_no_run_yet()
            elif ckpt_path == "last":
                if not os.path.exists(self.last):
                    warnings.filterwarnings("ignore", message=r".*ckpt_path=\"last\"\) is set, but there is no last")
                    rank_zero_info(f"--ckpt_path last: no {self.last} yet, so this fit starts a new run")
            elif read_checkpoint_arg(ckpt_path) and os.path.realpath(os.path.dirname(os.path.abspath(ckpt_path))) \
                    not in map(os.path.realpath, (self.checkpoints, self.root)):  # not one of the run's own
                self.check_no_run_yet(f" (--ckpt_path {ckpt_path} is not one of its checkpoints)")
        elif ckpt_path is None:
            found = self.latest()
            hint = f"--ckpt_path last takes {found}" if found is not None else "give --ckpt_path"
            rank_zero_warn(f"lwm {verb} without --ckpt_path: the untrained model, as initialised ({hint})")
        elif ckpt_path == "last":
            if not os.path.exists(self.last):
                raise ConfigError(f"--ckpt_path last: no checkpoint in the run ({self.last} does not exist)")
        else:
            read_checkpoint_arg(ckpt_path)
        if ckpt_path != "last" or not os.path.exists(self.last):
            return ckpt_path
        if is_deepspeed_checkpoint(self.last):
            check_deepspeed_checkpoint(self.last, "--ckpt_path last:")
        return self.last

    def check_no_run_yet(self, why: str = "") -> None:
        """A fresh fit into a folder with a run's checkpoints would start over on them: refused (a SLURM requeue's
        resumes instead)."""
        if self.resumes(None):
            return
        names = sorted(os.path.basename(f) for f in glob.glob(os.path.join(glob.escape(self.checkpoints), "*.ckpt")))
        if names:
            name = "last.ckpt" if "last.ckpt" in names else names[-1]
            raise ConfigError(f"{os.path.join(self.checkpoints, name)}: trainer.default_root_dir={self.root} already "
                              f"holds a run{why}; continue it with --ckpt_path last, or start a new one in another "
                              f"trainer.default_root_dir")

    def warn_other_run(self, verb: str, path: str) -> None:
        """Warn where ``path`` is another run's checkpoint: this verb's files go elsewhere than beside it."""
        run, root = run_of(Path(path).resolve()), Path(self.root).resolve()
        if run is not None and run != root:
            warnings.warn(f"--ckpt_path {path} is the run {run}'s, but this {verb} writes its files under "
                          f"trainer.default_root_dir {root / verb} (--trainer.default_root_dir={run} puts them "
                          f"beside its checkpoints)", stacklevel=2)

    def sweep_temp_files(self) -> None:
        """Remove the temp files killed writers left (Lightning reads ``.hpc_ckpt_1.ckpt.tmp-HOST-PID``'s digits as
        an hpc checkpoint's number)."""
        root = Path(self.root)
        for folder, ours in ((root, lambda n: n.startswith("hpc_ckpt_") or n == "metrics.csv"),
                             (root / "videos", lambda n: Path(n).suffix in VIDEO_SUFFIXES),
                             (Path(self.checkpoints), lambda n: n.endswith(".ckpt") or n == "codes.pt")):
            if folder.is_dir():
                remove_stale_temp_files(folder, target=ours)


class RunLock:
    """One fit at a time per RUN_DIR: an exclusive ``flock`` on ``RUN_DIR/.lwm.lock`` naming its holder (host, pid,
    SLURM job), held by global rank 0."""

    def __init__(self, run_dir: str) -> None:
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
        except OSError:  # no locks on this filesystem
            self._file.close()
            self._file = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            return
        self._file.truncate(0)  # (appended at the end: from the start)
        self._file.write(f"{socket.gethostname()} {os.getpid()}{' ' + job if job else ''}\n")
        self._file.flush()

    def release(self) -> None:
        """Removed, then unlocked."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self._file.close()
            self._file = None
            if self._made is not None:
                with contextlib.suppress(OSError):  # (not empty: the run's files)
                    os.rmdir(self._made)


class HoldRunLock(L.Callback):
    """Takes the :class:`RunLock` at a fit's setup, once the ranks can talk (rank 0 locks, every rank raises its
    refusal)."""

    def __init__(self) -> None:
        self.lock: RunLock | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        refusal = None
        if trainer.is_global_zero:
            try:
                self.lock = RunLock(trainer.default_root_dir)
            except ConfigError as e:
                refusal = str(e)
        refusal = trainer.strategy.broadcast(refusal, src=0)
        if refusal is not None:
            raise ConfigError(refusal)
        for logger in trainer.loggers:  # held: their runs may start (a wandb run: not for a refused fit)
            if getattr(logger, "wait_for_lock", False):
                logger.wait_for_lock = False

    def release(self, *hook_args: Any, **hook_kwargs: Any) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    teardown = on_exception = release  # (Lightning's teardown hooks do not run after a failure)

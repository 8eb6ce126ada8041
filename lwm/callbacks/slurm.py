"""Stopping on a signal with a checkpoint written at the end of a batch, not inside the signal handler: a SLURM
preemption or requeue, and outside SLURM an interrupt (Ctrl-C, ``kill``)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import _TunerExitException  # private: no public clean end of a fit

from lwm.training.checkpoint import ModelCheckpoint
from lwm.training.trainer_state import accumulating, every_rank
from lwm.utils.errors import ConfigError

log = logging.getLogger(__name__)
_HARD_STOP = False  # a Ctrl-C raised KeyboardInterrupt in a fit of this process


class SlurmRequeue(L.Callback):
    """With several ranks, the ranks agree on a signal every ``every_n_steps`` steps (a collective);
    ``interrupts``: Ctrl-C and SIGTERM outside SLURM save too."""

    def __init__(self, every_n_steps: int = 10, interrupts: bool = True) -> None:
        if every_n_steps < 1:
            raise ConfigError(f"slurm_requeue.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps, self.interrupts = every_n_steps, interrupts
        self._active = False  # our handler is installed
        self._slurm = False  # under SLURM with auto-requeue
        self._rank_zero = True
        self._requested = self._requeue = False  # a signal came; the requeue signal came
        self._signal: int | None = None  # the last one that came
        self._requeue_signal: int | None = getattr(signal, "SIGUSR1", None)  # SLURMEnvironment's, set at the start
        self.resume_hint = "continue with --ckpt_path last"  # what the stop's line advises
        self.preempted = False  # this run stopped on a signal, with its checkpoints written
        self.interrupted: int | None = None  # the signal, outside SLURM
        self._val_batches: int | None = None  # validation batches every rank runs
        self._previous: dict[int, Any] = {}  # the handlers ours replaced, put back when training is over
        self._over = False  # the training is over

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # (a second fit of the same trainer starts afresh)
            global _HARD_STOP
            self._requested = self._requeue = self.preempted = self._over = _HARD_STOP = False
            self._signal = self.interrupted = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        global _HARD_STOP
        if signum == signal.SIGINT and self._requested and self._signal == signal.SIGINT:  # a second Ctrl-C
            _HARD_STOP = True
            if self._rank_zero:
                _say("\nSIGINT again: stopping now, unsaved\n")
            raise KeyboardInterrupt
        first = not self._requested
        self._requested, self._signal = True, signum  # recorded before anything is said
        self._requeue = self._requeue or signum == self._requeue_signal
        if not self._slurm and first and self._rank_zero:
            again = " (Ctrl-C again: stop at once, unsaved)" if signum == signal.SIGINT else ""
            _say(f"\n{signal.Signals(signum).name}: stopping after a checkpoint at the end of this batch{again}\n")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A Ctrl-C where ours is not the handler (outside the training steps, or ``interrupts`` off) stopped the fit
        at once."""
        global _HARD_STOP
        if isinstance(exception, KeyboardInterrupt) and not _HARD_STOP:  # (a second Ctrl-C has said it)
            _HARD_STOP = True
            if trainer.is_global_zero:
                when = ("" if trainer.state.fn != "fit" else  # (validate, test, predict: nothing to save)
                        ", after the training (its checkpoints are written)" if self._over else
                        " (slurm_requeue.interrupts=false: nothing saved)" if not self.interrupts else
                        ", before the training steps (nothing saved)")
                _say(f"\nSIGINT: stopping now{when}\n")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():  # (signal handlers live there)
            return
        env = getattr(trainer.strategy, "cluster_environment", None)  # (one device: none; Lightning detects SLURM's
        if env is None and SLURMEnvironment.detect():  # with its defaults, auto-requeue on SIGUSR1)
            env = SLURMEnvironment()
        self._slurm = isinstance(env, SLURMEnvironment) and env.auto_requeue
        self._rank_zero = trainer.is_global_zero
        signals = [signal.SIGTERM] if self._slurm or self.interrupts else []
        if self._slurm:
            self._requeue_signal = env.requeue_signal or signal.SIGUSR1
            signals.append(self._requeue_signal)
        if self.interrupts and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # (`lwm fit &`: left so)
            signals.append(signal.SIGINT)
        self._active = self._active or bool(signals)
        for signum in signals:  # (Lightning restores every handler at teardown)
            current = signal.signal(signum, self._on_signal)
            if current != self._on_signal:
                self._previous[signum] = current

    on_sanity_check_start = on_train_start  # Lightning's handler is set by now

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After the last training batch (and its validation), the handlers ours replaced go back."""
        over = (trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
                or 0 <= (trainer.max_epochs if trainer.max_epochs is not None else -1) <= trainer.current_epoch + 1)
        self._over = self._over or over
        if over and threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            self._previous, self._active = {}, False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        agree = trainer.world_size == 1 or trainer.global_step % self.every_n_steps == 0  # ranks agree every n steps
        if self._active and not accumulating(trainer) and agree and self._preempt(trainer):
            trainer.should_stop = True

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.preempted and trainer.state.fn == "fit" and not trainer.sanity_checking:
            raise _TunerExitException  # the validation Lightning starts before any early stop

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_batches = None
        if self._active and trainer.world_size > 1 and not trainer.sanity_checking:
            # ranks may hold a validation batch more or fewer: they agree only at batches every rank runs
            self._val_batches = min(every_rank(trainer, int(sum(trainer.num_val_batches))))

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        """A signal during a fit's validation (which can outlast SLURM's grace time)."""
        agree = trainer.world_size == 1 or batch_idx % self.every_n_steps == 0 and batch_idx < (self._val_batches or 0)
        if (self._active and not trainer.sanity_checking and trainer.state.fn == "fit" and not accumulating(trainer)
                and agree and self._preempt(trainer)):
            self.on_validation_start(trainer, pl_module)  # ends the fit (Lightning's clean early end), preempted

    def _preempt(self, trainer: L.Trainer) -> bool:
        """If a signal came to any rank: save the hpc checkpoint (under SLURM) and ``last.ckpt``, requeue on the
        requeue signal, and say so (the caller stops the run)."""
        requested, requeue = self._requested, self._requeue
        if trainer.world_size > 1:  # ranks get the signal at different batches
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
            if requested:
                requeue = trainer.strategy.reduce_boolean_decision(requeue, all=False)
        if not requested:
            return False
        self._requested = self._requeue = False
        self.preempted = True
        if self._slurm:  # hpc_ckpt_N.ckpt one above the highest N (Lightning's name, which its SLURM restart takes)
            older = _hpc_checkpoints(trainer.default_root_dir)
            path = os.path.join(trainer.default_root_dir, f"hpc_ckpt_{max(older, default=0) + 1}.ckpt")
            trainer.save_checkpoint(path)
            for old in older.values() if trainer.is_global_zero and os.path.exists(path) else ():
                with contextlib.suppress(OSError):  # (DeepSpeed's: folders; Lightning keeps them all; best effort)
                    (shutil.rmtree if old.is_dir() else os.remove)(old)
        saved = []
        for callback in trainer.checkpoint_callbacks:  # else the end of fit would rewrite last.ckpt as "epoch done"
            if isinstance(callback, ModelCheckpoint):
                callback.save_stop_now(trainer)
                saved.append(callback.last_model_path)
        if not self._slurm:
            self.interrupted = self._signal or signal.SIGTERM  # (another rank's signal: SIGTERM, as from kill)
            if trainer.is_global_zero:
                said = (f"saved {saved[0]}: {self.resume_hint}" if saved and saved[0] else
                        "nothing saved (no checkpointing)")
                log.warning(f"{signal.Signals(self.interrupted).name}: stopped at step {trainer.global_step}; {said}")
        elif trainer.is_global_zero and not requeue:
            log.warning(f"terminated: {path} at step {trainer.global_step}")
        elif trainer.is_global_zero:  # (an array's task by its ARRAYJOB_TASK id)
            job = os.environ.get("SLURM_JOB_ID", "")
            if os.environ.get("SLURM_ARRAY_JOB_ID"):
                job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
            rc = subprocess.call(["scontrol", "requeue", job])
            log.warning(f"preempted: {path} at step {trainer.global_step}; scontrol requeue {job} "
                        + ("done" if rc == 0 else f"failed ({rc})"))
        return True


def _say(text: str) -> None:
    """To stderr from a signal handler, where a closed pipe (the ``| tee`` a Ctrl-C ended) must not raise."""
    with contextlib.suppress(OSError, ValueError):  # (ValueError: a closed stream)
        sys.stderr.write(text)


def hard_stopped() -> bool:
    """Whether a Ctrl-C stopped a fit of this process at once, unsaved."""
    return _HARD_STOP


def interrupted_by(trainer: Any) -> int | None:
    """The signal that stopped ``trainer``'s fit outside SLURM, after its checkpoint (the exit code is 128 + it)."""
    return next((c.interrupted for c in getattr(trainer, "callbacks", []) if getattr(c, "interrupted", None)), None)


def _hpc_checkpoints(root: str) -> dict[int, Path]:
    paths = ((re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", p.name), p) for p in Path(root).glob("hpc_ckpt_*.ckpt"))
    return {int(match[1]): p for match, p in paths if match}

"""SLURM preemption: the requeue checkpoint is written at the end of a training batch, not inside the signal
handler.

Lightning's SLURM auto-requeue (SIGUSR1, e.g. from ``sbatch --signal=USR1@90``) saves ``RUN_DIR/hpc_ckpt_N.ckpt``
from within the signal handler, usually in the middle of a training step (the data fetcher has already drawn the
next batches): a run resumed from it logs every step one higher, skips batches and no longer matches an
uninterrupted run. :class:`SlurmRequeue` replaces that handler (once Lightning has set it, before the sanity
check and at the start of training) by one that only takes note; at the next batch end, the same one on every
rank, it saves the hpc checkpoint and ``last.ckpt`` (with the same mid-epoch state as a step checkpoint), runs
``scontrol requeue`` on rank 0 and stops training. SIGTERM (SLURM's default preemption, ``scancel``) saves the
same way, without the requeue: SLURM requeues a preempted job by itself. With several ranks they agree every
``every_n_steps`` steps (a collective and a host read: not every step), so the save comes at most that many
steps after the signal. Outside SLURM, or with ``SLURMEnvironment(auto_requeue=False)``, it does nothing (and
costs nothing). A preempted run skips the end-of-training code dictionaries
(:class:`~lwm.callbacks.codes.CodeDictionaries`): the grace time is short.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from typing_extensions import override

from lwm.checkpoint import ModelCheckpoint

log = logging.getLogger(__name__)


class SlurmRequeue(L.Callback):
    def __init__(self, every_n_steps: int = 10) -> None:
        if every_n_steps < 1:
            raise ValueError(f"slurm_requeue.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._active = False  # our handler is installed
        self._requested = False
        self._requeue = False  # the requeue signal came (SIGTERM alone: SLURM requeues or cancels by itself)
        self.preempted = False  # this run stopped for a requeue

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._requested = True
        self._requeue = self._requeue or signum != signal.SIGTERM

    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_train_start(trainer, pl_module)  # Lightning's handler is set by now: replace it before the check

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        env = trainer._accelerator_connector.cluster_environment
        if (isinstance(env, SLURMEnvironment) and env.auto_requeue
                and threading.current_thread() is threading.main_thread()):
            # Lightning restores its own handlers at teardown. SIGTERM (how SLURM preempts by default, and
            # scancel) saves too: Lightning's handler only stops, losing the steps since the last checkpoint.
            signal.signal(env.requeue_signal or signal.SIGUSR1, self._on_signal)
            signal.signal(signal.SIGTERM, self._on_signal)
            self._active = True

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self._active:
            return
        if trainer.fit_loop._should_accumulate():  # not inside an accumulation window (its gradients would be lost)
            return
        requested, requeue = self._requested, self._requeue
        if trainer.world_size > 1:  # ranks get the signal at different batches: agree on one
            if trainer.global_step % self.every_n_steps:
                return
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
            if requested:  # and on whether any rank got the requeue signal (not SIGTERM alone)
                requeue = trainer.strategy.reduce_boolean_decision(requeue, all=False)
        if not requested:
            return
        self._requested = self._requeue = False
        self.preempted = True
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)
        for callback in trainer.checkpoint_callbacks:  # else the end of fit would rewrite last.ckpt as "epoch done"
            if isinstance(callback, ModelCheckpoint):  # (and the step's own checkpoint, if one is due)
                callback.save_stop_now(trainer)
        if trainer.is_global_zero and not requeue:
            log.warning(f"terminated: {path} at step {trainer.global_step}")
        elif trainer.is_global_zero:
            job = os.environ.get("SLURM_JOB_ID", "")
            if os.environ.get("SLURM_ARRAY_JOB_ID"):
                job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
            rc = subprocess.call(["scontrol", "requeue", job])
            log.warning(f"preempted: {path} at step {trainer.global_step}; scontrol requeue {job} "
                        + ("done" if rc == 0 else f"failed ({rc})"))
        trainer.should_stop = True

"""A stop on a signal whose output has nowhere to go: ``lwm fit 2>&1 | tee log`` and Ctrl-C, which ends tee too."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time

import pytest
import torch

from lwm.callbacks.slurm import SlurmRequeue
from tests.lightning.helpers import REPO, make_dataset
from tests.lightning.procs import lwm_command, lwm_env


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_group_with_its_output_pipes_closed_still_saves_and_exits_with_the_stops_code(tmp_path, name):
    """The terminal's Ctrl-C reaches the whole process group, the pipe's reader included: the fit's stdout and
    stderr are closed pipes when its handler and progress bar write. It records the stop, writes last.ckpt at the
    end of that batch and exits 128 + the signal (it exited 1 without a checkpoint: a broken pipe in the handler)."""
    manifest = make_dataset(tmp_path / "data", files=4)
    mark = tmp_path / "training"
    command = lwm_command(manifest, tmp_path / "run", "--trainer.max_steps=400", "--checkpoint.every_n_train_steps=1000",
                          "--trainer.enable_progress_bar=true", "--progress_bar.text_every_s=0.01",
                          "--trainer.callbacks+=tests.lightning.helpers.MarkStep", f"--trainer.callbacks.path={mark}",
                          "--trainer.callbacks.step=2")
    proc = subprocess.Popen(command, cwd=REPO, env=lwm_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        start = time.monotonic()
        while not mark.exists() and proc.poll() is None and time.monotonic() - start < 240:
            time.sleep(0.05)
        assert mark.exists(), f"the fit did not reach step 2 (exit {proc.poll()})"
        proc.stdout.close()  # the reader is gone: every write of the fit from here on meets a closed pipe
        proc.stderr.close()
        os.killpg(proc.pid, getattr(signal, name))
        assert proc.wait(timeout=240) == 128 + getattr(signal, name)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert [p.name for p in (tmp_path / "run/checkpoints").glob("*.ckpt")] == ["last.ckpt"]
    assert torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["global_step"] >= 3


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_the_signal_handler_records_the_stop_before_it_writes(monkeypatch):
    """A handler whose stderr is a closed pipe raises nothing into the step it interrupted, and the stop stands."""
    callback = SlurmRequeue()
    monkeypatch.setattr("sys.stderr", _ClosedPipe())
    callback._on_signal(signal.SIGTERM, None)
    assert callback._requested and callback._signal == signal.SIGTERM

"""configs/deepspeed.yaml's strategy (ZeRO stage 2, bf16) end to end on the CPU: Lightning's real DeepSpeedStrategy and
DeepSpeed's engine on its CPU accelerator (tests/lightning/deepspeed_cpu.py; the first run builds DeepSpeed's CPU
communication op, about 30 s, cached after). A NaN step is skipped by the engine and counted, a resume from the
DeepSpeed checkpoint directory continues exactly, and too many NaN steps in a row stop the run before a checkpoint
of the failing step is written. The first two with 2 ranks (gloo), checkpoints deferred to the end of the
validation that follows their step, a collective save on every rank."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.lightning.helpers import REPO, make_dataset, read_metrics, tiny_args
from tests.lightning.procs import lwm_env

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="DeepSpeed's CPU accelerator builds a C++ op at its first use: no C++ compiler")

DEEPSPEED = ["--trainer.strategy=deepspeed_stage_2", "--trainer.precision=bf16-mixed", "--trainer.accelerator=cpu",
             "--trainer.devices=1"]


def _deepspeed_lwm(manifest: Path, root: Path, *extra: str, nan_steps: str = "") -> subprocess.CompletedProcess:
    env = {**lwm_env(), "LWM_TEST_NAN_STEPS": nan_steps}
    command = [sys.executable, "-m", "tests.lightning.deepspeed_cpu", *tiny_args(manifest, root, *DEEPSPEED, *extra)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _by_step(root: Path, key: str) -> dict[int, float]:
    return {int(r["step"]): r[key] for r in read_metrics(root) if key in r}


def test_deepspeed_skips_a_nan_step_resumes_exactly_and_stops_before_a_checkpoint_of_the_failing_step(tmp_path):
    manifest = make_dataset(tmp_path / "data")
    two_ranks = ["--trainer.devices=2", "--checkpoint.every_n_train_steps=3", "--trainer.val_check_interval=3",
                 "--trainer.check_val_every_n_epoch=null", "--data.val_size_percent=0.5"]
    # one NaN step (3) in 6: DeepSpeed skips it (bf16.check_grad_overflow, which lwm turns on), lwm counts it
    _ok(_deepspeed_lwm(manifest, tmp_path / "full", "--trainer.max_steps=6", *two_ranks, nan_steps="3"))
    skipped = _by_step(tmp_path / "full", "Train_Total/skipped_steps")
    assert skipped == {0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0, 4: 1.0, 5: 1.0}
    norms = _by_step(tmp_path / "full", "Train_Total/grad_norm")  # the engine's own norm
    assert sorted(norms) == list(range(6)) and norms[3] == math.inf
    assert all(0 < v < math.inf for step, v in norms.items() if step != 3)
    shards = tmp_path / "full/checkpoints/last.ckpt/checkpoint"
    assert sorted(os.listdir(shards)) == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)] + [
        "mp_rank_00_model_states.pt"]  # the optimizer state sharded over both ranks
    states = torch.load(shards / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    weights = [v for v in states["module"].values() if v.is_floating_point()]
    assert weights and all(torch.isfinite(v).all() for v in weights)
    codebooks = [v for k, v in states["module"].items() if k.endswith(".embed")]
    assert codebooks and all(v.dtype == torch.float32 for v in codebooks)  # bf16 weights, fp32 codebooks

    # 3 steps, then --ckpt_path last (the DeepSpeed directory) to 6: the same losses and count as without the stop
    _ok(_deepspeed_lwm(manifest, tmp_path / "resumed", "--trainer.max_steps=3", *two_ranks, nan_steps="3"))
    _ok(_deepspeed_lwm(manifest, tmp_path / "resumed", "--trainer.max_steps=6", *two_ranks, "--ckpt_path=last",
                       nan_steps="3"))
    assert sorted(_by_step(tmp_path / "full", "Val_Total/loss")) == [2, 5]  # after steps 3 and 6, then their saves
    for key in ("Train_Total/loss", "Val_Total/loss", "Train_Total/skipped_steps"):
        full, resumed = _by_step(tmp_path / "full", key), _by_step(tmp_path / "resumed", key)
        assert resumed == full, key

    # NaN at every step, a stop after 2 in a row: at the second step, before its checkpoint (step 1's stays)
    stopped = _deepspeed_lwm(manifest, tmp_path / "stopped", "--trainer.max_steps=6", "--model.max_nonfinite=2",
                             "--checkpoint.every_n_train_steps=1", nan_steps=",".join(map(str, range(6))))
    assert stopped.returncode != 0
    assert "error: 2 consecutive steps had a non-finite loss or gradient (last at global step 1)" in stopped.stderr
    assert sorted(os.listdir(tmp_path / "stopped/checkpoints")) == ["last.ckpt", "step=0000001.ckpt"]

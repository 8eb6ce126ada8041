"""configs/deepspeed.yaml's strategy (ZeRO stage 2, bf16) end to end on the CPU: Lightning's real DeepSpeedStrategy and
DeepSpeed's engine on its CPU accelerator (tests/lightning/deepspeed_cpu.py; the first run builds DeepSpeed's CPU
communication op, about 30 s, cached after). A NaN step is skipped by the engine and counted, a resume from the
DeepSpeed checkpoint directory continues exactly, and too many NaN steps in a row stop the run before a checkpoint
of the failing step is written. The first two with 2 ranks (gloo), checkpoints deferred to the end of the
validation that follows their step, a collective save on every rank. A save cut short by a kill (DeepSpeed writes
a directory file by file, in place) is never resumed from: the run continues exactly from the latest whole one."""

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
pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="DeepSpeed's CPU accelerator builds a C++ op at its first use: no C++ compiler")]

DEEPSPEED = ["--trainer.strategy=deepspeed_stage_2", "--trainer.precision=bf16-mixed", "--trainer.accelerator=cpu",
             "--trainer.devices=1"]


def _deepspeed_lwm(manifest: Path, root: Path, *extra: str, nan_steps: str = "",
                   kill: str = "") -> subprocess.CompletedProcess:
    env = {**lwm_env(), "LWM_TEST_NAN_STEPS": nan_steps, "LWM_TEST_KILL_SAVE": kill}
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

    # from the run's step-3 checkpoint (a DeepSpeed directory) to 6: the same losses and count as the run itself
    _ok(_deepspeed_lwm(manifest, tmp_path / "resumed", "--trainer.max_steps=6", *two_ranks,
                       f"--ckpt_path={tmp_path / 'full/checkpoints/step=0000003.ckpt'}", nan_steps="3"))
    assert sorted(_by_step(tmp_path / "full", "Val_Total/loss")) == [2, 5]  # after steps 3 and 6, then their saves
    for key in ("Train_Total/loss", "Val_Total/loss", "Train_Total/skipped_steps"):
        full, resumed = _by_step(tmp_path / "full", key), _by_step(tmp_path / "resumed", key)
        assert resumed == {step: v for step, v in full.items() if step >= 3}, key

    # NaN at every step, a stop after 2 in a row: at the second step, before its checkpoint (step 1's stays)
    stopped = _deepspeed_lwm(manifest, tmp_path / "stopped", "--trainer.max_steps=6", "--model.max_nonfinite=2",
                             "--checkpoint.every_n_train_steps=1", nan_steps=",".join(map(str, range(6))))
    assert stopped.returncode != 0
    assert "error: 2 consecutive steps had a non-finite loss or gradient (last at global step 1)" in stopped.stderr
    assert sorted(os.listdir(tmp_path / "stopped/checkpoints")) == ["last.ckpt", "step=0000001.ckpt"]


def test_a_deepspeed_save_cut_short_by_a_kill_is_never_resumed_and_the_run_continues_from_the_latest_whole_one(
        tmp_path):
    from lwm.training.checkpoint import DEEPSPEED_MARK, DEEPSPEED_WRITING, deepspeed_step
    from lwm.training.run_dir import latest_checkpoint

    manifest = make_dataset(tmp_path / "data")
    every = ("--checkpoint.every_n_train_steps=2", "--trainer.val_check_interval=null")
    _ok(_deepspeed_lwm(manifest, tmp_path / "full", "--trainer.max_steps=6", *every))
    full = _by_step(tmp_path / "full", "Train_Total/loss")
    assert sorted(full) == list(range(6))
    for name, step in (("last.ckpt", 6), ("step=0000004.ckpt", 4)):
        assert deepspeed_step(tmp_path / "full/checkpoints" / name) == step

    # killed at step 4 before step=0000004.ckpt's optimizer shard: that new folder holds the model states alone
    # (DeepSpeed would start the shard's fp32 weights afresh); last.ckpt, of step 2, continues the run
    # killed at step 4 while last.ckpt was rewritten, after step=0000004.ckpt: last.ckpt holds step 4's model states
    # and step 2's shard (DeepSpeed would load step 2's fp32 weights under step 4's counters); step 4's continues
    for cut, whole, resumed_from in (("step=0000004.ckpt", "last.ckpt", 2), ("last.ckpt", "step=0000004.ckpt", 4)):
        root = tmp_path / cut
        killed = _deepspeed_lwm(manifest, root, "--trainer.max_steps=6", *every, kill=f"{cut}:4")
        assert killed.returncode == 137, killed.stderr[-3000:]
        ckpts = root / "checkpoints"
        assert (ckpts / cut / "checkpoint/mp_rank_00_model_states.pt").is_file()
        assert not (ckpts / cut / DEEPSPEED_MARK).exists() and deepspeed_step(ckpts / cut) is None
        assert (ckpts / cut / DEEPSPEED_WRITING).exists() == (cut == "last.ckpt")  # its last whole write's mark
        assert latest_checkpoint(root, ckpts) == ckpts / whole and deepspeed_step(ckpts / whole) == resumed_from
        _ok(_deepspeed_lwm(manifest, root, "--trainer.max_steps=6", *every, "--ckpt_path=last"))
        # Lightning logs a step's row after its batch-end checkpoint: a kill during the save of step 4 (after the
        # 4th batch, row 3) loses that row, and the run resumed after that batch does not log it again
        lost = {3} if resumed_from == 4 else set()
        assert _by_step(root, "Train_Total/loss") == {k: v for k, v in full.items() if k not in lost}, cut

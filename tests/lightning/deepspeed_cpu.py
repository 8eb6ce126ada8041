"""``python -m tests.lightning.deepspeed_cpu VERB ARGS...``: the ``lwm`` CLI under Lightning's real
``DeepSpeedStrategy`` on the CPU (DeepSpeed's CPU accelerator, gloo), for the tests of ``test_deepspeed.py``.

Lightning allows DeepSpeed on CUDA only; three checks are bypassed here, nothing else:
``DeepSpeedStrategy.setup_environment`` (its CUDA-accelerator check; DDP's set-up runs instead),
``_validate_device_index_selection`` (GPU indices), and ``deepspeed.initialize``'s ``device_rank`` (None on the CPU).
``LWM_TEST_NAN_STEPS=2,3`` makes the training loss NaN at those global steps (every micro-batch of them).
``LWM_TEST_KILL_SAVE=NAME:STEP`` kills the process (exit 137, as SIGKILL) in the save of the checkpoint directory
``NAME`` at global step ``STEP``, after its model states are written and before its optimizer shards.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import lightning.pytorch.strategies.deepspeed as lightning_deepspeed  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402

from lwm.cli.main import main  # noqa: E402
from lwm.training.module import WorldModelModule  # noqa: E402


def _patch_for_the_cpu() -> None:
    DeepSpeedStrategy.setup_environment = DDPStrategy.setup_environment
    lightning_deepspeed._validate_device_index_selection = lambda devices: None
    initialize = deepspeed.initialize

    def initialize_on_the_cpu(args=None, **kwargs):
        if args is not None and getattr(args, "device_rank", 0) is None:
            args.device_rank = 0
        return initialize(args=args, **kwargs)

    deepspeed.initialize = initialize_on_the_cpu


def _nan_at(steps: set[int]) -> None:
    training_step = WorldModelModule.training_step

    def with_nan(self, batch, batch_idx):
        out = training_step(self, batch, batch_idx)
        if self.global_step in steps:
            out["loss"] = out["loss"] * float("nan")
        return out

    WorldModelModule.training_step = with_nan


def _kill_in_save(name: str, step: int) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    save_shards = DeepSpeedEngine._save_zero_checkpoint

    def killed(self, save_path, tag):
        if os.path.basename(os.path.normpath(save_path)) == name and self.global_steps == step:
            os._exit(137)
        return save_shards(self, save_path, tag)

    DeepSpeedEngine._save_zero_checkpoint = killed


if __name__ == "__main__":
    _patch_for_the_cpu()
    if os.environ.get("LWM_TEST_KILL_SAVE"):
        name, step = os.environ["LWM_TEST_KILL_SAVE"].rsplit(":", 1)
        _kill_in_save(name, int(step))
    if os.environ.get("LWM_TEST_NAN_STEPS"):
        _nan_at({int(s) for s in os.environ["LWM_TEST_NAN_STEPS"].split(",")})
    sys.exit(main(sys.argv[1:]))

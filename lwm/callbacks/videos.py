"""Videos of rollouts at validation: the model plays validation clips forward from their first frame."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch

from lwm.training.loggers import log_video, run_log_dir
from lwm.utils.args import MAX_FPS
from lwm.utils.errors import ConfigError
from lwm.utils.video import grid, latent_preview, write_video


class RolloutVideos(L.Callback):
    """Every ``every_n_validations``-th validation of a fit (the first included; the count is checkpointed), and at
    ``lwm validate``, on rank 0: rows of ground truth, then generated."""

    def __init__(self, every_n_validations: int = 4, clips: int = 2, fps: int = 4) -> None:
        bad = [f"rollout_videos.{name} must be >= 1, got {value}" for name, value in
               (("every_n_validations", every_n_validations), ("clips", clips), ("fps", fps)) if value < 1]
        if fps > MAX_FPS:
            bad.append(f"rollout_videos.fps must be at most {MAX_FPS}, got {fps}")
        if bad:
            raise ConfigError("\n".join(bad))
        self.every_n_validations, self.clips, self.fps = every_n_validations, clips, fps
        self._validations = 0
        self._clip: torch.Tensor | None = None
        self.last_path: Path | None = None

    def state_dict(self) -> dict[str, int]:  # a resumed run keeps the cadence
        return {"validations": self._validations}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._validations = int(state_dict.get("validations", 0))

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx or trainer.sanity_checking or not trainer.is_global_zero or trainer.fast_dev_run:
            return  # (fast_dev_run: Lightning's trial run, of any verb: no files)
        if trainer.state.fn != "fit" or self._validations % self.every_n_validations == 0:
            self._clip = batch["latents"][: self.clips].detach()

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        clip, self._clip = self._clip, None
        self._validations += 1
        if clip is None:
            return
        model = pl_module.model
        with torch.no_grad(), trainer.precision_plugin.forward_context():  # as validation runs (bf16 autocast)
            actions, world = model.infer_codes(clip, pl_module.weights_world_phase)  # as validation feeds them
            generated = model.generate(clip[:, :1], actions, world, steps=clip.shape[1] - 1)
        rollout = torch.cat([clip[:, :1], generated], dim=1).cpu()
        codec = trainer.datamodule.codec() if hasattr(trainer.datamodule, "codec") else None
        show = (lambda x: codec.decode(x.float().numpy())) if codec is not None else latent_preview  # noqa: E731
        rows = [row for gt, gen in zip(clip.cpu(), rollout) for row in (show(gt), show(gen))]
        path = run_log_dir(trainer) / "videos" / f"step_{pl_module.weights_step:07d}.mp4"  # named as its checkpoint
        self.last_path = write_video(path, grid(rows), self.fps)
        log_video(pl_module, "Val_Dynamics_Predictor/rollout_video", str(path))

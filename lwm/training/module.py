"""The LightningModule: owns a :class:`~lwm.modules.world_model.WorldModel`, its optimisation and its logging
(``Train_*`` means over the logging interval; ``Val_*``/``Test_*`` exact means over every rank's windows)."""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from lwm.data.windows import nonfinite_mask, nonfinite_windows, window_name
from lwm.modules.world_model import WorldModel, WorldModelConfig
from lwm.training.nonfinite import (check_deepspeed_skips_overflow, deepspeed_scaling_loss, deepspeed_skipped_steps,
    SkippedSteps)
from lwm.training.optim import OptimConfig
from lwm.training.trainer_state import accumulating, every_rank, is_logging_step, logs_at_this_step
from lwm.utils.errors import ConfigError, NonFiniteLossError, refuse_first
from lwm.utils.metrics import psnr_from_mse, WeightedMean
from lwm.utils.seeds import seeded_generator


def _metric_name(key: str) -> str:
    return key.replace("/", "__")  # ModuleDict keys cannot hold "/" or "."


class WorldModelModule(L.LightningModule):
    """Trains a :class:`WorldModel` on batches ``{"latents": [B, T, C, H, W], ...}``.

    Args:
        net: the world model's hyperparameters (``model.net.*`` in configs).
        optim: AdamW and schedule (``model.optim.*``).
        compile: ``torch.compile`` the tokenizer, detokenizer and transformers (the quantizers stay eager).
        max_nonfinite: stop after this many consecutive steps with a non-finite gradient norm.
    """

    def __init__(self, net: WorldModelConfig = WorldModelConfig(), optim: OptimConfig = OptimConfig(),
                 compile: bool = False, max_nonfinite: int = 5) -> None:
        super().__init__()
        net = WorldModelConfig.from_dict(net) if isinstance(net, dict) else net  # dicts: from a checkpoint's hparams
        optim = OptimConfig(**optim) if isinstance(optim, dict) else optim
        if max_nonfinite < 1:
            raise ConfigError(f"model.max_nonfinite must be >= 1, got {max_nonfinite}")
        # Plain types only, so that checkpoints load with weights_only=True.
        self.save_hyperparameters({"net": asdict(net), "optim": asdict(optim), "compile": compile,
                                   "max_nonfinite": max_nonfinite})
        self.model = WorldModel(net)
        self.optim = optim
        self.compile_model, self.max_nonfinite = compile, max_nonfinite
        self.val_metrics = nn.ModuleDict({_metric_name(k): WeightedMean() for k in self.model.log_keys})
        self.skips = SkippedSteps()
        self._compiled = False
        self._grad_norm: Tensor | None = None  # this step's, for the non-finite check and clipping
        self._last_batch: dict[str, Tensor] | None = None  # this training step's, to name bad windows on a stop
        self._interval: dict[str, tuple[Tensor, Tensor]] = {}  # per key since the last logged step: finite sum, weight
        self._eval_windows: list[Tensor] = []  # per evaluated batch [B, 3]: non-finite?, file index, start
        self._checkpoint_step: int | None = None  # the loaded checkpoint's global step

    def setup(self, stage: str) -> None:  # (the data are checked where they are read: the CLI, lwm overfit, lwm codes)
        self.check_trainer(self.trainer)

    @staticmethod
    def check_trainer(trainer: L.Trainer) -> None:
        """Refuse trainer settings Lightning accepts and then divides by, or ignores."""
        clip, interval = trainer.gradient_clip_val, getattr(trainer, "val_check_interval", None)  # (timed: unset)
        refuse_first(
            (f"trainer.gradient_clip_val must be >= 0 (0 or null: no clipping), got {clip}",
             clip is not None and not clip >= 0),
            (f"trainer.val_check_interval must be > 0 (an integer: training batches between validations, a fraction "
             f"in (0, 1] of the epoch, or null: once per epoch), got {interval}",
             isinstance(interval, (int, float)) and not interval > 0),
            (f"trainer.accumulate_grad_batches must be >= 1 (1: no accumulation), got "
             f"{trainer.accumulate_grad_batches}", not trainer.accumulate_grad_batches >= 1),
            (f"trainer.log_every_n_steps must be >= 1 (the interval, in steps, of the Train_* logs), got "
             f"{trainer.log_every_n_steps}", not trainer.barebones and not trainer.log_every_n_steps >= 1))

    def check_data(self, frame_shape: tuple[int, int, int], window: int, source: str,
                   model_from: str | None = None) -> None:
        """Refuse frames ``[C, H, W]`` or a ``window`` the model does not take (``model_from``: its checkpoint)."""
        c, (C, H, W) = self.model.config, frame_shape
        shape = f"[{c.in_channels}, {c.height}, {c.width}]"
        refuse_first(
            (f"{model_from}: its model takes {shape} frames, but the files of {source} hold {list(frame_shape)} (use "
             f"data of the checkpoint's shape, or a checkpoint trained on this data)" if model_from else
             f"model.net.in_channels/height/width = {c.in_channels}/{c.height}/{c.width}, but the files of {source} "
             f"hold {list(frame_shape)} frames (set --model.net.in_channels={C} --model.net.height={H} "
             f"--model.net.width={W})", (C, H, W) != (c.in_channels, c.height, c.width)),
            (f"data.window = {window}, but the model needs at least {c.min_frames} frames (teacher forcing + "
             f"{c.min_frames - 2} rollout passes)", window < c.min_frames))

    def configure_model(self) -> None:
        if self.compile_model and not self._compiled:
            self.model.compile_parts()
            self._compiled = True

    def configure_optimizers(self) -> dict[str, Any]:
        o = self.optim
        if o.fused and self._scaler is not None:
            raise ConfigError("model.optim.fused=true with fp16 (trainer.precision 16-mixed): the GradScaler can "
                              "neither unscale a fused AdamW's gradients before clipping nor check them; use "
                              "bf16-mixed or model.optim.fused=null")
        on_cuda = all(p.device.type == "cuda" for p in self.parameters())
        optimizer = o.adamw(self.parameters(), fused=(on_cuda and self._scaler is None) if o.fused is None else o.fused)
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: o.lr_factor(step, total))
        # "name": LearningRateMonitor logs the two groups' lr under Train_Total/lr/pg1, .../pg2
        lr_scheduler = {"scheduler": scheduler, "interval": "step", "name": "Train_Total/lr"}
        return {"optimizer": optimizer, "lr_scheduler": lr_scheduler}

    def on_train_start(self) -> None:
        self.apply_optim_config()
        check_deepspeed_skips_overflow(self.trainer)
        self.skips.engine_start(deepspeed_skipped_steps(self.trainer))  # restored with a resumed engine

    def apply_optim_config(self) -> None:
        """Make a restored optimiser follow ``model.optim`` (a resume with a changed lr, decay, betas or eps) and this
        run's kernel choice (a CPU run resumed on a GPU)."""
        o = self.optim
        for config in self.trainer.lr_scheduler_configs:
            scheduler, optimizer = config.scheduler, config.scheduler.optimizer
            groups, defaults = optimizer.param_groups, getattr(optimizer, "defaults", {})
            kernel = {key: defaults[key] for key in ("fused", "foreach", "capturable") if key in defaults}
            for group, weight_decay, factor in zip(groups, (o.weight_decay, 0.0), scheduler.lr_lambdas):
                group.update(kernel, initial_lr=o.lr, lr=o.lr * factor(scheduler.last_epoch), weight_decay=weight_decay,
                             betas=tuple(o.betas), eps=o.eps)  # lr: the schedule's at the restored step
                on_device = bool(group.get("fused") or group.get("capturable"))
                for p in group["params"]:
                    state = optimizer.state.get(p, {})
                    if torch.is_tensor(state.get("step")):
                        state["step"] = state["step"].to(p.device if on_device else "cpu", torch.float32)
            scheduler.base_lrs = [o.lr] * len(groups)
            scheduler._last_lr = [group["lr"] for group in groups]

    @property
    def skipped_steps(self) -> int:
        return self.skips.total

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = self.skips.state()
        checkpoint.update(lwm_skipped_steps=state["total"], lwm_skipped_in_a_row=state["in_a_row"],
                          lwm_skipped_longest_unread=state["longest_unread"])
        # this rank's interval sums, so that a resumed run logs the means of an uninterrupted one
        checkpoint["lwm_train_interval"] = {k: (s.cpu(), w.cpu()) for k, (s, w) in self._interval.items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.skips = SkippedSteps(total=int(checkpoint.get("lwm_skipped_steps", 0)),
                                  in_a_row=int(checkpoint.get("lwm_skipped_in_a_row", 0)),
                                  longest_unread=int(checkpoint.get("lwm_skipped_longest_unread", 0)))
        keys = set(self.model.log_keys)
        self._interval = {k: (s, w) for k, (s, w) in checkpoint.get("lwm_train_interval", {}).items() if k in keys}
        self._checkpoint_step = int(checkpoint.get("global_step", 0))

    @property
    def attached_trainer(self) -> L.Trainer | None:
        try:
            return self.trainer
        except RuntimeError:
            return None

    @property
    def weights_step(self) -> int:
        """The global step of the weights in use, what files are named by (checkpoints, videos, codes)."""
        if self.global_step or self.attached_trainer is None or self.trainer.state.fn == "fit":
            return self.global_step
        return self._checkpoint_step or 0

    @property
    def weights_world_phase(self) -> str:
        """The world input (``model.net.world_curriculum``) of the weights' last training step."""
        return self.model.world_phase_of_weights(self.weights_step)

    def step_generator(self, device: torch.device, batch_idx: int, stream: int = 0) -> torch.Generator:
        """This step's generator, a pure function of (seed, rank, step, batch, stream): a resume draws the same."""
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # set by seed_everything
        return seeded_generator(device, seed, self.global_rank, self.global_step, batch_idx, stream)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Latents come as the files hold them (float16 through the loader), cast here on the device."""
        return {**batch, "latents": batch["latents"].to(self.model.param_dtype)}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """The loss, and the batch's codes for the monitoring callbacks."""
        x = batch["latents"]  # [B, T, C, H, W]
        self._last_batch = batch
        out = self.model.compute(x, self.global_step, generator=self.step_generator(x.device, batch_idx),
                                 world_phase=self.model.world_phase_at(self.global_step), labels=batch.get("actions"))
        for key, value in out.logs.items():  # the interval's sums over the finite values, weighted by windows
            value, (total, weight) = value.detach().float(), self._interval.get(key, (0.0, 0.0))
            finite = torch.isfinite(value)
            self._interval[key] = total + torch.where(finite, value, 0.0) * len(x), weight + finite.float() * len(x)
        if not accumulating(self.trainer) and (logs_at_this_step(self.trainer) or self.trainer.should_stop):
            self._log_interval(x.shape[0], over_ranks=logs_at_this_step(self.trainer))
        return {"loss": out.loss, **self._codes(out)}

    def _log_interval(self, windows: int, over_ranks: bool) -> None:
        """Log the interval's means (``over_ranks``: under DDP, also over the ranks) and start the next interval."""
        keys = list(self._interval)
        means = torch.stack([(total / weight).to(self.device) for total, weight in self._interval.values()])
        if over_ranks and self.trainer.world_size > 1:
            means = self.trainer.strategy.reduce(means, reduce_op="mean")
        self._interval = {}
        self.log_dict({f"Train_{k}": v for k, v in zip(keys, means.unbind())}, batch_size=windows)

    @staticmethod
    def _codes(out) -> dict[str, Tensor]:
        return {"Action_Encoder": out.actions.indices.detach(), "World_Encoder": out.world.indices.detach()}

    @property
    def _scaler(self) -> Any:
        """The precision plugin's GradScaler (fp16), or None."""
        return getattr(getattr(self.attached_trainer, "precision_plugin", None), "scaler", None)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """The step; under DeepSpeed (its own gradient buffers) the engine's skip count, read after it."""
        super().optimizer_step(*args, **kwargs)
        count = deepspeed_skipped_steps(self.trainer)
        if count is None or not self.skips.reading_engine or accumulating(self.trainer):
            return
        engine = self.trainer.strategy.deepspeed_engine
        norm = engine.get_global_grad_norm()
        if norm is not None:
            self.log("Train_Total/grad_norm", norm)
        self._check_in_a_row(self.skips.engine_count(count, scaling_loss=deepspeed_scaling_loss(engine)))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._last_batch = None  # this step's non-finite check is done
        if not accumulating(self.trainer):
            self.log("Train_Total/skipped_steps", self.skips.as_tensor(self.device))
            if self.trainer.should_stop and self._interval:  # a stop decided in this batch's callbacks: Lightning
                # writes the row all the same (rank-local: a rank that saw the stop alone must not wait in a collective)
                self._log_interval(batch["latents"].shape[0], over_ranks=False)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip the update when the gradient norm is not finite."""
        self._grad_norm = None
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:  # DeepSpeed keeps its own gradient buffers
            return
        self._grad_norm = norm = torch.nn.utils.get_total_norm(grads)  # clipping reuses it
        self.log("Train_Total/grad_norm", norm)
        scaler, fused = self._scaler, optimizer.defaults.get("fused")
        if fused and getattr(optimizer, "_step_supports_amp_scaling", False) and scaler is None:
            # a fused AdamW skips the whole update (moments, step count) on the device verdict itself: no host sync
            nonfinite = ~torch.isfinite(norm)
            optimizer.found_inf, optimizer.grad_scale = nonfinite.float(), None
            self.skips.on_device(nonfinite)
            if is_logging_step(self.trainer):  # the one host read, at the logging interval
                self._check_in_a_row(self.skips.in_a_row_on_device(), when="read at the logging interval, at")
        elif bool(torch.isfinite(norm)):
            self.skips.finite()
        elif scaler is not None:  # fp16: the GradScaler skips this step itself and halves its scale
            self._check_in_a_row(self.skips.skipped(in_a_row=scaler.get_scale() < 1.0))
        else:
            optimizer.zero_grad(set_to_none=True)  # AdamW skips parameters without a gradient
            self._check_in_a_row(self.skips.skipped())

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip by the norm ``on_before_optimizer_step`` just computed, instead of computing it again."""
        if not gradient_clip_val or self._grad_norm is None or (gradient_clip_algorithm or "norm") != "norm":
            return self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, self._grad_norm)

    def _check_in_a_row(self, in_a_row: int, when: str = "last at") -> None:
        if in_a_row < self.max_nonfinite:
            return
        batch, dataset = self._last_batch, self._dataset("train_set")
        bad = []
        if batch is not None and "file_index" in batch and getattr(dataset, "paths", None) is not None:
            bad = nonfinite_windows(batch, dataset.paths)  # a file gone bad after indexing
        bad = [name for names in every_rank(self.trainer, bad) for name in names]  # every rank's
        said = f"The last batch has non-finite latents: {', '.join(bad[:5])}. " if bad else ""
        raise NonFiniteLossError(
            f"{in_a_row} consecutive steps had a non-finite loss or gradient ({when} global step {self.global_step}); "
            f"stopped. {said}The last checkpoint is intact: lower optim.lr, check the data (`lwm data index`), or "
            f"raise model.max_nonfinite")

    def _dataset(self, name: str) -> Any:
        """The data module's ``train_set`` or ``val_set`` (None for another data source)."""
        return getattr(getattr(self.attached_trainer, "datamodule", None), name, None)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """The losses as ``Val_*`` (``Test_*`` under ``lwm test``), and the batch's codes for the callbacks."""
        x, prefix = batch["latents"], "Test" if self.trainer.testing else "Val"
        if "file_index" in batch:
            self._eval_windows.append(torch.stack([nonfinite_mask(x).long(), batch["file_index"], batch["start"]], 1))
        # eval mode: no token mask, no codebook update
        out = self.model.compute(x, step=None, t0=0, world_phase=self.weights_world_phase, labels=batch.get("actions"))
        for key, value in out.logs.items():
            metric = self.val_metrics[_metric_name(key)]
            metric.update(value, weight=x.shape[0])
            self.log(f"{prefix}_{key}", metric, on_step=False, on_epoch=True, batch_size=x.shape[0])
        return self._codes(out)

    test_step = validation_step

    def on_validation_epoch_start(self) -> None:
        self._eval_windows = []

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        """``tf_psnr`` of the epoch's mean MSE (peak 1), the windows holding NaN/inf named, the checkpoint's step."""
        prefix = "Test" if self.trainer.testing else "Val"
        metric = self.val_metrics[_metric_name("Dynamics_Predictor/tf_loss")]
        if metric.update_count:
            self.log(f"{prefix}_Dynamics_Predictor/tf_psnr", psnr_from_mse(metric.compute().float()), on_step=False,
                     on_epoch=True, rank_zero_only=True)
        windows, self._eval_windows, dataset = self._eval_windows, [], self._dataset("val_set")
        if windows and getattr(dataset, "paths", None) is not None:
            rows = torch.cat(windows).cpu()
            bad = rows[rows[:, 0] == 1].tolist()
            if bad:
                named = ", ".join(window_name(dataset.paths, f, s, dataset.window) for _, f, s in bad[:5])
                warnings.warn(f"{len(bad)} {prefix.lower()} window(s) hold non-finite latents (NaN/inf), so the "
                              f"{prefix}_* metrics are NaN: {named}{' ...' if len(bad) > 5 else ''}; run `lwm data "
                              f"index` on the folder again", stacklevel=2)
        if self.trainer.state.fn != "fit" and self._checkpoint_step and self.global_step == 0:  # validate|test CKPT:
            self.log("step", float(self._checkpoint_step), sync_dist=True)  # Lightning restores no loop, logs at 0

    on_test_epoch_end = on_validation_epoch_end

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """The codes of each window: action indices ``[B, T-1, La]``, world indices ``[B, Lh]``."""
        x = batch["latents"]
        return {"action_indices": self.model.encode_actions(x).indices,
                "world_indices": self.model.encode_world(x).indices, "file_index": batch["file_index"],
                "start": batch["start"]}

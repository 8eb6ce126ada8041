"""The LightningModule: owns a :class:`~lwm.modules.world_model.WorldModel`, its optimisation and its logging.

* ``training_step``: the model's ``(loss, logs)``, logged under ``Train_*/`` as means over the logging interval;
  its random draws come from a generator seeded by ``(seed, rank, step, batch)``, so a resume draws the same.
* A step with a non-finite gradient norm skips the update (on the device with a fused AdamW) and is counted in
  ``Train_Total/skipped_steps``; ``max_nonfinite`` in a row stop the run (:mod:`lwm.training.nonfinite`).
* Validation and test: ``Val_*/`` (``Test_*/``) as exact means over every rank's windows.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from lwm.data.datamodule import LatentDataModule
from lwm.data.windows import nonfinite_mask, nonfinite_windows, window_name
from lwm.modules.world_model import WorldModel, WorldModelConfig
from lwm.training.nonfinite import (check_deepspeed_skips_overflow, deepspeed_scaling_loss, deepspeed_skipped_steps,
    SkippedSteps)
from lwm.training.optim import OptimConfig
from lwm.training.trainer_state import accumulating, every_rank, is_logging_step, logs_at_this_step
from lwm.utils.errors import ConfigError, NonFiniteLossError
from lwm.utils.metrics import psnr_from_mse, WeightedMean
from lwm.utils.seeds import seeded_generator


def _metric_name(key: str) -> str:
    return key.replace("/", "__")  # ModuleDict keys cannot hold "/" or "."


def _use_this_runs_kernel(optimizer: torch.optim.Optimizer) -> None:
    """A restored optimizer's param groups keep the old run's kernel choice (a CPU run resumed on a GPU, fp16 resumed
    as bf16)."""
    defaults = getattr(optimizer, "defaults", {})
    for group in optimizer.param_groups:
        group.update({key: defaults[key] for key in ("fused", "foreach", "capturable") if key in defaults})
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(p.device if on_device else "cpu", torch.float32)


class WorldModelModule(L.LightningModule):
    """Trains a :class:`WorldModel` on batches ``{"latents": [B, T, C, H, W], ...}``.

    Args:
        net: the world model's hyperparameters (``model.net.*`` in configs).
        optim: AdamW and schedule (``model.optim.*``).
        compile: ``torch.compile`` the tokenizer, detokenizer and transformers (the quantizers stay eager).
        max_nonfinite: stop after this many consecutive steps with a non-finite gradient norm.

    The per-step token masks and PE starts are seeded by the run's ``seed_everything`` value.
    """

    def __init__(
        self,
        net: WorldModelConfig = WorldModelConfig(),
        optim: OptimConfig = OptimConfig(),
        compile: bool = False,
        max_nonfinite: int = 5,
    ) -> None:
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
        self.skips = SkippedSteps()  # steps whose update was skipped
        self._compiled = False
        self._grad_norm: Tensor | None = None  # this step's gradient norm, for the non-finite check and clipping
        self._last_batch: dict[str, Tensor] | None = None  # this training step's, to name bad windows on a stop
        self._interval: dict[str, tuple[Tensor, Tensor]] = {}  # since the last logged step
        # sum and weight over the finite values (see _log_train)
        self._eval_windows: list[Tensor] = []  # per evaluated batch [B, 3]: non-finite?, file index, start
        self._checkpoint_step: int | None = None  # the loaded checkpoint's global step

    def setup(self, stage: str) -> None:
        """Check that the data fits the model before any work starts."""

        trainer = self.attached_trainer
        if trainer is not None:
            self.check_trainer(trainer)
        dm = trainer.datamodule if trainer is not None else None
        if isinstance(dm, LatentDataModule):
            self.check_data(dm.frame_shape, dm.window, str(dm.manifest_path))

    @staticmethod
    def check_trainer(trainer: L.Trainer) -> None:
        """Raise :class:`ConfigError` on trainer settings this module refuses (those Lightning accepts and then
        divides by, or ignores: its own refusals, e.g. a negative ``val_check_interval``, come first)."""
        clip = trainer.gradient_clip_val
        if clip is not None and not clip >= 0:  # a negative max norm would flip the gradients' sign
            raise ConfigError(f"trainer.gradient_clip_val must be >= 0 (0 or null: no clipping), got {clip}")
        interval = getattr(trainer, "val_check_interval", None)  # unset when validation is timed; null: 1.0
        if isinstance(interval, (int, float)) and not interval > 0:  # 0 divides by zero; 0.0 validates every batch
            raise ConfigError(f"trainer.val_check_interval must be > 0 (an integer: training batches between "
                              f"validations, a fraction in (0, 1] of the epoch, or null: once per epoch), got "
                              f"{interval}")
        accumulate = trainer.accumulate_grad_batches
        if not accumulate >= 1:
            raise ConfigError(f"trainer.accumulate_grad_batches must be >= 1 (1: no accumulation), got {accumulate}")
        if not trainer.barebones and not trainer.log_every_n_steps >= 1:  # (barebones: Lightning sets 0)
            raise ConfigError(f"trainer.log_every_n_steps must be >= 1 (the interval, in steps, of the "
                              f"Train_* logs), got {trainer.log_every_n_steps}")

    def check_data(self, frame_shape: tuple[int, int, int], window: int, source: str,
                   model_from: str | None = None) -> None:
        """Raise :class:`ConfigError` unless frames ``[C, H, W]`` and ``window`` fit the model (``model_from``: the
        checkpoint the model came from, whose shape no setting changes)."""
        c = self.model.config
        if tuple(frame_shape) != (c.in_channels, c.height, c.width):
            C, H, W = frame_shape
            if model_from is not None:
                raise ConfigError(f"{model_from}: its model takes [{c.in_channels}, {c.height}, {c.width}] frames, but "
                                  f"the files of {source} hold {list(frame_shape)} (use data of the checkpoint's "
                                  f"shape, or a checkpoint trained on this data)")
            raise ConfigError(f"model.net.in_channels/height/width = {c.in_channels}/{c.height}/{c.width}, but the "
                              f"files of {source} hold {list(frame_shape)} frames (set --model.net.in_channels={C} "
                              f"--model.net.height={H} --model.net.width={W})")
        if window < self.model.min_frames:
            raise ConfigError(f"data.window = {window}, but the model needs at least {self.model.min_frames} frames "
                              f"(teacher forcing + {self.model.min_frames - 2} rollout passes)")

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
        fused = o.fused if o.fused is not None else (on_cuda and self._scaler is None)
        optimizer = o.adamw(self.parameters(), fused=fused)
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: o.lr_factor(step, total))
        # "name": the key LearningRateMonitor logs the two groups' lr under (Train_Total/lr/pg1, .../pg2)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step",
                                                         "name": "Train_Total/lr"}}

    def on_train_start(self) -> None:
        self.apply_optim_config()
        check_deepspeed_skips_overflow(self.trainer)
        self.skips.engine_start(deepspeed_skipped_steps(self.trainer))  # restored with a resumed engine

    def apply_optim_config(self) -> None:
        """Make the optimiser follow ``model.optim`` after a resume."""
        o = self.optim
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            groups = scheduler.optimizer.param_groups
            for group, weight_decay in zip(groups, (o.weight_decay, 0.0)):
                group.update(initial_lr=o.lr, weight_decay=weight_decay, betas=tuple(o.betas), eps=o.eps)
            _use_this_runs_kernel(scheduler.optimizer)
            scheduler.base_lrs = [o.lr] * len(groups)
            for group, factor in zip(groups, scheduler.lr_lambdas):  # the lr at the restored step
                group["lr"] = o.lr * factor(scheduler.last_epoch)
            scheduler._last_lr = [group["lr"] for group in groups]

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped over the whole run (a host read of the device count, if any)."""
        return self.skips.total

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = self.skips.state()
        checkpoint["lwm_skipped_steps"], checkpoint["lwm_skipped_in_a_row"] = state["total"], state["in_a_row"]
        checkpoint["lwm_skipped_longest_unread"] = state["longest_unread"]
        # the logging interval's sums so far (this rank's), so that a resumed run logs its means as an uninterrupted one
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
        """The trainer, or None where the module is not attached to one."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    def _log_checkpoint_step(self) -> None:
        """``lwm validate|test CKPT``: Lightning restores the weights, not the loops, so its loggers would write the
        metrics at step 0; a logged ``step`` is the step they write at."""
        step = self._checkpoint_step
        if step and self.global_step == 0:  # not after a fit in the same process
            self.log("step", float(step), sync_dist=True)  # (the same on every rank)

    @property
    def weights_step(self) -> int:
        """The global step of the weights in use, what files are named by (checkpoints, videos, codes)."""
        if self.attached_trainer is None or self.trainer.state.fn == "fit":
            return self.global_step
        step = self._checkpoint_step
        return step if step and self.global_step == 0 else self.global_step

    @property
    def weights_world_phase(self) -> str:
        """What the predictor gets for the world (``model.net.world_curriculum``) as the weights' last training step
        had it."""
        return self.model.world_phase_of_weights(self.weights_step)

    def step_generator(self, device: torch.device, batch_idx: int, stream: int = 0) -> torch.Generator:
        """A generator for this training step's random draws, a pure function of (seed, rank, step, batch, stream)."""
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # set by seed_everything
        return seeded_generator(device, seed, self.global_rank, self.global_step, batch_idx, stream)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Latents arrive as the files hold them (float16 stays float16 through the loader) and are cast here, on the
        device, to the parameters' dtype."""
        dtype = self.model.param_dtype
        if isinstance(batch, dict) and "latents" in batch and batch["latents"].dtype != dtype:
            batch = {**batch, "latents": batch["latents"].to(dtype)}
        return batch

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """The loss, and the batch's codes for the monitoring callbacks (``outputs`` of their batch hooks)."""
        x = batch["latents"]  # [B, T, C, H, W]
        self._last_batch = batch  # a reference, to name bad windows if the run stops on non-finite steps
        out = self.model.compute(x, self.global_step, generator=self.step_generator(x.device, batch_idx),
                                 world_phase=self.model.world_phase_at(self.global_step), labels=batch.get("actions"))
        self._log_train(out.logs, x.shape[0])
        return {"loss": out.loss, **self._codes(out)}

    def _log_train(self, logs: dict[str, Tensor], windows: int) -> None:
        """Log the ``Train_*`` values at the steps Lightning writes logs for (``trainer.log_every_n_steps``)."""
        interval = self._interval
        for key, value in logs.items():
            value = value.detach().float()
            finite = torch.isfinite(value)
            add = torch.where(finite, value, 0.0) * windows, finite.float() * windows
            interval[key] = add if key not in interval else (interval[key][0] + add[0], interval[key][1] + add[1])
        if accumulating(self.trainer) or not (logs_at_this_step(self.trainer) or self.trainer.should_stop):
            return
        self._log_interval(windows, over_ranks=True)

    def _log_interval(self, windows: int, over_ranks: bool) -> None:
        """Log the interval's means (under DDP, ``over_ranks``: also over the ranks) and start the next interval."""
        means = {key: (total / weight).to(self.device) for key, (total, weight) in self._interval.items()}
        self._interval = {}
        self.log_dict({f"Train_{k}": v for k, v in (self._over_ranks(means) if over_ranks else means).items()},
                      batch_size=windows)

    def _over_ranks(self, logs: dict[str, Tensor]) -> dict[str, Tensor]:
        """Under DDP, on a step whose logs Lightning writes."""
        trainer = self.attached_trainer
        if trainer is None or trainer.world_size <= 1 or not logs or not trainer.log_every_n_steps:
            return logs
        if not logs_at_this_step(trainer):
            return logs
        keys = list(logs)
        stacked = torch.stack([logs[k].detach().float() for k in keys])
        return dict(zip(keys, trainer.strategy.reduce(stacked, reduce_op="mean").unbind()))

    @staticmethod
    def _codes(out) -> dict[str, Tensor]:
        return {"Action_Encoder": out.actions.indices.detach(), "World_Encoder": out.world.indices.detach()}

    @property
    def _scaler(self) -> Any:
        """The precision plugin's GradScaler (fp16), or None."""
        return getattr(getattr(self.attached_trainer, "precision_plugin", None), "scaler", None)

    def _sync_free(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer can skip a step on the device: a fused AdamW, and no GradScaler of its own."""
        return bool(optimizer.defaults.get("fused")) and getattr(optimizer, "_step_supports_amp_scaling", False) \
            and self._scaler is None

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        # DeepSpeed's engine has stepped (or skipped) by now.
        self._after_deepspeed_step()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._last_batch = None  # the non-finite check of this step is done
        if not accumulating(self.trainer):  # after this step's verdict
            self.log("Train_Total/skipped_steps", self.skips.as_tensor(self.device))
            if self.trainer.should_stop and self._interval:  # a stop decided in this batch's callbacks
                # Lightning writes this step's row all the same, with the interval's means, not the last row's
                # (rank-local: a rank that saw the stop alone must not wait in a collective)
                self._log_interval(batch["latents"].shape[0], over_ranks=False)

    def _after_deepspeed_step(self) -> None:
        """Under DeepSpeed (which keeps its own gradient buffers: ``on_before_optimizer_step`` sees none), after the
        engine's step at the batch that ends a step."""
        count = deepspeed_skipped_steps(self.trainer)
        if count is None or not self.skips.reading_engine or accumulating(self.trainer):
            return
        engine = self.trainer.strategy.deepspeed_engine
        norm = engine.get_global_grad_norm()  # the engine's own
        if norm is not None:
            self.log("Train_Total/grad_norm", norm)
        self._check_in_a_row(self.skips.engine_count(count, scaling_loss=deepspeed_scaling_loss(engine)))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip the update when the gradient norm is not finite."""
        self._grad_norm = None
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:  # DeepSpeed keeps its own gradient buffers
            return
        norm = torch.nn.utils.get_total_norm(grads)  # foreach kernels where the device has them
        self._grad_norm = norm  # clipping reuses it (configure_gradient_clipping)
        self.log("Train_Total/grad_norm", norm)
        if self._sync_free(optimizer):
            self._skip_on_device(optimizer, norm)
        else:
            self._skip_on_host(optimizer, norm)

    def _skip_on_device(self, optimizer: torch.optim.Optimizer, norm: Tensor) -> None:
        """A fused AdamW gets the verdict as a device tensor and skips the whole update itself."""
        nonfinite = ~torch.isfinite(norm)
        optimizer.found_inf = nonfinite.float()  # fused AdamW: no update at all (moments, step count) when 1
        optimizer.grad_scale = None
        self.skips.on_device(nonfinite)
        if is_logging_step(self.trainer):  # the one host read, at the logging interval
            self._check_in_a_row(self.skips.in_a_row_on_device(), when="read at the logging interval, at")

    def _skip_on_host(self, optimizer: torch.optim.Optimizer, norm: Tensor) -> None:
        """The verdict read on the host (one sync): fp16's GradScaler skips the step itself."""
        if bool(torch.isfinite(norm)):
            self.skips.finite()
            return
        scaler = self._scaler
        if scaler is not None:
            # fp16: the GradScaler skips this step itself (its unscale_ saw the inf) and halves its scale.
            self._check_in_a_row(self.skips.skipped(in_a_row=scaler.get_scale() < 1.0))
            return
        for group in optimizer.param_groups:  # AdamW skips parameters without a gradient
            for p in group["params"]:
                p.grad = None
        self._check_in_a_row(self.skips.skipped())

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip by norm with the norm ``on_before_optimizer_step`` just computed over the same gradients (Lightning
        runs that hook right before this one), instead of computing it a second time."""
        norm = getattr(self, "_grad_norm", None)
        if not gradient_clip_val or norm is None or (gradient_clip_algorithm or "norm") != "norm":
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)

    def _check_in_a_row(self, in_a_row: int, when: str = "last at") -> None:
        if in_a_row >= self.max_nonfinite:
            raise NonFiniteLossError(
                f"{in_a_row} consecutive steps had a non-finite loss or gradient ({when} global step "
                f"{self.global_step}); stopped. {self._bad_windows_said()}The last checkpoint is intact: lower "
                f"optim.lr, check the data (`lwm data index`), or raise model.max_nonfinite")

    def _dataset(self, name: str) -> Any:
        """The trainer's data module's ``train_set`` or ``val_set`` (None without one: another data source)."""
        return getattr(getattr(self.attached_trainer, "datamodule", None), name, None)

    def _bad_windows_said(self) -> str:
        """The windows of the last training batch holding NaN/inf, named (a file gone bad after indexing), or ""."""
        batch = self._last_batch
        dataset = self._dataset("train_set")
        bad = []
        if batch is not None and "file_index" in batch and getattr(dataset, "paths", None) is not None:
            bad = nonfinite_windows(batch, dataset.paths)
        if self.attached_trainer is not None and self.trainer.world_size > 1:
            bad = [name for names in every_rank(self.trainer, bad) for name in names]
        return f"The last batch has non-finite latents: {', '.join(bad[:5])}. " if bad else ""

    def _evaluate(self, batch: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        x = batch["latents"]
        if "file_index" in batch:  # [B, 3]: non-finite?, file, start
            self._eval_windows.append(torch.stack([nonfinite_mask(x).long(), batch["file_index"], batch["start"]], 1))
        # eval mode: no token mask, no codebook update
        out = self.model.compute(x, step=None, t0=0, world_phase=self.weights_world_phase, labels=batch.get("actions"))
        for key, value in out.logs.items():
            metric = self.val_metrics[_metric_name(key)]
            metric.update(value, weight=x.shape[0])
            self.log(f"{prefix}_{key}", metric, on_step=False, on_epoch=True, batch_size=x.shape[0])
        return self._codes(out)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        return self._evaluate(batch, "Val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        return self._evaluate(batch, "Test")

    def _log_psnr(self, prefix: str) -> None:
        """``{prefix}_Dynamics_Predictor/tf_psnr``: the teacher-forcing PSNR of the epoch's mean MSE (peak 1, as the
        requirement defines PSNR), beside ``copy_last_psnr``."""
        metric = self.val_metrics[_metric_name("Dynamics_Predictor/tf_loss")]
        if metric.update_count:
            mse = metric.compute().float()
            self.log(f"{prefix}_Dynamics_Predictor/tf_psnr", psnr_from_mse(mse), on_step=False, on_epoch=True,
                     rank_zero_only=True)

    def on_validation_epoch_start(self) -> None:
        self._eval_windows = []

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._log_psnr("Val")
        self._warn_nonfinite_windows("Val")
        if self.trainer.state.fn == "validate":
            self._log_checkpoint_step()

    def on_test_epoch_end(self) -> None:
        self._log_psnr("Test")
        self._warn_nonfinite_windows("Test")
        self._log_checkpoint_step()

    def _warn_nonfinite_windows(self, prefix: str) -> None:
        """Name (warn) this rank's evaluated windows that hold NaN/inf, which make the epoch's metrics NaN: files
        gone bad after `lwm data index` checked them."""
        windows, self._eval_windows = self._eval_windows, []
        dataset = self._dataset("val_set")
        if not windows or getattr(dataset, "paths", None) is None:
            return
        rows = torch.cat(windows).cpu()
        bad = rows[rows[:, 0] == 1].tolist()
        if bad:
            named = ", ".join(window_name(dataset.paths, f, s, dataset.window) for _, f, s in bad[:5])
            warnings.warn(f"{len(bad)} {prefix.lower()} window(s) hold non-finite latents (NaN/inf), so the {prefix}_* "
                          f"metrics are NaN: {named}{' ...' if len(bad) > 5 else ''}; run `lwm data index` on the "
                          f"folder again", stacklevel=2)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """The codes of each window: action indices ``[B, T-1, La]``, world indices ``[B, Lh]``."""
        x = batch["latents"]
        return {
            "action_indices": self.model.encode_actions(x).indices,
            "world_indices": self.model.encode_world(x).indices,
            "file_index": batch["file_index"],
            "start": batch["start"],
        }

"""The Lightning verbs' :class:`LwmCLI` (lwm's run layout, always-on callbacks, checks before any work, atomic
checkpoints) and :func:`read_config`, a fit's config parsed without running it."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import warnings
from dataclasses import asdict
from typing import Any, Literal, Optional, Union

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lwm.callbacks import DEFAULTS, Sensitivity
from lwm.data.datamodule import LatentDataModule
from lwm.modules.world_model import WorldModelConfig
from lwm.training.checkpoint import (AtomicCheckpointIO, ModelCheckpoint, mark_deepspeed_saves_complete,
                                     read_checkpoint, warn_window_mismatch)
from lwm.training.loggers import make_loggers, run_log_dir, WandbConfig
from lwm.training.module import WorldModelModule
from lwm.training.nonfinite import deepspeed_checks_overflow
from lwm.training.optim import OptimConfig
from lwm.training.run_dir import EVAL_VERBS, HoldRunLock, RunDir
from lwm.utils.args import check_config_files, negative_values_joined, relative_interpolations
from lwm.utils.errors import ConfigError
from lwm.utils.threads import set_cpu_threads

_NOISE = (  # Lightning's warnings that do not apply to lwm
    "LightningCLI's args parameter is intended",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    "You have overridden `on_after_batch_transfer` in `LightningModule`",
    "Total length of `list` across ranks is zero",  # data.val_size_percent=0: no validation, on purpose
    "Checkpoint directory .* exists and is not empty",  # a resume (a fresh fit there is refused)
    "`broadcast_buffers` is deprecated",  # configs/ddp.yaml; the quantizers all-reduce their own statistics
    r"It is recommended to use `self.log\('(Train|Val)_.*sync_dist=True",  # lwm reduces them across ranks itself
)
_ADVERTS = ("try installing [litlogger]", "Trainer already configured with model summary callbacks",
            "Detected KeyboardInterrupt, attempting graceful shutdown")  # (lwm's own line says it)
_SECTIONS = ("trainer", "model", "model.net", "model.optim", "data", "checkpoint", "wandb", *DEFAULTS)


def _drop_advert(record: logging.LogRecord) -> bool:
    return not any(advert in record.getMessage() for advert in _ADVERTS)


class _SaveRunConfig(SaveConfigCallback):
    """``RUN_DIR/config.yaml`` (``RUN_DIR/<verb>/config.yaml``), without the ``ckpt_path`` a fit resumed from."""

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self.config.get("ckpt_path") is not None:
            self.config = self.config.clone()
            self.config.ckpt_path = None
        if stage != "fit" and not trainer.loggers and not self.already_saved:  # logger: false: Lightning's
            path = run_log_dir(trainer) / self.config_filename  # trainer.log_dir is RUN_DIR, over the fit's config
            if trainer.is_global_zero:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.parser.save(self.config, str(path), skip_none=False, overwrite=self.overwrite,
                                 multifile=self.multifile)
            self.already_saved = True
            return
        super().setup(trainer, pl_module, stage)


class LwmCLI(LightningCLI):
    """LightningCLI for :class:`WorldModelModule` + :class:`LatentDataModule` with lwm's run layout."""

    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs: Any) -> None:
        import jsonargparse
        from omegaconf.errors import OmegaConfBaseException

        for message in _NOISE:  # Lightning's noise filtered at each CLI (a test's warning filters are reset after it)
            warnings.filterwarnings("ignore", message=message)
        if "SLURM_JOB_ID" not in os.environ:
            warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
        for name in ("lightning.fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
            logging.getLogger(name).addFilter(_drop_advert)
        if not run and any(str(a).split("=")[0] == "--ckpt_path" for a in args or []):
            raise ConfigError("--ckpt_path: this command does not take one (lwm fit --ckpt_path resumes a run)")
        with contextlib.suppress(TypeError):  # (an older jsonargparse) ${a.b} names a key of the verb's config
            jsonargparse.set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
        if {"--help", "-h"} & set(args or []):  # the configs' field docstrings (reading them costs seconds: help only)
            jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
        self._verb_free = not run  # our verbs (codes, overfit, demo) and benchmarks: a fit's options, no verb
        self._verb = str(args[0]) if args else None
        self._run: RunDir | None = None
        self._resume_from: str | None = None
        try:
            super().__init__(
                WorldModelModule, LatentDataModule, seed_everything_default=0,
                # a parse error raises (one line) instead of printing the whole usage
                parser_kwargs={"parser_mode": "omegaconf+", "exit_on_error": False, "allow_abbrev": False},
                save_config_callback=_SaveRunConfig,
                save_config_kwargs={"overwrite": True},  # a resumed run rewrites RUN_DIR/config.yaml
                auto_configure_optimizers=False,  # the module's AdamW and schedule
                # the data module shards by rank itself; 4 validations per epoch, config or not
                trainer_defaults={"use_distributed_sampler": False, "val_check_interval": 0.25},
                args=None if args is None else negative_values_joined(relative_interpolations(args)), run=run,
                **kwargs)
        except (argparse.ArgumentError, OmegaConfBaseException) as e:  # jsonargparse's (omegaconf's) message
            raise ConfigError(" ".join(str(e).split())) from None

    def subcommands(self) -> dict[str, set[str]]:  # the given verb's parser only: each takes ~0.5 s to build
        every = LightningCLI.subcommands()
        return {self._verb: every[self._verb]} if self._verb in every else every

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        from jsonargparse.typing import restricted_number_type

        seed = restricted_number_type("Seed", int, [(">=", 0), ("<", 2**32)])  # numpy's seeds
        parser.add_argument("--seed_everything", type=Union[bool, seed], default=self.seed_everything_default,
                            help="the seed of seed_everything before the classes are made (true: a random one)")

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        for key, (callback, title) in DEFAULTS.items():  # always on (instantiate_trainer), each under its key
            parser.add_class_arguments(callback, key, fail_untyped=False, sub_configs=True)
            parser.groups[key].title = f"{title} (``{key}.*``)"
        parser.set_defaults({  # the 3 most recent step checkpoints, plus last.ckpt; one run per RUN_DIR
            "checkpoint.every_n_train_steps": 1000, "checkpoint.save_last": True, "checkpoint.save_top_k": 3,
            "checkpoint.monitor": "step", "checkpoint.mode": "max", "checkpoint.filename": "step={step:07d}",
            "checkpoint.auto_insert_metric_name": False, "checkpoint.enable_version_counter": False,
            "model_summary.max_depth": 2, "lr_monitor.logging_interval": "step"})
        parser.add_class_arguments(WandbConfig, "wandb")
        # Lightning's optimizer keys: none (the module's AdamW, set under model.optim.*); null in old config.yaml
        for key in ("optimizer", "lr_scheduler"):
            parser.add_argument(f"--{key}", type=Literal[None], default=None, help=argparse.SUPPRESS)
        if self._verb_free:  # a fit's RUN_DIR/config.yaml records them
            parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                                help="(read from a fit's config.yaml and ignored)")
            parser.add_argument("--weights_only", type=Optional[bool], default=None,
                                help="(read from a fit's config.yaml and ignored: checkpoints load weights only)")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        check_config_files(args or [], _SECTIONS)
        super().parse_arguments(parser, args)
        verb = self.config.get("subcommand")
        if verb is None:
            return
        config = self.config[verb]
        self._run = RunDir.of(config)
        path = self._run.checked_ckpt_path(verb, config.get("ckpt_path"), config.get("checkpoint.save_last"))
        # a fit resumes with the config's settings: its ckpt_path hidden from Lightning's parse of the checkpoint's
        self._resume_from, config.ckpt_path = (path, None) if verb == "fit" else (None, path)

    def before_instantiate_classes(self) -> None:
        if self._resume_from is not None:
            self.config.fit.ckpt_path = self._resume_from

    _EVAL_LIMITS = {"fit": ("limit_val_batches", None), "validate": ("limit_val_batches", None),  # val_size_percent
                    "test": ("limit_test_batches", 1.0), "predict": ("limit_predict_batches", 1.0)}  # every window

    def _before(self) -> None:
        """Before a verb runs: the CPU threads, and the checks of the checkpoint, data and model."""
        from lightning.pytorch.accelerators import CPUAccelerator

        dm, trainer, verb = self.datamodule, self.trainer, self.subcommand
        path = self.config[verb].get("ckpt_path")
        path = path if path and path != "last" and os.path.isfile(path) else None  # a file, not a DeepSpeed directory
        if isinstance(trainer.accelerator, CPUAccelerator):
            rank_zero_info(f"CPU threads: {set_cpu_threads(trainer.num_devices)}")
        if verb in EVAL_VERBS and trainer.is_global_zero and path is not None:
            self._run.warn_other_run(verb, path)
        if verb == "fit":
            if trainer.max_steps == 0:
                raise ConfigError("trainer.max_steps=0: a fit of no step (a number of steps, or -1: no limit)")
            self._run.sweep_temp_files()
        if path is not None:
            self._check_checkpoint_fits(path)
        dm.setup(verb)
        self.model.check_data(dm.frame_shape, dm.window, str(dm.manifest_path),
                              model_from=path if verb != "fit" else None)
        self.model.check_trainer(trainer)
        for callback in trainer.callbacks:
            if isinstance(callback, Sensitivity):
                callback.check_window(dm.window)
        # a fraction trainer.limit_*_batches leaving a rank no batch: here, where Lightning raises on that rank alone
        key, fraction = self._EVAL_LIMITS[verb]
        limit = getattr(trainer, key)
        if isinstance(limit, float) and 0 < limit < 1:
            batches = dm.val_batches_per_rank(trainer.world_size, fraction)
            starved = [rank for rank, n in enumerate(batches) if n and int(n * limit) == 0]
            if starved:
                who = f"rank {starved[0]} (of {trainer.world_size})" if trainer.world_size > 1 else "the run"
                n = batches[starved[0]]
                raise ConfigError(
                    f"trainer.{key}={limit} leaves {who} no batch: {limit} x its {n} batch{'es' * (n != 1)} of "
                    f"data.val_batch_size={dm.val_batch_size} ({dm.manifest_path}) < 1; use a larger fraction, a "
                    f"number of batches (an integer), or a smaller data.val_batch_size")

    before_fit = before_validate = before_test = before_predict = _before

    def _after(self) -> None:
        if not self.trainer.fast_dev_run and self.trainer.is_global_zero:  # (a trial writes no files)
            rank_zero_info(f"lwm {self.subcommand}: its files are in {run_log_dir(self.trainer)}")

    after_validate = after_test = after_predict = _after

    def _check_checkpoint_fits(self, path: str) -> None:
        """A checkpoint of another model shape than the config's is one line naming the fields."""
        checkpoint = read_checkpoint(path)
        if self.subcommand != "fit":
            warn_window_mismatch(checkpoint, self.datamodule.window, path)
        step, max_steps = int(checkpoint.get("global_step", 0)), self.trainer.max_steps
        if self.subcommand == "fit" and 0 <= max_steps < step:
            rank_zero_warn(f"trainer.max_steps={max_steps} is below the step of {path}, {step}: nothing is trained "
                           f"(a larger max_steps extends the run)")
        config = self.model.model.config
        saved, current = checkpoint.get("hyper_parameters", {}).get("net") or {}, asdict(config)
        changed = [f"model.net.{k}={current[k]!r} (the checkpoint has {saved[k]!r})" for k in config.SHAPE_FIELDS
                   if k in saved and _as_lists(saved[k]) != _as_lists(current[k])]
        if changed:
            raise ConfigError(f"{path}: a model of another shape than the config's: {', '.join(changed)}; "
                              f"use the run's own config (--config RUN_DIR/config.yaml)")


    def instantiate_trainer(self, **kwargs: Any):
        """Lightning's Trainer with lwm's run layout and always-on callbacks."""
        section = self.config_init.get(str(self.subcommand), self.config_init)
        trainer_config = section.get("trainer") or {}
        run_dir = trainer_config.get("default_root_dir") or "."
        checkpoint = section.get("checkpoint")
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is None:  # RUN_DIR/checkpoints for
            checkpoint.dirpath = os.path.realpath(os.path.join(run_dir, "checkpoints"))  # every verb (`last`)
        if trainer_config.get("logger") in (None, True):  # CSV and wandb, RUN_DIR/<verb> for validate/test/predict
            log_dir = os.path.join(run_dir, self.subcommand) if self.subcommand in EVAL_VERBS else run_dir
            resume = self._run.resumes(self._resume_from) if self.subcommand == "fit" else None
            kwargs.setdefault("logger", make_loggers(str(log_dir), section.get("wandb"), strict=not self._verb_free,
                                                     resume=resume))
        strategy = trainer_config.get("strategy")
        plugins = trainer_config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not (isinstance(strategy, DeepSpeedStrategy) or (isinstance(strategy, str) and "deepspeed" in strategy)
                or any(isinstance(p, CheckpointIO) for p in plugins)):
            kwargs.setdefault("plugins", [*plugins, AtomicCheckpointIO()])  # a temp file, then renamed
        off = {"progress_bar": trainer_config.get("enable_progress_bar") is False,  # the trainer's switches
               "model_summary": trainer_config.get("enable_model_summary") is False}
        given = trainer_config.get("callbacks") or []
        kwargs["callbacks"] = [*(given if isinstance(given, list) else [given]),
                               *(section[key] for key in DEFAULTS if not off.get(key)),
                               *([HoldRunLock()] if self.subcommand == "fit" else [])]
        trainer = super().instantiate_trainer(**kwargs)
        deepspeed_checks_overflow(trainer.strategy)  # bf16: a NaN/inf gradient skips the step (DeepSpeed 0.19.2: not)
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            mark_deepspeed_saves_complete(trainer.strategy)  # a directory cut short by a kill is never resumed
        return trainer


def _as_lists(value: Any) -> Any:
    """Tuples as lists (a checkpoint's hyperparameters hold lists where the config has tuples)."""
    return [_as_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


def read_config(args: list[str]) -> dict[str, Any]:
    """A fit's config (``["--config", FILE, *overrides]``) checked by the fit's parser; nothing made or seeded."""

    class ParseOnly(LwmCLI):
        def add_arguments_to_parser(self, parser) -> None:
            super().add_arguments_to_parser(parser)
            parser.set_defaults({"data.manifest": ""})

        def parse_arguments(self, parser, args) -> None:
            super().parse_arguments(parser, args)
            self.parsed = self.config.clone().as_dict()
            self.config.seed_everything = False  # (Lightning's _set_seed comes next)

        def instantiate_classes(self) -> None:
            pass

    config = ParseOnly(args=args, run=False, load_from_checkpoint_support=False).parsed
    model = config.get("model") or {}
    WorldModelConfig(**(model.get("net") or {}))  # their checks
    OptimConfig(**(model.get("optim") or {}))
    return config

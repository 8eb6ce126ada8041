"""The Lightning verbs' command line: :class:`LwmCLI`, a LightningCLI for :class:`WorldModelModule` and
:class:`LatentDataModule` with lwm's run layout (RUN_DIR, always-on callbacks, checks before any work, atomic
checkpoints, the wandb run a resumed fit continues), and :func:`read_config` / :func:`lightning_cli` for the verbs
of our own that read a fit's config. It imports Lightning: :mod:`lwm.cli` imports it only for the verbs that need
it (`lwm data index` and `lwm --help` should not pay for Lightning).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import re
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lwm.callbacks import DEFAULTS, Sensitivity
from lwm.data.datamodule import LatentDataModule
from lwm.modules.world_model import WorldModelConfig
from lwm.training.checkpoint import (AtomicCheckpointIO, ModelCheckpoint, is_deepspeed_checkpoint,
                                     mark_deepspeed_saves_complete, read_checkpoint, warn_window_mismatch)
from lwm.training.loggers import make_loggers, run_log_dir, WandbConfig
from lwm.training.module import WorldModelModule
from lwm.training.nonfinite import deepspeed_checks_overflow
from lwm.training.optim import OptimConfig
from lwm.training.run_dir import EVAL_VERBS, HoldRunLock, RunDir, check_deepspeed_checkpoint, run_of
from lwm.utils.errors import ConfigError
from lwm.utils.threads import set_cpu_threads


def _parsing_settings() -> None:
    """``${trainer.default_root_dir}`` names a key of the same config under every verb (jsonargparse resolves over
    ``fit.*`` under ``lwm fit``)."""
    import jsonargparse

    with contextlib.suppress(TypeError):  # (an older jsonargparse: without it)
        jsonargparse.set_parsing_settings(omegaconf_absolute_to_relative_paths=True)


_ABSOLUTE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")  # ${trainer.default_root_dir}, not ${..x} nor ${oc.env:X}


def relative_interpolations(args: list[str]) -> list[str]:
    """Command-line values with ``${a.b}`` rewritten relative to their key, as config files are
    (``--checkpoint.dirpath '${trainer.default_root_dir}/c'`` -> ``${..trainer.default_root_dir}/c``)."""
    out = list(args)
    for i, arg in enumerate(out):
        if "${" not in str(arg):
            continue
        if str(arg).startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i and str(out[i - 1]).startswith("--") and "=" not in out[i - 1]:
            key, value = out[i - 1][2:], arg
        else:
            continue
        value = _ABSOLUTE.sub(lambda match: _relative_to(key, match[1]), value)
        out[i] = f"--{key}={value}" if str(arg).startswith("--") else value
    return out


def negative_values_joined(args: list[str]) -> list[str]:
    """``--key -1e-3`` as ``--key=-1e-3``: argparse takes a value that starts with ``-`` and is no plain decimal (an
    exponent, ``-inf``) for an option, and refuses the key ("expected one argument")."""
    out: list[str] = []
    for arg in map(str, args):
        if out and out[-1].startswith("--") and "=" not in out[-1] and arg.startswith("-") and _is_number(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _relative_to(key: str, target: str) -> str:
    """``${target}`` as written in the value of ``key``."""
    path, target_path = key.split("."), target.split(".")
    common = 0
    while common < min(len(path), len(target_path)) and path[common] == target_path[common]:
        common += 1
    return "${" + "." * max(1, len(path) - common) + ".".join(target_path[common:]) + "}"


def _quiet_lightning() -> None:
    """Lightning's noise that does not apply to lwm, filtered at each CLI (a test's warning filters are reset after
    it)."""
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message="You have overridden `on_after_batch_transfer` in `LightningModule`")
    # data.val_size_percent=0: the data module's val_dataloader is an empty list on purpose (no validation)
    warnings.filterwarnings("ignore", message="Total length of `list` across ranks is zero")
    # every resume: a fit that would start over in a folder with checkpoints is refused before this
    warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
    # recent torch, under configs/ddp.yaml: its replacement (forward_sync_buffers) is not in older torch, and the
    # quantizers need no buffer sync in the forward (they all-reduce their EMA statistics themselves)
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
    # under DDP, a hint per epoch-level key: lwm's are reduced across ranks before they are logged (torchmetrics, or
    # gathered by the callback and logged by rank 0).
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('(Train|Val)_.*sync_dist=True")
    if "SLURM_JOB_ID" not in os.environ:  # not in a job
        warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
    for name in ("lightning.fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_drop_advert)


_ADVERTS = ("try installing [litlogger]",  # Lightning's logger tip, on every run
            "Trainer already configured with model summary callbacks")  # ours is configured on purpose


def _drop_advert(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if "Detected KeyboardInterrupt, attempting graceful shutdown" in message:
        return False  # lwm's line says it
    return not any(advert in message for advert in _ADVERTS)


class _SaveRunConfig(SaveConfigCallback):
    """``RUN_DIR/config.yaml`` (and ``RUN_DIR/<verb>/config.yaml``)."""

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


class _Parsed(Exception):
    """Ends a parse-only :class:`LwmCLI` once its config is read (LightningCLI instantiates all in ``__init__``)."""


class LwmCLI(LightningCLI):
    """LightningCLI for :class:`WorldModelModule` + :class:`LatentDataModule` with lwm's run layout."""

    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs: Any) -> None:
        from omegaconf.errors import OmegaConfBaseException

        _quiet_lightning()
        if not run and any(str(a).split("=")[0] == "--ckpt_path" for a in (args or [])):
            raise ConfigError("--ckpt_path: this command does not take one (lwm fit --ckpt_path resumes a run)")
        _parsing_settings()
        args = negative_values_joined(relative_interpolations(args)) if args is not None else None
        self._verb_free = not run  # our verbs (codes, overfit, demo) and benchmarks read a fit's options without a verb
        self._run_dirs: dict[tuple[str, str], RunDir] = {}
        try:
            super().__init__(
                WorldModelModule,
                LatentDataModule,
                seed_everything_default=0,
                # a parse error raises (one error line below) instead of printing ~145 lines of usage
                parser_kwargs={"parser_mode": "omegaconf+", "exit_on_error": False, "allow_abbrev": False},
                save_config_callback=_SaveRunConfig,
                save_config_kwargs={"overwrite": True},  # a resumed run rewrites RUN_DIR/config.yaml
                auto_configure_optimizers=False,  # the module's AdamW and schedule
                # the data module shards by rank itself; 4 validations per epoch (the requirement's), config or not
                trainer_defaults={"use_distributed_sampler": False, "val_check_interval": 0.25},
                args=args,
                run=run,
                **kwargs,
            )
        except (argparse.ArgumentError, OmegaConfBaseException) as e:  # jsonargparse's (omegaconf's) own message
            raise ConfigError(" ".join(str(e).split())) from None

    @staticmethod
    def _section(config: Any) -> Any:
        """The verb's part of a config (all of it without a verb)."""
        return config.get(str(config.get("subcommand")), config)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        given = [str(a) for a in args or []]
        _check_sections(given)
        _check_override_order(given)
        super().parse_arguments(parser, args)
        config = self._section(self.config)
        for key in _NOT_LIGHTNINGS_OPTIMIZER:
            if config.get(key) is not None:
                raise ConfigError(f"{key}: lwm trains with its own AdamW and schedule, set under model.optim.* "
                                  f"(Lightning's --optimizer and --lr_scheduler are not used)")
        seed = config.get("seed_everything")
        if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < 2**32:  # numpy's bounds
            raise ConfigError(f"seed_everything must lie in [0, {2**32 - 1}] (or true: a random seed), got {seed}")
        self._check_ckpt_path()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.every_n_train_steps": 1000,
            "checkpoint.save_last": True,
            "checkpoint.save_top_k": 3,  # the 3 most recent step checkpoints, plus last.ckpt
            "checkpoint.monitor": "step",
            "checkpoint.mode": "max",
            "checkpoint.filename": "step={step:07d}",
            "checkpoint.auto_insert_metric_name": False,
            "checkpoint.enable_version_counter": False,  # one run per RUN_DIR
        })
        # Always-on callbacks, each configurable under its key (e.g. --revival.every_n_steps 10); instantiate_trainer
        # adds them (the progress bar and the summary where the trainer's switches leave them on).
        for key, (callback, title) in DEFAULTS.items():
            parser.add_class_arguments(callback, key, fail_untyped=False, sub_configs=True)
            parser.groups[key].title = f"{title} (``{key}.*``)"
        parser.groups["checkpoint"].title = "checkpoints (``checkpoint.*``; Lightning's ModelCheckpoint)"
        for key, title in (("model", "the training module (``model.*``)"), ("data", "the data (``data.*``)")):
            if key in parser.groups:
                parser.groups[key].title = title
        parser.set_defaults({"model_summary.max_depth": 2, "lr_monitor.logging_interval": "step"})
        parser.add_class_arguments(WandbConfig, "wandb")
        _field_help(parser, {"model.net": WorldModelConfig, "model.optim": OptimConfig, "wandb": WandbConfig})
        for key in _NOT_LIGHTNINGS_OPTIMIZER:  # in the config.yaml of runs before lwm left them out
            parser.add_argument(f"--{key}", type=Optional[Any], default=None, help=argparse.SUPPRESS)
        if self._verb_free:  # a fit's RUN_DIR/config.yaml records its ckpt_path
            parser.add_argument("--ckpt_path", type=Optional[str], default=None,
                                help="(read from a fit's config.yaml and ignored)")
            parser.add_argument("--weights_only", type=Optional[bool], default=None,
                                help="(read from a fit's config.yaml and ignored: checkpoints load weights only)")

    def run_dir(self, config: Any) -> RunDir:
        """The run directory of a verb's config (one per folder pair: ``last`` is resolved once)."""
        run = RunDir.of(config)
        return self._run_dirs.setdefault((run.root, run.checkpoints), run)

    def _checkpoint_file(self, config: Any) -> str | None:
        """``ckpt_path`` as a file (None where there is none, or a DeepSpeed directory)."""
        path = self.run_dir(config).resolve(config.get("ckpt_path"))
        return path if path and os.path.isfile(path) else None

    def _check_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` and resolve ``last`` to the run's latest whole checkpoint (Lightning's ``last`` is
        ``last.ckpt``, whether cut short or behind a newer one), before Lightning reads the hyperparameters of it."""
        sub = self.config.get("subcommand")
        if sub is None:
            return
        config = self.config[sub]
        run = self.run_dir(config)
        if sub == "fit":
            run.check_fit(config.get("ckpt_path"), config.get("checkpoint.save_last"))
            if config.get("ckpt_path") is None and run.resumes(None):  # a SLURM restart: the latest, hpc or not
                config.ckpt_path = "last"
        else:
            run.check_eval(sub, config.get("ckpt_path"))
        if config.get("ckpt_path") == "last" and os.path.exists(run.last):
            config.ckpt_path = run.last
            if sub == "fit" and is_deepspeed_checkpoint(run.last):
                check_deepspeed_checkpoint(run.last, "--ckpt_path last:")
        if sub == "fit":  # a fit resumes with the config's settings: hidden from Lightning, which would parse the
            self._resume_from, config.ckpt_path = config.get("ckpt_path"), None  # checkpoint's hyperparameters over it

    def before_instantiate_classes(self) -> None:
        if getattr(self, "_resume_from", None) is not None:
            self.config.fit.ckpt_path = self._resume_from

    def _check_checkpoint_fits(self) -> None:
        """A checkpoint of another model shape is one line naming the fields, not a state-dict traceback."""
        path = self._checkpoint_file(self.config[self.subcommand])
        if path is None:
            return
        checkpoint = read_checkpoint(path)
        if self.subcommand != "fit":
            warn_window_mismatch(checkpoint, self.datamodule.window, path)
        step, max_steps = int(checkpoint.get("global_step", 0)), self.trainer.max_steps
        if self.subcommand == "fit" and 0 <= max_steps < step:  # (it printed "fit done: step 14/10", no more)
            rank_zero_warn(f"trainer.max_steps={max_steps} is below the step of {path}, {step}: nothing is trained "
                           f"(a larger max_steps extends the run)")
        saved = checkpoint.get("hyper_parameters", {})
        config = self.model.model.config
        saved, current = saved.get("net") or {}, asdict(config)
        changed = [f"model.net.{k}={current[k]!r} (the checkpoint has {saved[k]!r})" for k in config.SHAPE_FIELDS
                   if k in saved and _as_lists(saved[k]) != _as_lists(current[k])]
        if changed:
            raise ConfigError(f"{path}: a model of another shape than the config's: {', '.join(changed)}; "
                              f"use the run's own config (--config RUN_DIR/config.yaml)")

    def _check_data(self) -> None:
        """Read and check the manifest, its files and the model's fit to them before the trainer starts anything (a
        wandb run, a log folder)."""
        self._check_checkpoint_fits()
        dm, trainer = self.datamodule, self.trainer
        dm.setup(self.subcommand)
        from_checkpoint = self._checkpoint_file(self.config[self.subcommand]) if self.subcommand != "fit" else None
        self.model.check_data(dm.frame_shape, dm.window, str(dm.manifest_path), model_from=from_checkpoint)
        self.model.check_trainer(trainer)
        for callback in trainer.callbacks:
            if isinstance(callback, Sensitivity):
                callback.check_window(dm.window)
        if self.subcommand == "validate" and dm.val_size_percent == 0:  # (it ran, and reported nothing)
            raise ConfigError("data.val_size_percent=0: lwm validate would validate no window (1: all of them)")
        self._check_eval_limit()
        if self.subcommand == "fit":
            self._check_val_interval()

    _EVAL_LIMITS = {"fit": ("limit_val_batches", None), "validate": ("limit_val_batches", None),  # val_size_percent
                    "test": ("limit_test_batches", 1.0), "predict": ("limit_predict_batches", 1.0)}  # every window

    def _check_eval_limit(self) -> None:
        """A fraction ``trainer.limit_val_batches`` (test, predict: theirs) that leaves a rank no batch is refused
        here, in one line (Lightning raises as that rank's loop starts; under DDP, on that rank alone, where the
        ranks' windows differ by one, while the others wait for it)."""
        dm, trainer = self.datamodule, self.trainer
        key, fraction = self._EVAL_LIMITS[self.subcommand]
        limit = getattr(trainer, key)
        if not isinstance(limit, float) or not 0 < limit < 1:
            return
        batches = dm.val_batches_per_rank(trainer.world_size, fraction)
        starved = [rank for rank, n in enumerate(batches) if n and int(n * limit) == 0]
        if starved:
            who = f"rank {starved[0]} (of {trainer.world_size})" if trainer.world_size > 1 else "the run"
            n = batches[starved[0]]
            raise ConfigError(
                f"trainer.{key}={limit} leaves {who} no batch: {limit} x its {n} batch{'es' * (n != 1)} of "
                f"data.val_batch_size={dm.val_batch_size} ({dm.manifest_path}) < 1; use a larger fraction, a "
                f"number of batches (an integer), or a smaller data.val_batch_size")

    def _check_val_interval(self) -> None:
        """An integer ``trainer.val_check_interval`` longer than an epoch is refused here, in one line (Lightning's
        own check comes after the loggers start, as a traceback)."""
        dm, trainer = self.datamodule, self.trainer
        interval = getattr(trainer, "val_check_interval", None)  # unset when validation is timed
        by_epoch = trainer.check_val_every_n_epoch is not None
        if not (isinstance(interval, int) and by_epoch and trainer.limit_val_batches):
            return
        batches = len(dm.train_sampler(0, trainer.world_size))
        limit = trainer.limit_train_batches
        batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
        if 0 < batches < interval:
            raise ConfigError(
                f"trainer.val_check_interval={interval} is more than the {batches} training batches of an "
                f"epoch ({dm.manifest_path}); use a fraction of the epoch (0.25), or count steps across "
                f"epochs with trainer.check_val_every_n_epoch=null")

    def _before(self) -> None:
        """Before a verb runs: the CPU threads line, its checks, and for validate/test/predict a warning where the
        checkpoint is another run's."""
        from lightning.pytorch.accelerators import CPUAccelerator

        if isinstance(self.trainer.accelerator, CPUAccelerator):
            rank_zero_info(f"CPU threads: {set_cpu_threads(self.trainer.num_devices)}")
        if self.subcommand in EVAL_VERBS and self.trainer.is_global_zero:
            self._warn_other_run(self.subcommand)
        if self.subcommand == "fit":
            if self.trainer.max_steps == 0:
                raise ConfigError("trainer.max_steps=0: a fit of no step (a number of steps, or -1: no limit)")
            self.run_dir(self.config["fit"]).sweep_temp_files()
        self._check_data()

    before_fit = before_validate = before_test = before_predict = _before

    def _after(self) -> None:
        if not self.trainer.fast_dev_run and self.trainer.is_global_zero:  # (a trial writes no files)
            rank_zero_info(f"lwm {self.subcommand}: its files are in {run_log_dir(self.trainer)}")  # not RUN_DIR itself

    after_validate = after_test = after_predict = _after

    def instantiate_trainer(self, **kwargs: Any):
        """Lightning's Trainer with lwm's run layout and always-on callbacks."""
        section = self._section(self.config_init)
        trainer_config = section.get("trainer") or {}
        if trainer_config.get("enable_checkpointing") is False:
            raise ConfigError("trainer.enable_checkpointing=false: lwm always checkpoints (last.ckpt is what "
                              "--ckpt_path last, a signal and a SLURM requeue resume from); "
                              "checkpoint.every_n_train_steps sets how often")
        run_dir = trainer_config.get("default_root_dir") or "."
        checkpoint = section.get("checkpoint")
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is None:  # RUN_DIR/checkpoints for
            checkpoint.dirpath = os.path.realpath(os.path.join(run_dir, "checkpoints"))  # every verb (ckpt_path last)
        if trainer_config.get("logger") in (None, True):
            kwargs.setdefault("logger", self._default_loggers(run_dir))
        plugins = _with_atomic_checkpoints(trainer_config)
        if plugins is not None:
            kwargs.setdefault("plugins", plugins)
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

    def _default_loggers(self, run_dir: str) -> list:
        """The CSV logger and wandb (:func:`make_loggers`) in RUN_DIR, or ``RUN_DIR/<verb>`` for
        validate/test/predict (never into the fit's metrics.csv or config.yaml)."""
        log_dir = os.path.join(run_dir, self.subcommand) if self.subcommand in EVAL_VERBS else run_dir
        resume = self.run_dir(self.config["fit"]).resumes(self.config["fit"].get("ckpt_path")) \
            if self.subcommand == "fit" else None
        return make_loggers(str(log_dir), self._section(self.config_init).get("wandb"), strict=not self._verb_free,
                            resume=resume)

    def _warn_other_run(self, subcommand: str) -> None:
        """Warn (one line) where ``--ckpt_path`` is another run's checkpoint (``RUN/checkpoints/X.ckpt``, RUN holding
        a config.yaml)."""

        path = self._checkpoint_file(self.config[subcommand])
        if path is None:
            return
        ckpt, root = Path(path).resolve(), Path(self.trainer.default_root_dir).resolve()
        run = run_of(ckpt)
        if run is not None and run != root:
            warnings.warn(f"--ckpt_path {path} is the run {run}'s, but this {subcommand} writes its files under "
                          f"trainer.default_root_dir {root / subcommand} (--trainer.default_root_dir={run} puts them "
                          f"beside its checkpoints)", stacklevel=2)


def field_comments(cls: type) -> dict[str, str]:
    """``{field: its comment}`` of a dataclass, from its source."""
    import dataclasses
    import inspect
    import io
    import tokenize

    names = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    above: list[str] = []
    field_of_line: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if token.start[0] in field_of_line:  # at the end of a field's line
                comments[field_of_line[token.start[0]]] = text
            else:
                above.append(text)
        elif token.type == tokenize.NAME and token.string in names and token.start[0] not in field_of_line \
                and token.line[:token.start[1]].strip() == "":  # a field's name, first on its line
            field_of_line[token.start[0]] = token.string
            if above:
                comments[token.string] = " ".join(above)
        if token.type in (tokenize.NEWLINE, tokenize.NL) and not token.line.strip().startswith("#"):
            above = []  # a blank, code or field line ends the comment block above
    return comments


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """``{field: its help}`` of a dataclass from its source: its comment, else the docstring below it."""
    import docstring_parser

    docs = {p.arg_name: p.description for p in docstring_parser.parse_from_object(cls).params if p.description}
    return docs | field_comments(cls)


def _field_help(parser: Any, sections: dict[str, type]) -> None:
    """``--help`` text of each field of the dataclasses under ``sections`` (none where the source is not installed).
    jsonargparse's own attribute docstrings would parse the source of every Lightning class: seconds at each start."""
    try:
        helps = {f"{prefix}.{name}": text for prefix, cls in sections.items() for name, text in field_help(cls).items()}
    except (OSError, TypeError):  # inspect.getsource: no .py files
        return
    for action in parser._actions:
        if action.dest in helps and not action.help:
            action.help = helps[action.dest]


def _as_lists(value: Any) -> Any:
    """Tuples and lists alike (a checkpoint's hyperparameters hold lists where the config has tuples)."""
    return [_as_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


def _with_atomic_checkpoints(trainer_config: dict) -> list | None:
    """The trainer's plugins plus :class:`AtomicCheckpointIO` (writes to a temp file, then renamed), or None where it
    does not apply."""
    strategy = trainer_config.get("strategy")
    deepspeed = isinstance(strategy, DeepSpeedStrategy) or (isinstance(strategy, str) and "deepspeed" in strategy)
    plugins = trainer_config.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if deepspeed or any(isinstance(p, CheckpointIO) for p in plugins):
        return None
    return plugins + [AtomicCheckpointIO()]


def config_files(args: list[str]) -> list[str]:
    """The ``--config`` files among ``args``, in order."""
    return [a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            for i, a in enumerate(map(str, args)) if a in ("-c", "--config") or a.startswith("--config=")]


def _read_yaml(path: str) -> Any:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


_UNSET = object()


def _value(path: str, key: str) -> Any:
    """The dotted ``key``'s value in the YAML file ``path`` (``_UNSET`` where unset or unreadable: jsonargparse names
    a broken file)."""
    try:
        node = _read_yaml(path)
    except Exception:
        return _UNSET
    for part in key.split("."):
        node = node.get(part, _UNSET) if isinstance(node, dict) else _UNSET
    return node


def _config_file_with(args: list[str], key: str) -> str | None:
    """The last ``--config`` file among ``args`` that sets the dotted ``key`` to anything."""
    return next((path for path in reversed(config_files(args)) if _value(path, key) is not _UNSET), None)


_SECTIONS = ("trainer", "model", "model.net", "model.optim", "data", "checkpoint", "wandb", *DEFAULTS)


def _check_sections(args: list[str]) -> None:
    """An empty or single-value section of a ``--config`` file (its keys all commented out, say) is one line naming
    it (jsonargparse fails on it with a traceback, or drops it)."""
    for path in config_files(args):
        for name in _SECTIONS:
            value = _value(path, name)
            if value is not _UNSET and not isinstance(value, dict):
                raise ConfigError(f"--config {path}: {name} is {'empty' if value is None else repr(value)}, not a "
                                  f"section of keys (give it keys, or leave it out)")


# Lightning's optimizer arguments (LightningCLI(auto_configure_optimizers=False)): refused unless null
_NOT_LIGHTNINGS_OPTIMIZER = ("optimizer", "lr_scheduler")


def _check_override_order(args: list[str]) -> None:
    """An override before a ``--config`` file that sets the same key is lost (the later file wins): one line."""
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg in ("--config", "-c") or arg.startswith("--config="):
            continue
        key = arg[2:].split("=", 1)[0]
        later = _config_file_with(args[i + 1:], key)
        if later is not None:
            raise ConfigError(f"--{key} comes before --config {later}, which sets it again (a later config wins): "
                              f"put the overrides after the --config files")


def read_config(args: list[str]) -> dict[str, Any]:
    """A fit's config (``["--config", FILE, *overrides]``) read by the fit's parser, as a dict, instantiating nothing
    (no trainer, loggers, data or model)."""

    class ParseOnly(LwmCLI):
        def add_arguments_to_parser(self, parser) -> None:
            super().add_arguments_to_parser(parser)
            parser.set_defaults({"data.manifest": ""})

        def parse_arguments(self, parser, args) -> None:
            super().parse_arguments(parser, args)
            raise _Parsed(self.config)

    try:
        ParseOnly(args=args, run=False)
    except _Parsed as parsed:
        config = parsed.args[0].clone().as_dict()  # (jsonargparse 5 drops namespace_to_dict)
    model = config.get("model") or {}
    WorldModelConfig(**(model.get("net") or {}))  # their checks
    OptimConfig(**(model.get("optim") or {}))
    return config


def lightning_cli(args: list[str], run: bool = True):
    """Build (and with ``run`` execute) the LightningCLI for ``args`` (``["fit", "--config", ...]``, or without a
    verb when ``run`` is False)."""
    return LwmCLI(args=args, run=run)

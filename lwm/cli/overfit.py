"""The requirement's overfit test: one datapoint from the training data, many steps, every loss logged."""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from lwm.callbacks.slurm import interrupted_by, SlurmRequeue
from lwm.cli.lightning_cli import LwmCLI
from lwm.utils.args import ArgumentParser, positive_int
from lwm.utils.errors import ConfigError

TF_KEY = "Train_Dynamics_Predictor/tf_loss"
# the keys lwm overfit sets itself, whatever the config or the command line says (and what to use instead)
OWN_KEYS = {**{f"--trainer.{key}": "--steps" for key in ("max_steps", "max_epochs", "limit_train_batches")},
            **{key: "" for key in ("--trainer.log_every_n_steps", "--trainer.accumulate_grad_batches",
                                   "--trainer.limit_val_batches", "--trainer.val_check_interval",
                                   "--trainer.num_sanity_val_steps", "--trainer.check_val_every_n_epoch",
                                   "--checkpoint.dirpath", "--data.val_size_percent", "--data.batch_size")}}


class _Record(L.Callback):
    """The teacher-forcing loss of every step; the data's hyperparameters in the checkpoints, as `lwm fit`'s."""

    def __init__(self, hparams: dict[str, Any]) -> None:
        self.tf_losses: list[float] = []
        self.hparams = hparams

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        value = trainer.callback_metrics.get(TF_KEY)
        if value is not None:
            self.tf_losses.append(float(value))

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["datamodule_hyper_parameters"] = dict(self.hparams)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(prog="lwm overfit", description=__doc__.split("\n\n")[0], epilog="Every other argument "
                            "is a `lwm fit` option: --config FILE and dotted overrides such as --data.manifest M.")
    parser.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps on the one datapoint")
    parser.add_argument("--file", type=int, default=0, help="index of the file among the manifest's train files "
                        "that hold a whole data.window (in manifest order)")
    parser.add_argument("--start", type=int, default=0, help="first frame of the window")
    args, rest = parser.parse_known_args(argv)
    for key, instead in OWN_KEYS.items():  # given on the command line, and silently overridden
        if any(a.split("=")[0] == key for a in rest):
            warnings.warn(f"{key}: lwm overfit sets it itself (every step logged, one window, a batch of one, no "
                          f"validation, checkpoints in its folder): ignored" + (f"; use {instead}" if instead else ""))
    return args, rest


def _fresh_folder(path: str) -> str:
    """``path``, or ``path_2``, ``path_3``, ..."""
    candidate, n = path, 1
    while os.path.exists(candidate) and not (os.path.isdir(candidate) and not any(os.scandir(candidate))):
        n += 1
        candidate = f"{path}_{n}"
    return candidate


def main(argv: list[str]) -> int:
    args, rest = parse(argv)
    inherited = "LWM_OVERFIT_DIR" in os.environ  # a DDP child of an overfit run
    try:
        return _run(args, rest)
    finally:
        if not inherited:  # a later overfit in this process picks its own folder
            os.environ.pop("LWM_OVERFIT_DIR", None)


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    class OverfitCLI(LwmCLI):
        def before_instantiate_classes(self) -> None:
            trainer = self.config.trainer
            # one folder for every process: Lightning's DDP children inherit the parent's choice
            folder = os.environ.get("LWM_OVERFIT_DIR") or _fresh_folder(
                os.path.join(trainer.default_root_dir or ".", "overfit"))
            os.environ["LWM_OVERFIT_DIR"] = trainer.default_root_dir = folder
            trainer.max_steps, trainer.max_epochs = args.steps, 1
            trainer.limit_val_batches, trainer.num_sanity_val_steps, trainer.val_check_interval = 0, 0, 1.0
            trainer.check_val_every_n_epoch = 1
            # every loss of every step, --steps optimizer steps of one batch each, whatever the config says
            trainer.log_every_n_steps, trainer.accumulate_grad_batches, trainer.limit_train_batches = 1, 1, 1.0
            self.config.checkpoint.dirpath = None  # into the overfit folder, never over a run's checkpoints
            self.config.data.val_size_percent = 0.0

    cli = OverfitCLI(args=rest, run=False)
    dm, model = cli.datamodule, cli.model
    dm.setup("fit")
    files = dm.train_set
    if not 0 <= args.file < len(files.paths):
        raise ConfigError(f"--file {args.file}: the train split has {len(files.paths)} usable files "
                          f"(0..{len(files.paths) - 1})")
    if not 0 <= args.start <= files.frames[args.file] - dm.window:
        raise ConfigError(f"--start {args.start}: {files.paths[args.file]} has {files.frames[args.file]} frames, "
                          f"window {dm.window}")
    model.check_data(dm.frame_shape, dm.window, str(dm.manifest_path))
    if model.optim.warmup_steps >= args.steps:
        warnings.warn(f"model.optim.warmup_steps {model.optim.warmup_steps} >= --steps {args.steps}: the whole overfit "
                      f"runs in the warmup, below the peak lr (e.g. --model.optim.warmup_steps={args.steps // 10})")

    item = files[(args.file, args.start)]
    loader = DataLoader([item] * args.steps, batch_size=1)
    record = _Record(dm.hparams)
    cli.trainer.callbacks.append(record)
    for callback in cli.trainer.callbacks:
        if isinstance(callback, SlurmRequeue):  # a stopped overfit is run again, not resumed
            callback.resume_hint = "lwm overfit does not resume (run it again; each run has a folder of its own)"
    cli.trainer.fit(model, train_dataloaders=loader)
    dm.teardown("fit")
    signum = interrupted_by(cli.trainer)

    tf = record.tf_losses
    if tf:
        print(f"overfit: teacher-forcing loss {tf[0]:.4g} -> {tf[-1]:.4g} (min {min(tf):.4g}) in {len(tf)} steps "
              f"on one window ({files.paths[args.file]}, frames {args.start}..{args.start + dm.window - 1}); "
              f"every loss in {cli.trainer.default_root_dir}/metrics.csv")
    return 128 + signum if signum else 0  # stopped by Ctrl-C or kill

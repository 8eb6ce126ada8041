"""Loggers. Every run writes a local CSV of every logged scalar (``RUN_DIR/metrics.csv``), and, unless
``wandb.mode`` (else ``WANDB_MODE``) is ``disabled``, a wandb run in ``RUN_DIR/wandb`` (``WANDB_DIR/wandb`` where
that is set; offline by default when no wandb login is configured; ``wandb sync RUN_DIR/wandb/offline-run-*``
uploads it later). The ``wandb.*`` keys a config leaves unset keep wandb's environment variables' meaning. This
is the only module that imports wandb; :func:`log_distribution` is how callbacks log a distribution (a wandb
histogram, plus min/mean/max scalars that reach the CSV)."""

from __future__ import annotations

import csv
import importlib.util
import netrc
import os
import secrets
from pathlib import Path
from dataclasses import dataclass
from typing import Literal

import lightning as L
import torch

from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import DummyExperiment, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lwm.utils.errors import ConfigError, first_line
from lwm.utils.files import atomic_write, remove_stale_temp_files


class _AppendingWriter(ExperimentWriter):
    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        name = Path(self.metrics_file_path).name
        remove_stale_temp_files(log_dir, target=name.__eq__)  # of a header rewrite killed mid-way
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = next(csv.reader(f), [])

    @override
    def _check_log_dir_exists(self) -> None:  # private: Lightning's removes metrics.csv, no public switch
        pass

    @override
    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        """One row per step: what Lightning logs in several calls at one step (the training scalars, the learning
        rate, a validation) joins that step's row, which :meth:`save` holds back until a later step comes."""
        pending = len(self.metrics)
        super().log_metrics(metrics_dict, step)
        if pending and self.metrics[-2].get("step") == self.metrics[-1]["step"]:
            self.metrics[-2].update(self.metrics.pop())
        elif pending:
            self.save()

    @override
    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:  # private: atomic, no public hook
        """A column appeared (the first validation, a resume of another version)."""
        def rewrite(target) -> None:
            with open(self.metrics_file_path, newline="") as source:
                writer = csv.DictWriter(target, fieldnames=fieldnames)
                writer.writeheader()
                writer.writerows(csv.DictReader(source))

        atomic_write(self.metrics_file_path, rewrite, mode="w", newline="")

    @override
    def save(self, final: bool = False) -> None:
        """Write the rows of the steps before the latest (Lightning saves after every call); ``final``: all."""
        if final or len(self.metrics) < 2:
            if final:
                super().save()
            return
        latest = self.metrics.pop()
        super().save()
        self.metrics = [latest]


class CSVLogger(_LightningCSVLogger):
    """Lightning's CSVLogger, appending to ``save_dir/name/version/metrics.csv`` across resumes, one row per step (a
    step repeated after a resume, from its last checkpoint, is a row again: readers keep the last)."""

    def __init__(self, save_dir: str, name: str = "", version: int | str | None = "", **kwargs) -> None:
        super().__init__(save_dir, name=name, version=version, **kwargs)

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> _AppendingWriter:
        if self._experiment is None:  # private: whether it started, without starting it
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def flush(self) -> None:
        """Write every row held back, the latest step's too: where nothing more is logged at that step (the end, a
        checkpoint written at a validation's end)."""
        if self._experiment is not None:
            self._experiment.save(final=True)

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.flush()  # the held-back row of the last step too


@dataclass(frozen=True)
class WandbConfig:
    """wandb settings (``wandb.*`` in configs)."""

    mode: Literal["online", "offline", "disabled"] | None = None
    """None: WANDB_MODE, else online when logged in, else offline"""
    project: str | None = None
    """wandb project (None: WANDB_PROJECT, else lwm)"""
    name: str | None = None
    """run name (None: WANDB_NAME, else the run directory's name)"""
    entity: str | None = None
    """wandb team or user (None: WANDB_ENTITY, else your default)"""


WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")  # wandb's (dryrun: offline; run: online)


def wandb_mode(mode: str | None) -> str:
    """The wandb run's mode: ``mode`` (the config's), else ``WANDB_MODE``, else online when logged in, else offline."""
    return mode or os.environ.get("WANDB_MODE") or ("online" if wandb_logged_in() else "offline")


def wandb_logged_in() -> bool:
    """A wandb API key is configured (``WANDB_API_KEY`` or a ``~/.netrc`` entry, as ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc().hosts
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return any("wandb" in host for host in hosts)


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


RUN_ID_FILE = "wandb/run_id"  # under RUN_DIR


def wandb_run_id(root: str, resume: bool) -> str:
    """The wandb run id of the fit in ``root``: the one recorded in ``root/wandb/run_id`` when the fit resumes (a
    requeued or restarted run continues its wandb run, online or, with ``wandb sync``, offline), else a new one
    (recorded once its wandb run starts: :class:`WandbLogger`)."""
    path = Path(root) / RUN_ID_FILE
    if resume and path.is_file():
        run_id = path.read_text().strip()
        if run_id:
            return run_id
    return secrets.token_hex(4)  # wandb's own ids are 8 characters of [0-9a-z]


class WandbLogger(_LightningWandbLogger):
    """Lightning's WandbLogger that records its run id in ``run_id_file`` when its run starts (rank 0), so that a
    resumed fit continues the run."""

    def __init__(self, *args, run_id_file: str | Path | None = None, wait_for_lock: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._run_id_file = Path(run_id_file) if run_id_file is not None else None
        self.wait_for_lock = wait_for_lock
        self.next_row: dict = {}  # histograms and videos, for the row of the scalars Lightning logs next
        if self._wandb_init.get("anonymous") is None:  # private: Lightning passes None, which wandb warns about
            self._wandb_init.pop("anonymous", None)

    @property
    @override
    def experiment(self):
        if self._experiment is None and self.wait_for_lock:  # (Lightning's early ask: started after the lock)
            return DummyExperiment()
        if self._experiment is None and self.save_dir:  # wandb writes into save_dir/wandb
            os.makedirs(self.save_dir, exist_ok=True)
        try:
            experiment = super().experiment
        except Exception as e:  # wandb's UsageError
            if type(e).__name__ != "UsageError":
                raise
            raise ConfigError(f"wandb: {first_line(e)} (or set WANDB_API_KEY; --wandb.mode=offline logs without an "
                              f"account)") from None
        if self._run_id_file is not None and rank_zero_only.rank == 0 and getattr(experiment, "id", None):
            path, self._run_id_file = self._run_id_file, None
            atomic_write(path, lambda f: f.write(f"{experiment.id}\n"), mode="w")
        return experiment

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        extras, self.next_row = self.next_row, {}
        super().log_metrics({**metrics, **extras}, step)


def make_loggers(root: str, wandb: WandbConfig = WandbConfig(), strict: bool = True, resume: bool | None = None) -> list:
    """The run's loggers: our CSV logger in ``root`` and, unless disabled, a WandbLogger writing to ``root/wandb``."""
    loggers: list = [CSVLogger(save_dir=root)]
    mode = wandb_mode(wandb.mode)
    if mode not in WANDB_MODES:  # (from WANDB_MODE)
        raise ConfigError(f"WANDB_MODE={mode}: wandb's modes are {', '.join(WANDB_MODES)} (or set wandb.mode)")
    if mode != "disabled" and not wandb_installed():
        if wandb.mode is not None and strict:
            raise ConfigError(f"wandb.mode={wandb.mode}, but wandb is not installed (pip install wandb, or "
                              f"wandb.mode=disabled)")
        rank_zero_warn("wandb is not installed: logging to RUN_DIR/metrics.csv only (wandb.mode=disabled "
                       "silences this)")
        mode = "disabled"
    if mode != "disabled":
        fit = resume is not None
        loggers.append(WandbLogger(  # mode passed to wandb, not Lightning's offline
            save_dir=os.environ.get("WANDB_DIR") or root, project=wandb.project or os.environ.get("WANDB_PROJECT") or
            "lwm", entity=wandb.entity, mode=mode, name=wandb.name or os.environ.get("WANDB_NAME") or
            os.path.basename(os.path.abspath(root)),
            # Lightning's WandbLogger resumes with "allow"
            id=(os.environ.get("WANDB_RUN_ID") or wandb_run_id(root, resume)) if fit else None,
            run_id_file=Path(root) / RUN_ID_FILE if fit else None, wait_for_lock=fit,
        ))
    return loggers


def run_log_dir(trainer: L.Trainer) -> Path:
    """Where this run's files go: the CSV logger's folder (RUN_DIR, or RUN_DIR/<verb> for validate, test and
    predict)."""
    logger = trainer.loggers[0] if trainer.loggers else None
    log_dir = getattr(logger, "log_dir", None)
    if log_dir:
        return Path(log_dir)
    verb = trainer.state.fn.value if trainer.state.fn is not None else "fit"
    return Path(trainer.default_root_dir) / ("" if verb == "fit" else verb)


def _to_wandb(pl_module: L.LightningModule, data: dict) -> None:
    """``data`` (histograms, videos) into the wandb row of the scalars Lightning logs next, at their step (rank 0)."""
    for logger in pl_module.loggers:
        if isinstance(logger, WandbLogger):
            logger.next_row.update(data)
        elif type(logger).__name__ == "WandbLogger":  # Lightning's own: commit=False joins the next row
            logger.experiment.log(data, commit=False)


def log_distribution(pl_module: L.LightningModule, name: str, values: torch.Tensor) -> None:
    """Log ``values`` as a distribution: ``name/min``, ``name/mean``, ``name/max`` scalars (every logger, so the CSV
    has them) and a native histogram ``name`` on wandb, at the current global step."""
    v = values.detach().float().flatten()
    validating = pl_module.trainer.validating or pl_module.trainer.sanity_checking
    # this rank's values (callbacks gather what they need before calling): no reduction across ranks
    pl_module.log_dict({f"{name}/min": v.min(), f"{name}/mean": v.mean(), f"{name}/max": v.max()},
                       on_step=not validating, on_epoch=validating, rank_zero_only=True)
    if pl_module.trainer.sanity_checking or not pl_module.trainer.is_global_zero:
        return
    histogram = histogram_values(v)
    if histogram is not None and any(type(logger).__name__ == "WandbLogger" for logger in pl_module.loggers):
        import wandb

        _to_wandb(pl_module, {name: wandb.Histogram(histogram)})  # one row per logged step, not one per histogram


def histogram_values(values: torch.Tensor):
    """The finite ``values`` as a float64 numpy array for ``wandb.Histogram`` (None when none is finite)."""
    v = values.detach().flatten()
    v = v[torch.isfinite(v)]
    return v.cpu().double().numpy() if v.numel() else None


def log_video(pl_module: L.LightningModule, name: str, path: str) -> None:
    """Send an mp4/gif file to wandb as a video ``name`` at the current global step (rank 0; no other logger takes
    videos: the file itself stays in the run directory)."""
    if pl_module.trainer.is_global_zero and any(type(logger).__name__ == "WandbLogger" for logger in pl_module.loggers):
        import wandb

        _to_wandb(pl_module, {name: wandb.Video(path)})  # at the file's fps, with the validation's scalars

"""Loggers: a local CSV of every logged scalar (``RUN_DIR/metrics.csv``) and, unless disabled, a wandb run in
``RUN_DIR/wandb`` (offline without a login). The only module that imports wandb."""

from __future__ import annotations

import csv
import importlib.util
import netrc
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import DummyExperiment, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

from lwm.utils.errors import ConfigError, first_line
from lwm.utils.files import atomic_write, remove_stale_temp_files


class _AppendingWriter(ExperimentWriter):
    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        remove_stale_temp_files(log_dir, target=Path(self.metrics_file_path).name.__eq__)  # a killed header rewrite's
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = next(csv.reader(f), [])

    def _check_log_dir_exists(self) -> None:  # private: Lightning's removes metrics.csv, no public switch
        pass

    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        """One row per step: the calls of one step join its row, which :meth:`save` holds back until the next."""
        pending = len(self.metrics)
        super().log_metrics(metrics_dict, step)
        if pending and self.metrics[-2].get("step") == self.metrics[-1]["step"]:
            self.metrics[-2].update(self.metrics.pop())
        elif pending:
            self.save()

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:  # private: atomic, no public hook
        def rewrite(target) -> None:
            with open(self.metrics_file_path, newline="") as source:
                writer = csv.DictWriter(target, fieldnames=fieldnames)
                writer.writeheader()
                writer.writerows(csv.DictReader(source))

        atomic_write(self.metrics_file_path, rewrite, mode="w", newline="")

    def save(self, final: bool = False) -> None:
        """Write the rows before the latest step's (``final``: all)."""
        held = [] if final or not self.metrics else [self.metrics.pop()]
        super().save()
        self.metrics = held


class CSVLogger(_LightningCSVLogger):
    """Lightning's CSVLogger appending to ``save_dir/metrics.csv`` across resumes, one row per step."""

    def __init__(self, save_dir: str, name: str = "", version: int | str | None = "", **kwargs) -> None:
        super().__init__(save_dir, name=name, version=version, **kwargs)

    @property
    @rank_zero_experiment
    def experiment(self) -> _AppendingWriter:
        if self._experiment is None:  # private: whether it started, without starting it
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def flush(self) -> None:
        """Write every row held back, the latest step's too."""
        if self._experiment is not None:
            self._experiment.save(final=True)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.flush()


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
RUN_ID_FILE = "wandb/run_id"  # under RUN_DIR


def wandb_logged_in() -> bool:
    """A wandb API key is configured (``WANDB_API_KEY`` or a ``~/.netrc`` entry, as ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return any("wandb" in host for host in netrc.netrc().hosts)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_installed() -> bool:
    return importlib.util.find_spec("wandb") is not None


def wandb_run_id(root: str, resume: bool) -> str:
    """The wandb run id recorded in ``root/wandb/run_id`` when the fit resumes, else a new one."""
    path = Path(root) / RUN_ID_FILE
    run_id = path.read_text().strip() if resume and path.is_file() else ""
    return run_id or secrets.token_hex(4)  # wandb's own ids are 8 characters of [0-9a-z]


class WandbLogger(_LightningWandbLogger):
    """Lightning's WandbLogger recording its run id in ``run_id_file`` (rank 0): a resumed fit continues the run."""

    def __init__(self, *args, run_id_file: str | Path | None = None, wait_for_lock: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._run_id_file = Path(run_id_file) if run_id_file is not None else None
        self.wait_for_lock = wait_for_lock
        self.next_row: dict = {}  # histograms and videos, for the row of the scalars Lightning logs next
        if self._wandb_init.get("anonymous") is None:  # private: Lightning passes None, which wandb warns about
            self._wandb_init.pop("anonymous", None)

    @property
    def experiment(self):
        if self._experiment is None and self.wait_for_lock:  # (Lightning's early ask: started after the lock)
            return DummyExperiment()
        if self._experiment is None and self.save_dir:  # wandb writes into save_dir/wandb
            os.makedirs(self.save_dir, exist_ok=True)
        from wandb.errors import UsageError

        try:
            experiment = super().experiment
        except UsageError as e:
            raise ConfigError(f"wandb: {first_line(e)} (or set WANDB_API_KEY; --wandb.mode=offline logs without an "
                              f"account)") from None
        if self._run_id_file is not None and rank_zero_only.rank == 0 and getattr(experiment, "id", None):
            path, self._run_id_file = self._run_id_file, None
            atomic_write(path, lambda f: f.write(f"{experiment.id}\n"), mode="w")
        return experiment

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        extras, self.next_row = self.next_row, {}
        super().log_metrics({**metrics, **extras}, step)


def make_loggers(root: str, wandb: WandbConfig = WandbConfig(), strict: bool = True, resume: bool | None = None) -> list:
    """The CSV logger in ``root`` and, unless disabled, a WandbLogger in ``root/wandb`` (``resume``: None: no fit)."""
    loggers: list = [CSVLogger(save_dir=root)]
    mode = wandb.mode or os.environ.get("WANDB_MODE") or ("online" if wandb_logged_in() else "offline")
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
            id=(os.environ.get("WANDB_RUN_ID") or wandb_run_id(root, resume)) if fit else None,  # Lightning: "allow"
            run_id_file=Path(root) / RUN_ID_FILE if fit else None, wait_for_lock=fit,
        ))
    return loggers


def run_log_dir(trainer: L.Trainer) -> Path:
    """Where this run's files go: the CSV logger's folder (RUN_DIR, or RUN_DIR/<verb> for validate, test, predict)."""
    log_dir = getattr(trainer.loggers[0] if trainer.loggers else None, "log_dir", None)
    if log_dir:
        return Path(log_dir)
    verb = trainer.state.fn.value if trainer.state.fn is not None else "fit"
    return Path(trainer.default_root_dir) / ("" if verb == "fit" else verb)


def _to_wandb(pl_module: L.LightningModule, make) -> None:
    """``make(wandb)`` (histograms, videos) into the wandb row of the scalars Lightning logs next (rank 0)."""
    loggers = [logger for logger in pl_module.loggers if type(logger).__name__ == "WandbLogger"]
    if not loggers or not pl_module.trainer.is_global_zero:
        return
    import wandb

    data = make(wandb)
    for logger in loggers if data else ():
        if isinstance(logger, WandbLogger):
            logger.next_row.update(data)
        else:  # Lightning's own: commit=False joins the next row
            logger.experiment.log(data, commit=False)


def log_distribution(pl_module: L.LightningModule, name: str, values: torch.Tensor) -> None:
    """``name/min``, ``/mean``, ``/max`` of this rank's ``values`` (every logger), and a wandb histogram ``name``."""
    v = values.detach().float().flatten()
    validating = pl_module.trainer.validating or pl_module.trainer.sanity_checking
    pl_module.log_dict({f"{name}/min": v.min(), f"{name}/mean": v.mean(), f"{name}/max": v.max()},
                       on_step=not validating, on_epoch=validating, rank_zero_only=True)
    if not pl_module.trainer.sanity_checking:
        _to_wandb(pl_module, lambda wandb: {} if (h := histogram_values(v)) is None else {name: wandb.Histogram(h)})


def histogram_values(values: torch.Tensor):
    """The finite ``values`` as a float64 numpy array for ``wandb.Histogram`` (None when none is finite)."""
    v = values.detach().flatten()
    v = v[torch.isfinite(v)]
    return v.cpu().double().numpy() if v.numel() else None


def log_video(pl_module: L.LightningModule, name: str, path: str) -> None:
    """An mp4/gif file to wandb as a video ``name`` at the current step (it plays at the file's own fps)."""
    _to_wandb(pl_module, lambda wandb: {name: wandb.Video(path)})

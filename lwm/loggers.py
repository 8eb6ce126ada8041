"""Loggers. Every run writes a local CSV of every logged scalar (``RUN_DIR/metrics.csv``).

Lightning's CSV writer, resumed into an existing ``metrics.csv``, forgets the columns already in the file and
fails to rewrite the header when the first new row lacks one of them (a validation metric, say); this one
reads the existing header first and appends. Rows logged after the last checkpoint of an interrupted run
stay in the file, so a resumed run repeats a few steps: readers keep the last row per step.
"""

from __future__ import annotations

import csv
import os

from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from typing_extensions import override


class _AppendingWriter(ExperimentWriter):
    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = next(csv.reader(f), [])

    @override
    def _check_log_dir_exists(self) -> None:  # appending to an existing run is what we want
        pass


class CSVLogger(_LightningCSVLogger):
    """Lightning's CSVLogger, appending to ``save_dir/name/version/metrics.csv`` across resumes."""

    def __init__(self, save_dir: str, name: str = "", version: int | str | None = "", **kwargs) -> None:
        super().__init__(save_dir, name=name, version=version, **kwargs)

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> _AppendingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

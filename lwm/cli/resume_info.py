"""``lwm resume-info --config CFG [overrides]``: where a run lives and which checkpoint continues it, for the SLURM
scripts (``slurm/train.sbatch`` runs it at every start of a job).

Prints two lines: ``RUN_DIR`` (``trainer.default_root_dir`` as ``lwm fit`` resolves the config, overrides and
interpolations; ``.`` when unset) and the checkpoint to resume from (:meth:`RunDir.latest`), or an empty line.
"""

from __future__ import annotations

from lwm.cli.lightning_cli import read_config
from lwm.training.run_dir import RunDir
from lwm.utils.args import config_files
from lwm.utils.errors import ConfigError


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if not config_files(argv):
        raise ConfigError("lwm resume-info needs --config CFG (and the run's overrides, as given to lwm fit)")
    run = RunDir.of(read_config(argv))  # every argument in its order: a later --config overrides
    found = run.latest()
    print(run.root)
    print(found if found is not None else "")
    return 0

"""``lwm resume-info --config CFG [overrides]``: RUN_DIR and the checkpoint that continues it (the SLURM scripts)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from lwm.cli.lightning_cli import config_files, lightning_cli
from lwm.training.run_dir import latest_checkpoint
from lwm.utils.errors import ConfigError


def run_paths(args: list[str]) -> tuple[Path, Path]:
    """``(RUN_DIR, CHECKPOINT_DIR)`` of ``lwm fit ARGS`` (``--config`` files and overrides, in their order)."""
    import yaml


    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            lightning_cli(["fit", *args, "--print_config"])
    except SystemExit as e:  # --print_config exits 0 after printing
        if e.code not in (0, None):
            raise ConfigError(f"`lwm fit {' '.join(args)} --print_config` failed (exit {e.code})") from None
    cfg = yaml.safe_load(out.getvalue()) or {}
    root = Path((cfg.get("trainer") or {}).get("default_root_dir") or ".")
    dirpath = (cfg.get("checkpoint") or {}).get("dirpath")
    return root, Path(dirpath) if dirpath else root / "checkpoints"

def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0

    configs = config_files(argv)
    if not configs:
        raise ConfigError("lwm resume-info needs --config CFG (and the run's overrides, as given to lwm fit)")
    for config in configs:
        if not os.path.isfile(config):
            raise ConfigError(f"--config {config}: not found")
    run_dir, checkpoint_dir = run_paths(argv)  # every argument in its order: a later --config overrides
    found = latest_checkpoint(run_dir, checkpoint_dir)
    print(run_dir)
    print(found if found is not None else "")
    return 0

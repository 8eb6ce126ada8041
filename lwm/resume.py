"""``lwm resume-info --config CFG [overrides]``: where a run lives and which checkpoint continues it, for the
SLURM scripts (``slurm/train.sbatch`` runs it at every start of a job, first or requeued).

Prints two lines: ``RUN_DIR`` (``trainer.default_root_dir`` as lwm resolves the config, overrides and
interpolations; ``.`` when unset) and the checkpoint to resume from, or an empty line when the run has none.
The candidates are ``CHECKPOINT_DIR/last.ckpt`` (``checkpoint.dirpath``, by default ``RUN_DIR/checkpoints``)
and ``RUN_DIR/hpc_ckpt_N.ckpt`` (written when SLURM preempts); the one at the highest global step wins, read
from the file (``weights_only``, memory-mapped), not from its modification time, which a DeepSpeed
checkpoint (a directory rewritten in place) or a shared filesystem's clock skew would get wrong. DeepSpeed
checkpoint directories: ``last.ckpt`` first, else the highest ``N``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

from lwm.errors import ConfigError


def run_paths(config: str, overrides: list[str]) -> tuple[Path, Path]:
    """``(RUN_DIR, CHECKPOINT_DIR)`` of ``lwm fit --config config overrides``."""
    import yaml

    from lwm.cli import lightning_cli

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            lightning_cli(["fit", "--config", config, *overrides, "--print_config"])
    except SystemExit as e:  # --print_config exits 0 after printing
        if e.code not in (0, None):
            raise ConfigError(f"`lwm fit --config {config} ... --print_config` failed (exit {e.code})") from None
    cfg = yaml.safe_load(out.getvalue()) or {}
    root = Path((cfg.get("trainer") or {}).get("default_root_dir") or ".")
    dirpath = (cfg.get("checkpoint") or {}).get("dirpath")
    return root, Path(dirpath) if dirpath else root / "checkpoints"


def _step(path: Path) -> int | None:
    """The global step of a checkpoint file (None: a directory, or unreadable)."""
    if not path.is_file():
        return None
    import torch

    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
    except Exception:  # a torn or foreign file: not a candidate
        return None


def latest_checkpoint(run_dir: Path, checkpoint_dir: Path) -> Path | None:
    """The checkpoint that continues the run: the highest global step among ``last.ckpt`` and the hpc ones."""
    hpc = sorted(run_dir.glob("hpc_ckpt_*.ckpt"), key=lambda p: int(re.findall(r"\d+", p.name)[-1]))
    candidates = [p for p in (checkpoint_dir / "last.ckpt", *reversed(hpc)) if p.exists()]
    if not candidates:
        return None
    steps = {p: _step(p) for p in candidates}
    files = [p for p in candidates if steps[p] is not None]
    if files and len(files) == len(candidates):
        return max(files, key=lambda p: steps[p])  # ties: last.ckpt (listed first)
    return candidates[0]  # DeepSpeed directories: last.ckpt, else the newest hpc


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="lwm resume-info", description=__doc__.split("\n\n")[0],
                                epilog="Every other argument is a `lwm fit` override (--section.key=value).")
    p.add_argument("--config", required=True, help="the fit config")
    args, overrides = p.parse_known_args(argv)
    if not os.path.isfile(args.config):
        raise ConfigError(f"--config {args.config}: not found")
    run_dir, checkpoint_dir = run_paths(args.config, overrides)
    found = latest_checkpoint(run_dir, checkpoint_dir)
    print(run_dir)
    print(found if found is not None else "")
    return 0

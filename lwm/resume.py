"""``lwm resume-info --config CFG [overrides]``: where a run lives and which checkpoint continues it, for the
SLURM scripts (``slurm/train.sbatch`` runs it at every start of a job, first or requeued).

Prints two lines: ``RUN_DIR`` (``trainer.default_root_dir`` as lwm resolves the config, overrides and
interpolations; ``.`` when unset) and the checkpoint to resume from, or an empty line when the run has none.
The candidates are ``CHECKPOINT_DIR/last.ckpt`` (``checkpoint.dirpath``, by default ``RUN_DIR/checkpoints``),
the step checkpoints beside it written after it (a kill between a step's two writes, the step file and then
``last.ckpt``, leaves the step file the newer; where there is no ``last.ckpt``, all of them) and
``RUN_DIR/hpc_ckpt_N.ckpt`` (written when SLURM preempts); the one at the highest global step wins (ties:
``last.ckpt``), read from the file (``weights_only``, memory-mapped; a DeepSpeed directory: from its model
states, where lwm marked it complete), not from its modification time, which a DeepSpeed checkpoint (a
directory rewritten in place) or a shared filesystem's clock skew would get wrong (the time only tells a step
file written after ``last.ckpt``, in the same folder by the same job, from one left by an abandoned branch: a
run resumed from an older checkpoint writes ``last.ckpt`` anew).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

from lwm.errors import ConfigError


def run_paths(args: list[str]) -> tuple[Path, Path]:
    """``(RUN_DIR, CHECKPOINT_DIR)`` of ``lwm fit ARGS`` (``--config`` files and overrides, in their order)."""
    import yaml

    from lwm.lightning_cli import lightning_cli

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


def _step(path: Path) -> int | None:
    """The global step of a checkpoint file, or of a DeepSpeed checkpoint directory lwm marked complete
    (:func:`lwm.checkpoint.deepspeed_step`); None: unreadable, torn, a DeepSpeed write cut short."""
    import torch

    from lwm.checkpoint import deepspeed_step

    if path.is_dir():  # DeepSpeed's, rewritten in place: a kill during its write leaves files of two steps
        return deepspeed_step(path)
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
    except Exception:  # a torn or foreign file: not a candidate
        return None


def _written(path: Path) -> float | None:
    """When a checkpoint was last written whole (None: never): a file's time; a DeepSpeed directory's (rewritten in
    place: the folder's own time is not it), :func:`lwm.checkpoint.deepspeed_written`."""
    from lwm.checkpoint import deepspeed_written

    return deepspeed_written(path) if path.is_dir() else path.stat().st_mtime


def _number(path: Path) -> int:
    digits = re.findall(r"\d+", path.name)
    return int(digits[-1]) if digits else -1


def latest_checkpoint(run_dir: Path, checkpoint_dir: Path) -> Path | None:
    """The checkpoint that continues the run: the highest global step among ``last.ckpt``, the step checkpoints
    written after it was last whole (all of them where there is none: a kill during the first ``last.ckpt`` write
    leaves only a step one; a kill during a later one leaves the step file of that step newer than ``last.ckpt``,
    which is an interval behind or cut short; a ``last.ckpt`` file that does not load, all of them) and the hpc
    ones. A ``last.ckpt`` passed over for not being whole is said in a warning."""
    hpc = sorted(run_dir.glob("hpc_ckpt_*.ckpt"), key=_number)
    last = checkpoint_dir / "last.ckpt"
    steps = sorted((p for p in checkpoint_dir.glob("*.ckpt") if p.name != last.name), key=_number, reverse=True)
    last_step = _step(last) if last.exists() else None
    # a torn last.ckpt file was never whole: its time says nothing (a DeepSpeed one keeps its last whole time)
    since = _written(last) if last_step is not None or last.is_dir() else None
    if since is not None:  # (a step file older than last.ckpt: of a branch abandoned for an earlier checkpoint)
        steps = [p for p in steps if (written := _written(p)) is not None and written >= since]
    candidates = [p for p in (last, *reversed(hpc), *steps) if p.exists()]
    steps = {p: s for p in candidates if (s := _step(p)) is not None}
    if not steps:  # none readable: the first, for lwm fit to refuse loudly (never a silent fresh start)
        return candidates[0] if candidates else None
    found = max(steps, key=lambda p: steps[p])  # ties: last.ckpt (listed first)
    if last.exists() and last_step is None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"{last}: not a whole checkpoint (unreadable, or its write cut short): taking {found}, the "
                       f"run's latest whole one (step {steps[found]})")
    return found


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from lwm.lightning_cli import config_files

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

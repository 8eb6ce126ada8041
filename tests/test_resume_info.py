"""`lwm resume-info`: the run directory as lwm resolves it, and the checkpoint that continues the run chosen by
its global step, not by file times (for slurm/train.sbatch)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lwm.training.checkpoint import (DEEPSPEED_MARK, DEEPSPEED_WRITING, deepspeed_step, deepspeed_written,
    mark_deepspeed_saves_complete)
from lwm.cli.main import main
from lwm.training.run_dir import latest_checkpoint

TINY = "configs/tiny.yaml"


def _ckpt(path, step: int, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step}, path)
    os.utime(path, (mtime, mtime))


def test_the_highest_global_step_wins_whatever_the_file_times(tmp_path):
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    assert latest_checkpoint(run, ckpts) is None
    _ckpt(run / "hpc_ckpt_1.ckpt", 5000, mtime=2000)
    _ckpt(ckpts / "last.ckpt", 8000, mtime=1000)  # rewritten later, but (say) a skewed clock dates it earlier
    assert latest_checkpoint(run, ckpts) == ckpts / "last.ckpt"
    _ckpt(run / "hpc_ckpt_2.ckpt", 9000, mtime=500)
    assert latest_checkpoint(run, ckpts) == run / "hpc_ckpt_2.ckpt"
    (run / "hpc_ckpt_3.ckpt").write_bytes(b"torn")  # unreadable: not a candidate, the others still compared
    (run / "hpc_ckpt_backup.ckpt").write_bytes(b"x")  # no number in the name
    assert latest_checkpoint(run, ckpts) == run / "hpc_ckpt_2.ckpt"
    (ckpts / "last.ckpt").unlink()
    (ckpts / "last.ckpt").mkdir()  # an empty folder: no checkpoint (DeepSpeed's hold their files)
    assert latest_checkpoint(run, ckpts) == run / "hpc_ckpt_2.ckpt"


def test_without_last_ckpt_the_latest_step_checkpoint_continues_the_run(tmp_path):
    """A kill during the first last.ckpt write leaves a step checkpoint alone: it continues the run. A kill during a
    later one leaves last.ckpt an interval behind the step file written just before it: the step file wins (its
    checkpoint-callback state counts it). A step file older than last.ckpt is of a branch abandoned for an earlier
    checkpoint (resumed from it, the run wrote last.ckpt anew): never taken, whatever its step."""
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    _ckpt(ckpts / "step=0000100.ckpt", 100, mtime=2000)
    _ckpt(ckpts / "step=0000200.ckpt", 200, mtime=1000)
    assert latest_checkpoint(run, ckpts) == ckpts / "step=0000200.ckpt"
    _ckpt(ckpts / "last.ckpt", 100, mtime=1000)
    assert latest_checkpoint(run, ckpts) == ckpts / "step=0000200.ckpt"  # as old as last.ckpt: written after it
    _ckpt(ckpts / "last.ckpt", 150, mtime=1500)  # resumed from step 100: step 200 is the abandoned branch's
    assert latest_checkpoint(run, ckpts) == ckpts / "last.ckpt"
    _ckpt(ckpts / "step=0000180.ckpt", 180, mtime=1600)  # then killed while the last.ckpt of step 180 was written
    assert latest_checkpoint(run, ckpts) == ckpts / "step=0000180.ckpt"


def test_a_torn_last_ckpt_beside_a_whole_step_checkpoint_of_its_step_falls_back_to_it_and_says_so(tmp_path):
    """The step file is written before last.ckpt of the same step: a last.ckpt that does not load (corrupt on disk,
    a copy cut short) gives no time to tell branches by; the highest whole step wins, with a warning naming both."""
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    _ckpt(ckpts / "step=0000100.ckpt", 100, mtime=900)
    _ckpt(ckpts / "step=0000200.ckpt", 200, mtime=1000)
    _ckpt(ckpts / "last.ckpt", 200, mtime=1001)
    _cut_short(ckpts / "last.ckpt")
    os.utime(ckpts / "last.ckpt", (1001, 1001))
    with pytest.warns(UserWarning, match=rf"{ckpts / 'last.ckpt'}: not a whole checkpoint .* taking "
                                         rf"{ckpts / 'step=0000200.ckpt'}, the run's latest whole one \(step 200\)"):
        assert latest_checkpoint(run, ckpts) == ckpts / "step=0000200.ckpt"


@pytest.mark.slow
def test_resume_info_prints_the_resolved_run_dir_and_checkpoint(tmp_path, capsys):
    root = tmp_path / "a long run directory name with spaces that YAML would fold over two lines" / "run"
    elsewhere = tmp_path / "elsewhere"
    _ckpt(elsewhere / "last.ckpt", 3, mtime=1000)
    assert main(["resume-info", "--config", TINY, f"--trainer.default_root_dir={root}"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(root), ""]
    assert main(["resume-info", "--config", TINY, f"--trainer.default_root_dir={root}",
                 f"--checkpoint.dirpath={elsewhere}"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(root), str(elsewhere / "last.ckpt")]
    assert main(["resume-info", "--config", "nope.yaml"]) == 2
    assert main(["resume-info", f"--trainer.default_root_dir={root}"]) == 2  # no --config


@pytest.mark.slow
def test_resume_info_reads_layered_configs_in_order(tmp_path, capsys):
    """`train.sbatch base.yaml --config extra.yaml ...`: every config, as lwm fit reads them."""
    base, extra = tmp_path / "base.yaml", tmp_path / "extra.yaml"
    base.write_text(open(TINY).read().replace("default_root_dir: runs/tiny", f"default_root_dir: {tmp_path / 'run'}"))
    extra.write_text("data:\n  batch_size: 2\n")
    _ckpt(tmp_path / "run/checkpoints/last.ckpt", 30, mtime=1000)
    assert main(["resume-info", "--config", str(base), "--config", str(extra)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / "run"), str(tmp_path / "run/checkpoints/last.ckpt")]


class NotAWeight:  # a pickled object weights_only refuses
    pass


def _save_step(path, step, extra=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, **({"x": extra} if extra is not None else {})}, path)


def _deepspeed(path, step: int, written: float | None, ranks: int = 2,
               model: str = "mp_rank_00_model_states.pt") -> None:
    """A DeepSpeed checkpoint directory as Lightning's strategy writes it: ``latest`` naming the tag folder, which
    holds the model states (Lightning's client state, the global step among it) and one optimizer shard per rank;
    then lwm's completion mark, written last, at ``written`` (None: DeepSpeed's files only)."""
    folder = path / "checkpoint"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {"w": torch.zeros(2)}, "global_step": step}, folder / model)
    for rank in range(ranks):
        torch.save({"optimizer_state_dict": {"m": torch.ones(3)}},
                   folder / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (path / "latest").write_text("checkpoint")
    if written is not None:
        (path / DEEPSPEED_MARK).write_text(json.dumps({"global_step": step}))
        os.utime(path / DEEPSPEED_MARK, (written, written))


def _cut_short(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_deepspeed_directories_are_ranked_by_their_step_and_a_torn_one_is_passed_over(tmp_path):
    """DeepSpeed rewrites its checkpoint directories in place: a kill during a write leaves a file cut short. The
    step is read from a directory's model states, where every file of it is whole; a step directory counts as
    written after last.ckpt by the time of lwm's completion marks (written last), not of the folders."""
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    _deepspeed(ckpts / "last.ckpt", 40, written=1000)
    _deepspeed(ckpts / "step=0000040.ckpt", 40, written=1000)
    _deepspeed(ckpts / "step=0000060.ckpt", 60, written=500)  # of a branch abandoned before last.ckpt was written
    _deepspeed(run / "hpc_ckpt_1.ckpt", 30, written=900)
    _deepspeed(run / "hpc_ckpt_2.ckpt", 43, written=2000)
    assert latest_checkpoint(run, ckpts) == run / "hpc_ckpt_2.ckpt"
    _cut_short(run / "hpc_ckpt_2.ckpt/checkpoint/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert latest_checkpoint(run, ckpts) == ckpts / "last.ckpt"  # a tie with step=40: last.ckpt
    _cut_short(ckpts / "last.ckpt/checkpoint/mp_rank_00_model_states.pt")  # killed while last.ckpt was rewritten
    assert latest_checkpoint(run, ckpts) == ckpts / "step=0000040.ckpt"  # not the abandoned step 60, nor hpc 30
    for n in (9, 10):  # an older layout's folders without their files: none is a whole checkpoint
        (run / f"hpc_ckpt_{n}.ckpt").mkdir()
    assert latest_checkpoint(run, ckpts) == ckpts / "step=0000040.ckpt"
    stage3 = run / "hpc_ckpt_11.ckpt"  # ZeRO stage 3: each rank's model states, the step in rank 0's
    _deepspeed(stage3, 70, written=3000, model="zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert latest_checkpoint(run, ckpts) == stage3


def test_a_deepspeed_directory_counts_only_where_lwm_marked_it_whole_and_a_cut_short_rewrite_keeps_its_last_time(
        tmp_path):
    """lwm moves a DeepSpeed directory's completion mark aside (to DEEPSPEED_WRITING, keeping its time) before the
    directory is rewritten, and writes a new one after every rank's files: without the mark its files may be of two
    steps. A last.ckpt cut short is still as old as its last whole write, so the step directory written just before
    the cut continues the run, not a step directory of an abandoned branch."""
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    _deepspeed(ckpts / "step=0000080.ckpt", 80, written=500)  # of a branch abandoned for step 40
    _deepspeed(ckpts / "last.ckpt", 40, written=1000)
    _deepspeed(ckpts / "step=0000060.ckpt", 60, written=1100)
    assert latest_checkpoint(run, ckpts) == ckpts / "step=0000060.ckpt"  # (as after a kill before last.ckpt's write)
    last = ckpts / "last.ckpt"
    os.replace(last / DEEPSPEED_MARK, last / DEEPSPEED_WRITING)  # killed while last.ckpt was rewritten for step 60:
    torch.save({"module": {}, "global_step": 60}, last / "checkpoint/mp_rank_00_model_states.pt")  # new model states
    assert deepspeed_step(last) is None  # (whole files of steps 60 and 40)
    assert latest_checkpoint(run, ckpts) == ckpts / "step=0000060.ckpt"
    (last / DEEPSPEED_WRITING).unlink()  # the first last.ckpt cut short: every step directory counts
    assert latest_checkpoint(run, ckpts) == ckpts / "step=0000080.ckpt"

    whole = tmp_path / "whole.ckpt"
    _deepspeed(whole, 7, written=1)
    assert deepspeed_step(whole) == 7
    (whole / DEEPSPEED_MARK).write_text(json.dumps({"global_step": 6}))  # the model states of another step
    assert deepspeed_step(whole) is None
    _deepspeed(whole, 7, written=1)
    _cut_short(whole / "checkpoint/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")  # (no kill can: a damaged disk)
    assert deepspeed_step(whole) is None
    _deepspeed(whole, 7, written=1)
    (whole / "latest").unlink()  # (DeepSpeed's load reads it)
    assert deepspeed_step(whole) is None


def test_a_deepspeed_save_moves_the_mark_aside_before_writing_and_marks_the_directory_after(tmp_path, monkeypatch):
    """lwm's wrapper of DeepSpeedStrategy.save_checkpoint, around a stand-in that writes the directory: the mark is
    gone (moved aside, its time kept) before any file is written, a save that fails leaves no mark, the next marks
    again; every rank fsyncs every file, then a barrier, then rank 0 alone writes the mark."""
    path, seen = tmp_path / "last.ckpt", []

    def save(checkpoint, filepath, storage_options=None):
        seen.append(sorted(p.name for p in Path(filepath).glob("lwm_*.json")))
        if checkpoint.get("fail"):
            raise OSError("disk full")
        _deepspeed(Path(filepath), checkpoint["global_step"], written=None)

    def barrier(name=None):
        seen.append(("barrier", deepspeed_step(path)))  # (no mark before every rank's files are on disk)

    import lwm.training.checkpoint

    monkeypatch.setattr(lwm.training.checkpoint, "fsync_file", lambda f: seen.append(("fsync", f.name)))
    strategies = [SimpleNamespace(is_global_zero=rank == 0, broadcast=lambda x: x, save_checkpoint=save,
                                  barrier=barrier) for rank in (1, 0)]
    for strategy in strategies:
        mark_deepspeed_saves_complete(strategy)
    fsynced = [("fsync", name) for name in ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                            "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                            "mp_rank_00_model_states.pt", "latest")]
    strategies[0].save_checkpoint({"global_step": 4}, path)  # rank 1: its files fsynced, no mark
    assert seen == [[], *fsynced, ("barrier", None)] and deepspeed_step(path) is None
    del seen[:]
    strategies[1].save_checkpoint({"global_step": 4}, path)
    assert seen == [[], *fsynced, ("barrier", None)] and deepspeed_step(path) == 4 and deepspeed_written(path) > 1000
    os.utime(path / DEEPSPEED_MARK, (1000, 1000))
    with pytest.raises(OSError, match="disk full"):
        strategies[1].save_checkpoint({"global_step": 6, "fail": True}, path)
    assert seen[-1] == [DEEPSPEED_WRITING]  # moved aside before the write
    assert deepspeed_step(path) is None and deepspeed_written(path) == 1000  # as old as its last whole write
    strategies[1].save_checkpoint({"global_step": 6}, path)
    assert deepspeed_step(path) == 6 and sorted(p.name for p in path.glob("lwm_*.json")) == [DEEPSPEED_MARK]


def test_a_tie_goes_to_last_ckpt_and_an_unreadable_sole_candidate_is_still_returned(tmp_path):
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    _save_step(run / "hpc_ckpt_3.ckpt", 100)
    _save_step(ckpts / "last.ckpt", 100)
    assert latest_checkpoint(run, ckpts) == ckpts / "last.ckpt"
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints/last.ckpt").write_bytes(b"torn")
    assert latest_checkpoint(other, other / "checkpoints") == other / "checkpoints/last.ckpt"  # lwm fit refuses it


def test_a_checkpoint_that_needs_unpickling_is_not_read(tmp_path):
    from lwm.training.checkpoint import read_checkpoint
    from lwm.utils.errors import DataError
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    _save_step(ckpts / "last.ckpt", 5)
    _save_step(run / "hpc_ckpt_1.ckpt", 10, extra=NotAWeight())
    assert latest_checkpoint(run, ckpts) == ckpts / "last.ckpt"
    from lwm.training.checkpoint import AtomicCheckpointIO

    with pytest.raises(Exception, match="Unsupported global"):  # Lightning's loads: weights_only whatever it asks
        AtomicCheckpointIO().load_checkpoint(run / "hpc_ckpt_1.ckpt", weights_only=False)
    with pytest.raises(DataError) as e:
        read_checkpoint(run / "hpc_ckpt_1.ckpt")
    # one plain line: what torch refused, not its advice to load with weights_only=False nor its escape codes
    assert str(e.value) == (f"{run / 'hpc_ckpt_1.ckpt'}: not a readable checkpoint (torch.load with weights_only=True: "
                            f"Unsupported global: GLOBAL {NotAWeight.__module__}.NotAWeight was not an allowed global "
                            f"by default)")


def test_a_run_its_checkpoint_folder_and_last_name_its_latest_checkpoint(tmp_path):
    """`lwm codes|generate` take the run's latest checkpoint where given the run, its checkpoint folder or `last`:
    a step file newer than last.ckpt, or an hpc one (in RUN_DIR, not in the checkpoint folder)."""
    from lwm.training.run_dir import checkpoint_file

    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    (run / "config.yaml").parent.mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    _ckpt(ckpts / "last.ckpt", 5, mtime=1000)
    _ckpt(ckpts / "step=0000010.ckpt", 10, mtime=1001)  # a kill between its write and last.ckpt's
    for given in ("last", run, ckpts):
        assert checkpoint_file(given, ckpts) == ckpts / "step=0000010.ckpt", given
    _ckpt(run / "hpc_ckpt_1.ckpt", 12, mtime=900)
    for given in ("last", run, ckpts):
        assert checkpoint_file(given, ckpts) == run / "hpc_ckpt_1.ckpt", given
    assert checkpoint_file(ckpts / "last.ckpt", ckpts) == ckpts / "last.ckpt"  # a file: as given


def test_a_file_without_a_global_step_never_wins(tmp_path):
    """An exported weights file beside the checkpoints (no global_step) would block every resume if it won."""
    run, ckpts = tmp_path / "run", tmp_path / "run/checkpoints"
    _ckpt(ckpts / "last.ckpt", 5, mtime=1000)
    torch.save({"state_dict": {}}, ckpts / "exported.ckpt")
    assert latest_checkpoint(run, ckpts) == ckpts / "last.ckpt"

"""LatentDataModule: rank shards, fixed validation windows, a loader that resumes mid-epoch, clear errors."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch

from lwm.data.datamodule import LatentDataModule
from lwm.data.h5 import DataError
from lwm.data.manifest import index_directory
from tests.data.conftest import write_h5


@pytest.fixture
def manifest(tmp_path) -> Path:
    for i in range(8):
        write_h5(tmp_path / "d" / f"ep{i}.h5", 18 + 2 * i, offset=i / 100)
    return index_directory(tmp_path / "d", val_fraction=0.25).path


def _dm(manifest, **kw) -> LatentDataModule:
    kw = {"window": 6, "batch_size": 3, "num_workers": 0, **kw}
    return LatentDataModule(str(manifest), **kw)


def _keys(batch) -> list[tuple[int, int]]:
    return list(zip(batch["file_index"].tolist(), batch["start"].tolist()))


def test_loader_resumes_mid_epoch_with_the_remaining_batches(manifest):
    dm = _dm(manifest)
    dm.setup("fit")
    full = dm.train_dataloader()
    _set_sampler_epoch(full, 2)  # what Lightning calls at each epoch start
    assert full.batch_sampler.epoch == 2
    uninterrupted = [_keys(b) for b in full]
    assert len(uninterrupted) == len(full) >= 4

    first = dm.train_dataloader()
    _set_sampler_epoch(first, 2)
    it = iter(first)
    head = [_keys(next(it)) for _ in range(3)]
    state = first.state_dict()
    assert state["epoch"] == 2 and state["batches"] == 3

    resumed = _dm(manifest)
    resumed.setup("fit")
    loader = resumed.train_dataloader()
    loader.load_state_dict(state)
    _set_sampler_epoch(loader, 2)
    tail = [_keys(b) for b in loader]
    assert head + tail == uninterrupted
    assert [_keys(b) for b in loader] == uninterrupted  # the next iteration of the same epoch starts over


def test_epochs_draw_different_batches(manifest):
    dm = _dm(manifest)
    dm.setup("fit")
    loader = dm.train_dataloader()
    epochs = []
    for e in range(2):
        _set_sampler_epoch(loader, e)
        epochs.append([_keys(b) for b in loader])
    assert epochs[0] != epochs[1]


def test_batch_elements_come_from_different_files(manifest):
    dm = _dm(manifest)
    dm.setup("fit")
    for batch in dm.train_dataloader():
        files = batch["file_index"].tolist()
        assert len(set(files)) == len(files)


class _FakeTrainer:
    def __init__(self, rank: int, world_size: int) -> None:
        self.global_rank, self.world_size = rank, world_size
        self.strategy = SimpleNamespace(root_device=torch.device("cpu"))


def _on_rank(manifest, rank, world_size, **kw) -> LatentDataModule:
    dm = _dm(manifest, **kw)
    dm.trainer = _FakeTrainer(rank, world_size)
    dm.setup("fit")
    return dm


def test_ranks_draw_their_own_batches_and_agree_on_the_epoch_length(manifest):
    r0, r1 = (_on_rank(manifest, r, 2).train_dataloader() for r in (0, 1))
    assert len(r0) == len(r1) == max(1, len(_on_rank(manifest, 0, 1).train_set) // (3 * 2))
    assert [_keys(b) for b in r0] != [_keys(b) for b in r1]


def test_validation_windows_are_dealt_to_ranks_without_overlap(manifest):
    single = _on_rank(manifest, 0, 1).val_windows()
    frames = _on_rank(manifest, 0, 1).val_set.frames
    assert sorted(single) == sorted((i, s) for i, f in enumerate(frames) for s in range(0, f - 5, 6))
    shards = [_on_rank(manifest, r, 3).val_windows() for r in range(3)]
    assert sorted(sum(shards, [])) == sorted(single)
    assert _on_rank(manifest, 0, 1).val_windows() == single  # the same windows at every validation


def test_val_size_percent_takes_a_fixed_fraction(manifest):
    every = _on_rank(manifest, 0, 1).val_windows()
    half = _on_rank(manifest, 0, 1, val_size_percent=0.5).val_windows()
    assert len(half) == int(np.ceil(0.5 * len(every))) and set(half) <= set(every)
    none = _on_rank(manifest, 0, 1, val_size_percent=0.0)
    assert none.val_windows() == [] and none.val_dataloader() == []


def test_validation_batches_hold_the_windows_data(manifest):
    dm = _on_rank(manifest, 0, 1)
    lengths = []
    for path in dm.val_set.paths:
        with h5py.File(path) as h:
            lengths.append(h["latents"].shape[0])
    expected = {(f, s) for f, n in enumerate(lengths) for s in range(0, n - 6 + 1, 6)}  # every window of 6
    assert len(lengths) == 2 and len(expected) == sum(n // 6 for n in lengths) >= 6
    seen, batches = [], 0
    for batch in dm.val_dataloader():
        batches += 1
        assert len(_keys(batch)) == (3 if batches <= len(expected) // 3 else len(expected) % 3)
        for i, (f, s) in enumerate(_keys(batch)):
            with h5py.File(dm.val_set.paths[f]) as h:
                np.testing.assert_array_equal(batch["latents"][i].numpy(), h["latents"][s : s + 6])
            seen.append((f, s))
    assert batches == -(-len(expected) // 3)  # batches of 3, the last one partial
    assert len(seen) == len(set(seen)) and set(seen) == expected  # each window once, none left out


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"window": 1}, "data.window"), ({"batch_size": 0}, "data.batch_size"),
     ({"val_size_percent": 1.5}, "data.val_size_percent"), ({"num_workers": -1}, "data.num_workers"),
     ({"batches_per_epoch": 0}, "data.batches_per_epoch"), ({"val_batch_size": 0}, "data.val_batch_size"),
     ({"prefetch_factor": 0}, "data.prefetch_factor")],
)
def test_bad_settings_name_the_field(manifest, kw, field):
    with pytest.raises(DataError, match=field.replace(".", r"\.")):
        _dm(manifest, **kw)


def _entries(manifest: Path) -> list[dict]:
    return json.loads(manifest.read_text())["files"]


def test_missing_file_is_named_at_setup(manifest):
    victim = manifest.parent / _entries(manifest)[0]["path"]
    victim.unlink()
    with pytest.raises(DataError, match=f"{victim}: file not found"):
        _dm(manifest).setup("fit")


def test_truncated_file_is_named_at_setup(manifest):
    victim = manifest.parent / _entries(manifest)[1]["path"]
    write_h5(victim, 4)  # shorter than the manifest says
    with pytest.raises(DataError, match=f"{victim}: 4 frames, the manifest says"):
        _dm(manifest).setup("fit")


def test_unreadable_file_is_named_at_setup(manifest):
    victim = manifest.parent / _entries(manifest)[2]["path"]
    victim.write_bytes(victim.read_bytes()[:200])  # a torn copy
    with pytest.raises(DataError, match=f"{victim}: cannot be opened"):
        _dm(manifest).setup("fit")


def test_wrong_shape_is_named_at_setup(manifest):
    victim = manifest.parent / _entries(manifest)[3]["path"]
    write_h5(victim, 30, channels=5)
    with pytest.raises(DataError, match=f"{victim}: .*channels 5, expected 4"):
        _dm(manifest).setup("fit")


def test_window_longer_than_every_file_and_empty_split(manifest, tmp_path):
    with pytest.raises(DataError, match="window 99 is longer than every 'train' file"):
        _dm(manifest, window=99).setup("fit")
    only_train = index_directory(manifest.parent, out=tmp_path / "m2.json", val_fraction=0.0).path
    with pytest.raises(DataError, match="the 'val' split is empty"):
        _dm(only_train).setup("fit")
    _dm(only_train, val_size_percent=0.0).setup("fit")  # no validation wanted: fine


def test_fewer_validation_windows_than_ranks_is_refused_at_setup(manifest):
    windows = len(_on_rank(manifest, 0, 1).val_windows())
    with pytest.raises(DataError, match=f"{windows} validation windows of 6 frames for {windows + 1} ranks"):
        _on_rank(manifest, 0, windows + 1)
    tiny = [len(_on_rank(manifest, r, windows, val_size_percent=0.01).val_windows()) for r in range(windows)]
    assert tiny == [1] * windows  # a small fraction still gives every rank a window


class _WorkerSignals(torch.utils.data.Dataset):
    """Item 0: whether the loading worker ignores SIGUSR1 and Ctrl-C (SIGINT); item 1: its pid."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        import os
        import signal

        if i == 0:
            return torch.tensor(all(signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGUSR1, signal.SIGINT)))
        return torch.tensor(os.getpid())


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_loader_workers_leave_slurms_signals_to_the_main_process(manifest, context):
    """SLURM signals every process of the step, and Ctrl-C every process of the terminal's group. A forked worker
    inherits Lightning's SIGUSR1 handler (which saves and requeues): ignored, as is SIGINT. PyTorch's SIGTERM handler kills a worker (failing the step before the save):
    a SIGTERM from another process is ignored, one from the parent (shutting the workers down) still ends it."""
    import signal
    import subprocess

    kwargs = _dm(manifest, num_workers=1, multiprocessing_context=context)._loader_kwargs()
    kwargs.pop("collate_fn")
    previous = signal.signal(signal.SIGUSR1, lambda *args: None)  # as Lightning sets it in the main process
    loader = torch.utils.data.DataLoader(_WorkerSignals(), batch_size=None, **kwargs)
    it = iter(loader)
    try:
        assert bool(next(it))
        pid = int(next(it))
        assert signal.getsignal(signal.SIGUSR1) != signal.SIG_IGN  # the main process keeps its handler
        if context == "spawn":  # torch's threads in a spawned worker do not block SIGTERM (see the docstring)
            return
        subprocess.run(["kill", "-TERM", str(pid)], check=True)  # as SLURM: from another process
        time.sleep(0.5)
        assert it._workers[0].is_alive() and list(loader)  # still serving
        worker = it._workers[0]
        worker.terminate()  # the parent's SIGTERM (as multiprocessing's exit does for daemon workers)
        worker.join(timeout=10)
        assert not worker.is_alive() and worker.exitcode == 0
    finally:
        it._shutdown_workers()
        signal.signal(signal.SIGUSR1, previous)


@pytest.fixture
def dm_manifest(tmp_path) -> Path:
    """Train files of 18..32 frames; val: a 12- and an 18-frame file (multiples of the window 6), and a 20."""
    d = tmp_path / "d"
    for i in range(8):
        write_h5(d / f"t{i}.h5", 18 + 2 * i, offset=i / 100)
    m = index_directory(d, val_fraction=0.0)
    for name, frames in (("v0.h5", 12), ("v1.h5", 18), ("v2.h5", 20)):
        write_h5(d / name, frames)
    doc = m.to_json()
    doc["files"] += [{"path": n, "key": "latents", "frames": f, "split": "val"} for n, f in
                     (("v0.h5", 12), ("v1.h5", 18), ("v2.h5", 20))]
    (d / "manifest.json").write_text(json.dumps(doc))
    return d / "manifest.json"


def test_every_non_overlapping_val_window_is_used(dm_manifest):
    dm = _on_rank(dm_manifest, 0, 1)
    frames = dm.val_set.frames
    expected = {(i, s) for i, f in enumerate(frames) for s in range(0, f - 6 + 1, 6)}
    assert len(expected) == sum(f // 6 for f in frames) == 8
    assert set(dm.val_windows()) == expected and len(dm.val_windows()) == 8


def test_the_val_subset_is_a_seeded_draw(dm_manifest):
    subsets = {tuple(sorted(_on_rank(dm_manifest, 0, 1, seed=s, val_size_percent=0.5).val_windows())) for s in range(6)}
    assert len(subsets) > 1


def test_ranks_share_the_same_val_subset_as_one_process(dm_manifest):
    single = _on_rank(dm_manifest, 0, 1, val_size_percent=0.5).val_windows()
    shards = [_on_rank(dm_manifest, r, 2, val_size_percent=0.5).val_windows() for r in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(single) and not set(shards[0]) & set(shards[1])


def _state_after(manifest: Path, batches: int, **settings) -> dict:
    """The train loader's state after ``batches`` batches of epoch 0 (one process)."""
    loader = _on_rank(manifest, 0, 1, **settings).train_dataloader()
    _set_sampler_epoch(loader, 0)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader.state_dict()


def test_a_resumed_loader_counts_on_from_where_it_resumed(dm_manifest):
    state = _state_after(dm_manifest, 2)
    loader = _on_rank(dm_manifest, 0, 1).train_dataloader()
    loader.load_state_dict(state)
    _set_sampler_epoch(loader, 0)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["batches"] == 3  # 2 before the stop + 1 after: a second resume continues right


def test_a_state_saved_at_an_epoch_end_does_not_skip_the_next_epoch(dm_manifest):
    fresh = _on_rank(dm_manifest, 0, 1).train_dataloader()
    _set_sampler_epoch(fresh, 1)
    expected = [_keys(b) for b in fresh]
    loader = _on_rank(dm_manifest, 0, 1).train_dataloader()
    loader.load_state_dict({"epoch": 0, "batches": len(loader), "seed": 0})  # saved after epoch 0's last batch
    _set_sampler_epoch(loader, 1)  # Lightning restarts at epoch 1
    assert [_keys(b) for b in loader] == expected


def test_a_run_resumed_with_another_global_batch_continues_at_the_same_batch_index(dm_manifest):
    """One process at batch 2 stopped after 3 batches; resumed on 2 ranks of batch 2 (global 4), epoch 0
    continues at batch 3, where Lightning's count of the epoch's batches is, with a warning naming both."""
    state = _state_after(dm_manifest, 3, batch_size=2)
    assert state["global_batch"] == 2
    for rank in range(2):
        loader = _on_rank(dm_manifest, rank, 2, batch_size=2).train_dataloader()
        fresh = _on_rank(dm_manifest, rank, 2, batch_size=2).train_dataloader()
        _set_sampler_epoch(fresh, 0)
        expected = [_keys(b) for b in fresh][3:]
        with pytest.warns(UserWarning, match=rf"global batch of 4 windows .* had 2: epoch 0 continues at batch 3 of "
                                             rf"this run's {len(fresh)}, with other batches"):
            loader.load_state_dict(state)
        _set_sampler_epoch(loader, 0)
        assert [_keys(b) for b in loader] == expected and expected


def test_a_resumed_loader_keeps_the_checkpoints_seed_and_says_so(dm_manifest):
    first = _on_rank(dm_manifest, 0, 1, seed=3).train_dataloader()
    state = first.state_dict()
    loader = _on_rank(dm_manifest, 0, 1, seed=4).train_dataloader()
    with pytest.warns(UserWarning, match=r"data.seed=4 differs from the checkpoint's sampler seed 3"):
        loader.load_state_dict(state)
    assert loader.batch_sampler.seed == 3


def _variant(manifest: Path, edit) -> Path:
    """A copy of ``manifest`` beside it (the same files), its entries changed by ``edit(files)``."""
    doc = json.loads(manifest.read_text())
    edit(doc["files"])
    out = manifest.parent / "variant.json"
    out.write_text(json.dumps(doc))
    return out


def _train(files: list[dict]) -> list[dict]:
    return [f for f in files if f["split"] == "train"]


def _add_train_file(files: list[dict], directory: Path) -> None:
    write_h5(directory / "t8.h5", 20)
    files.append({"path": "t8.h5", "key": "latents", "frames": 20, "split": "train"})


def _reverse_train(files: list[dict]) -> None:
    train = _train(files)
    files[:] = train[::-1] + [f for f in files if f["split"] != "train"]


# the train files t0..t7 hold 18, 20, ..., 32 frames: 200 in all
@pytest.mark.parametrize(("settings", "edit", "change"), [
    ({"window": 8}, None, "data.window 6 -> 8"),
    ({"batches_per_epoch": 3}, None, "data.batches_per_epoch null -> 3"),
    ({}, lambda files, d: files.remove(_train(files)[0]),
     "the train split changed since the checkpoint (8 files -> 7 files)"),
    ({}, _add_train_file, "the train split changed since the checkpoint (8 files -> 9 files)"),
    ({}, lambda files, d: _train(files)[0].update(frames=12),
     "the train split changed since the checkpoint (200 frames -> 194 frames in 8 files)"),
    ({}, lambda files, d: _reverse_train(files), "the train split changed since the checkpoint (other files or frame "
                                                 "counts)"),
    ({"window": 8}, _add_train_file,
     "data.window 6 -> 8; the train split changed since the checkpoint (8 files -> 9 files)"),
])
def test_a_resume_with_another_batch_stream_says_what_changed(dm_manifest, settings, edit, change):
    """The loader's state records what else decides the batches (the train files and their frames, the window,
    the epoch length setting): a resume where any of them changed warns in one line naming it, and its own
    state records the new stream (a second resume from it is silent)."""
    import warnings

    state = _state_after(dm_manifest, 2)
    manifest = _variant(dm_manifest, lambda files: edit(files, dm_manifest.parent)) if edit else dm_manifest
    loader = _on_rank(manifest, 0, 1, **settings).train_dataloader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(state)
    assert [str(w.message) for w in caught] == [
        f"resuming with {change}: epoch 0 continues at batch 2 with other batches than an uninterrupted run's"]
    again = _on_rank(manifest, 0, 1, **settings).train_dataloader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.load_state_dict(loader.state_dict())
    assert caught == []


@pytest.mark.parametrize("edit", [None, "val file added", "old checkpoint", "manifest elsewhere"])
def test_a_resume_with_the_same_batch_stream_is_silent(dm_manifest, edit):
    """No warning where the train files, window and epoch length are the checkpoint's (another val file does
    not change the batches; the same files listed by a manifest in another folder), nor from a checkpoint of an
    earlier lwm (no stream recorded: nothing to compare)."""
    import warnings

    state = _on_rank(dm_manifest, 0, 1).train_dataloader().state_dict()
    manifest = dm_manifest
    if edit == "manifest elsewhere":  # the paths as written differ ("../d/t0.h5"), the files do not
        manifest = dm_manifest.parent.parent / "elsewhere/manifest.json"
        manifest.parent.mkdir()
        doc = json.loads(dm_manifest.read_text())
        for f in doc["files"]:
            f["path"] = os.path.relpath(dm_manifest.parent / f["path"], manifest.parent)
        manifest.write_text(json.dumps(doc))
    if edit == "val file added":
        write_h5(dm_manifest.parent / "v3.h5", 12)
        manifest = _variant(dm_manifest, lambda files: files.append(
            {"path": "v3.h5", "key": "latents", "frames": 12, "split": "val"}))
    settings = {}
    if edit == "old checkpoint":
        state = {k: v for k, v in state.items() if k != "stream"}
        settings = {"window": 8, "batches_per_epoch": 3}  # changed, but unknown to such a checkpoint
    loader = _on_rank(manifest, 0, 1, **settings).train_dataloader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(state)
    assert caught == []


@pytest.mark.parametrize("restored_by", ["data module", "loader"])
def test_a_resume_with_another_seed_validates_on_the_checkpoints_subset(dm_manifest, restored_by):
    """data.seed changed on resume: the training batches and the validation subset both stay the checkpoint's,
    as the warning says. A checkpoint holds the seed in the data module's state (restored before any loader is
    made, a sanity check's included); one of an earlier lwm only in the train loader's, which tells the data
    module when Lightning restores it."""
    kept = _on_rank(dm_manifest, 0, 1, seed=3, val_size_percent=0.5)
    assert kept.val_windows() != _on_rank(dm_manifest, 0, 1, seed=4, val_size_percent=0.5).val_windows()
    expected = [_keys(b) for b in kept.train_dataloader()]
    resumed = _on_rank(dm_manifest, 0, 1, seed=4, val_size_percent=0.5)
    said = {"data module": "batches and validation windows", "loader": "batches"}[restored_by]  # (see the loader)
    with pytest.warns(UserWarning, match=rf"^data.seed=4 differs from the checkpoint's sampler seed 3: the resumed "
                                         rf"run keeps drawing the checkpoint's {said} \(its seed\)$"):
        if restored_by == "data module":
            resumed.load_state_dict(kept.state_dict())
        else:
            resumed.train_dataloader().load_state_dict(kept.train_dataloader().state_dict())
    assert resumed.val_windows() == kept.val_windows()
    assert [_keys(b) for b in resumed.train_dataloader()] == expected
    assert resumed.state_dict() == {"seed": 3}  # and the next checkpoint keeps it


def test_validate_from_a_checkpoint_uses_its_validation_subset(dm_manifest):
    """`lwm validate --ckpt_path` with another data.seed validates on the windows the checkpoint's run validated
    on (the fit's logged values are reproducible from the run's config.yaml, which a resume with another seed
    rewrites), with a warning."""
    fit = _on_rank(dm_manifest, 0, 1, seed=3, val_size_percent=0.5)
    validate = _dm(dm_manifest, seed=4, val_size_percent=0.5)
    validate.trainer = _FakeTrainer(0, 1)
    validate.trainer.state = SimpleNamespace(fn="validate")
    validate.setup("validate")
    with pytest.warns(UserWarning, match=r"^data.seed=4 differs from the checkpoint's 3: validating on the "
                                         r"checkpoint run's validation windows \(its seed\)$"):
        validate.load_state_dict(fit.state_dict())
    assert validate.val_windows() == fit.val_windows()


@pytest.mark.parametrize(("key", "message"), [
    ("nope", "no dataset 'nope' (the key the manifest names"),
    ("actions", "dataset 'actions' must be 4-D [T, C, H, W], got shape"),
])
def test_the_manifests_key_is_checked_at_setup(manifest, key, message):
    """The setup check opens each file's dataset under the manifest's key, not the one the file would offer."""
    write_h5(manifest.parent / _entries(manifest)[0]["path"], 18, actions=True)
    doc = json.loads(manifest.read_text())
    doc["files"][0]["key"] = key
    manifest.write_text(json.dumps(doc))
    victim = manifest.parent / doc["files"][0]["path"]
    with pytest.raises(DataError, match=rf"1 of 8 files in .* refused:\n{victim}: .*") as exc:
        _dm(manifest).setup("fit")
    assert message in str(exc.value)


@pytest.mark.parametrize("seed", [-1, True, 1.5])
def test_a_bad_seed_is_refused_naming_the_field(manifest, seed):
    with pytest.raises(DataError, match=rf"data\.seed must be an integer >= 0, got {seed!r}"):
        _dm(manifest, seed=seed)


def test_a_file_changed_since_indexing_is_named_in_one_warning_before_any_work(manifest, recwarn):
    """`lwm data index` records each checked file's size and modification time; a file written since (here in place:
    same size, another time) has its values checked again at setup: fine ones are counted in one warning."""
    entries = json.loads(manifest.read_text())["files"]
    stat = (manifest.parent / entries[0]["path"]).stat()
    assert (entries[0]["bytes"], entries[0]["mtime"]) == (stat.st_size, stat.st_mtime)
    _dm(manifest).setup("fit")
    assert not [w for w in recwarn if "changed since" in str(w.message)]  # as indexed: nothing said

    first = manifest.parent / entries[0]["path"]  # copied to a file system of whole-second times: the same
    os.utime(first, (math.floor(stat.st_mtime),) * 2)
    _dm(manifest).setup("fit")
    assert not [w for w in recwarn if "changed since" in str(w.message)]

    changed = (manifest.parent / entries[2]["path"]).resolve()
    indexed = changed.stat().st_mtime
    with h5py.File(changed, "r+") as f:
        f["latents"][3, 0, 0, 0] = 0.5
    os.utime(changed, (indexed + 0.01,) * 2)  # written 10 ms after it was indexed: same size, another time
    with pytest.warns(UserWarning, match=r"1 of 8 files in .* changed since `lwm data index` checked their values "
                                         r"\(size or modification time; first: .*ep\d\.h5\): their values were "
                                         r"checked again"):
        _dm(manifest).setup("fit")
    old = json.loads(manifest.read_text())  # a manifest of an earlier lwm, without the stamps: nothing to compare
    for entry in old["files"]:
        del entry["bytes"], entry["mtime"]
    manifest.write_text(json.dumps(old))
    recwarn.clear()
    _dm(manifest).setup("fit")
    assert not [w for w in recwarn if "changed since" in str(w.message)]


@pytest.mark.parametrize("value, problem", [(np.nan, "NaN/inf values"), (3.0, "outside [-1, 1]")])
def test_a_file_given_bad_values_since_indexing_is_refused_at_setup_naming_it(manifest, value, problem):
    """NaN (it trained the whole run, then the code dictionaries refused it: exit 2, no codes.pt) or values outside
    [-1, 1] (it trained silently) written into an indexed file: refused before training, the file named."""
    entries = json.loads(manifest.read_text())["files"]
    changed = (manifest.parent / entries[2]["path"]).resolve()
    indexed = changed.stat().st_mtime
    with h5py.File(changed, "r+") as f:
        f["latents"][3, 0, 0, 0] = value
    os.utime(changed, (indexed + 0.01,) * 2)
    with pytest.raises(DataError) as exc:
        _dm(manifest).setup("fit")
    lines = str(exc.value).splitlines()
    assert lines[0] == f"1 of 8 files in {manifest} refused:"
    assert lines[1].startswith(f"{changed}: dataset 'latents' has ") and problem in lines[1]
    assert lines[1].endswith("(changed since `lwm data index` checked it)")


@pytest.mark.parametrize("percent", [0.0, 0.5, 1.0])
def test_test_and_predict_take_every_val_window_whatever_val_size_percent(dm_manifest, percent):
    every = {(i, s) for i, f in enumerate(_on_rank(dm_manifest, 0, 1).val_set.frames) for s in range(0, f - 5, 6)}
    dm = _dm(dm_manifest, val_size_percent=percent)
    dm.trainer = _FakeTrainer(0, 1)
    dm.setup("test")
    assert len(every) == 8 and sorted(dm.test_dataloader().sampler) == sorted(every)
    assert sorted(dm.predict_dataloader().sampler) == sorted(every)


def test_val_batch_size_sets_the_validation_batches(dm_manifest):
    dm = _on_rank(dm_manifest, 0, 1, batch_size=3, val_batch_size=5)
    assert [len(b["start"]) for b in dm.val_dataloader()] == [5, 3]  # 8 windows


def test_teardown_closes_every_open_file(dm_manifest, monkeypatch):
    monkeypatch.setattr("lwm.data.windows.LOADED_BYTES", 0)  # short files keep handles too
    dm = _on_rank(dm_manifest, 0, 1)
    next(iter(dm.train_dataloader()))
    next(iter(dm.val_dataloader()))
    handles = [h.file for ds in (dm.train_set, dm.val_set) for h in ds._handles.values()]
    assert handles
    dm.teardown("fit")
    assert not any(h.id.valid for h in handles)

"""H5WindowDataset (exact windows, lazy per-process handles) and FileBatchSampler (deterministic batches)."""

from __future__ import annotations

import math
import os
import pickle
import warnings
from collections import Counter
from itertools import combinations

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lwm.data.h5 import DataError
from lwm.data.manifest import Manifest, ManifestEntry, index_directory
from lwm.data import windows
from lwm.data.windows import MISSING, FileBatchSampler, H5WindowDataset, collate_windows, inclusion_probabilities, systematic_pps
from tests.data.conftest import action_pattern, pattern, write_h5

WINDOW = 4


@pytest.fixture
def manifest(window_files) -> Manifest:
    d, _ = window_files
    return index_directory(d, val_fraction=0.0)


@pytest.fixture
def dataset(manifest) -> H5WindowDataset:
    with pytest.warns(UserWarning, match="d.h5"):
        return H5WindowDataset(manifest, "train", WINDOW)


def spec_of(ds: H5WindowDataset, spec: dict, index: int):
    return spec[os.path.basename(ds.paths[index])]


def expected_item(ds: H5WindowDataset, spec: dict, index: int, start: int) -> dict:
    frames, offset, has_actions, label = spec_of(ds, spec, index)
    lat = pattern(frames, offset)[start : start + ds.window]
    act = action_pattern(frames)[start : start + ds.window] if has_actions else np.full(ds.window, MISSING)
    return {"latents": lat, "actions": act, "world_label": MISSING if label is None else label}


# ---------------------------------------------------------------- H5WindowDataset


def test_many_short_files_are_one_warning_naming_the_first_ten(tmp_path):
    for i in range(13):
        write_h5(tmp_path / f"s{i:02d}.h5", 3)
    write_h5(tmp_path / "long.h5", 20)
    m = index_directory(tmp_path, val_fraction=0.0)
    with pytest.warns(UserWarning) as rec:
        H5WindowDataset(m, "train", WINDOW)
    ours = [str(r.message) for r in rec if "left out" in str(r.message)]
    assert len(ours) == 1 and ours[0].startswith("13 'train' file(s) shorter than the window of 4 frames, left out: ")
    assert ours[0].count("(3 frames)") == 10 and ours[0].endswith(" and 3 more"), ours[0]


def test_short_file_left_out_with_one_warning(manifest, window_files):
    d, _ = window_files
    with pytest.warns(UserWarning) as rec:
        ds = H5WindowDataset(manifest, "train", WINDOW)
    ours = [r for r in rec if "left out" in str(r.message)]
    assert len(ours) == 1
    assert str(ours[0].message) == f"1 'train' file(s) shorter than the window of 4 frames, left out: {(d / 'd.h5').resolve()} (3 frames)"
    assert [os.path.basename(p) for p in ds.paths] == ["a.h5", "b.h5", "c.h5"]
    assert ds.frames == [40, 23, 100]
    assert all(os.path.isabs(p) and os.path.isfile(p) for p in ds.paths)


def test_no_warning_when_every_file_fits(manifest):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = H5WindowDataset(manifest, "train", 3)
    assert len(ds.paths) == 4


def test_len_counts_non_overlapping_windows(dataset, manifest):
    assert len(dataset) == 40 // 4 + 23 // 4 + 100 // 4  # d.h5 (3 frames) contributes nothing
    assert len(H5WindowDataset(manifest, "train", 1)) == 40 + 23 + 100 + 3
    with pytest.warns(UserWarning):
        assert len(H5WindowDataset(manifest, "train", 30)) == 1 + 3


@pytest.mark.parametrize("index, start", [(0, 0), (0, 36), (0, 17), (1, 0), (1, 19), (2, 0), (2, 96), (2, 50)])
def test_window_content_is_exact(dataset, window_files, index, start):
    _, spec = window_files
    item = dataset[(index, start)]
    want = expected_item(dataset, spec, index, start)
    assert item["latents"].dtype == torch.float32 and item["latents"].shape == (WINDOW, 4, 8, 8)
    np.testing.assert_array_equal(item["latents"].numpy(), want["latents"])
    # the pattern encodes the frame: frame t of the window is frame start + t of the file
    frames_read = np.round((item["latents"][:, 0, 0, 0].numpy() - spec_of(dataset, spec, index)[1]) * 1000)
    np.testing.assert_array_equal(frames_read, np.arange(start, start + WINDOW))
    assert item["actions"].dtype == torch.int64 and item["actions"].shape == (WINDOW,)
    np.testing.assert_array_equal(item["actions"].numpy(), want["actions"])
    assert item["world_label"].dtype == torch.int64 and item["world_label"].ndim == 0
    assert int(item["world_label"]) == want["world_label"]
    assert int(item["file_index"]) == index and int(item["start"]) == start
    assert item["file_index"].dtype == torch.int64 and item["start"].dtype == torch.int64


def test_missing_actions_and_label_are_minus_one(dataset):
    item = dataset[(1, 5)]  # b.h5: no actions, no label
    assert item["actions"].tolist() == [-1] * WINDOW and int(item["world_label"]) == -1
    item = dataset[(2, 5)]  # c.h5: actions, no label
    assert int(item["world_label"]) == -1 and (item["actions"] >= 0).all()


def test_other_key_and_float16(tmp_path):
    d = tmp_path / "k"
    data = pattern(12, 0.1).astype(np.float16)
    d.mkdir()
    with h5py.File(d / "x.h5", "w") as f:
        f.create_dataset("z", data=data)
    manifest = index_directory(d, val_fraction=0.0)
    item = H5WindowDataset(manifest, "train", 5)[(0, 7)]
    assert item["latents"].dtype == torch.float16  # kept: half the bytes through the loader; cast on the device
    np.testing.assert_array_equal(item["latents"].numpy(), data[7:12])
    item = H5WindowDataset(manifest, "train", 5, float16=False)[(0, 7)]
    assert item["latents"].dtype == torch.float32
    np.testing.assert_array_equal(item["latents"].numpy(), data[7:12].astype(np.float32))


def test_val_split_used(window_files):
    d, spec = window_files
    m = index_directory(d, val_fraction=0.5, seed=0)
    val = m.split("val")
    assert len(val) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = H5WindowDataset(m, "val", WINDOW)
    fitting = sorted(os.path.basename(m.resolve(e)) for e in val if e.frames >= WINDOW)
    assert sorted(os.path.basename(p) for p in ds.paths) == fitting


def test_all_files_shorter_than_window(manifest):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error alone says it: no warning per file before it
        with pytest.raises(DataError) as exc:
            H5WindowDataset(manifest, "train", 101)
    msg = str(exc.value)
    assert str(manifest.path) in msg and "longest: 100 frames" in msg


def test_empty_split(manifest):
    with pytest.raises(DataError, match=r"'val' split is empty \(index more files, or with a larger --val-fraction; "
                                        r"or train without validation: data\.val_size_percent=0\)$") as exc:
        H5WindowDataset(manifest, "val", WINDOW)
    assert str(manifest.path) in str(exc.value)


def test_file_damaged_after_indexing_names_the_file(tmp_path):
    path = tmp_path / "damaged.h5"
    with h5py.File(path, "w") as f:
        data = np.random.default_rng(0).uniform(-1, 1, (8, 4, 8, 8)).astype(np.float32)  # chunks of ~1 KB
        f.create_dataset("latents", data=data, chunks=(2, 4, 8, 8), compression="gzip")
        offset = f["latents"].id.get_chunk_info_by_coord((2, 0, 0, 0)).byte_offset  # the chunk of frames 2..3
    m = index_directory(tmp_path, val_fraction=0.0)
    with open(path, "r+b") as raw:  # damage it after the index checked it
        raw.seek(offset)
        raw.write(b"\xff" * 16)
    ds = H5WindowDataset(m, "train", 4)
    assert ds[(0, 4)]["latents"].shape == (4, 4, 8, 8)  # undamaged frames still read
    with pytest.raises(DataError, match=r"damaged.h5: 'latents' unreadable at frames 0\.\.3"):
        ds[(0, 0)]


def test_at_most_max_open_files_per_process(tmp_path, count_opens):
    for i in range(5):
        with h5py.File(tmp_path / f"f{i}.h5", "w") as f:
            f["latents"] = pattern(6, i / 10)
    ds = H5WindowDataset(index_directory(tmp_path, val_fraction=0.0), "train", 4, max_open=2)
    before = count_opens.calls
    for index in [0, 1, 2, 3, 4, 4, 3, 0]:
        item = ds[(index, 1)]
        np.testing.assert_array_equal(item["latents"].numpy(), pattern(6, int(ds.paths[index][-4]) / 10)[1:5])
        assert len(ds._handles) <= 2 and all(h.file.id.valid for h in ds._handles.values())
    assert count_opens.calls - before == 6  # 0-4 once each; then 4 and 3 were still open, 0 had been closed
    ds.close()


def test_mixed_float16_and_float32_windows_collate_to_float32():
    from lwm.data.windows import collate_windows

    a = {"latents": torch.tensor([[0.1]], dtype=torch.float16), "start": torch.tensor(0)}
    b = {"latents": torch.tensor([[0.1]], dtype=torch.float32), "start": torch.tensor(1)}
    batch = collate_windows([a, b])
    assert batch["latents"].dtype == torch.float32
    assert batch["latents"][1, 0, 0].item() == pytest.approx(0.1, abs=1e-8)  # not rounded to float16
    assert collate_windows([a, a])["latents"].dtype == torch.float16


def test_unreadable_file_raises_data_error(tmp_path):
    (tmp_path / "broken.h5").write_bytes(b"x" * 64)
    m = Manifest(tmp_path / "m.json", 4, 8, 8, [ManifestEntry("broken.h5", 10, "train")])
    ds = H5WindowDataset(m, "train", 2)
    with pytest.raises(DataError, match="broken.h5"):
        ds[(0, 0)]


# ---------------------------------------------------------------- lazy opening, workers, pickling


class CountingFile(h5py.File):
    calls = 0

    def __init__(self, *a, **kw):
        type(self).calls += 1
        super().__init__(*a, **kw)


@pytest.fixture
def count_opens(monkeypatch):
    monkeypatch.setattr(windows, "LOADED_BYTES", 0)  # short files keep handles too
    CountingFile.calls = 0
    monkeypatch.setattr(h5py, "File", CountingFile)
    return CountingFile


def test_construction_opens_nothing(manifest, count_opens):
    with pytest.warns(UserWarning):
        ds = H5WindowDataset(manifest, "train", WINDOW)
    assert count_opens.calls == 0 and ds._handles == {}
    ds[(2, 3)]
    ds[(2, 10)]
    assert count_opens.calls == 1 and list(ds._handles) == [2]  # one handle per file, kept open
    ds[(0, 0)]
    assert count_opens.calls == 2 and sorted(ds._handles) == [0, 2]
    ds.close()
    assert ds._handles == {}
    ds[(0, 0)]
    assert count_opens.calls == 3
    ds.close()


def test_new_process_gets_new_handles(count_opens, dataset):
    """A forked worker inherits the parent's dict: it must not reuse those handles."""
    before = count_opens.calls
    dataset[(0, 0)]
    inherited = dataset._handles[0]
    dataset._pid = -1  # as seen from a child process
    item = dataset[(0, 4)]
    assert dataset._handles[0] is not inherited and count_opens.calls - before == 2
    assert int(item["start"]) == 4
    inherited.file.close()
    dataset.close()


def read_all(loader) -> list[dict]:
    return [dict(b) for b in loader]


def assert_batches_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_open_files_parent_never(dataset, count_opens, context):
    sampler = FileBatchSampler(dataset.frames, WINDOW, batch_size=3, seed=11, batches_per_epoch=6)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2, multiprocessing_context=context)
    batches = read_all(loader)
    assert count_opens.calls == 0 and dataset._handles == {} and dataset._pid is None
    assert len(batches) == 6 and batches[0]["latents"].shape == (3, WINDOW, 4, 8, 8)
    # same batches as reading in the parent (num_workers=0), from a fresh sampler with the same seed
    sampler0 = FileBatchSampler(dataset.frames, WINDOW, batch_size=3, seed=11, batches_per_epoch=6)
    assert_batches_equal(batches, read_all(DataLoader(dataset, batch_sampler=sampler0, num_workers=0)))
    assert count_opens.calls == 3  # now the parent did read: one open per file
    dataset.close()


def test_loader_batches_match_sampler(dataset, window_files):
    _, spec = window_files
    sampler = FileBatchSampler(dataset.frames, WINDOW, batch_size=3, seed=2, batches_per_epoch=4)
    batches = read_all(DataLoader(dataset, batch_sampler=sampler, num_workers=0))
    for batch, idx in zip(batches, list(sampler), strict=True):
        assert [(int(f), int(s)) for f, s in zip(batch["file_index"], batch["start"])] == idx
        for row, (f, s) in enumerate(idx):
            want = expected_item(dataset, spec, f, s)
            np.testing.assert_array_equal(batch["latents"][row].numpy(), want["latents"])
            np.testing.assert_array_equal(batch["actions"][row].numpy(), want["actions"])
            assert int(batch["world_label"][row]) == want["world_label"]
    dataset.close()


def test_pickle_after_open(dataset, window_files):
    _, spec = window_files
    before = dataset[(2, 10)]
    assert len(dataset._handles) == 1
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._handles == {} and copy._pid is None
    assert len(dataset._handles) == 1  # the original keeps its handle
    assert copy.paths == dataset.paths and copy.frames == dataset.frames and len(copy) == len(dataset)
    after = copy[(2, 10)]
    assert all(torch.equal(before[k], after[k]) for k in before)
    copy.close()
    dataset.close()


# ---------------------------------------------------------------- FileBatchSampler

FRAMES = [40, 23, 100, 12, 57, 31]  # windows of 4: 10, 5, 25, 3, 14, 7 = 64


def test_distinct_files_per_batch():
    s = FileBatchSampler(FRAMES, WINDOW, batch_size=4, seed=3, batches_per_epoch=200)
    batches = list(s)
    assert len(batches) == 200
    for b in batches:
        assert len(b) == 4
        assert len({f for f, _ in b}) == 4
    assert {f for b in batches for f, _ in b} == set(range(len(FRAMES)))


def test_ranks_take_slices_of_one_global_batch_of_distinct_files():
    """Under DDP the batch is every rank's batch together: its elements come from different files too (ranks
    drawing on their own would often read the same file in the same step)."""
    frames = [40 + i for i in range(32)]
    ranks = [FileBatchSampler(frames, WINDOW, batch_size=4, seed=3, rank=r, world_size=4, batches_per_epoch=50)
             for r in range(4)]
    for index in range(50):
        parts = [s.batch(0, index) for s in ranks]
        assert all(len(p) == 4 for p in parts)
        assert len({f for p in parts for f, _ in p}) == 16, index
    single = FileBatchSampler(frames, WINDOW, batch_size=16, seed=3, batches_per_epoch=50)
    assert [x for s in ranks for x in s.batch(0, 7)] == single.batch(0, 7)  # the slices of the one global batch


@pytest.mark.parametrize("files, batch_size, world_size", [(4, 3, 2), (4, 3, 3), (5, 4, 3), (6, 6, 2), (3, 1, 4)])
def test_fewer_files_than_the_global_batch_but_enough_for_a_ranks_batch_keeps_each_ranks_batch_distinct(
        files, batch_size, world_size):
    """Each file is in the global batch once per round (its count 1 apart from any other's), and never twice in a
    rank's batch while the rank's batch has enough files; the same global batch on every rank, a slice each."""
    frames = [40 + 3 * i for i in range(files)]
    ranks = [FileBatchSampler(frames, WINDOW, batch_size=batch_size, seed=3, rank=r, world_size=world_size,
                              batches_per_epoch=300) for r in range(world_size)]
    seen = Counter()
    for index in range(300):
        parts = [s.batch(0, index) for s in ranks]
        assert all(len(p) == batch_size and len({f for f, _ in p}) == batch_size for p in parts), (index, parts)
        counts = Counter(f for p in parts for f, _ in p)
        assert set(counts) == set(range(files)) and max(counts.values()) - min(counts.values()) <= 1
        seen.update((r, f) for r, p in enumerate(parts) for f, _ in p)
    assert len(seen) == world_size * files  # every rank reads every file


def test_batch_size_equal_to_files_uses_every_file():
    s = FileBatchSampler(FRAMES, WINDOW, batch_size=6, seed=0, batches_per_epoch=20)
    assert all(sorted(f for f, _ in b) == list(range(6)) for b in s)


@pytest.mark.parametrize("frames, batch_size", [([40, 23, 100], 8), ([12, 50], 7), ([9], 5), ([40, 23, 100, 12], 12)])
def test_few_files_whole_rounds(frames, batch_size):
    s = FileBatchSampler(frames, WINDOW, batch_size=batch_size, seed=5, batches_per_epoch=30)
    n = len(frames)
    for b in s:
        assert len(b) == batch_size
        counts = Counter(f for f, _ in b)
        assert set(counts) == set(range(n))
        assert set(counts.values()) <= {batch_size // n, math.ceil(batch_size / n)}
        assert max(counts.values()) - min(counts.values()) <= 1


def test_open_files_are_closed_least_recently_used_first(tmp_path):
    for i in range(3):
        write_h5(tmp_path / f"f{i}.h5", 8)
    ds = H5WindowDataset(index_directory(tmp_path, val_fraction=0.0), "train", 4, max_open=2, loaded_bytes=0)
    for i in (0, 1, 0, 2):
        ds[(i, 0)]
    assert list(ds._handles) == [0, 2]  # 1 was the least recently used
    ds.close()


def test_starts_cover_exactly_the_valid_range():
    frames = [12, 7, 4]  # valid starts 0..8, 0..3, 0..0
    s = FileBatchSampler(frames, WINDOW, batch_size=2, seed=0, batches_per_epoch=400)
    seen = {i: set() for i in range(3)}
    for b in s:
        for f, st in b:
            assert 0 <= st <= frames[f] - WINDOW
            seen[f].add(st)
    assert seen == {0: set(range(9)), 1: set(range(4)), 2: {0}}


def test_determinism_and_dependence_on_seed_rank_epoch():
    def batches(**kw):
        s = FileBatchSampler(FRAMES, WINDOW, batch_size=3, batches_per_epoch=8, world_size=2, **kw)
        return [s.batch(e, i) for e in range(2) for i in range(8)]

    base = batches(seed=7, rank=0)
    assert base == batches(seed=7, rank=0)
    for other in (batches(seed=7, rank=1), batches(seed=8, rank=0)):
        assert other != base
        assert sum(x != y for x, y in zip(base, other)) >= 8  # most batches differ, not just one
    epoch0, epoch1 = base[:8], base[8:]
    assert sum(x != y for x, y in zip(epoch0, epoch1)) >= 4


def test_iteration_follows_epoch():
    s = FileBatchSampler(FRAMES, WINDOW, batch_size=3, seed=1, batches_per_epoch=5)
    e0 = list(s)
    assert e0 == [s.batch(0, i) for i in range(5)] == list(s)  # iterating twice: same epoch, same batches
    s.set_epoch(3)
    e3 = list(s)
    assert e3 == [s.batch(3, i) for i in range(5)] and e3 != e0


def test_batch_index_is_independent_of_history():
    a = FileBatchSampler(FRAMES, WINDOW, batch_size=3, seed=9, rank=2, world_size=4)
    b = FileBatchSampler(FRAMES, WINDOW, batch_size=3, seed=9, rank=2, world_size=4)
    full = [a.batch(5, i) for i in range(4)]
    assert [b.batch(5, i) for i in reversed(range(4))] == full[::-1]


def test_len_default_and_override():
    windows = sum(f // WINDOW for f in FRAMES)  # 64
    assert len(FileBatchSampler(FRAMES, WINDOW, batch_size=4)) == 64 // 4 == 16
    assert len(FileBatchSampler(FRAMES, WINDOW, batch_size=5, world_size=2)) == windows // 10 == 6
    assert len(list(FileBatchSampler(FRAMES, WINDOW, batch_size=5, world_size=2))) == 6
    s = FileBatchSampler(FRAMES, WINDOW, batch_size=5, world_size=2, batches_per_epoch=17)
    assert len(s) == 17 and len(list(s)) == 17
    assert len(FileBatchSampler([4, 5], WINDOW, batch_size=8)) == 1  # at least one batch


def test_dataset_frames_feed_the_sampler(dataset):
    """The short file (d.h5) is left out of the dataset, so no sampled index can point at it."""
    s = FileBatchSampler(dataset.frames, WINDOW, batch_size=2, seed=0, batches_per_epoch=100)
    used = {f for b in s for f, _ in b}
    assert used == {0, 1, 2}
    assert all(not p.endswith("d.h5") for p in dataset.paths)
    assert len(FileBatchSampler(dataset.frames, WINDOW, batch_size=2)) == len(dataset) // 2


def test_start_batch_resumes_mid_epoch():
    s = FileBatchSampler(FRAMES, WINDOW, batch_size=3, seed=4, batches_per_epoch=10)
    s.set_epoch(2)
    full = list(s)
    for k in (0, 3, 9, 10):
        s.start_batch = k
        assert list(s) == full[k:]
        assert s.start_batch == 0
        assert list(s) == full  # the next iteration starts again from 0


def test_state_dict_round_trip():
    a = FileBatchSampler(FRAMES, WINDOW, batch_size=3, seed=13, batches_per_epoch=6)
    a.set_epoch(4)
    state = a.state_dict()
    assert state["seed"] == 13 and state["epoch"] == 4
    b = FileBatchSampler(FRAMES, WINDOW, batch_size=3, seed=0, batches_per_epoch=6)
    b.load_state_dict(state)
    assert (b.seed, b.epoch) == (13, 4)
    assert list(b) == list(a)
    b.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert list(b) == list(a)


def test_selection_frequency_follows_windows():
    frames = [400, 40, 40]  # 100, 10, 10 windows
    s = FileBatchSampler(frames, WINDOW, batch_size=1, seed=0, batches_per_epoch=3000)
    counts = Counter(f for b in s for f, _ in b)
    assert counts[0] + counts[1] + counts[2] == 3000
    assert 2500 * 0.9 < counts[0] < 2500 * 1.1  # expected 3000 * 100/120 = 2500
    assert 6 < counts[0] / counts[1] < 15 and 6 < counts[0] / counts[2] < 15


def test_selection_frequency_with_bigger_batches():
    """A file whose share of a batch would exceed one place is in every batch; the others share the remaining
    places in proportion to their windows. 100 and 5 x 10 windows, batch 2: 2 * 100/150 > 1, so the big file
    is in all 1500 batches and each small one in a fifth of them."""
    frames = [400] + [40] * 5
    s = FileBatchSampler(frames, WINDOW, batch_size=2, seed=1, batches_per_epoch=1500)
    counts = Counter(f for b in s for f, _ in b)
    assert counts[0] == 1500
    assert all(300 * 0.85 < counts[i] < 300 * 1.15 for i in range(1, 6)), counts


@pytest.mark.slow
def test_inclusion_is_proportional_to_windows():
    """Windows 1, 1, 2, 4 and batch 2: each file is in a batch with probability 2 * windows / 8 (0.25, 0.25,
    0.5, 1), i.e. windows are drawn uniformly; drawing files one after another without replacement would
    favour the small ones (the big file in 81% of the batches)."""
    frames = [4, 4, 8, 16]
    s = FileBatchSampler(frames, WINDOW, batch_size=2, seed=2, batches_per_epoch=4000)
    counts = Counter(f for b in s for f, _ in b)
    assert counts[3] == 4000
    for f, p in ((0, 0.25), (1, 0.25), (2, 0.5)):
        assert abs(counts[f] / 4000 - p) < 0.03, counts
    assert all(len({f for f, _ in b}) == 2 for b in s)


@pytest.mark.parametrize("weights, n, expected", [
    ([1, 1, 2, 4], 2, [0.25, 0.25, 0.5, 1.0]),
    ([10, 1, 1, 1, 1], 2, [1.0, 0.25, 0.25, 0.25, 0.25]),
    ([10, 5, 1, 1, 1], 3, [1.0, 1.0, 1 / 3, 1 / 3, 1 / 3]),  # 5 exceeds one place only once 10 is fixed
    ([3, 1], 2, [1.0, 1.0]),
    ([1, 1, 1, 1], 1, [0.25] * 4),
])
def test_inclusion_probabilities_known_answers(weights, n, expected):
    w = np.asarray(weights, dtype=float)
    pi = inclusion_probabilities(w / w.sum(), n)
    np.testing.assert_allclose(pi, expected, rtol=1e-12)
    assert math.isclose(pi.sum(), n)


def test_systematic_pps_draws_distinct_items_with_their_probabilities():
    pi = np.array([0.9, 0.1, 0.6, 0.4, 1.0, 0.5, 0.5])  # sums to 4
    rng = np.random.default_rng(0)
    counts = np.zeros(len(pi))
    for _ in range(5000):
        picks = systematic_pps(pi, rng)
        assert len(picks) == 4 and len(set(picks.tolist())) == 4
        counts[picks] += 1
    np.testing.assert_allclose(counts / 5000, pi, atol=0.025)


class _Items(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        dtype = torch.float16 if i == 0 else torch.float32
        return {"latents": torch.full((1, 1), 0.1, dtype=dtype), "start": torch.tensor(i)}


def test_mixed_windows_collate_to_float32_in_a_worker_too():
    loader = torch.utils.data.DataLoader(_Items(), batch_size=2, num_workers=1, collate_fn=collate_windows)
    batch = next(iter(loader))
    assert batch["latents"].dtype == torch.float32
    assert batch["latents"][1, 0, 0].item() == pytest.approx(0.1, abs=1e-8)


def test_inclusion_follows_whole_windows_not_frames():
    """Files of 7 and 4 frames hold one window of 4 each: each is drawn with probability 1/2, not 7/11."""
    s = FileBatchSampler([7, 4], 4, batch_size=1)
    np.testing.assert_allclose(s.pi, [0.5, 0.5], rtol=1e-12)


def test_systematic_pps_draws_in_a_random_order():
    """With equal probabilities every pair of items is drawn together and every item comes first about equally."""
    pi = np.full(4, 0.5)
    rng = np.random.default_rng(0)
    draws = [systematic_pps(pi, rng) for _ in range(2000)]
    pairs = Counter(tuple(sorted(d.tolist())) for d in draws)
    assert set(pairs) == set(combinations(range(4), 2))
    first = Counter(int(d[0]) for d in draws)
    assert all(400 < first[i] < 600 for i in range(4)), first


def test_whole_rounds_of_files_come_in_a_random_order():
    """Fewer files than the global batch (3 files, 2 ranks x 3): rank 0's first element is each file about a third of the time."""
    s = FileBatchSampler([40, 40, 40], 4, batch_size=3, seed=0, rank=0, world_size=2, batches_per_epoch=300)
    first = Counter(b[0][0] for b in s)
    assert all(70 < first[f] < 130 for f in range(3)), first


@pytest.mark.parametrize("actions", [False, True])
def test_a_file_rewritten_shorter_after_setup_is_a_data_error_naming_it(tmp_path, actions):
    """h5py cuts a slice past the end short: a window of a file rewritten shorter since setup checked it would
    come out with fewer frames (a stack error naming no file in a batch, silent short windows at batch size 1)."""
    write_h5(tmp_path / "a.h5", 12, actions=actions)
    ds = H5WindowDataset(index_directory(tmp_path, val_fraction=0.0), "train", WINDOW)
    assert ds[(0, 8)]["latents"].shape[0] == WINDOW
    ds.close()
    write_h5(tmp_path / "a.h5", 10, actions=actions)  # re-encoded in place, say
    with pytest.raises(DataError, match=r"a\.h5: 'latents' has 10 frames, the manifest says 12 \(changed since it "
                                        r"was indexed\)"):
        ds[(0, 8)]
    assert ds[(0, 6)]["latents"].shape[0] == WINDOW  # a window the shorter file still holds is read as before


def test_label_fraction_keeps_a_fixed_share_of_the_actions(manifest, window_files):
    _, spec = window_files
    with pytest.warns(UserWarning):
        kept = H5WindowDataset(manifest, "train", WINDOW, label_fraction=0.25)
    index = 2  # c.h5: actions, 100 frames
    every = np.concatenate([kept[(index, s)]["actions"].numpy() for s in range(0, 100 - WINDOW + 1, WINDOW)])
    truth = action_pattern(100)[: len(every)]
    labelled = every != MISSING
    np.testing.assert_array_equal(every[labelled], truth[labelled])  # what is kept is the true action
    assert 0.1 < labelled.mean() < 0.4
    # the same frames in another window, dataset and process: a fixed draw
    with pytest.warns(UserWarning):
        again = H5WindowDataset(manifest, "train", WINDOW, label_fraction=0.25)
    np.testing.assert_array_equal(again[(index, 1)]["actions"].numpy(), every[1 : 1 + WINDOW])


def test_a_short_file_is_read_whole_once_and_a_long_one_keeps_a_handle(tmp_path, count_opens, monkeypatch):
    monkeypatch.setattr(windows, "LOADED_BYTES", 2**20)
    write_h5(tmp_path / "a_short.h5", windows.LOAD_WINDOWS * WINDOW, actions=True)
    write_h5(tmp_path / "b_long.h5", windows.LOAD_WINDOWS * WINDOW + 1, actions=True)
    m = index_directory(tmp_path, val_fraction=0.0)
    ds, by_window = H5WindowDataset(m, "train", WINDOW), H5WindowDataset(m, "train", WINDOW, loaded_bytes=0)
    before = count_opens.calls
    for start in (0, 5, windows.LOAD_WINDOWS * WINDOW - WINDOW, 3):
        for name in ("latents", "actions"):
            assert torch.equal(ds[(0, start)][name], by_window[(0, start)][name])
    ds[(1, 0)], ds[(1, 7)]
    assert list(ds._loaded) == [0] and ds._loaded[0].file is None and list(ds._handles) == [1]
    assert count_opens.calls - before == 2 + 1  # ds: one open per file; by_window: its one handle

"""index_directory and Manifest: checked files, relative paths, the seeded val split, refusals naming every file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from lwm.cli.main import main
from lwm.data.h5 import DataError
from lwm.data.manifest import Manifest, ManifestEntry, index_directory
from tests.data.conftest import pattern, write_h5


def val_names(manifest: Manifest) -> set[str]:
    return {Path(e.path).name for e in manifest.split("val")}


# ---------------------------------------------------------------- index_directory


def test_index_writes_manifest_in_directory(data_dir):
    m = index_directory(data_dir, val_fraction=0.0)
    out = data_dir / "manifest.json"
    assert out.is_file() and m.path == out
    assert (m.channels, m.height, m.width) == (4, 8, 8)
    assert [e.path for e in m.entries] == [f"ep_{i:02d}.h5" for i in range(10)]
    assert [e.frames for e in m.entries] == [20 + 3 * i for i in range(10)]
    assert all(e.split == "train" and e.key == "latents" for e in m.entries)
    raw = json.loads(out.read_text())
    assert raw["version"] == 1 and (raw["channels"], raw["height"], raw["width"]) == (4, 8, 8)
    stat = (data_dir / "ep_03.h5").stat()  # the checked file's size and modification time: a later change shows
    assert raw["files"][3] == {"path": "ep_03.h5", "frames": 29, "split": "train", "key": "latents",
                               "bytes": stat.st_size, "mtime": stat.st_mtime}
    assert not [p for p in data_dir.iterdir() if ".tmp" in p.name]  # no temp file left behind


def test_index_records_other_key_and_subfolders(tmp_path):
    d = tmp_path / "d"
    write_h5(d / "x.h5", 6)
    write_h5(d / "sub" / "y.hdf5", 8, key="z")
    (d / "notes.txt").write_text("not a latents file")
    m = index_directory(d, val_fraction=0.0)
    assert [(e.path, e.frames, e.key) for e in m.entries] == [("sub/y.hdf5", 8, "z"), ("x.h5", 6, "latents")]


def test_index_out_elsewhere_uses_relative_paths(data_dir, tmp_path):
    out = tmp_path / "elsewhere" / "deeper" / "m.json"
    m = index_directory(data_dir, out=out, val_fraction=0.0)
    assert out.is_file() and not (data_dir / "manifest.json").exists()
    assert m.entries[0].path == os.path.join("..", "..", "data", "ep_00.h5")
    assert not any(os.path.isabs(e.path) for e in m.entries)
    loaded = Manifest.load(out)
    for e in loaded.entries:
        assert loaded.resolve(e) == (data_dir / Path(e.path).name).resolve()
        assert loaded.resolve(e).is_file()


def test_load_round_trip(data_dir):
    m = index_directory(data_dir, val_fraction=0.3, seed=4)
    loaded = Manifest.load(data_dir / "manifest.json")
    assert loaded.entries == m.entries
    assert (loaded.channels, loaded.height, loaded.width) == (m.channels, m.height, m.width)
    assert loaded.path == data_dir / "manifest.json"
    assert all(isinstance(e, ManifestEntry) for e in loaded.entries)


def test_resolve_from_relative_manifest_path(data_dir, tmp_path, monkeypatch):
    index_directory(data_dir, out=tmp_path / "m" / "manifest.json", val_fraction=0.0)
    monkeypatch.chdir(tmp_path / "m")
    loaded = Manifest.load("manifest.json")
    assert loaded.resolve(loaded.entries[5]) == (data_dir / "ep_05.h5").resolve()


def test_save_elsewhere_then_load(data_dir, tmp_path):
    """Saving to another place keeps the entry paths as they are (relative to the original folder)."""
    m = index_directory(data_dir, val_fraction=0.0)
    copy = m.save(tmp_path / "copy.json")
    assert copy == tmp_path / "copy.json" and m.path == copy
    assert Manifest.load(copy).entries == m.entries


# ---------------------------------------------------------------- val split


def test_val_split_size_and_determinism(data_dir):
    a = index_directory(data_dir, val_fraction=0.2, seed=1)
    b = index_directory(data_dir, val_fraction=0.2, seed=1)
    assert len(a.split("val")) == 2 and len(a.split("train")) == 8
    assert val_names(a) == val_names(b)
    assert set(a.split("val")) | set(a.split("train")) == set(a.entries)
    others = [val_names(index_directory(data_dir, val_fraction=0.2, seed=s, resplit=True)) for s in range(2, 8)]
    assert all(len(v) == 2 for v in others)
    assert any(v != val_names(a) for v in others)


def test_indexing_again_keeps_every_listed_file_in_its_split(data_dir):
    """Adding files and indexing again must not move a validation file into training (a continued run would then
    validate on files it trained on); the new files' splits are drawn towards the fraction."""
    first = index_directory(data_dir, val_fraction=0.2, seed=1)
    old = {e.path: e.split for e in first.entries}
    for i in range(10):
        with h5py.File(data_dir / f"new_{i:02d}.h5", "w") as f:
            f["latents"] = np.zeros((5, 4, 8, 8), np.float32)
    second = index_directory(data_dir, val_fraction=0.2, seed=99)
    assert {e.path: e.split for e in second.entries if e.path in old} == old
    assert len(second.split("val")) == 4  # 0.2 of 20: the 2 kept and 2 of the new ones
    fresh = index_directory(data_dir, val_fraction=0.2, seed=99, resplit=True)
    assert len(fresh.split("val")) == 4 and val_names(fresh) != val_names(second)


def test_the_odd_file_out_is_named_not_the_majority(tmp_path):
    for name, channels in (("a_odd.h5", 8), ("b.h5", 4), ("c.h5", 4), ("d.h5", 4)):
        with h5py.File(tmp_path / name, "w") as f:
            f["latents"] = np.zeros((5, channels, 8, 8), np.float32)
    with pytest.raises(DataError) as err:
        index_directory(tmp_path)
    message = str(err.value)
    assert message.startswith("1 of 4 files refused") and "a_odd.h5: dataset 'latents' has channels 8, expected 4" in message
    assert "b.h5" not in message and not (tmp_path / "manifest.json").exists()


def test_val_fraction_zero(data_dir):
    m = index_directory(data_dir, val_fraction=0.0)
    assert m.split("val") == [] and len(m.split("train")) == 10


def test_two_files_small_fraction_gives_one_val(tmp_path):
    d = tmp_path / "two"
    write_h5(d / "a.h5", 5)
    write_h5(d / "b.h5", 6)
    for seed in range(4):
        m = index_directory(d, val_fraction=0.1, seed=seed)
        assert len(m.split("val")) == 1 and len(m.split("train")) == 1


def test_single_file_stays_train(tmp_path):
    write_h5(tmp_path / "one" / "a.h5", 5)
    m = index_directory(tmp_path / "one", val_fraction=0.5)
    assert [e.split for e in m.entries] == ["train"]


# ---------------------------------------------------------------- refusals


def test_bad_files_are_all_named_and_nothing_written(data_dir, tmp_path):
    bad_nan = pattern(10)
    bad_nan[2] = np.nan
    write_h5(data_dir / "ep_03b.h5", data=bad_nan)
    (data_dir / "zz_garbage.h5").write_bytes(b"definitely not hdf5" * 50)
    out = data_dir / "manifest.json"
    out.write_text('{"old": "manifest"}\n')
    before = out.read_bytes()
    with pytest.raises(DataError) as exc:
        index_directory(data_dir)
    lines = str(exc.value).splitlines()
    assert lines[0].startswith("2 of 12 files refused")
    assert len(lines) == 3  # a header, then one line per bad file
    assert str(data_dir / "ep_03b.h5") in lines[1] and "NaN/inf" in lines[1]
    assert str(data_dir / "zz_garbage.h5") in lines[2]
    assert out.read_bytes() == before
    assert sorted(p.name for p in data_dir.iterdir() if not p.name.endswith(".h5")) == ["manifest.json"]


def test_many_bad_files_are_named_up_to_a_limit_then_counted(data_dir):
    from lwm.utils.errors import LISTED_PROBLEMS

    for i in range(LISTED_PROBLEMS + 5):
        (data_dir / f"zz_bad_{i:02d}.h5").write_bytes(b"not hdf5")
    with pytest.raises(DataError) as exc:
        index_directory(data_dir)
    lines = str(exc.value).splitlines()
    assert lines[0] == f"{LISTED_PROBLEMS + 5} of {LISTED_PROBLEMS + 15} files refused:"
    assert len(lines) == LISTED_PROBLEMS + 2 and lines[-1] == "... and 5 more"
    assert "zz_bad_00.h5" in lines[1]


def test_bad_files_with_out_elsewhere_write_nothing(data_dir, tmp_path):
    (data_dir / "broken.h5").write_bytes(b"\0" * 100)
    out = tmp_path / "out" / "m.json"
    with pytest.raises(DataError, match="broken.h5"):
        index_directory(data_dir, out=out)
    assert not out.exists()


def test_other_shape_refused_by_name(data_dir):
    write_h5(data_dir / "ep_05x.h5", 10, channels=3)
    write_h5(data_dir / "ep_07x.h5", 10, height=16)
    with pytest.raises(DataError) as exc:
        index_directory(data_dir)
    lines = str(exc.value).splitlines()
    assert len(lines) == 3
    assert str(data_dir / "ep_05x.h5") in lines[1] and "channels 3, expected 4" in lines[1]
    assert str(data_dir / "ep_07x.h5") in lines[2] and "height 16, expected 8" in lines[2]
    assert not (data_dir / "manifest.json").exists()


def test_tolerance_passed_through(tmp_path):
    data = pattern(6)
    data[1, 0, 0, 0] = 1.05
    write_h5(tmp_path / "t" / "a.h5", data=data)
    with pytest.raises(DataError, match="outside"):
        index_directory(tmp_path / "t")
    assert index_directory(tmp_path / "t", tolerance=0.1).entries[0].frames == 6


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match="no .h5/.hdf5 files") as exc:
        index_directory(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(exc.value)
    assert not (tmp_path / "empty" / "manifest.json").exists()


def test_not_a_directory(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        index_directory(tmp_path / "missing")


# ---------------------------------------------------------------- Manifest.load refusals


def load_refused(path, match: str) -> str:
    with pytest.raises(DataError) as exc:
        Manifest.load(path)
    msg = str(exc.value)
    assert str(path) in msg and match in msg, msg
    assert "\n" not in msg
    return msg


def good_json() -> dict:
    return {"version": 1, "channels": 4, "height": 8, "width": 8,
            "files": [{"path": "a.h5", "frames": 10, "split": "train", "key": "latents"}]}


def test_load_missing(tmp_path):
    load_refused(tmp_path / "none.json", "manifest not found")


def test_load_a_folder_names_the_manifest_inside(tmp_path):
    """``--data.manifest data`` (the folder `lwm data index` wrote into): its manifest.json named, or the command."""
    load_refused(tmp_path, f"{tmp_path}/manifest.json")


def test_load_invalid_json(tmp_path):
    p = tmp_path / "m.json"
    p.write_text('{"version": 1, "files": [')
    load_refused(p, "not valid JSON")


def test_load_not_utf8(tmp_path):
    p = tmp_path / "m.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    load_refused(p, "not valid JSON")


@pytest.mark.parametrize("drop", ["files", "channels", "height", "width"])
def test_load_missing_top_field(tmp_path, drop):
    raw = good_json()
    del raw[drop]
    p = tmp_path / "m.json"
    p.write_text(json.dumps(raw))
    load_refused(p, "field missing or malformed")


@pytest.mark.parametrize("drop", ["path", "frames", "split"])
def test_load_missing_entry_field(tmp_path, drop):
    raw = good_json()
    del raw["files"][0][drop]
    p = tmp_path / "m.json"
    p.write_text(json.dumps(raw))
    load_refused(p, "field missing or malformed")


@pytest.mark.parametrize("doc", ["[]", "null", '{"channels": 4, "height": 8, "width": 8, "files": ["a.h5"]}',
                                 '{"channels": "four", "height": 8, "width": 8, "files": []}'])
def test_load_malformed(tmp_path, doc):
    p = tmp_path / "m.json"
    p.write_text(doc)
    load_refused(p, "field missing or malformed")


@pytest.mark.parametrize(("change", "message"), [
    ({"version": 99}, "'version' must be 1, the version this lwm reads (index the folder again, or update lwm), got 99"),
    ({"version": "1"}, "'version' must be 1"),
    ({"path": None}, "'path'"),
    ({"path": ""}, "'path'"),
])
def test_load_refuses_a_newer_version_and_a_pathless_entry(tmp_path, change, message):
    raw = good_json()
    if "version" in change:
        raw.update(change)
    else:
        raw["files"][0].update(change)
    p = tmp_path / "m.json"
    p.write_text(json.dumps(raw))
    load_refused(p, message)


def test_load_key_defaults_to_latents(tmp_path):
    raw = good_json()
    del raw["files"][0]["key"]
    p = tmp_path / "m.json"
    p.write_text(json.dumps(raw))
    assert Manifest.load(p).entries == [ManifestEntry("a.h5", 10, "train", "latents")]


def test_load_bad_split_name(tmp_path):
    raw = good_json()
    raw["files"][0]["split"] = "test"
    p = tmp_path / "m.json"
    p.write_text(json.dumps(raw))
    assert "'test'" in load_refused(p, "file a.h5: 'split'")


def test_load_zero_frames(tmp_path):
    raw = good_json()
    raw["files"][0]["frames"] = 0
    p = tmp_path / "m.json"
    p.write_text(json.dumps(raw))
    load_refused(p, "file a.h5: 'frames'")


def test_checking_yields_every_item_with_or_without_a_progress_bar():
    from lwm.data.manifest import PROGRESS_MIN_FILES, checking

    few, many = list(range(3)), list(range(PROGRESS_MIN_FILES + 5))
    assert checking(few, "x") is few  # no bar for a handful of files
    assert list(checking(many, "x")) == many
    assert checking(many, "x", show=False) is many  # e.g. on ranks other than 0


def test_links_and_case_each_physical_file_indexed_once(tmp_path, capsys):
    """A file linked in again is indexed once (else it could land in both splits); linked folders are followed
    (without looping on a link back up); any case of the suffix counts."""
    root = tmp_path / "data"
    for i in range(4):
        write_h5(root / f"ep_{i}.h5", offset=i / 100)
    write_h5(root / "UPPER.H5", offset=0.07)
    outside = tmp_path / "elsewhere"
    write_h5(outside / "far.hdf5", offset=0.09)
    os.symlink(root / "ep_0.h5", root / "link.h5")
    os.symlink(outside, root / "linked_folder")
    os.symlink(root, root / "loop")  # a link back up the tree
    manifest = index_directory(root, val_fraction=0.4)
    paths = sorted(e.path for e in manifest.entries)
    # (paths as found, relative to the manifest: a linked folder's files under its name)
    assert paths == ["UPPER.H5", "ep_0.h5", "ep_1.h5", "ep_2.h5", "ep_3.h5", "linked_folder/far.hdf5"]
    assert "link.h5 is the same file as" in capsys.readouterr().err


def test_a_folder_of_links_copied_with_its_links_followed_keeps_its_manifest(tmp_path):
    """Linked files are listed under their links' names: the folder copied to node-local scratch following links
    (cp -rL, rsync -L) still matches its manifest, as the files themselves."""
    import shutil

    store, root = tmp_path / "store", tmp_path / "data"
    root.mkdir()
    for i in range(3):
        write_h5(store / f"blob{i}.h5", offset=i / 100)
        os.symlink(store / f"blob{i}.h5", root / f"ep{i}.h5")
    index_directory(root, val_fraction=0.0)
    copy = tmp_path / "scratch" / "data"
    shutil.copytree(root, copy, symlinks=False)  # cp -rL: the links' files copied in their place
    manifest = Manifest.load(copy / "manifest.json")
    assert sorted(e.path for e in manifest.entries) == ["ep0.h5", "ep1.h5", "ep2.h5"]
    assert all(manifest.resolve(e).is_file() and not manifest.resolve(e).is_symlink() for e in manifest.entries)


def test_a_link_to_a_missing_file_is_refused_by_name_and_one_to_a_missing_folder_noted(tmp_path, capsys):
    root = tmp_path / "data"
    for i in range(2):
        write_h5(root / f"ep_{i}.h5", offset=i / 100)
    os.symlink(tmp_path / "gone.h5", root / "ep_9.h5")
    os.symlink(tmp_path / "not_mounted", root / "part2")
    with pytest.raises(DataError) as exc:
        index_directory(root)
    lines = str(exc.value).splitlines()
    assert lines == ["1 of 3 files refused:", f"{root / 'ep_9.h5'}: a link to {tmp_path / 'gone.h5'}, which is not there"]
    assert f"note: {root / 'part2'}: a link to {tmp_path / 'not_mounted'}, which is not there" in capsys.readouterr().err


def test_a_manifest_listing_a_file_twice_is_refused(data_dir):
    manifest = index_directory(data_dir)
    doc = json.loads(manifest.path.read_text())
    twice = dict(doc["files"][0], split="val" if doc["files"][0]["split"] == "train" else "train")
    doc["files"].append(twice)
    manifest.path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match=f"file {twice['path']} is listed twice"):
        Manifest.load(manifest.path)


def test_out_that_is_a_folder_or_not_a_manifest_is_refused_untouched(data_dir, tmp_path):
    target = data_dir / "ep_00.h5"
    before = target.read_bytes()
    with pytest.raises(DataError, match="exists and is not a JSON manifest; not overwritten"):
        index_directory(data_dir, out=target)
    assert target.read_bytes() == before
    folder = tmp_path / "somewhere"
    folder.mkdir()
    with pytest.raises(DataError, match=f"--out {folder}: "):
        index_directory(data_dir, out=folder)
    assert list(folder.iterdir()) == []


def test_reindexing_over_a_manifest_listing_a_file_twice_keeps_it_in_val(data_dir, capsys):
    """Earlier versions could list a linked file twice; re-indexing reads such a manifest leniently: a file listed
    as val anywhere stays val (never moved into training), and the other splits are kept."""
    manifest = index_directory(data_dir, val_fraction=0.3)
    doc = json.loads(manifest.path.read_text())
    train = next(f for f in doc["files"] if f["split"] == "train")
    doc["files"].append(dict(train, split="val"))  # the same file, listed again as val
    manifest.path.write_text(json.dumps(doc))
    again = index_directory(data_dir, val_fraction=0.3)
    splits = {e.path: e.split for e in again.entries}
    assert splits[train["path"]] == "val"
    assert all(splits[f["path"]] == "val" for f in doc["files"] if f["split"] == "val")
    assert len(again.entries) == len(set(splits))


def _val(m) -> set[str]:
    return {Path(e.path).name for e in m.split("val")}


def _ten(d: Path) -> Path:
    for i in range(10):
        write_h5(d / f"ep_{i:02d}.h5", 20 + i)
    return d


def test_reindex_keeps_val_whichever_order_a_doubly_listed_file_has(tmp_path):
    d = _ten(tmp_path / "d")
    m = index_directory(d, val_fraction=0.3)
    doc = json.loads(m.path.read_text())
    train = next(f for f in doc["files"] if f["split"] == "train")
    doc["files"].insert(0, dict(train, split="val"))  # the val listing FIRST, the train listing after it
    m.path.write_text(json.dumps(doc))
    again = index_directory(d, val_fraction=0.3)
    assert {e.path: e.split for e in again.entries}[train["path"]] == "val"


def test_val_count_is_the_nearest_integer_to_the_fraction(tmp_path):
    d = _ten(tmp_path / "d")
    assert len(index_directory(d, val_fraction=0.18).split("val")) == 2  # round(1.8), not floor
    assert len(index_directory(d, val_fraction=0.34, resplit=True).split("val")) == 3


def test_a_single_file_stays_train_whatever_the_fraction(tmp_path):
    write_h5(tmp_path / "one" / "a.h5", 5)
    for f in (0.6, 0.9):
        m = index_directory(tmp_path / "one", val_fraction=f, resplit=True)
        assert [e.split for e in m.entries] == ["train"]


def test_the_split_is_a_function_of_the_seed(tmp_path):
    d = _ten(tmp_path / "d")
    a = index_directory(d, out=tmp_path / "a.json", val_fraction=0.3, seed=7)  # two fresh manifests: nothing kept
    b = index_directory(d, out=tmp_path / "b.json", val_fraction=0.3, seed=7)
    c = index_directory(d, out=tmp_path / "a.json", val_fraction=0.3, seed=7, resplit=True)
    assert _val(a) == _val(b) == _val(c)


def test_lwm_data_index_passes_seed_tolerance_and_resplit(tmp_path, capsys):
    d = _ten(tmp_path / "d")
    assert main(["data", "index", str(d), "--val-fraction", "0.3", "--seed", "5"]) == 0
    ref = index_directory(d, out=tmp_path / "ref5.json", val_fraction=0.3, seed=5)
    assert _val(Manifest.load(d / "manifest.json")) == _val(ref)  # CL3: --seed reached the split
    assert main(["data", "index", str(d), "--val-fraction", "0.3", "--seed", "9", "--resplit"]) == 0
    ref9 = index_directory(d, out=tmp_path / "ref9.json", val_fraction=0.3, seed=9)
    assert _val(Manifest.load(d / "manifest.json")) == _val(ref9) != _val(ref)  # CL2: --resplit redrew it
    data = pattern(5)
    data[0, 0, 0, 0] = 1.01
    write_h5(tmp_path / "t" / "a.h5", data=data)
    assert main(["data", "index", str(tmp_path / "t")]) == 2
    assert main(["data", "index", str(tmp_path / "t"), "--tolerance", "0.02"]) == 0


# ---------------------------------------------------------------- one file twice, strict fields, flags, warnings


def _with(manifest: Path, *extra: dict) -> Path:
    doc = json.loads(manifest.read_text())
    doc["files"].extend(extra)
    manifest.write_text(json.dumps(doc))
    return manifest


@pytest.mark.parametrize("spelling", ["./{}", "sub/../{}", "{abs}"])
def test_one_file_under_two_spellings_is_refused_naming_both(data_dir, spelling):
    m = index_directory(data_dir, val_fraction=0.0)
    first = m.entries[0]
    other = spelling.format(first.path, abs=data_dir / first.path)
    (data_dir / "sub").mkdir()
    _with(m.path, {"path": other, "frames": first.frames, "split": "val", "key": "latents"})
    msg = load_refused(m.path, f"files {first.path} (train) and {other} (val) are the same file")
    assert "validated on what it trained on" in msg


def test_a_hard_link_is_indexed_once_and_refused_in_a_manifest(data_dir, capsys):
    os.link(data_dir / "ep_03.h5", data_dir / "zz_hard.h5")
    m = index_directory(data_dir, val_fraction=0.2)
    assert "zz_hard.h5" not in {e.path for e in m.entries} and len(m.entries) == 10
    assert "zz_hard.h5 is the same file as" in capsys.readouterr().err
    _with(m.path, {"path": "zz_hard.h5", "frames": 29, "split": "train"})  # as an older lwm would have listed it
    manifest = Manifest.load(m.path)  # loading compares spellings only (a stat per file costs at 1M files) ...
    with pytest.raises(DataError, match="files ep_03.h5 \\(") as exc:
        manifest.check_duplicates(files=True)  # ... fit's setup check, which opens every file, compares inodes
    assert str(m.path) in str(exc.value)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("frames", 16.9, "file a.h5: 'frames' must be an integer >= 1, got 16.9"),
    ("frames", True, "file a.h5: 'frames' must be an integer >= 1, got True"),
    ("frames", "10", "file a.h5: 'frames' must be an integer >= 1, got '10'"),
    ("split", ["train"], "file a.h5: 'split' must be one of train, val, got ['train']"),
    ("key", "", "file a.h5: 'key' must be the name of the latents dataset, got ''"),
    ("key", 3, "'key' must be the name of the latents dataset, got 3"),
    ("channels", "16", "'channels' must be an integer >= 1, got '16'"),
    ("height", 0, "'height' must be an integer >= 1, got 0"),
    ("width", 8.0, "'width' must be an integer >= 1, got 8.0"),
    ("version", -7, "'version' must be 1"),
    ("version", True, "'version' must be 1"),
    ("files", {"a.h5": 10}, "'files' must be a list of file entries"),
])
def test_load_refuses_wrong_types_and_values_naming_the_field(tmp_path, field, value, message):
    raw = good_json()
    (raw if field in raw else raw["files"][0])[field] = value
    p = tmp_path / "m.json"
    p.write_text(json.dumps(raw))
    assert str(p) in load_refused(p, message)


def test_a_negative_seed_is_refused_before_any_file_is_read(tmp_path, capsys, monkeypatch):
    d = _ten(tmp_path / "d")
    monkeypatch.setattr("lwm.data.manifest.inspect_h5", lambda *a, **k: pytest.fail("a file was read"))
    assert main(["data", "index", str(d), "--seed", "-1"]) == 2
    assert "argument --seed: expected an integer in [0, inf], got '-1'" in capsys.readouterr().err
    assert not (d / "manifest.json").exists()


@pytest.mark.parametrize(("files", "fraction", "why"), [
    (1, "0.1", "a single file is never split"), (3, "0", "--val-fraction 0")])
def test_an_empty_val_split_is_warned_about_at_index_time(tmp_path, capsys, files, fraction, why):
    for i in range(files):
        write_h5(tmp_path / "d" / f"a{i}.h5", 6)
    assert main(["data", "index", str(tmp_path / "d"), "--val-fraction", fraction]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {tmp_path / 'd' / 'manifest.json'}: no val files ({why})")
    assert "--val-fraction" in err[0] and "lwm data encode VIDEO --segment N" in err[0]
    write_h5(tmp_path / "d" / "b.h5", 6)
    assert main(["data", "index", str(tmp_path / "d"), "--val-fraction", "0.5", "--resplit"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_generate_rollouts_in_the_folder_are_skipped_with_a_note(data_dir, capsys):
    path = data_dir / "ep_00.mp4.h5"  # what `lwm generate --data ep_00.h5 --out ep_00.mp4` leaves beside its video
    with h5py.File(path, "w") as f:
        f["latents"] = np.zeros((4, 6, 4, 8, 8), dtype=np.float32)
        f["ground_truth"] = np.zeros((6, 4, 8, 8), dtype=np.float32)
        f.attrs["source"], f.attrs["start"], f.attrs["context"] = "ep_00.h5", 0, 1
    m = index_directory(data_dir)
    assert len(m.entries) == 10 and "ep_00.mp4.h5" not in {e.path for e in m.entries}
    notes = [line for line in capsys.readouterr().err.splitlines() if "ep_00.mp4.h5" in line]
    assert len(notes) == 1 and notes[0].startswith("note: ") and notes[0].endswith(": skipped")


def test_latents_the_model_cannot_train_on_are_indexed_with_one_warning(tmp_path, capsys):
    """[16, 50, 50] latents (the pixel codec at --size 100) are valid files, maybe for another tool: indexed, with
    one warning naming the shape, since lwm's tokenizer downsamples by 4."""
    for i in range(3):
        write_h5(tmp_path / "d" / f"a{i}.h5", 6, channels=16, height=50, width=50)
    assert main(["data", "index", str(tmp_path / "d"), "--val-fraction", "0.4"]) == 0
    out = tmp_path / "d" / "manifest.json"
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {out}: the files' latents are [16, 50, 50], and lwm's model cannot train on them (it needs a height "
        f"and width that are multiples of 4: its tokenizer downsamples by 4); indexed all the same (to train on them, "
        f"encode them again at another --size)"]
    assert len(Manifest.load(out).entries) == 3
    for i in range(3):  # one side alone off too
        write_h5(tmp_path / "w" / f"a{i}.h5", 6, height=8, width=6)
    index_directory(tmp_path / "w", val_fraction=0.4)
    assert "[4, 8, 6], and lwm's model cannot train on them" in capsys.readouterr().err


def test_channels_last_latents_of_square_frames_are_warned_about(tmp_path, capsys):
    """[T, 8, 8, 16]: 8x8 frames of 16 channels stored channels-last read as 8 channels of 8x16 (fit then asked for
    in_channels=8 and trained on transposed latents); a warning names the transpose. Proper latents: no warning."""
    for i in range(3):
        write_h5(tmp_path / "cl" / f"a{i}.h5", 6, channels=8, height=8, width=16)
        write_h5(tmp_path / "ok" / f"a{i}.h5", 6, channels=16, height=8, width=8)
    index_directory(tmp_path / "cl", val_fraction=0.4)
    err = capsys.readouterr().err
    assert "read as [T, C, H, W] = [T, 8, 8, 16]: 8 channels of 8x16; if they are channels-last [T, H, W, C] (8x8 " \
           "frames of 16 channels), transpose them" in err and "x.transpose(0, 3, 1, 2)" in err
    index_directory(tmp_path / "ok", val_fraction=0.4)
    assert "channels-last" not in capsys.readouterr().err


def test_compressed_latents_in_chunks_of_many_frames_are_warned_about_once(tmp_path, capsys):
    """h5py's automatic chunks of a compressed dataset can span hundreds of frames: every window read decompresses
    them whole. One warning names the first such file and the repack; one-frame chunks and plain files pass."""
    write_h5(tmp_path / "a_fast.h5", 24, chunks=(1, 4, 8, 8), compression="gzip")
    write_h5(tmp_path / "b_plain.h5", 24)
    write_h5(tmp_path / "c_slow.h5", 24, chunks=(12, 4, 8, 8), compression="gzip")
    write_h5(tmp_path / "d_slow.h5", 24, chunks=(24, 2, 4, 4), compression="lzf")
    index_directory(tmp_path)
    lines = [line for line in capsys.readouterr().err.splitlines() if "chunks of many frames" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: 2 of 4 files store compressed latents")
    assert f"{tmp_path / 'c_slow.h5'}, 'latents' in chunks of 12 frames" in lines[0]
    assert "h5repack -l latents:CHUNK=1x4x8x8 IN OUT" in lines[0]


def test_latents_inside_a_group_are_named_in_the_refusal(tmp_path):
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f.create_dataset("clip/latents", data=np.zeros((8, 4, 8, 8), np.float32))
    with pytest.raises(DataError, match=r"g\.h5: no 'latents' dataset .*\(datasets: none; inside groups: "
                                        r"clip/latents\(8, 4, 8, 8\), where lwm does not look\)"):
        index_directory(tmp_path)


def test_reindexing_keeps_the_split_of_a_linked_file_an_older_manifest_listed_under_its_target(tmp_path):
    """Earlier versions listed a linked file under its target's path; now under its link's name: re-indexing finds
    the file by its identity, so no file moves between train and val."""
    store, root = tmp_path / "store", tmp_path / "data"
    for i in range(6):
        write_h5(store / f"far{i}.h5", offset=i / 100)
        write_h5(root / f"ep{i}.h5", offset=(i + 6) / 100)
    os.symlink(store, root / "linked")
    index_directory(root, val_fraction=0.5, seed=1)
    doc = json.loads((root / "manifest.json").read_text())
    for f in doc["files"]:  # as an older version wrote it
        f["path"] = f["path"].replace("linked/", "../store/")
    (root / "manifest.json").write_text(json.dumps(doc))
    before = {f["path"].replace("../store/", "linked/"): f["split"] for f in doc["files"]}
    again = index_directory(root, val_fraction=0.5, seed=7)  # another seed: only new files would be drawn by it
    assert {e.path: e.split for e in again.entries} == before


def test_a_manifest_in_a_linked_folder_finds_data_beside_the_real_folder(tmp_path):
    """``..`` in an entry's path is the manifest's real parent, as the index computed it, not the link's."""
    real = tmp_path / "mnt" / "proj"
    data = tmp_path / "mnt" / "videos"
    for i in range(2):
        write_h5(data / f"ep{i}.h5", offset=i / 100)
    real.mkdir(parents=True)
    (tmp_path / "home").mkdir()
    os.symlink(real, tmp_path / "home" / "proj")  # ~/proj -> /mnt/proj
    out = tmp_path / "home" / "proj" / "manifest.json"
    manifest = index_directory(tmp_path / "home" / "proj" / ".." / ".." / "mnt" / "videos", out=out, val_fraction=0.0)
    loaded = Manifest.load(out)
    assert sorted(e.path for e in manifest.entries) == ["../videos/ep0.h5", "../videos/ep1.h5"]
    assert all(loaded.resolve(e).is_file() for e in loaded.entries)

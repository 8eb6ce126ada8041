import json

import h5py
import numpy as np

from lwm.cli import main


def _write(path, frames=12, fill=None):
    data = np.random.default_rng(0).uniform(-1, 1, (frames, 4, 8, 8)).astype(np.float32)
    if fill is not None:
        data[3] = fill
    with h5py.File(path, "w") as f:
        f["latents"] = data


def test_data_index_writes_manifest(tmp_path, capsys):
    for i in range(5):
        _write(tmp_path / f"ep{i}.h5", frames=10 + i)
    out = tmp_path / "sub" / "m.json"
    assert main(["data", "index", str(tmp_path), "--out", str(out), "--val-fraction", "0.2"]) == 0
    manifest = json.loads(out.read_text())
    assert sorted(f["path"] for f in manifest["files"]) == [f"../ep{i}.h5" for i in range(5)]
    assert sum(f["split"] == "val" for f in manifest["files"]) == 1
    assert sum(f["frames"] for f in manifest["files"]) == 10 + 11 + 12 + 13 + 14
    assert "5 files checked (4 train, 1 val)" in capsys.readouterr().out


def test_data_index_refuses_bad_files_by_name_and_writes_nothing(tmp_path, capsys):
    _write(tmp_path / "good.h5")
    _write(tmp_path / "nan.h5", fill=np.nan)
    _write(tmp_path / "big.h5", fill=3.0)
    assert main(["data", "index", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: 2 of 3 files refused:"
    assert any(str(tmp_path / "nan.h5") in line and "NaN" in line for line in err)
    assert any(str(tmp_path / "big.h5") in line and "outside [-1, 1]" in line for line in err)
    assert not (tmp_path / "manifest.json").exists()


def test_data_synth_through_the_lwm_command(tmp_path, capsys):
    assert main(["data", "synth", "--out", str(tmp_path / "s"), "--episodes", "4", "--frames", "8"]) == 0
    manifest = json.loads((tmp_path / "s/manifest.json").read_text())
    assert len(manifest["files"]) == 4 and manifest["channels"] == 16
    assert "synthetic episodes" in capsys.readouterr().out


def test_an_error_raised_in_a_loader_worker_prints_its_message_only():
    from torch._utils import ExceptionWrapper

    from lwm.cli import error_lines
    from lwm.data.h5 import DataError

    try:
        raise DataError("/data/ep.h5: 'latents' unreadable at frames 0..3 (boom)")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    try:
        wrapped.reraise()  # what the DataLoader does in the main process
    except DataError as e:
        assert str(e).startswith("Caught DataError") and len(str(e).splitlines()) > 2
        assert error_lines(e) == ["/data/ep.h5: 'latents' unreadable at frames 0..3 (boom)"]
    assert error_lines(DataError("a\nb")) == ["a", "b"]

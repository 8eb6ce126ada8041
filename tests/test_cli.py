import argparse
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from lwm.cli.main import main


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

    from lwm.cli.main import error_lines
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


def test_seeded_streams_differ_for_every_distinct_tuple_and_repeat_for_the_same():
    from lwm.utils.seeds import seeded_generator

    tuples = [(0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 2), (0, 2, 0), (0, 1, 1), (1, 1, 0)]
    draws = [tuple(torch.randint(0, 2**31, (4,), generator=seeded_generator("cpu", *t)).tolist()) for t in tuples]
    assert len(set(draws)) == len(tuples)
    again = torch.randint(0, 2**31, (4,), generator=seeded_generator("cpu", 0, 1, 0)).tolist()
    assert tuple(again) == draws[1]


def test_positive_int_and_first_line():
    from lwm.utils.errors import first_line
    from lwm.utils.args import positive_int

    assert positive_int("1") == 1
    for bad in ("0", "-3", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)
    assert first_line(RuntimeError("\n  first\nsecond\n")) == "first"
    assert first_line(RuntimeError("")) == "RuntimeError"


def test_error_lines_take_the_last_raise_of_a_chained_worker_traceback():
    from lwm.cli.main import error_lines
    from lwm.utils.errors import DataError

    e = DataError("Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
                  "  File ...\nlwm.utils.errors.DataError: inner\n\nDuring handling of the above exception, another "
                  "exception occurred:\n\nTraceback (most recent call last):\n  File ...\n"
                  "lwm.utils.errors.DataError: outer\nsecond line")
    assert error_lines(e) == ["outer", "second line"]


@pytest.mark.slow
def test_a_missing_required_key_is_named_as_its_option(capsys):
    from lwm.cli.main import main

    tiny = str(Path(__file__).parents[1] / "configs/tiny.yaml")
    assert main(["fit", "--config", tiny]) == 2
    errors = capsys.readouterr().err.splitlines()  # jsonargparse's own line, naming the key
    assert len(errors) == 1 and errors[0].startswith("error: ") and "data.manifest" in errors[0], errors


def test_an_os_error_not_about_a_path_keeps_its_traceback(monkeypatch):
    import lwm.cli.plot

    def fail(argv):
        raise OSError(28, "No space left on device")  # no filename: a real failure, not a one-line path error

    monkeypatch.setattr(lwm.cli.plot, "main", fail)
    with pytest.raises(OSError, match="No space left"):
        main(["plot", "x"])


@pytest.mark.parametrize("argv", [
    ["data", "index"],  # a required argument missing
    ["data", "index", "somewhere", "--val-fraction", "abc"],
    ["bogus-verb"],
    ["overfit", "--steps", "0"],
    ["plot"],
    ["demo", "--steps", "x"],
    ["data", "decode", "f.h5", "--out", "x.gif", "--fps", "0"],
    ["data", "decode", "f.h5", "--out", "x.gif", "--fps", "2000"],  # (PyAV fails at some rates above 65536)
    ["generate", "--ckpt_path", "c.ckpt", "--data", "f.h5", "--fps", "1e5"],
    ["data", "synth", "--out", "x", "--episode", "4"],  # a prefix of --episodes: refused, not guessed
])
def test_argument_errors_of_every_verb_are_one_line_without_the_usage_block(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--help` for the options" in errors[0] and "usage:" not in err, err


@pytest.mark.parametrize("option, value, expected", [
    ("--tolerance", "-5", "a number in [0, inf]"),  # -5 blamed every file for values outside [-1, 1]
    ("--tolerance", "nan", "a number in [0, inf]"),  # nan switched the range check off
    ("--tolerance", "inf", "a number in [0, inf]"),
    ("--val-fraction", "-0.1", "a number in [0, 1)"),
    ("--val-fraction", "1.0", "a number in [0, 1)"),
    ("--val-fraction", "1.5", "a number in [0, 1)"),
    ("--seed", "-1", "an integer in [0, inf]"),
])
def test_data_index_refuses_bad_values_before_reading_files(tmp_path, option, value, expected, capsys):
    (tmp_path / "d").mkdir()
    assert main(["data", "index", str(tmp_path / "d"), option, value]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"argument {option}: expected {expected}" in errors[0], errors
    assert not (tmp_path / "d" / "manifest.json").exists()


def test_python_dash_m_lwm_is_the_lwm_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "lwm", "data", "index"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: lwm data index"), done.stderr


def test_help_shows_each_default_once(capsys):
    for argv in (["data", "index", "--help"], ["generate", "--help"], ["codes", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())  # (argparse wraps the lines)
        assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text, argv
        for option in text.split(" --")[1:]:
            assert option.count("(default") <= 1, (argv, option)
    with pytest.raises(SystemExit):
        main(["data", "index", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fraction of files in the val split (default: 0.1)" in text


def test_a_ctrl_c_outside_a_fit_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """A Ctrl-C while `lwm data index` checks files (or a verb loads): Python's traceback, exit 130 by its rule."""
    import lwm.data.manifest

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lwm.data.manifest, "index_directory", interrupted)
    assert main(["data", "index", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["stopped by Ctrl-C (SIGINT)"]


def test_data_index_says_where_the_files_kept_their_split(tmp_path, capsys):
    """A second `lwm data index DIR --val-fraction 0.5` kept every file's split silently: 3 train, 1 val."""
    from tests.lightning.helpers import make_dataset

    manifest = make_dataset(tmp_path / "data", files=4, val_fraction=0.25)  # 3 train, 1 val
    assert main(["data", "index", str(tmp_path / "data"), "--val-fraction", "0.25"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # as asked: nothing to say
    assert main(["data", "index", str(tmp_path / "data"), "--val-fraction", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(3 train, 1 val)" in out[0] and out[1] == (
        "  the files the manifest listed before kept their split (--val-fraction 0.5 would put 2 in val): --resplit "
        "draws every file's again")
    assert main(["data", "index", str(tmp_path / "data"), "--val-fraction", "0.5", "--resplit"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(2 train, 2 val)" in out[0] and len(out) == 1 and manifest.is_file()
    from lwm.data.manifest import val_count

    assert [val_count(0.6, n) for n in (0, 1, 2, 5)] == [0, 0, 1, 3]  # one file: it trains (no "kept" line then)

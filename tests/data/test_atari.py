"""Atari footage through ale-py: true actions from the game's legal set, game id as world label, seeded."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

pytest.importorskip("ale_py")

from lwm.cli.main import main  # noqa: E402
from lwm.data.atari import make_dataset, record  # noqa: E402
from lwm.data.manifest import Manifest  # noqa: E402
from lwm.utils.errors import DataError  # noqa: E402


def test_record_is_seeded_and_plays_the_games_legal_actions():
    video, actions = record("breakout", seed=3, frames=40)
    again, same = record("breakout", seed=3, frames=40)
    other, _ = record("breakout", seed=4, frames=40)
    assert video.shape == (40, 210, 160, 3) and video.dtype == np.uint8
    np.testing.assert_array_equal(video, again)
    np.testing.assert_array_equal(actions, same)
    assert set(actions.tolist()) <= {0, 1, 3, 4}  # breakout's minimal set: NOOP, FIRE, RIGHT, LEFT
    assert len(set(actions.tolist())) > 1 and not np.array_equal(video, other)


def test_actions_are_held_for_a_vae_latent_step():
    _, actions = record("pong", seed=0, frames=40, sticky=0.0, hold=4)  # sticky 0: a fresh draw at every decision
    groups = actions.reshape(10, 4)
    assert (groups == groups[:, :1]).all()  # constant within each group of 4 frames starting at frame 0
    assert len(set(groups[:, 0].tolist())) > 1


def test_lwm_data_atari_writes_labelled_files_and_a_manifest(tmp_path, capsys):
    assert main(["data", "atari", "--games", "pong", "breakout", "--episodes", "2", "--frames", "12",
                 "--out", str(tmp_path / "atari"), "--val-fraction", "0.25"]) == 0
    manifest = Manifest.load(tmp_path / "atari" / "manifest.json")
    assert len(manifest.entries) == 4 and manifest.channels == 16 and manifest.height == 64
    with h5py.File(tmp_path / "atari" / "breakout_001.h5") as f:
        assert f["latents"].shape == (12, 16, 64, 64)
        assert f["actions"].shape == (12,) and f.attrs["world_label"] == 1 and f.attrs["game"] == "breakout"
        assert json.loads(f.attrs["codec"])["name"] == "pixel"
    with h5py.File(tmp_path / "atari" / "pong_000.h5") as f:
        assert f.attrs["world_label"] == 0


def test_bad_atari_arguments(tmp_path, capsys):
    with pytest.raises(DataError, match="unknown game.*notagame"):
        make_dataset(tmp_path, ["pong", "notagame"], episodes=1, frames=4)
    assert main(["data", "atari", "--games", "pong", "--frames", "1", "--out", str(tmp_path / "x")]) == 2
    assert "argument --frames" in capsys.readouterr().err
    assert main(["data", "atari", "--games", "pong", "--val-fraction", "1.5", "--out", str(tmp_path / "y")]) == 2
    assert "argument --val-fraction" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_an_earlier_recording_in_out_is_refused_before_recording(tmp_path, capsys, monkeypatch):
    """A second run into one folder indexed the first run's extra episodes beside its own; `--games pong pong`
    wrote pong_000.h5 twice, the file left with world label 1 of a one-game set."""
    import lwm.data.atari as atari

    out = tmp_path / "a"
    assert main(["data", "atari", "--games", "pong", "--episodes", "2", "--frames", "4", "--out", str(out)]) == 0
    with h5py.File(out / "pong_000.h5") as f:
        assert f.attrs["fps"] == 15.0  # 60 emulator frames per second, 4 per recorded frame
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    monkeypatch.setattr(atari, "record", lambda *a, **k: pytest.fail("recorded before refusing"))
    for argv, message in [
        (["--episodes", "1"], f"{out}: already holds other h5 files (pong_001.h5), which would join the manifest"),
        (["--episodes", "2"], f"{out / 'pong_000.h5'}: exists (--overwrite replaces it, or record into another --out)"),
        (["--episodes", "1", "--games", "pong", "pong"], "--games: pong named twice (each game is one world label)"),
        (["--episodes", "1", "--codec", "wan", "--vae", str(tmp_path / "no_vae")], "already holds other h5 files"),
    ]:
        games = [] if "--games" in argv else ["--games", "pong"]
        assert main(["data", "atari", *games, "--frames", "4", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and message in err[0], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()
    assert main(["data", "atari", "--games", "pong", "--episodes", "2", "--frames", "4", "--out", str(out),
                 "--overwrite", "--seed", "1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "pong_000.h5", "pong_001.h5"]
    assert (out / "pong_000.h5").read_bytes() != before["pong_000.h5"]

"""The synthetic world: deterministic, actions move the agent by the world's speed, worlds differ, and the
written data set passes the h5 checks with its manifest."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from lwm.cli.main import main as lwm
from lwm.data.codecs import PixelCodec
from lwm.data.h5 import DataError, inspect_h5
from lwm.data.manifest import Manifest
from lwm.data.synth import (
    ACTIONS,
    AGENT,
    K,
    MOVES,
    SIZE,
    WORLDS,
    AGENT_COLOUR,
    episode_seed,
    main,
    make_dataset,
    render_episode,
)


def agent_position(frame: np.ndarray) -> tuple[int, int]:
    """The agent's top-left corner ``(y, x)`` in a rendered frame, found by its colour (cyclically, so an agent
    wrapped across an edge is measured where it starts)."""
    mask = (frame == np.array(AGENT_COLOUR, np.uint8)).all(axis=-1)
    pos = []
    for present in (mask.any(axis=1), mask.any(axis=0)):
        starts = np.flatnonzero(present & ~np.roll(present, 1))
        assert len(starts) == 1, f"no single agent in the frame ({len(starts)} runs of agent pixels)"
        pos.append(int(starts[0]))
    return pos[0], pos[1]


def positions(frames: np.ndarray) -> np.ndarray:
    return np.array([agent_position(f) for f in frames])


def test_shapes_and_types():
    frames, actions, label = render_episode(3, 10)
    assert frames.shape == (10, SIZE, SIZE, 3) and frames.dtype == np.uint8
    assert actions.shape == (10,) and actions.dtype == np.int64
    assert set(actions.tolist()) <= set(range(len(ACTIONS)))
    assert isinstance(label, int) and 0 <= label < K


def test_deterministic_under_a_seed():
    a = render_episode(11, 16)
    b = render_episode(11, 16)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert a[2] == b[2]
    c = render_episode(12, 16, world=a[2])
    assert not np.array_equal(a[0], c[0])
    assert episode_seed(0, 1) != episode_seed(0, 2) != episode_seed(1, 1)


def test_agent_colour_is_unique():
    frames, _, _ = render_episode(5, 20)
    white = (frames == 255).all(axis=-1).sum(axis=(1, 2))
    assert (white == AGENT * AGENT).all()  # the whole square, always on top, and nothing else pure white


@pytest.mark.parametrize("world", range(K))
def test_actions_move_the_agent_by_the_world_speed(world):
    w = WORLDS[world]
    moved = stayed = 0
    for seed in range(6):
        frames, actions, label = render_episode(seed, 40, world=world)
        assert label == world
        pos = positions(frames)
        for t in range(len(frames) - 1):
            expected = pos[t] + w.speed * MOVES[actions[t]]
            if w.wrap:
                expected %= SIZE
            else:  # walls: the policy never pushes into them
                assert (0 <= expected).all() and (expected <= SIZE - AGENT).all()
            np.testing.assert_array_equal(pos[t + 1], expected, err_msg=f"seed {seed} t {t} action {ACTIONS[actions[t]]}")
            moved += actions[t] != 0
            stayed += actions[t] == 0
    assert moved > 20 and stayed > 5  # both kinds of step were checked


def test_wrapping_worlds_wrap():
    """In a wrapping world the agent crosses an edge at some point (checked over a few long episodes)."""
    crossed = False
    for seed in range(10):
        frames, actions, _ = render_episode(seed, 64, world=3)
        pos = positions(frames)
        crossed |= bool((np.abs(np.diff(pos, axis=0)) > WORLDS[3].speed).any())
    assert crossed


@pytest.mark.slow
def test_sticky_policy():
    _, actions, _ = render_episode(0, 2000, world=2)  # a wrapping world: no move is ever redrawn
    repeats = (actions[1:] == actions[:-1]).mean()
    assert 0.7 < repeats < 0.82  # 0.7 + 0.3 / 5
    assert np.bincount(actions, minlength=5).min() > 200


def test_worlds_change_motion_and_background():
    seed = 4
    episodes = [render_episode(seed, 24, world=w) for w in range(K)]
    # the same seed: the same start, distractors and policy draws, but other backgrounds
    for i in range(K):
        for j in range(i + 1, K):
            assert not np.array_equal(episodes[i][0][0], episodes[j][0][0])
    # the two wrapping worlds take the same actions at different speeds
    (f_slow, a_slow, _), (f_fast, a_fast, _) = episodes[2], episodes[3]
    np.testing.assert_array_equal(a_slow, a_fast)
    assert WORLDS[2].speed != WORLDS[3].speed and WORLDS[2].wrap and WORLDS[3].wrap
    p_slow, p_fast = positions(f_slow), positions(f_fast)
    np.testing.assert_array_equal(p_slow[0], p_fast[0])
    assert (a_slow[:-1] != 0).any() and not np.array_equal(p_slow, p_fast)


def test_look_alike_worlds_share_the_first_frame_and_differ_in_motion():
    episodes = [render_episode(4, 24, world=w, look_alike=True) for w in range(K)]
    for frames, _, _ in episodes[1:]:  # the same start on the same background: one frame does not tell the world
        np.testing.assert_array_equal(frames[0], episodes[0][0][0])
    (f_slow, a_slow, _), (f_fast, a_fast, _) = episodes[2], episodes[3]
    np.testing.assert_array_equal(a_slow, a_fast)
    assert not np.array_equal(positions(f_slow), positions(f_fast))  # the speeds differ


@pytest.mark.parametrize("option, value, expected", [
    ("--episodes", "0", "an integer in [1, inf]"),
    ("--frames", "1", "an integer in [2, inf]"),
    ("--val-fraction", "1.0", "a number in [0, 1)"),
    ("--distractors", "9", "an integer in [0, 4]"),
    ("--size", "40", "an integer in [16, inf], a multiple of 16"),
    ("--worlds", "0", "an integer in [1, "),
    ("--seed", "-1", "an integer in [0, inf]"),
])
def test_bad_arguments_are_refused_before_the_folder_is_made(tmp_path, capsys, option, value, expected):
    out = tmp_path / "out"
    assert lwm(["data", "synth", "--out", str(out), "--episodes", "2", "--frames", "4", "--size", "32",
                option, value]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and f"argument {option}: expected {expected}" in errors[0], errors
    assert not out.exists()  # nothing rendered or written, no empty folder left behind


def test_make_dataset(tmp_path):
    out = tmp_path / "synth"
    manifest_path = make_dataset(out, episodes=8, frames=6, seed=1, val_fraction=0.25)
    manifest = Manifest.load(manifest_path)
    assert manifest_path == out / "manifest.json"
    assert (manifest.channels, manifest.height, manifest.width) == (16, 64, 64)
    assert len(manifest.entries) == 8 and len(manifest.split("val")) == 2 and len(manifest.split("train")) == 6
    labels = []
    for i in range(8):
        path = out / f"ep_{i:04d}.h5"
        info = inspect_h5(path, channels=16, height=64, width=64)
        assert info.frames == 6 and info.has_actions and info.world_label == i % K
        labels.append(info.world_label)
        with h5py.File(path, "r") as f:
            latents = f["latents"][...]
            assert latents.dtype == np.float16 and -1 <= latents.min() and latents.max() <= 1
            assert f["actions"].shape == (6,) and f["actions"].dtype == np.int64
            assert json.loads(f.attrs["codec"]) == json.loads(PixelCodec().attr)
            frames, actions, label = render_episode(episode_seed(1, i), 6, world=i % K)
            np.testing.assert_array_equal(f["actions"][...], actions)
            np.testing.assert_array_equal(PixelCodec().decode(latents), frames)  # float16 keeps uint8 pixels exactly
    assert sorted(labels) == [0, 0, 1, 1, 2, 2, 3, 3]
    # rewriting into the same folder is fine; other h5 files there are refused
    make_dataset(out, episodes=8, frames=6, seed=1, val_fraction=0.25)
    (out / "other.h5").write_bytes(b"")
    with pytest.raises(DataError, match="other.h5"):
        make_dataset(out, episodes=8, frames=6, seed=1)


def test_main(tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["--out", str(out), "--episodes", "5", "--frames", "4", "--seed", "2", "--val-fraction", "0.2"]) == 0
    printed = capsys.readouterr().out.strip()
    assert "\n" not in printed and str(out / "manifest.json") in printed
    manifest = Manifest.load(out / "manifest.json")
    assert len(manifest.split("train")) == 4 and len(manifest.split("val")) == 1
    assert all(e.frames == 4 for e in manifest.entries)


@pytest.mark.parametrize("size", [64, 32])
def test_smaller_sizes_scale_every_length(size, tmp_path):
    from lwm.data.synth import scaled

    for world in range(K):
        frames, actions, _ = render_episode(7, 30, world=world, size=size, distractors=0)
        assert frames.shape == (30, size, size, 3)
        side = scaled(AGENT, size)
        assert ((frames == 255).all(axis=-1).sum(axis=(1, 2)) == side * side).all()
        pos, speed = positions(frames), scaled(WORLDS[world].speed, size)
        expected = pos[:-1] + speed * MOVES[actions[:-1]]
        np.testing.assert_array_equal(pos[1:], expected % size if WORLDS[world].wrap else expected)
        colours = {tuple(c) for c in frames.reshape(-1, 3)}
        assert len(colours) == len({tuple(c) for c in WORLDS[world].colours}) + 1  # background + agent: no discs
    manifest = Manifest.load(make_dataset(tmp_path, episodes=2, frames=4, size=size, distractors=1))
    assert (manifest.channels, manifest.height, manifest.width) == (16, size // 2, size // 2)


def test_an_agent_at_a_wall_may_stay_or_move_along_it():
    from lwm.data.synth import AGENT, SIZE, WORLDS, blocked

    walls = WORLDS[0]
    edge = SIZE - AGENT  # the bottom-right corner where the agent may stand
    pos = np.array([edge, edge])
    assert not blocked(pos, 0, walls)  # stay
    assert not blocked(pos, 1, walls) and not blocked(pos, 3, walls)  # up, left: away from the walls
    assert blocked(pos, 2, walls) and blocked(pos, 4, walls)  # down, right: into them


def test_distractors_bounce_off_the_edges_keeping_their_speed():
    from lwm.data.synth import DISTRACTOR_RADIUS, SIZE, simulate

    hi = SIZE - 2 * DISTRACTOR_RADIUS
    for seed in range(3):
        *_, discs, _ = simulate(seed, 300)
        for d in range(discs.shape[0]):
            for axis in range(2):
                p = discs[d, :, axis]
                steps = np.abs(np.diff(p))
                speed = np.bincount(steps).argmax()
                travelled = np.minimum.reduce([  # straight on, or reflected off the top/bottom edge
                    np.where(steps == speed, speed, 10**6),
                    np.where(2 * hi - p[:-1] - p[1:] == speed, speed, 10**6),
                    np.where(p[:-1] + p[1:] == speed, speed, 10**6),
                ])
                assert (travelled == speed).all(), (seed, d, axis)
                assert (np.diff(np.sign(np.diff(p))) != 0).any()  # it did bounce in these 300 frames


def _contents(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_other_settings_over_an_earlier_synth_are_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "s"
    assert lwm(["data", "synth", "--out", str(out), "--episodes", "4", "--frames", "6", "--size", "32"]) == 0
    assert lwm(["data", "synth", "--out", str(out), "--episodes", "4", "--frames", "6", "--size", "32"]) == 0  # the same: fine
    before = _contents(out)  # (the manifest records the files' modification times: the second run's)
    capsys.readouterr()
    for other in (["--frames", "8", "--size", "32"], ["--frames", "6", "--size", "64"], ["--frames", "6", "--size",
                                                                                           "32", "--seed", "3"]):
        assert lwm(["data", "synth", "--out", str(out), "--episodes", "4", *other]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {out / 'ep_0000.h5'}: exists, made with "), err
        assert "--overwrite replaces it" in err[0]
        assert _contents(out) == before  # nothing written
    assert lwm(["data", "synth", "--out", str(out), "--episodes", "4", "--frames", "8", "--size", "32", "--overwrite"]) == 0
    assert all(e.frames == 8 for e in Manifest.load(out / "manifest.json").entries)


def test_files_without_a_settings_record_or_a_lone_manifest_are_not_replaced(tmp_path):
    out = tmp_path / "s"
    make_dataset(out, episodes=2, frames=4, size=32)
    with h5py.File(out / "ep_0000.h5", "a") as f:  # anyone else's, even of this shape
        del f.attrs["synth"]
    with pytest.raises(DataError, match="ep_0000.h5: exists, made with no record of its settings"):
        make_dataset(out, episodes=2, frames=4, size=32)
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "manifest.json").write_text("{}")
    with pytest.raises(DataError, match="manifest.json: exists; --overwrite replaces it"):
        make_dataset(lone, episodes=2, frames=4, size=32)
    assert (lone / "manifest.json").read_text() == "{}" and not list(lone.glob("*.h5"))

"""`lwm generate` from a trained tiny checkpoint: video + latents written, seeded, exact on its first step,
bad indices refused with one line, default names that tell settings apart, earlier outputs kept unless
--overwrite, a ground truth the file has only part of shown as far as it goes."""

from __future__ import annotations

import json

import h5py
import imageio.v3 as iio
import numpy as np
import pytest
import torch

from lwm.cli.main import main
from lwm.training.module import WorldModelModule
from tests.lightning.helpers import make_dataset, run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    manifest = make_dataset(tmp / "data", files=5)
    assert run(manifest, tmp / "run", "--trainer.max_steps=3", "--data.val_size_percent=0",
               "--checkpoint.every_n_train_steps=2") == 0  # step=0000002.ckpt, and last.ckpt at step 3
    return tmp, tmp / "run/checkpoints/last.ckpt", tmp / "data/ep00.h5"


def _generate(ckpt, data, out, *extra) -> np.ndarray:
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--out", str(out), *extra]) == 0
    with h5py.File(f"{out}.h5") as f:
        return f["latents"][...]


@pytest.mark.slow
def test_video_and_latents_are_written_and_seeded(trained):
    tmp, ckpt, data = trained
    a = _generate(ckpt, data, tmp / "a.gif", "--steps", "5", "--rollouts", "2", "--actions", "random")
    assert a.shape == (2, 6, 4, 16, 16)
    video = iio.imread(tmp / "a.gif", index=None)
    assert video.shape[0] == 6 and video.shape[-1] == 3
    b = _generate(ckpt, data, tmp / "b.gif", "--steps", "5", "--rollouts", "2", "--actions", "random")
    c = _generate(ckpt, data, tmp / "c.gif", "--steps", "5", "--rollouts", "2", "--actions", "random", "--seed", "1")
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    d = _generate(ckpt, data, tmp / "d.mp4", "--steps", "3", "--rollouts", "1")  # actions from codes.pt
    assert d.shape == (1, 4, 4, 16, 16) and (tmp / "d.mp4").stat().st_size > 0


def test_inferred_actions_reproduce_teacher_forcing_on_the_first_step(trained):
    tmp, ckpt, data = trained
    gen = _generate(ckpt, data, tmp / "tf.gif", "--steps", "4", "--rollouts", "1", "--actions", "inferred",
                    "--context", "2")
    model = WorldModelModule.load_from_checkpoint(ckpt, weights_only=True).model.eval()
    with h5py.File(data) as f:
        clip = torch.from_numpy(f["latents"][0:6])[None]
    with torch.no_grad():
        a, h = model.encode_actions(clip).quantized, model.encode_world(clip).quantized
        tf = model.predict(clip[:, :2], a[:, :2], h)[:, -1]  # frame 2 from the true frames 0, 1
    assert np.allclose(gen[0, :2], clip[0, :2].numpy())  # the context is the ground truth
    assert np.allclose(gen[0, 2], tf[0].numpy(), atol=1e-5)


@pytest.mark.parametrize(("extra", "message"), [
    (["--action-indices", "[[9, 0], [0, 0], [0, 0]]"], "--action-indices: expected shape [transitions, 2] of codes "
                                                       "0..k-1 of each level's codebook size k ([4, 8]), got [[9, 0]"),
    (["--action-indices", "[[0], [0], [0]]"], "--action-indices: expected shape [transitions, 2]"),
    (["--world-indices", "[0, 99]"], "--world-indices: expected shape [2] of codes 0..k-1 of each level's codebook "
                                     "size k ([4, 8]), got [0, 99]"),
    (["--world-indices", "[0.7, 1.9]"], "--world-indices: not a JSON list of integers"),
    (["--world-indices", "[true, 1]"], "--world-indices: not a JSON list of integers"),
    (["--world-indices", "[[0, 1]]"], "--world-indices: expected shape [2] "),
    (["--action-indices", "[[0, 1], [0]]"], "--action-indices: not a JSON list of integer code tuples"),
    (["--action-indices", "[[0, 0], [0, 0]]"],
     "--action-indices: 3 transitions needed (1 frame of context, 3 steps), got 2"),
    (["--codes", "/nope/codes.pt"], "code dictionary not found"),
    (["--actions", "random", "--world", "dictionary", "--codes", "DATA"],
     "ep00.h5: not a code dictionary of `lwm codes`"),
    (["--codes", "CKPT"], "last.ckpt: not a code dictionary of `lwm codes`"),
    (["--start", "50"], "14 frames, but the request reads frame 50"),
    (["--seed", "-1"], "argument --seed: expected an integer in [0, "),  # (not a traceback after the load)
    (["--start", "12", "--actions", "inferred"], "14 frames, but the request reads frames 12 to 15"),
])
def test_bad_generation_requests_are_one_error_line(trained, capsys, monkeypatch, extra, message):
    """Each refused in one line before the codec is built (a VAE: seconds and GPU memory before the refusal)."""
    tmp, ckpt, data = trained
    built = _no_codec_built(monkeypatch)
    extra = [{"DATA": str(data), "CKPT": str(ckpt)}.get(a, a) for a in extra]
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--steps", "3",
                 "--out", str(tmp / "bad.gif"), *extra]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert built == [] and not (tmp / "bad.gif.h5").exists()


def _no_codec_built(monkeypatch) -> list:
    """Record each codec built by `lwm generate` (none here: a stand-in that shows latent channels)."""
    import lwm.inference.generation as gen

    built = []
    monkeypatch.setattr(gen, "codec_from_attr", lambda *args: built.append(args))
    return built


@pytest.mark.parametrize(("extra", "message"), [
    (["--world-indices", "[0.7, 1.9]"], "--world-indices: not a JSON list of integers, one per RVQ level: [0.7, 1.9]"),
    (["--world-indices", "[true, 1]"], "--world-indices: not a JSON list of integers, one per RVQ level: [true, 1]"),
    (["--action-indices", "[[0, 1], [0]]"], "--action-indices: not a JSON list of integer code tuples: [[0, 1], [0]] "
                                            "(setting an array element with a sequence"),  # ragged
    (["--action-indices", "[[0, 1],"], "--action-indices: not a JSON list of integer code tuples: [[0, 1], "
                                       "(Expecting value"),
])
def test_index_json_that_is_not_integers_is_refused_before_the_checkpoint_is_loaded(trained, capsys, monkeypatch,
                                                                                   extra, message):
    tmp, ckpt, data = trained
    _no_checkpoint_loaded(monkeypatch)
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--out", str(tmp / "j.gif"), *extra]) == 2
    errors = _error_lines(capsys)
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.slow
def test_dictionary_actions_do_not_depend_on_where_the_world_comes_from(trained, tmp_path, monkeypatch):
    """With --world dictionary the world's draws came first from the actions' generator: the same --seed drew
    other actions than with --world inferred. The world and the actions draw from streams of their own."""
    from lwm.inference.dictionary import CodeDictionary, save_dictionaries

    tmp, ckpt, data = trained
    every = CodeDictionary((4, 8))  # every tuple once: draws that tell the streams apart
    every.update(torch.cartesian_prod(torch.arange(4), torch.arange(8)))
    codes = save_dictionaries(tmp_path / "every.pt", {"Action_Encoder": every, "World_Encoder": every}, windows=32,
                              global_step=3)
    draws = []
    sample = CodeDictionary.sample

    def spy(self, shape, by="frequency", generator=None):
        drawn = sample(self, shape, by, generator)
        draws[-1]["actions" if len(shape) == 2 else "world"] = drawn
        return drawn

    monkeypatch.setattr(CodeDictionary, "sample", spy)

    def drawn(world, actions="dictionary", seed=0):
        draws.append({})
        _generate(ckpt, data, tmp_path / "d.gif", "--steps", "4", "--rollouts", "3", "--codes", str(codes),
                  "--world", world, "--actions", actions, "--seed", str(seed), "--overwrite")
        return draws[-1]

    inferred, dictionary, other_seed = drawn("inferred"), drawn("dictionary"), drawn("inferred", seed=1)
    assert inferred["actions"].shape == (3, 4, 2) and dictionary["world"].shape == (3, 2)
    assert torch.equal(inferred["actions"], dictionary["actions"])
    assert not torch.equal(inferred["actions"], other_seed["actions"])
    assert torch.equal(drawn("dictionary", actions="random")["world"], dictionary["world"])  # a function of --seed
    assert not torch.equal(drawn("dictionary", seed=1)["world"], dictionary["world"])


def test_a_code_dictionary_of_another_model_is_refused_by_name(trained, capsys):
    from lwm.inference.dictionary import CodeDictionary, save_dictionaries

    tmp, ckpt, data = trained
    other = tmp / "other_codes.pt"
    d = CodeDictionary((5, 5))
    d.update(torch.tensor([[1, 2]]))
    save_dictionaries(other, {"Action_Encoder": d, "World_Encoder": d}, windows=1)
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--steps", "3", "--codes", str(other),
                 "--out", str(tmp / "other.gif")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "other_codes.pt: Action_Encoder codebook sizes [5, 5]" in errors[0], errors


@pytest.mark.slow
def test_a_code_dictionary_of_another_step_is_used_with_a_warning(trained, capsys):
    import shutil

    from lwm.inference.dictionary import dictionaries_step, load_dictionaries, save_dictionaries

    tmp, ckpt, data = trained
    codes = ckpt.parent / "codes.pt"
    assert dictionaries_step(codes) == torch.load(ckpt, weights_only=True)["global_step"] == 3  # written at fit end
    capsys.readouterr()
    _generate(ckpt, data, tmp / "same_step.gif", "--steps", "2")
    assert "warning" not in capsys.readouterr().err
    stale = tmp / "stale_codes.pt"
    shutil.copy(codes, stale)
    save_dictionaries(stale, load_dictionaries(codes), windows=1, global_step=1)
    _generate(ckpt, data, tmp / "stale.gif", "--steps", "2", "--codes", str(stale))
    assert f"warning: {stale} was made by the encoders of step 1, the checkpoint is at step 3" in capsys.readouterr().err


def test_an_unknown_video_suffix_is_refused_before_any_work(trained, capsys):
    tmp, ckpt, data = trained
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--out", str(tmp / "x.avi")]) == 2
    errors = _error_lines(capsys)  # one line, no usage block
    assert len(errors) == 1 and "x.avi: the video must end in one of .mp4, .gif" in errors[0], errors
    assert not (tmp / "x.avi.h5").exists()


@pytest.mark.slow
def test_the_inferred_world_does_not_depend_on_the_number_of_steps(trained):
    """The world code is inferred from the training window's length of frames, however many are generated: the
    first frames of a short and a long rollout with the same actions are the same."""
    tmp, ckpt, data = trained
    actions = "[" + ", ".join(["[1, 2]"] * 8) + "]"
    short = _generate(ckpt, data, tmp / "w3.gif", "--steps", "3", "--rollouts", "1", "--action-indices", actions)
    long = _generate(ckpt, data, tmp / "w8.gif", "--steps", "8", "--rollouts", "1", "--action-indices", actions)
    assert np.allclose(short[0], long[0, :4], atol=1e-6)


def test_a_world_inferred_from_fewer_frames_than_training_says_so(trained, capsys):
    tmp, ckpt, data = trained  # trained on 6-frame windows
    with h5py.File(data) as f:
        frames = f["latents"].shape[0]
    capsys.readouterr()
    _generate(ckpt, data, tmp / "few.gif", "--start", str(frames - 3), "--steps", "2", "--rollouts", "1",
              "--actions", "random")
    assert "warning: --world inferred from 3 frames" in capsys.readouterr().err
    _generate(ckpt, data, tmp / "all.gif", "--steps", "2", "--rollouts", "1", "--actions", "random")
    assert "--world inferred from" not in capsys.readouterr().err


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("kind", ["text", "foreign", "deepspeed", "folder"])
def test_a_bad_checkpoint_is_one_error_line(trained, tmp_path, capsys, kind):
    tmp, ckpt, data = trained
    bad = tmp_path / "bad.ckpt"
    if kind == "text":
        bad.write_text("not a checkpoint")
    elif kind == "foreign":
        torch.save({"a": 1}, bad)
    elif kind == "deepspeed":  # what a DeepSpeed checkpoint is: a folder of the ranks' shards
        (bad / "checkpoint").mkdir(parents=True)
        (bad / "latest").write_text("checkpoint")
    else:
        bad.mkdir()
    for argv in (["generate", "--ckpt_path", str(bad), "--data", str(data), "--out", str(tmp_path / "x.gif")],
                 ["codes", "--ckpt_path", str(bad), "--config", str(tmp / "run/config.yaml")]):
        assert main(argv) == 2
        errors = _error_lines(capsys)
        expected = {"deepspeed": "a DeepSpeed checkpoint directory", "folder": "a folder without a checkpoint"}.get(
            kind, "not a readable lwm checkpoint")
        assert len(errors) == 1 and f"{bad}: {expected}" in errors[0], errors
    assert not (tmp_path / "x.gif.h5").exists()


def test_a_bad_code_dictionary_file_and_window_are_refused(trained, tmp_path, capsys):
    tmp, ckpt, data = trained
    garbage = tmp_path / "codes.pt"
    garbage.write_text("no")
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--codes", str(garbage),
                 "--out", str(tmp_path / "x.gif")]) == 2
    errors = _error_lines(capsys)
    assert len(errors) == 1 and f"{garbage}: not a code dictionary of `lwm codes`" in errors[0], errors
    for window in ("0", "-3"):
        assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--window", window]) == 2
        errors = _error_lines(capsys)
        assert len(errors) == 1 and f"argument --window: expected an integer in [1, inf], got '{window}'" in errors[0]
    assert main(["codes", "--ckpt_path", str(ckpt), "--config", str(tmp / "run/config.yaml"), "--max-windows", "0"]) == 2
    assert "argument --max-windows" in _error_lines(capsys)[0]


@pytest.mark.slow
def test_lwm_codes_from_the_run_config_writes_each_checkpoint_its_own_dictionary(trained, capsys):
    """The command the step-mismatch warning suggests works on the fit's own config.yaml; a step checkpoint's
    dictionary goes beside it under its name (codes.pt stays last.ckpt's), and generate finds it."""
    from lwm.inference.dictionary import dictionaries_step

    tmp, ckpt, data = trained
    step2 = ckpt.parent / "step=0000002.ckpt"
    codes = ckpt.parent / "codes.pt"
    before = codes.read_bytes()
    assert main(["codes", "--config", str(tmp / "run/config.yaml"), "--ckpt_path", str(step2)]) == 0
    assert codes.read_bytes() == before and dictionaries_step(codes) == 3
    assert dictionaries_step(ckpt.parent / "step=0000002.codes.pt") == 2
    capsys.readouterr()
    _generate(step2, data, tmp / "step2.gif", "--steps", "2")
    assert "warning" not in capsys.readouterr().err  # its own dictionary, not codes.pt (step 3)
    assert main(["overfit", "--config", str(tmp / "run/config.yaml"), "--ckpt_path", str(ckpt)]) == 2
    assert "--ckpt_path: this command does not take one" in _error_lines(capsys)[0]


def test_the_context_transitions_keep_their_inferred_actions(trained):
    """With several context frames and drawn actions, the transitions between context frames get the actions
    inferred from them; the draws start at the first generated frame."""
    from lwm.utils.metrics import random_codes

    tmp, ckpt, data = trained
    gen = _generate(ckpt, data, tmp / "ctx.gif", "--steps", "3", "--rollouts", "1", "--actions", "random",
                    "--context", "3", "--seed", "4")
    model = WorldModelModule.load_from_checkpoint(ckpt, weights_only=True).model.eval()
    with h5py.File(data) as f:
        clip = torch.from_numpy(f["latents"][0:6])[None]
    with torch.no_grad():
        seen = model.encode_actions(clip[:, :3]).quantized  # a_0, a_1 from frames 0..2
        drawn = random_codes(model.quantizers["Action_Encoder"], (1, 3), torch.Generator().manual_seed(4))
        world = model.encode_world(clip).quantized  # the training window: 6 frames
        expected = model.generate(clip[:, :3], torch.cat([seen, drawn], dim=1), world, 3, window=5)
    assert np.allclose(gen[0, 3:], expected[0].numpy(), atol=1e-5)


@pytest.mark.slow
def test_positions_past_the_trained_range_are_warned_about(trained, capsys):
    tmp, ckpt, data = trained  # window 6, max_time_offset 32: training fed positions up to 32 + 6 - 2 = 36
    capsys.readouterr()
    _generate(ckpt, data, tmp / "p37.gif", "--steps", "37", "--rollouts", "1", "--actions", "random")
    assert "warning" not in capsys.readouterr().err  # the last frame fed sits at position 36
    _generate(ckpt, data, tmp / "p38.gif", "--steps", "38", "--rollouts", "1", "--actions", "random")
    assert "the rollout feeds temporal positions up to 37; training saw up to 36" in capsys.readouterr().err


def test_inferred_actions_of_a_rollout_longer_than_the_window_are_read_window_by_window(trained, monkeypatch):
    """9 frames from a model trained on windows of 6: the actions are read with encode_actions(window=6) (its own
    test shows what that computes), and the rollout is the model's with them."""
    from lwm.modules.world_model import WorldModel

    tmp, ckpt, data = trained
    windows = []
    encode = WorldModel.encode_actions

    def spy(self, x, t0=0, window=None):
        windows.append((x.shape[1], window))
        return encode(self, x, t0, window)

    monkeypatch.setattr(WorldModel, "encode_actions", spy)
    gen = _generate(ckpt, data, tmp / "long.gif", "--steps", "8", "--rollouts", "1", "--actions", "inferred")
    assert windows == [(9, 6)]
    model = WorldModelModule.load_from_checkpoint(ckpt, weights_only=True).model.eval()
    with h5py.File(data) as f:
        clip = torch.from_numpy(f["latents"][0:9])[None]
    with torch.no_grad():
        actions = encode(model, clip, window=6).quantized
        world = model.encode_world(clip[:, :6]).quantized
        expected = model.generate(clip[:, :1], actions, world, 8, window=5)
    assert np.allclose(gen[0, 1:], expected[0].numpy(), atol=1e-5)


def test_generate_draws_actions_with_the_sampling_asked_for(trained, monkeypatch):
    from lwm.inference.dictionary import CodeDictionary

    tmp, ckpt, data = trained
    seen = []
    sample = CodeDictionary.sample

    def spy(self, shape, by="frequency", generator=None):
        seen.append(by)
        return sample(self, shape, by, generator)

    monkeypatch.setattr(CodeDictionary, "sample", spy)
    _generate(ckpt, data, tmp / "uni.gif", "--steps", "2", "--rollouts", "1", "--sampling", "uniform")
    assert seen == ["uniform"]
    _generate(ckpt, data, tmp / "uni_world.gif", "--steps", "2", "--rollouts", "2", "--sampling", "uniform",
              "--world", "dictionary")
    assert seen == ["uniform"] * 3  # the world's draw too


@pytest.mark.parametrize("steps", ["1", "3"])
def test_rollout_0_of_three_draws_from_the_dictionaries_what_a_rollout_of_one_draws(trained, tmp_path, steps):
    from lwm.inference.dictionary import CodeDictionary, save_dictionaries

    tmp, ckpt, data = trained
    every = CodeDictionary((4, 8))  # every tuple once: draws that tell random streams apart
    every.update(torch.cartesian_prod(torch.arange(4), torch.arange(8)))
    codes = save_dictionaries(tmp_path / "every.pt", {"Action_Encoder": every, "World_Encoder": every}, windows=32,
                              global_step=3)
    common = ["--steps", steps, "--actions", "dictionary", "--world", "dictionary", "--seed", "5", "--codes", str(codes)]
    _generate(ckpt, data, tmp_path / "one.gif", "--rollouts", "1", *common)
    _generate(ckpt, data, tmp_path / "three.gif", "--rollouts", "3", *common)
    with h5py.File(tmp_path / "one.gif.h5") as one, h5py.File(tmp_path / "three.gif.h5") as three:
        for key in ("action_indices", "world_indices"):
            assert np.array_equal(one[key][0], three[key][0]), key


def test_a_context_longer_than_the_window_reads_its_actions_window_by_window_and_the_world_from_all_of_it(
        trained, monkeypatch):
    from lwm.modules.world_model import WorldModel

    tmp, ckpt, data = trained  # trained on 6-frame windows; 14 frames in the file
    calls, encode_actions, encode_world = [], WorldModel.encode_actions, WorldModel.encode_world
    monkeypatch.setattr(WorldModel, "encode_actions", lambda self, x, t0=0, window=None: (
        calls.append(("actions", x.shape[1], window)) or encode_actions(self, x, t0, window)))
    monkeypatch.setattr(WorldModel, "encode_world", lambda self, x, t0=0: (
        calls.append(("world", x.shape[1])) or encode_world(self, x, t0)))
    _generate(ckpt, data, tmp / "ctx8.gif", "--context", "8", "--steps", "2", "--rollouts", "1", "--actions", "random")
    assert calls == [("world", 8), ("actions", 8, 6)]


def test_an_empty_code_dictionary_is_one_error_line(trained, tmp_path, capsys):
    from lwm.inference.dictionary import CodeDictionary, save_dictionaries

    tmp, ckpt, data = trained
    empty = save_dictionaries(tmp_path / "empty.pt", {"Action_Encoder": CodeDictionary((4, 8)),
                                                      "World_Encoder": CodeDictionary((4, 8))}, windows=0, global_step=3)
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--codes", str(empty),
                 "--out", str(tmp_path / "e.gif")]) == 2
    errors = _error_lines(capsys)
    assert len(errors) == 1 and errors[0].startswith(f"error: {empty}: the Action_Encoder dictionary is empty")


def test_a_step_checkpoint_without_its_own_dictionary_takes_the_end_of_fits_with_a_warning(trained, tmp_path, capsys):
    import shutil

    tmp, ckpt, data = trained
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    step2 = shutil.copy(ckpt.parent / "step=0000002.ckpt", folder)
    shutil.copy(ckpt.parent / "codes.pt", folder)  # last.ckpt's (step 3); no step=0000002.codes.pt here
    capsys.readouterr()
    _generate(step2, data, tmp_path / "s2.gif", "--steps", "2", "--rollouts", "1")
    assert f"{folder / 'codes.pt'} was made by the encoders of step 3, the checkpoint is at step 2" in (
        capsys.readouterr().err)


def test_generate_puts_the_ground_truth_on_top(trained, monkeypatch):
    import lwm.inference.generation as gen
    from lwm.utils.video import latent_preview

    tmp, ckpt, data = trained
    grids = []
    monkeypatch.setattr(gen, "write_video", lambda path, frames, fps: grids.append(frames))
    _generate(ckpt, data, tmp / "gt.gif", "--steps", "3", "--rollouts", "2", "--actions", "random")
    with h5py.File(data) as f:
        gt = latent_preview(torch.from_numpy(f["latents"][0:4]).float())
    H = gt.shape[1]
    assert grids[0].shape[1] == 3 * H + 2 * 4 and np.array_equal(grids[0][:, :H], gt)


def test_generate_uses_the_first_transitions_of_longer_action_indices(trained):
    tmp, ckpt, data = trained
    exact = _generate(ckpt, data, tmp / "i3.gif", "--steps", "3", "--rollouts", "1",
                      "--action-indices", "[[0, 0], [1, 2], [3, 4]]")
    longer = _generate(ckpt, data, tmp / "i5.gif", "--steps", "3", "--rollouts", "1",
                       "--action-indices", "[[0, 0], [1, 2], [3, 4], [2, 7], [3, 1]]")
    assert np.array_equal(exact, longer)
    with h5py.File(tmp / "i5.gif.h5") as f:  # the transitions played, not all of those given
        assert f["action_indices"][...].tolist() == [[[0, 0], [1, 2], [3, 4]]]


def test_more_action_indices_than_the_rollout_plays_are_said_in_a_warning(trained, capsys):
    tmp, ckpt, data = trained
    _generate(ckpt, data, tmp / "w5.gif", "--steps", "3", "--rollouts", "1",
              "--action-indices", "[[0, 0], [1, 2], [3, 4], [2, 7], [3, 1]]")
    assert ("warning: --action-indices: 5 transitions given, the rollout plays the first 3 (1 frame of context, 3 "
            "steps); --steps 5 plays them all") in capsys.readouterr().err


@pytest.mark.parametrize("codec", [None, "unknown", "wan"])
def test_a_vae_folder_that_is_not_one_or_not_used_is_refused_before_any_output(trained, tmp_path, capsys, codec):
    """`--vae /missing/folder` went unnoticed where the file's codec takes no VAE (none, one lwm does not know, the
    pixel codec: tests/data/test_convert.py); given for a VAE
    file, a folder without one is refused as by `lwm data encode`. Nothing is written."""
    import shutil

    tmp, ckpt, data = trained
    copy = tmp_path / "ep.h5"
    shutil.copy(data, copy)
    specs = {"unknown": {"name": "cosmos"}, "wan": {"name": "wan", "size": 128, "frames_per_latent": 4,
                                                             "shift": [0.0] * 4, "scale": [1.0] * 4}}
    if codec == "wan":
        pytest.importorskip("diffusers")
    if codec is not None:
        with h5py.File(copy, "a") as f:
            f.attrs["codec"] = json.dumps(specs[codec])
    out = tmp_path / "x.gif"
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(copy), "--out", str(out), "--steps", "2",
                 "--vae", str(tmp_path / "missing")]) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"error: --vae {tmp_path / 'missing'}: ")
    assert ("cannot load the AutoencoderKLWan" if codec == "wan" else f"{copy} is not encoded with a VAE") in lines[0]
    assert not out.exists() and not (tmp_path / "x.gif.h5").exists()


def test_the_output_line_says_what_the_latents_file_beside_the_video_is_for(trained, tmp_path, capsys):
    tmp, ckpt, data = trained
    out = tmp_path / "o.gif"
    _generate(ckpt, data, out, "--steps", "2", "--rollouts", "1", "--actions", "random")
    line = capsys.readouterr().out.strip().splitlines()[-1]
    size = (tmp_path / "o.gif.h5").stat().st_size / 1e6
    assert line.startswith(f"wrote {out} (") and line.endswith(
        f"and {out}.h5 ({size:.3g} MB: the rollouts' latents and the codes each played, which --action-indices and "
        f"--world-indices take back to play it again)")


def test_generate_reads_its_context_at_start(trained):
    tmp, ckpt, data = trained
    out = _generate(ckpt, data, tmp / "s3.gif", "--start", "3", "--context", "2", "--steps", "2", "--rollouts", "1",
                    "--actions", "random")
    with h5py.File(data) as f:
        file = f["latents"][...].astype(np.float32)
    with h5py.File(tmp / "s3.gif.h5") as f:
        assert np.array_equal(f["ground_truth"][...], file[3:7])
    assert np.array_equal(out[0, :2], file[3:5])


def test_random_actions_differ_between_rollouts(trained):
    tmp, ckpt, data = trained
    out = _generate(ckpt, data, tmp / "r2.gif", "--steps", "4", "--rollouts", "3", "--actions", "random")
    assert np.array_equal(out[0, 0], out[1, 0])  # the same context frame
    assert not np.array_equal(out[0, 1:], out[1, 1:]) and not np.array_equal(out[1, 1:], out[2, 1:])


@pytest.mark.parametrize("tiling", [False, True])
def test_generate_hands_vae_and_tiling_to_the_codec(trained, monkeypatch, tiling):
    """``--vae PATH [--vae-tiling]`` reach the codec that decodes the video (a stand-in here: no VAE weights)."""
    import lwm.inference.generation as gen

    tmp, ckpt, data = trained
    asked = []

    def codec_from_attr(attr, path, vae, device, vae_tiling):
        asked.append((vae, vae_tiling))
        return None  # as for a file without a codec: latent channels are shown

    monkeypatch.setattr(gen, "codec_from_attr", codec_from_attr)
    _generate(ckpt, data, tmp / f"vae{tiling}.gif", "--steps", "2", "--rollouts", "1", "--actions", "random",
              "--vae", "/weights/vae", *(["--vae-tiling"] if tiling else []))
    assert asked == [("/weights/vae", tiling)]


def _no_checkpoint_loaded(monkeypatch):
    """Fail the test if the checkpoint is loaded: the refusals below come before any work."""
    import lwm.cli.codes
    import lwm.inference.generation

    def load(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the refusal")

    for module in (lwm.inference.generation, lwm.cli.codes):
        monkeypatch.setattr(module, "load_checkpoint", load)


@pytest.mark.parametrize("kind", ["latents onto the input", "video onto the input", "hard link"])
def test_an_output_that_is_the_input_is_refused_before_any_work(trained, tmp_path, capsys, monkeypatch, kind):
    """`--data X.gif.h5 --out X.gif` wrote the generated latents over the file they were read from."""
    tmp, ckpt, data = trained
    source = tmp_path / ("x.gif" if kind == "video onto the input" else "x.gif.h5")
    source.write_bytes(data.read_bytes())
    given = source
    if kind == "hard link":  # the same file under another name
        given = tmp_path / "other.h5"
        given.hardlink_to(source)
    written = tmp_path / "x.gif.h5" if kind != "video onto the input" else source
    what = "the latents of --out " + str(tmp_path / "x.gif") if kind != "video onto the input" else "--out"
    _no_checkpoint_loaded(monkeypatch)
    before = source.read_bytes()
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(given), "--out", str(tmp_path / "x.gif")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {written}: is the input --data {given}; writing it ({what}) would destroy it"]
    assert source.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({source.name, given.name})  # nothing written


@pytest.mark.parametrize("folder", ["adir.gif", "adir.gif.h5"])
def test_an_output_path_that_is_a_folder_is_refused_before_any_work(trained, tmp_path, capsys, monkeypatch, folder):
    """A folder at --out was found after the work (the latents already written beside it), with an imageio
    traceback after the error line."""
    tmp, ckpt, data = trained
    (tmp_path / folder).mkdir()
    _no_checkpoint_loaded(monkeypatch)
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--out", str(tmp_path / "adir.gif")]) == 2
    what = "--out" if folder == "adir.gif" else f"the latents of --out {tmp_path / 'adir.gif'}"
    assert capsys.readouterr().err.splitlines() == [f"error: {tmp_path / folder}: is a folder, not a file to write ({what})"]
    assert [p.name for p in tmp_path.iterdir()] == [folder] and not any((tmp_path / folder).iterdir())


def test_non_finite_latents_in_the_data_are_refused(trained, tmp_path, capsys):
    tmp, ckpt, data = trained
    bad = tmp_path / "inf.h5"
    bad.write_bytes(data.read_bytes())
    with h5py.File(bad, "r+") as f:
        f["latents"][2, 1, 0, 0] = np.inf
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(bad), "--out", str(tmp_path / "v.gif")]) == 2
    assert _error_lines(capsys) == [f"error: {bad}: dataset 'latents' has NaN/inf values (first at frame 2)"]
    assert [p.name for p in tmp_path.iterdir()] == ["inf.h5"]  # no video, no latents


@pytest.mark.slow
def test_generate_plays_at_the_datas_frame_rate_unless_told(trained, tmp_path, monkeypatch):
    import shutil

    import lwm.inference.generation as gen

    tmp, ckpt, data = trained
    rates = []
    monkeypatch.setattr(gen, "write_video", lambda path, frames, fps: rates.append(fps))
    _generate(ckpt, data, tmp_path / "a.gif", "--steps", "2")  # the test data records no rate: 8
    copy = tmp_path / "ep.h5"
    shutil.copy(data, copy)
    with h5py.File(copy, "a") as f:
        f.attrs["fps"] = 7.5
    _generate(ckpt, copy, tmp_path / "b.gif", "--steps", "2")
    _generate(ckpt, copy, tmp_path / "c.gif", "--steps", "2", "--fps", "30")
    assert rates == [8.0, 7.5, 30.0]
    with h5py.File(copy, "a") as f:  # a VAE's latents without --vae: a preview of one frame per latent step
        f.attrs["codec"] = json.dumps({"name": "wan", "size": 128, "frames_per_latent": 4, "shift": [0.0] * 4,
                                       "scale": [1.0] * 4})
        f.attrs["fps"] = 24.0
    _generate(ckpt, copy, tmp_path / "d.gif", "--steps", "2")
    assert rates[-1] == 6.0  # each latent step is 4 frames of the 24 fps video


@pytest.mark.slow
def test_a_run_folder_or_last_stands_for_the_runs_last_checkpoint(trained, tmp_path, capsys):
    tmp, ckpt, data = trained
    by_file = _generate(ckpt, data, tmp_path / "file.gif", "--steps", "2", "--rollouts", "1", "--actions", "random")
    by_folder = _generate(tmp / "run", data, tmp_path / "run.gif", "--steps", "2", "--rollouts", "1",
                          "--actions", "random")
    assert np.array_equal(by_file, by_folder)
    assert main(["generate", "--ckpt_path", "last", "--data", str(data), "--out", str(tmp_path / "x.gif")]) == 2
    assert _error_lines(capsys) == ["error: last: checkpoint not found"]  # (no run folder to look in)
    out = tmp_path / "codes.pt"  # lwm codes knows the run's folder from its config
    assert main(["codes", "--ckpt_path", "last", "--config", str(tmp / "run/config.yaml"), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "name"), [
    ([], "ep00_0_1+16_dictionary-inferred_seed0_step0000007.mp4"),
    (["--actions", "inferred", "--world", "dictionary", "--start", "2", "--seed", "3"],
     "ep00_2_1+16_inferred-dictionary_seed3_step0000007.mp4"),
    (["--context", "3", "--steps", "64"], "ep00_0_3+64_dictionary-inferred_seed0_step0000007.mp4"),
    (["--actions", "random"], "ep00_0_1+16_random-inferred_seed0_step0000007.mp4"),
    (["--sampling", "uniform"], "ep00_0_1+16_dictionary-inferred_uniform_seed0_step0000007.mp4"),
    (["--sampling", "uniform", "--actions", "random"],  # nothing drawn from the dictionary, so no _uniform
     "ep00_0_1+16_random-inferred_seed0_step0000007.mp4"),
    (["--world-indices", "[1, 2]"], "ep00_0_1+16_dictionary-given-1bc866_seed0_step0000007.mp4"),
    (["--world-indices", " [1,2] ", "--world", "dictionary"], "ep00_0_1+16_dictionary-given-1bc866_seed0_step0000007.mp4"),
    (["--steps", "2", "--action-indices", "[[0, 0], [1, 2]]", "--seed", "5"],
     "ep00_0_1+2_given-3eb702-inferred_seed5_step0000007.mp4"),
    (["--window", "3"], "ep00_0_1+16_dictionary-inferred_window3_seed0_step0000007.mp4"),
    (["--codes", "d/other.pt", "--sampling", "uniform"],
     "ep00_0_1+16_dictionary-inferred_uniform_codes-other_seed0_step0000007.mp4"),
    (["--codes", "d/other.pt", "--actions", "random"],  # nothing drawn from the dictionary: no _codes
     "ep00_0_1+16_random-inferred_seed0_step0000007.mp4"),
])
def test_the_default_video_name_tells_the_frames_codes_sources_seed_and_checkpoint_apart(extra, name):
    from lwm.inference.generation import default_name
    from lwm.cli.generate import parse

    assert default_name(parse(["--ckpt_path", "c.ckpt", "--data", "d/ep00.h5", *extra]), step=7) == name


def test_given_action_indices_are_named_by_the_tuples_played():
    from lwm.inference.generation import default_name
    from lwm.cli.generate import parse

    def name(indices):
        return default_name(parse(["--ckpt_path", "c", "--data", "ep00.h5", "--steps", "2",
                                   "--action-indices", indices]), step=7)

    played = name("[[0, 0], [1, 2]]")
    assert played.startswith("ep00_0_1+2_given-") and played.endswith("-inferred_seed0_step0000007.mp4")
    assert name("[[0,0],[1,2],[3,3]]") == played  # a third tuple is not played in 2 steps
    assert name("[[0, 0], [1, 3]]") != played


@pytest.mark.slow
def test_runs_of_other_settings_write_other_default_videos_and_the_same_again_is_refused(trained, capsys,
                                                                                        monkeypatch):
    """Six runs of other --actions/--world on one clip each wrote RUN_DIR/generated/ep00_0.mp4 over the last; so
    did runs of other lengths and of the run's other checkpoints."""
    tmp, ckpt, data = trained
    generated = tmp / "run/generated"
    runs = [(ckpt, "2", "dictionary", "inferred"), (ckpt, "2", "random", "inferred"),
            (ckpt, "2", "random", "dictionary"), (ckpt, "3", "random", "inferred"),
            (ckpt.parent / "step=0000002.ckpt", "2", "random", "inferred")]
    for checkpoint, steps, actions, world in runs:
        assert main(["generate", "--ckpt_path", str(checkpoint), "--data", str(data), "--steps", steps,
                     "--rollouts", "1", "--actions", actions, "--world", world]) == 0
    videos = ["ep00_0_1+2_dictionary-inferred_seed0_step0000003.mp4", "ep00_0_1+2_random-dictionary_seed0_step0000003.mp4",
              "ep00_0_1+2_random-inferred_seed0_step0000002.mp4", "ep00_0_1+2_random-inferred_seed0_step0000003.mp4",
              "ep00_0_1+3_random-inferred_seed0_step0000003.mp4"]
    assert sorted(p.name for p in generated.iterdir()) == sorted(videos + [f"{v}.h5" for v in videos])
    before = {p.name: p.read_bytes() for p in generated.iterdir()}
    capsys.readouterr()
    _no_checkpoint_loaded(monkeypatch)
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--steps", "2", "--actions",
                 "random"]) == 2
    video = generated / "ep00_0_1+2_random-inferred_seed0_step0000003.mp4"
    assert capsys.readouterr().err.splitlines() == [
        f"error: {video} and its latents {video.name}.h5: already there, where this rollout would be written "
        f"(--overwrite replaces them, or give another --out)"]
    assert {p.name: p.read_bytes() for p in generated.iterdir()} == before
    typo = ckpt.parent / "lst.ckpt"  # a misspelt checkpoint: named before the video already there
    assert main(["generate", "--ckpt_path", str(typo), "--data", str(data), "--out", str(video)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {typo}: checkpoint not found"]


@pytest.mark.parametrize("there", ["video", "latents", "both"])
def test_an_existing_out_is_refused_before_any_work_and_overwrite_replaces_it(trained, tmp_path, capsys,
                                                                             monkeypatch, there):
    tmp, ckpt, data = trained
    out, latents = tmp_path / "v.gif", tmp_path / "v.gif.h5"
    for path in {"video": [out], "latents": [latents], "both": [out, latents]}[there]:
        path.write_bytes(b"earlier")
    argv = ["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--steps", "2", "--rollouts", "1",
            "--out", str(out)]
    with monkeypatch.context() as m:
        _no_checkpoint_loaded(m)
        assert main(argv) == 2
    first = {"video": f"{out}", "latents": f"{latents}", "both": f"{out} and its latents v.gif.h5"}[there]
    it = "them" if there == "both" else "it"
    assert capsys.readouterr().err.splitlines() == [
        f"error: {first}: already there, where this rollout would be written (--overwrite replaces {it}, or give "
        f"another --out)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {"video": ["v.gif"], "latents": ["v.gif.h5"], "both": ["v.gif", "v.gif.h5"]}[there])
    assert all(p.read_bytes() == b"earlier" for p in tmp_path.iterdir())
    assert main(argv + ["--overwrite"]) == 0
    assert iio.imread(out, index=None).shape[0] == 3
    with h5py.File(latents) as f:
        assert f["latents"].shape == (1, 3, 4, 16, 16)


class _Decoder:
    """A stand-in codec decoding each latent to 2 video frames (the first to 1, as a causal VAE): frame values are
    the latent's channel 0 at (0, 0), mapped to 1..255."""
    name = "stand-in"

    def decode(self, latents: np.ndarray) -> np.ndarray:
        values = np.clip(np.round((latents[:, 0, 0, 0] + 1) * 127 + 1), 1, 255).astype(np.uint8)
        frames = np.concatenate([values[:1], np.repeat(values[1:], 2)])
        return np.broadcast_to(frames[:, None, None, None], (len(frames), 6, 5, 3)).copy()


@pytest.mark.parametrize("codec", ["latent preview", "decoded"])
def test_a_ground_truth_the_file_has_in_part_is_shown_then_blank(trained, tmp_path, capsys, monkeypatch, codec):
    """--steps 60 --context 3 on a 40-frame file left the ground truth out of the video: here frames 10..13 of a
    14-frame file, 4 of the 7 the rollout covers, then blank cells; the latents file holds the same 4."""
    import lwm.inference.generation as gen
    from lwm.utils.video import BLANK, latent_preview

    tmp, ckpt, data = trained
    grids = []
    monkeypatch.setattr(gen, "write_video", lambda path, frames, fps: grids.append(frames))
    if codec == "decoded":
        monkeypatch.setattr(gen, "codec_from_attr", lambda *args: _Decoder())
    out = tmp_path / "part.gif"
    rollouts = _generate(ckpt, data, out, "--start", "10", "--steps", "6", "--rollouts", "2", "--actions", "random")
    with h5py.File(data) as f:
        truth = f["latents"][10:14].astype(np.float32)
    with h5py.File(f"{out}.h5") as f:
        assert np.array_equal(f["ground_truth"][...], truth) and f["latents"].shape == (2, 7, 4, 16, 16)
    to_video = _Decoder().decode if codec == "decoded" else (lambda x: latent_preview(torch.from_numpy(x)))
    top, rows = to_video(truth), [to_video(r) for r in rollouts]
    (g,) = grids
    H = top.shape[1]
    assert g.shape[:2] == (len(rows[0]), 3 * H + 2 * 4)  # 7 latent frames: 7 previews, or 13 decoded frames
    assert np.array_equal(g[: len(top), :H], top) and (g[len(top):, :H] == BLANK).all()
    assert len(top) == {"latent preview": 4, "decoded": 7}[codec] and BLANK == 0
    for i, row in enumerate(rows):
        assert np.array_equal(g[:, (i + 1) * (H + 4) : (i + 1) * (H + 4) + H], row)
    shown = "decoded by the stand-in codec" if codec == "decoded" else "latent channels 0-2 shown as RGB"
    assert (f"wrote {out} (ground truth: 4 of 7 frames, then 2 rollouts of 6 frames after 1 context frame; {shown}"
            in capsys.readouterr().out)


@pytest.mark.slow
def test_a_checkpoint_outside_a_checkpoints_folder_writes_beside_itself_and_a_curriculum_phase_warns(trained, tmp_path,
                                                                                                  capsys):
    """A checkpoint copied elsewhere (not RUN_DIR/checkpoints/): its default video goes to its own folder's
    generated/, not the folder above. Weights still in a world_curriculum warm-up (the predictor has not trained
    with the world code generation feeds it) are warned about."""
    _, ckpt, data = trained
    raw = torch.load(ckpt, weights_only=True)
    raw["hyper_parameters"]["net"]["world_curriculum"] = [2, 5]  # step 3: the weights of step 2, unquantized phase
    copy = tmp_path / "solo/m.ckpt"
    copy.parent.mkdir()
    torch.save(raw, copy)
    capsys.readouterr()
    assert main(["generate", "--ckpt_path", str(copy), "--data", str(data), "--steps", "2", "--rollouts", "1",
                 "--actions", "random"]) == 0
    assert (tmp_path / "solo/generated/ep00_0_1+2_random-inferred_seed0_step0000003.mp4").is_file()
    assert not (tmp_path / "generated").exists()
    assert ("warning: the checkpoint (step 3) is in the 'unquantized' phase of model.net.world_curriculum [2, 5]: its "
            "predictor has not yet trained with the world code, which generation feeds it (training does from step 7 "
            "on)") in capsys.readouterr().err


def test_rollouts_with_nothing_drawn_are_the_same_and_it_is_said(trained, capsys):
    """--actions inferred with --world inferred draws nothing: every rollout is the same (the predictor is
    deterministic), which a note says; with drawn actions they differ and nothing is said."""
    tmp, ckpt, data = trained
    same = _generate(ckpt, data, tmp / "same.gif", "--steps", "3", "--rollouts", "3", "--actions", "inferred")
    assert all(np.array_equal(same[0], r) for r in same[1:])
    assert "nothing is drawn (the actions and the world are inferred or given), so the 3 rollouts are the same" \
        in capsys.readouterr().err
    drawn = _generate(ckpt, data, tmp / "drawn.gif", "--steps", "3", "--rollouts", "3", "--actions", "random")
    assert not all(np.array_equal(drawn[0], r) for r in drawn[1:])
    assert "nothing is drawn" not in capsys.readouterr().err


@pytest.mark.slow
def test_the_codes_played_are_recorded_and_replay_each_rollout(trained):
    """The latents file holds each rollout's action and world indices (what --action-indices and --world-indices
    take); given back, they play that rollout again. Random actions are drawn rollout by rollout: rollout 0
    of three is the rollout of one."""
    tmp, ckpt, data = trained
    three = _generate(ckpt, data, tmp / "r3.gif", "--steps", "4", "--rollouts", "3", "--actions", "random",
                      "--world", "dictionary", "--seed", "7")
    with h5py.File(tmp / "r3.gif.h5") as f:
        actions, world = f["action_indices"][...], f["world_indices"][...]
        assert f.attrs["actions"] == "random" and f.attrs["world"] == "dictionary" and f.attrs["seed"] == 7
    assert actions.shape == (3, 4, 2) and world.shape == (3, 2)
    replay = _generate(ckpt, data, tmp / "replay.gif", "--steps", "4", "--rollouts", "1",
                       "--action-indices", json.dumps(actions[2].tolist()),
                       "--world-indices", json.dumps(world[2].tolist()))
    assert np.allclose(replay[0], three[2], atol=1e-5)  # (a batch of one: other kernels, float noise)
    one = _generate(ckpt, data, tmp / "r1.gif", "--steps", "4", "--rollouts", "1", "--actions", "random",
                    "--seed", "7")
    with h5py.File(tmp / "r1.gif.h5") as f:
        assert np.array_equal(f["action_indices"][0], actions[0])
    inferred = _generate(ckpt, data, tmp / "inf.gif", "--steps", "3", "--rollouts", "1", "--actions", "inferred")
    with h5py.File(tmp / "inf.gif.h5") as f:
        replay = _generate(ckpt, data, tmp / "inf_replay.gif", "--steps", "3", "--rollouts", "1",
                           "--action-indices", json.dumps(f["action_indices"][0].tolist()),
                           "--world-indices", json.dumps(f["world_indices"][0].tolist()))
    assert np.array_equal(replay, inferred) and one.shape == (1, 5, 4, 16, 16)


def test_a_failing_decode_keeps_the_rollout_latents(trained, tmp_path, monkeypatch):
    """The latents are written before any frame is decoded: a decoder that fails (out of memory at 512 px) loses
    the video, not the rollouts."""
    import lwm.inference.generation as gen

    tmp, ckpt, data = trained

    def out_of_memory(x):
        raise RuntimeError("simulated: out of memory while decoding")

    monkeypatch.setattr(gen, "latent_preview", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--out", str(tmp_path / "v.gif"),
              "--steps", "3", "--rollouts", "2"])
    with h5py.File(tmp_path / "v.gif.h5") as f:
        assert f["latents"].shape == (2, 4, 4, 16, 16) and f["action_indices"].shape == (2, 3, 2)
    assert not (tmp_path / "v.gif").exists()


def test_only_the_frames_read_are_checked_for_non_finite_values(trained, tmp_path):
    """A NaN in frames the rollout never reads does not refuse the file (nor does generate read the whole file);
    one in the frames it reads does (test_non_finite_latents_in_the_data_are_refused)."""
    tmp, ckpt, data = trained
    far = tmp_path / "far.h5"
    far.write_bytes(data.read_bytes())
    with h5py.File(far, "r+") as f:
        f["latents"][13, 0, 0, 0] = np.nan  # the world's clip is frames 0..5, the rollout's ground truth 0..2
    out = _generate(ckpt, far, tmp_path / "v.gif", "--steps", "2", "--rollouts", "1")
    assert np.isfinite(out).all()


def test_a_vae_files_rows_are_decoded_after_the_latents_before_start(trained, tmp_path, capsys, monkeypatch):
    """A video VAE's decoder carries history: with --start 3 every row (the ground truth, each rollout) is decoded
    after the file's latents 0..2, as a decode of the whole file would give its frames; a note says so."""
    import lwm.inference.generation as gen

    tmp, ckpt, data = trained
    seen = []

    class Vae(_Decoder):
        frames_per_latent, size = 4, 16

        def decode(self, latents, before=None):
            seen.append((len(latents), None if before is None else before.copy()))
            return super().decode(latents)

    monkeypatch.setattr(gen, "codec_from_attr", lambda *args: Vae())
    _generate(ckpt, data, tmp_path / "v.gif", "--start", "3", "--steps", "2", "--rollouts", "2")
    with h5py.File(data) as f:
        head = f["latents"][:3].astype(np.float32)
    assert len(seen) == 3 and all(b is not None and np.array_equal(b, head) for _, b in seen)
    assert "each of the 3 rows is decoded after the file's 3 latents before --start" in capsys.readouterr().err
    seen.clear()
    _generate(ckpt, data, tmp_path / "v0.gif", "--steps", "2", "--rollouts", "1")
    assert [b for _, b in seen] == [None, None]  # from the file's first latent: nothing before


def test_an_mp4_grid_taller_than_h264_takes_is_refused_before_any_work(trained, tmp_path, capsys):
    tmp, ckpt, data = trained  # 16x16 latents previewed at 64 px: 300 rows of 68 px
    assert main(["generate", "--ckpt_path", str(ckpt), "--data", str(data), "--out", str(tmp_path / "big.mp4"),
                 "--rollouts", "299", "--steps", "1"]) == 2
    assert "H.264 takes at most 16384 pixels a side (fewer rollouts, or a .gif)" in _error_lines(capsys)[0]
    assert not list(tmp_path.iterdir())

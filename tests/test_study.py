"""The learning study's numbers on constructed models with known answers."""

from __future__ import annotations

import pytest
import torch

from lwm.modules.rvq import RVQOutput
from lwm.modules.world_model import WorldModel
from lwm.inference.study import Clips, evaluate, other_clip


def _model(**overrides) -> WorldModel:
    torch.manual_seed(0)
    config = dict(in_channels=2, height=8, width=8, d_model=16, n_heads=2, depth_action=1, depth_world=1,
                  depth_dynamics=1, d_code_action=4, d_code_world=4, codebook_sizes_action=(5,),
                  codebook_sizes_world=(3, 2))
    return WorldModel(**{**config, **overrides}).eval()


def _clips(n=12, T=6, files=6, seed=0) -> Clips:
    g = torch.Generator().manual_seed(seed)
    return Clips(latents=torch.rand(n, T, 2, 8, 8, generator=g) * 2 - 1,
                 actions=torch.randint(0, 5, (n, T), generator=g),
                 worlds=torch.arange(n) % 3, files=torch.arange(n) % files)


def test_other_clip_is_another_file_and_the_same_world_when_asked():
    clips = _clips()
    g = torch.Generator().manual_seed(0)
    anyone, same = other_clip(clips, False, g), other_clip(clips, True, g)
    assert (clips.files[anyone] != clips.files).all()
    assert (clips.files[same] != clips.files).all() and (clips.worlds[same] == clips.worlds).all()


def _oracle(model, clips, codes):
    """An ``encode_actions`` whose code of each transition is ``codes(actions [B, T], worlds [B])`` of its clip."""
    quantizer = model.quantizers["Action_Encoder"]

    def encode(x):
        rows = (clips.latents[:, None] == x[None]).flatten(2).all(-1).float().argmax(0)  # [B]: x's clips
        indices = codes(clips.actions[rows], clips.worlds[rows])[:, :-1, None]  # [B, T-1, 1]
        return RVQOutput(quantizer.decode_indices(indices), indices, torch.tensor(0.0), torch.tensor(0.0),
                         torch.zeros(1), quantizer.decode_indices(indices))

    return encode


def test_codes_that_are_the_true_actions_give_nmi_1(monkeypatch):
    model, clips = _model(), _clips(n=60, files=30)
    monkeypatch.setattr(model, "encode_actions", _oracle(model, clips, lambda actions, worlds: actions))
    result = evaluate(model, clips, t=4, batch_size=16)
    assert result["action"]["nmi"] == pytest.approx(1.0)
    assert result["action"]["probe"] == 1.0
    assert result["action_usage"] == {"levels": [5], "sizes": [5], "tuples": 5}


def test_codes_that_name_each_worlds_actions_their_own_way_give_nmi_1_per_world(monkeypatch):
    model, clips = _model(), _clips(n=90, files=30)
    # world w's action a gets code (a + w) % 5: one meaning per world, another across them
    own_way = lambda actions, worlds: (actions + worlds[:, None]) % 5
    monkeypatch.setattr(model, "encode_actions", _oracle(model, clips, own_way))
    result = evaluate(model, clips, t=4, batch_size=16)
    assert result["action"]["nmi"] < 0.5
    for world in range(3):
        assert result["per_world"][world]["action"]["nmi"] == pytest.approx(1.0)
        assert result["per_world"][world]["action"]["probe"] == 1.0


def test_a_model_that_ignores_its_actions_and_world_is_insensitive_to_them():
    model = _model()
    for layer in (model.dynamics.action_proj, model.dynamics.world_proj):
        torch.nn.init.zeros_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
    result = evaluate(model, _clips(), t=4, batch_size=5)
    assert result["action_dpsnr"] == {"random": 0.0, "dictionary": 0.0, "other_clip": 0.0}
    assert result["world_dpsnr"] == {"random": 0.0, "same_world": 0.0}


def test_identical_clips_of_one_world_give_no_world_gap_and_copy_last_is_exact():
    model, clips = _model(), _clips(n=8, files=8)
    clips.latents[:] = clips.latents[0]
    clips.worlds[:] = 0
    result = evaluate(model, clips, t=3, batch_size=3)
    assert result["world_dpsnr"]["same_world"] == 0.0
    assert result["per_world"][0]["world_gap_same_world"] == 0.0
    x = clips.latents[0]
    expected = [float(10 * torch.log10(1 / (x[k] - x[0]).pow(2).mean())) for k in (1, 2, 3)]
    assert result["copy_psnr"] == pytest.approx(expected, abs=1e-4)
    assert len(result["psnr"]) == 3


def test_clips_too_short_for_t_are_refused():
    with pytest.raises(ValueError, match="actions: expected"):  # (model.generate's check: T - 1 actions, t needed)
        evaluate(_model(), _clips(T=4), t=4)


def test_the_code_to_action_mapping_takes_each_codes_most_frequent_action():
    from lwm.inference.study import code_to_action_accuracy

    train_ids = torch.tensor([0, 0, 0, 1, 1, 2])
    train_y = torch.tensor([3, 3, 1, 2, 2, 3])  # code 0 -> 3, 1 -> 2, 2 -> 3; the most frequent action: 3
    test_ids = torch.tensor([0, 1, 2, 5, 1])  # code 5 unseen: the most frequent action
    test_y = torch.tensor([3, 2, 0, 3, 1])
    accuracy, chance = code_to_action_accuracy(train_ids, train_y, test_ids, test_y)
    assert accuracy == pytest.approx(3 / 5) and chance == pytest.approx(2 / 5)

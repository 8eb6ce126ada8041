"""Generation: the cached rollout equals full recomputation, also past the window; it continues the
training rollout exactly; bad inputs are refused."""

from __future__ import annotations

import pytest
import torch

from lwm.modules.world_model import WorldModel


def _model(**overrides) -> WorldModel:
    torch.manual_seed(0)
    model = WorldModel(**{**dict(in_channels=2, height=8, width=8, d_model=16, n_heads=2, depth_action=1, depth_world=1,
                                 depth_dynamics=2, d_code_action=4, d_code_world=4, codebook_sizes_action=(3, 4),
                                 codebook_sizes_world=(3,)), **overrides}).eval()
    torch.nn.init.normal_(model.detokenizer.net[6].weight, std=0.1)  # starts at zero when residual: given weights
    return model


def _inputs(model, B=2, c=2, steps=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    context = torch.rand(B, c, 2, 8, 8, generator=g) * 2 - 1
    actions = torch.randn(B, c + steps - 1, 4, generator=g)
    world = torch.randn(B, 4, generator=g)
    return context, actions, world


def _count_calls(monkeypatch, obj, name: str) -> list[int]:
    """Wrap ``obj.name`` (an instance attribute shadowing the method) and count its calls."""
    calls = [0]
    original = getattr(obj, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


@pytest.mark.parametrize(("window", "c", "options"), [(None, 2, {}), (4, 2, {}), (None, 3, {}), (4, 5, {}), (1, 2, {}),
                                                  (4, 2, {"residual": True})])
def test_cached_rollout_equals_full_recomputation(monkeypatch, window, c, options):
    """The same frames with and without the cache; with it each fed frame (the c context frames, then the
    generated ones but the last: c + steps - 1) is one cached ``dynamics.step`` and the full predictor never
    runs, without it the reverse."""
    model = _model(**options)
    context, actions, world = _inputs(model, c=c)  # c + 9 frames: longer than the window of 4
    cached_calls = _count_calls(monkeypatch, model.dynamics, "step")
    full_calls = _count_calls(monkeypatch, model.dynamics, "forward")
    cached = model.generate(context, actions, world, steps=9, t0=5, window=window)
    assert (cached_calls[0], full_calls[0]) == (c + 9 - 1, 0)
    full = model.generate(context, actions, world, steps=9, t0=5, window=window, use_cache=False)
    assert (cached_calls[0], full_calls[0]) == (c + 9 - 1, c + 9 - 1)
    assert cached.shape == (2, 9, 2, 8, 8)
    assert torch.allclose(cached, full, atol=1e-5), (cached - full).abs().max()


def test_window_changes_nothing_until_the_context_is_longer():
    model = _model()
    context, actions, world = _inputs(model, steps=6)
    free = model.generate(context, actions, world, steps=6)
    windowed = model.generate(context, actions, world, steps=6, window=4)
    assert torch.allclose(free[:, :3], windowed[:, :3], atol=1e-6)  # frames 2..4 see at most 4 frames anyway
    assert not torch.allclose(free[:, -1], windowed[:, -1], atol=1e-4)  # frame 7 would see 7: the window bites


@torch.no_grad()
def step_by_step(model, first, actions, world, steps: int):
    """The reference rollout: frames ``1..steps`` after ``first [B, 1, ...]``, each from the whole prefix through
    ``model.predict`` (no cache, nothing reused)."""
    frames = first
    for k in range(steps):
        frames = torch.cat([frames, model.predict(frames, actions[:, : k + 1], world)[:, -1:]], dim=1)
    return frames[:, 1:]


def test_generate_equals_the_step_by_step_rollout_and_teacher_forcing():
    model = _model()
    x = torch.rand(2, 6, 2, 8, 8) * 2 - 1
    a, h = model.encode_actions(x).quantized, model.encode_world(x).quantized
    gen = model.generate(x[:, :1], a, h, steps=4)
    assert torch.allclose(gen, step_by_step(model, x[:, :1], a, h, steps=4), atol=1e-5)
    tf = model.predict(x[:, :3], a[:, :3], h)  # teacher forcing: frame 3 from the true frames 0..2
    assert torch.allclose(model.generate(x[:, :3], a, h, steps=1)[:, 0], tf[:, -1], atol=1e-5)


def test_a_longer_context_batch_is_many_rollouts_at_once():
    model = _model()
    context, actions, world = _inputs(model, B=3, steps=4)
    together = model.generate(context, actions, world, steps=4)
    alone = torch.cat([model.generate(context[i : i + 1], actions[i : i + 1], world[i : i + 1], steps=4) for i in range(3)])
    assert torch.allclose(together, alone, atol=1e-5)


def test_bad_generation_inputs_are_refused():
    model = _model()
    context, actions, world = _inputs(model, steps=3)
    with pytest.raises(ValueError, match="actions: expected"):
        model.generate(context, actions[:, :2], world, steps=3)
    with pytest.raises(ValueError, match=r"actions: expected \[B=2, >= 4"):  # one short of c + steps - 1 = 4
        model.generate(context, actions[:, :3], world, steps=3)
    with pytest.raises(ValueError, match="actions: expected"):  # another code width
        model.generate(context, actions[..., :-1], world, steps=3)
    with pytest.raises(ValueError, match=r"world: expected \[B=2, Dh="):  # [Dh] broadcast into extra frames
        model.generate(context, actions, world[0], steps=3)
    with pytest.raises(ValueError, match=r"world: expected"):
        model.predict(context, actions[:, :2], world[0])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        model.generate(context, actions, world, steps=0)
    with pytest.raises(ValueError, match="window must be >= 1"):
        model.generate(context, actions, world, steps=3, window=0)
    with pytest.raises(ValueError, match="context: expected shape"):
        model.generate(context[:, :, :1], actions, world, steps=3)


def test_actions_of_a_clip_longer_than_the_window_are_read_window_by_window():
    """``encode_actions(x, window=W)``: a_0..a_{W-2} are the first window's (= the whole clip's: causal with one
    frame of lookahead); each later a_i is the last action of the window of frames i+2-W..i+1 at positions
    t0 + frame, exactly what encoding that window alone gives."""
    model = _model()
    g = torch.Generator().manual_seed(3)
    x = torch.rand(2, 11, 2, 8, 8, generator=g) * 2 - 1
    W, t0 = 4, 7
    with torch.no_grad():
        windowed = model.encode_actions(x, t0=t0, window=W)
        whole = model.encode_actions(x, t0=t0)
        assert windowed.quantized.shape == (2, 10, 4) and windowed.indices.shape == (2, 10, 2)
        z = windowed.inputs  # pre-quantization vectors
        assert torch.allclose(z[:, : W - 1], whole.inputs[:, : W - 1], atol=1e-6)
        for i in range(W - 1, 10):
            s = i + 2 - W
            alone = model.encode_actions(x[:, s : s + W], t0=t0 + s)
            assert torch.allclose(z[:, i], alone.inputs[:, -1], atol=1e-5), i
            assert torch.equal(windowed.indices[:, i], alone.indices[:, -1])
        assert not torch.allclose(z[:, W - 1 :], whole.inputs[:, W - 1 :], atol=1e-4)  # the window bites
        assert torch.equal(model.encode_actions(x[:, :W], t0=t0, window=W).indices, whole.indices[:, : W - 1])
    with pytest.raises(ValueError, match="window must be >= 2"):
        model.encode_actions(x, window=1)

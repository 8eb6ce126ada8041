"""The monitoring metrics on hand-made inputs with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from lwm.utils.metrics import (attention_diagonality, codebook_diversity, codebook_usage, delta_psnr, psnr,
    random_codes, random_indices, sensitivity)
from lwm.modules.rvq import ResidualVectorQuantizer
from lwm.modules.world_model import WorldModel
from tests.modules.test_generate import step_by_step


def test_diagonality_of_identity_shifted_attention_is_one():
    T = 6
    attn = torch.zeros(2, 3, T, T)
    for i in range(T):  # each query splits its attention between itself and the next frame (the last: itself)
        attn[..., i, i] = 0.3 if i < T - 1 else 1.0
        if i < T - 1:
            attn[..., i, i + 1] = 0.7
    assert torch.allclose(attention_diagonality(attn), torch.ones(2))
    identity = torch.eye(T).expand(2, 3, T, T)
    assert torch.allclose(attention_diagonality(identity), torch.ones(2))


def test_diagonality_of_uniform_and_off_diagonal_attention():
    T = 5
    uniform = torch.full((1, 2, T, T), 1.0 / T)
    expected = (T * (1 / T) + (T - 1) * (1 / T)) / T  # (2T - 1) / T^2
    assert torch.allclose(attention_diagonality(uniform), torch.tensor([expected]))
    first = torch.zeros(1, 1, T, T)
    first[..., 0] = 1.0  # every query looks only at frame 0: on the diagonal for query 0 alone
    assert torch.allclose(attention_diagonality(first), torch.tensor([1 / T]))


def test_codebook_usage():
    sizes = (4, 6)
    every = torch.stack([torch.arange(12) % 4, torch.arange(12) % 6], dim=-1)  # every code of both levels
    assert torch.equal(codebook_usage(every, sizes), torch.tensor([1.0, 1.0]))
    some = torch.tensor([[0, 5], [0, 5], [3, 5]])  # level 0 uses {0, 3}, level 1 uses {5}
    assert torch.allclose(codebook_usage(some, sizes), torch.tensor([2 / 4, 1 / 6]))
    assert torch.allclose(codebook_usage(some[None].expand(2, 3, 2), sizes), torch.tensor([2 / 4, 1 / 6]))


def test_codebook_diversity():
    codes = torch.tensor([[0.0, 0.0], [0.0, 0.0], [2.0, 0.0]])  # two identical codes, one at distance 2
    lo, hi, mean = codebook_diversity(codes).tolist()
    assert lo == 0.0 and hi == pytest.approx(2.0) and mean == pytest.approx((0 + 2 + 2) / 3)  # MSE = 4 / 2
    assert torch.isnan(codebook_diversity(torch.zeros(1, 3))).all()


def test_codebook_diversity_at_the_real_sizes_sees_identical_codes_as_zero():
    """At 256 codes of width 64 (cdist's matmul path above 25 rows) two identical codes still give exactly 0,
    and the pairwise MSEs equal the brute-force ones."""
    torch.manual_seed(2)
    codes = torch.randn(256, 64) * 3 + 1  # with these, cdist's default gives the identical pair 0.011 apart
    codes[200] = codes[17]
    lo, hi, mean = codebook_diversity(codes)
    assert lo.item() == 0.0
    i, j = torch.triu_indices(256, 256, offset=1)
    brute = (codes[i] - codes[j]).pow(2).mean(dim=1)
    assert torch.allclose(torch.stack([hi, mean]), torch.stack([brute.max(), brute.mean()]), rtol=1e-5)


def test_psnr_and_delta_psnr_known_values():
    target = torch.zeros(2, 3, 4)
    pred = torch.full_like(target, 0.1)  # MSE 0.01 -> 20 dB
    assert torch.allclose(psnr(target, pred), torch.tensor([20.0, 20.0]))
    worse = torch.full_like(target, 1.0)  # MSE 1 -> 0 dB
    d, seq, rand = delta_psnr(target, pred, worse).tolist()
    assert (d, seq, rand) == pytest.approx((20.0, 20.0, 0.0))
    assert delta_psnr(target, pred, pred)[0].item() == 0.0  # identical predictions: no sensitivity


def test_psnr_is_per_sample():
    target = torch.zeros(2, 3, 4)
    pred = torch.stack([torch.full((3, 4), 0.1), torch.full((3, 4), 1.0)])  # MSE 0.01 and 1: 20 and 0 dB
    assert torch.allclose(psnr(target, pred), torch.tensor([20.0, 0.0]), atol=1e-4)


def test_random_codes_are_sums_of_one_code_per_level():
    torch.manual_seed(0)
    q = ResidualVectorQuantizer(3, (2, 3), init_from_data=False)
    codes = random_codes(q, (50,), torch.Generator().manual_seed(1))
    sums = torch.stack([q.codebook(0)[i] + q.codebook(1)[j] for i in range(2) for j in range(3)])
    assert codes.shape == (50, 3)
    assert all(bool((sums - c).abs().amax(dim=1).min() < 1e-6) for c in codes)


def _tiny_model() -> WorldModel:
    torch.manual_seed(0)
    return WorldModel(in_channels=2, height=8, width=8, d_model=16, n_heads=2, depth_action=1, depth_world=1,
                      depth_dynamics=1, d_code_action=4, d_code_world=4, codebook_sizes_action=(3,),
                      codebook_sizes_world=(3,)).eval()


def test_sensitivity_is_zero_when_the_codes_do_not_matter():
    model = _tiny_model()
    with torch.no_grad():  # the predictor ignores actions and world entirely
        model.dynamics.action_proj.weight.zero_()
        model.dynamics.world_proj.weight.zero_()
    x = torch.rand(3, 6, 2, 8, 8) * 2 - 1
    out = sensitivity(model, x, t=4, generator=torch.Generator().manual_seed(0))
    for name in ("Action_Encoder", "World_Encoder"):
        d, seq, rand = out[name].tolist()
        assert d == pytest.approx(0.0, abs=1e-5) and seq == pytest.approx(rand, abs=1e-5) and math.isfinite(seq)


def test_code_ids_mixed_radix():
    from lwm.utils.metrics import code_ids

    indices = torch.tensor([[0, 0], [0, 3], [1, 0], [2, 3]])
    assert code_ids(indices, (3, 4)).tolist() == [0, 3, 4, 11]


def test_nmi_identical_renamed_and_independent_labels():
    from lwm.utils.metrics import nmi

    a = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert nmi(a, a).item() == pytest.approx(1.0)
    assert nmi(a + 10, a).item() == pytest.approx(1.0)  # a renaming is the same partition
    g = torch.Generator().manual_seed(0)
    assert nmi(torch.randint(0, 4, (5000,), generator=g), torch.randint(0, 4, (5000,), generator=g)).item() < 0.01


def test_nmi_chance_is_the_finite_sample_bias_of_independent_labels():
    import math

    from lwm.utils.metrics import nmi, nmi_chance

    g = torch.Generator().manual_seed(0)
    codes, labels = torch.randint(0, 8, (448,), generator=g), torch.randint(0, 18, (448,), generator=g)
    mean, margin = nmi_chance(codes, labels)
    # Miller-Madow: independent labelings show (K-1)(L-1)/2N nats of mutual information; NMI divides by the mean entropy
    bias = 7 * 17 / (2 * 448) / ((math.log(8) + math.log(18)) / 2)
    assert mean == pytest.approx(bias, abs=0.015) and margin > 0
    assert nmi(codes, labels).item() < mean + margin
    mean, margin = nmi_chance(labels, labels)  # codes that are the labels: 18 codes, so more bias
    assert mean == pytest.approx(17 * 17 / (2 * 448) / math.log(18), abs=0.03) and nmi(labels, labels) > mean + margin


def test_nmi_chance_within_groups_keeps_what_the_groups_tell():
    from lwm.utils.metrics import nmi, nmi_chance

    g = torch.Generator().manual_seed(0)
    games = torch.randint(0, 3, (600,), generator=g)
    actions = 2 * games + torch.randint(0, 2, (600,), generator=g)  # each game its own two actions
    codes = games  # codes that name the game and nothing of the actions within it
    observed = nmi(codes, actions).item()
    assert observed > 0.5 and nmi_chance(codes, actions)[0] < 0.05
    mean, margin = nmi_chance(codes, actions, games)  # a shuffle within each game leaves that information
    assert mean == pytest.approx(observed) and margin == pytest.approx(0.0, abs=1e-6)


def test_linear_probe_separable_and_random_features():
    from lwm.utils.metrics import linear_probe_accuracy, probe_train_size

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (600,), generator=g)
    separable = torch.nn.functional.one_hot(labels, 3).float() * 3 + 0.1 * torch.randn(600, 3, generator=g)
    accuracy, chance = linear_probe_accuracy(separable, labels)
    assert accuracy == 1.0 and 0.25 < chance < 0.45
    noise = torch.randn(600, 3, generator=g)
    accuracy, chance = linear_probe_accuracy(noise, labels)
    assert abs(accuracy - chance) < 0.1
    # chance is the held-out rate of the TRAINING set's majority class: labels laid out on the probe's seeded
    # split (seed 0) so that class 0 is 60% of the training half and 40% of the held-out half (class 1 the
    # rest): chance is exactly 0.4, not the held-out majority's 0.6 nor 1 / classes = 0.5
    n = 600
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    cut = probe_train_size(n)
    assert cut == 300
    imbalanced = torch.ones(n, dtype=torch.long)
    imbalanced[order[:180]] = 0  # 180 of the 300 training samples
    imbalanced[order[cut: cut + 120]] = 0  # 120 of the 300 held-out ones
    features = torch.nn.functional.one_hot(imbalanced, 2).float() + 0.1 * torch.randn(n, 2, generator=g)
    accuracy, chance = linear_probe_accuracy(features, imbalanced)
    assert chance == pytest.approx(0.4, abs=1e-7) and accuracy == 1.0


def test_copy_last_loss_known_values():
    from lwm.utils.metrics import copy_last_loss

    still = torch.ones(2, 5, 3, 4, 4)
    assert copy_last_loss(still).item() == 0.0
    ramp = torch.arange(5.0).view(1, 5, 1, 1, 1).expand(2, 5, 3, 4, 4) * 0.1  # +0.1 per frame
    assert copy_last_loss(ramp).item() == pytest.approx(0.01)
    accelerating = torch.tensor([0.0, 1.0, 3.0, 6.0]).view(1, 4, 1, 1, 1).expand(2, 4, 3, 4, 4) * 0.1  # steps 1, 2, 3
    assert copy_last_loss(accelerating).item() == pytest.approx((1 + 4 + 9) / 3 * 0.01)


@torch.no_grad()
def test_sensitivity_known_answers():
    """With the predictor's world projection zeroed the world cannot matter: world dPSNR exactly 0 (its random
    run keeps the inferred actions), action dPSNR not; PSNR_seq is frame 4 of the rollout with the inferred
    codes against ground-truth frame 4."""
    model = _tiny_model()
    model.dynamics.world_proj.weight.zero_()
    x = torch.rand(3, 6, 2, 8, 8, generator=torch.Generator().manual_seed(2)) * 2 - 1
    out = sensitivity(model, x, t=4, generator=torch.Generator().manual_seed(0))
    assert out["World_Encoder"][0].item() == pytest.approx(0.0, abs=1e-5)
    assert abs(out["Action_Encoder"][0].item()) > 1e-4
    a = model.encode_actions(x[:, :5]).quantized
    h = model.encode_world(x).quantized
    seq = psnr(x[:, 4], step_by_step(model, x[:, :1], a, h, 4)[:, -1]).mean()
    assert out["Action_Encoder"][1].item() == pytest.approx(seq.item(), abs=1e-4)


@torch.no_grad()
def test_sensitivity_world_known_answer_with_given_random_codes(monkeypatch):
    """With the random codes fixed (a code other than the inferred one for every clip and transition), each
    PSNR_rand is frame 4 of the rollout with that quantizer's codes random and the other's inferred: the world's
    differs from PSNR_seq (world dPSNR not 0) and equals the rollout with the given world and inferred actions."""
    import lwm.utils.metrics as metrics

    model = _tiny_model()
    x = torch.rand(3, 6, 2, 8, 8, generator=torch.Generator().manual_seed(2)) * 2 - 1
    a_idx, h_idx = model.encode_actions(x[:, :5]).indices, model.encode_world(x).indices  # [3, 4, 1], [3, 1]
    quantizers = model.quantizers
    given = {"Action_Encoder": quantizers["Action_Encoder"].decode_indices((a_idx + 1) % 3),
             "World_Encoder": quantizers["World_Encoder"].decode_indices((h_idx + 1) % 3)}
    asked = []

    def fixed_codes(quantizer, lead, generator=None):
        name = next(k for k, q in quantizers.items() if q is quantizer)
        asked.append((name, tuple(lead)))
        return given[name]

    monkeypatch.setattr(metrics, "random_codes", fixed_codes)
    out = sensitivity(model, x, t=4)
    assert sorted(asked) == [("Action_Encoder", (3, 4)), ("World_Encoder", (3,))]
    a, h = model.encode_actions(x[:, :5]).quantized, model.encode_world(x).quantized
    target = x[:, 4]
    seq = psnr(target, step_by_step(model, x[:, :1], a, h, 4)[:, -1])
    world_rand = psnr(target, step_by_step(model, x[:, :1], a, given["World_Encoder"], 4)[:, -1])
    action_rand = psnr(target, step_by_step(model, x[:, :1], given["Action_Encoder"], h, 4)[:, -1])
    for name, rand in (("World_Encoder", world_rand), ("Action_Encoder", action_rand)):
        expected = torch.stack([(seq - rand).mean(), seq.mean(), rand.mean()])
        assert torch.allclose(out[name], expected, atol=1e-4), name
    assert abs(out["World_Encoder"][0].item()) > 1e-2  # the random world changes frame 4


@torch.no_grad()
def test_sensitivity_feeds_the_world_as_the_curriculum_phase_does():
    """Under a ``world_curriculum`` the predictor trains on no world (``off``) or the encoder's output
    (``unquantized``): the sensitivity plays the clip with that, as validation does. Off: the world's dPSNR is
    exactly 0 (a random world is no world either) while the actions' is not; unquantized: PSNR_seq is the rollout
    with the encoder's output, not the code."""
    model = _tiny_model()
    x = torch.rand(3, 6, 2, 8, 8, generator=torch.Generator().manual_seed(2)) * 2 - 1
    a = model.encode_actions(x[:, :5]).quantized
    world = model.encode_world(x)
    off = sensitivity(model, x, t=4, generator=torch.Generator().manual_seed(0), world_phase="off")
    assert off["World_Encoder"][0].item() == 0.0 and abs(off["Action_Encoder"][0].item()) > 1e-4
    no_world = psnr(x[:, 4], step_by_step(model, x[:, :1], a, torch.zeros_like(world.quantized), 4)[:, -1]).mean()
    assert off["World_Encoder"][1].item() == pytest.approx(no_world.item(), abs=1e-4)
    unquantized = sensitivity(model, x, t=4, generator=torch.Generator().manual_seed(0), world_phase="unquantized")
    seq = psnr(x[:, 4], step_by_step(model, x[:, :1], a, world.inputs, 4)[:, -1]).mean()
    coded = psnr(x[:, 4], step_by_step(model, x[:, :1], a, world.quantized, 4)[:, -1]).mean()
    assert unquantized["World_Encoder"][1].item() == pytest.approx(seq.item(), abs=1e-4)
    assert abs(seq.item() - coded.item()) > 1e-3  # the two inputs differ: the test tells them apart


def test_weighted_mean_weighs_values_and_keeps_nan():
    from lwm.utils.metrics import WeightedMean

    m = WeightedMean()
    m.update(torch.tensor(1.0), weight=3)
    m.update(torch.tensor(5.0), weight=1)
    assert m.compute().item() == 2.0 and m.update_count == 2  # (3*1 + 1*5) / 4
    m.update(torch.tensor(float("nan")), weight=2)  # torchmetrics' MeanMetric drops it: a finite mean of fewer
    assert torch.isnan(m.compute())
    m.reset()
    m.update(torch.tensor([2.0, 4.0]))  # a tensor of values, each of weight 1
    assert m.compute().item() == 3.0


def test_attention_diagonality_of_uniform_attention_over_the_allowed_keys():
    """The levels the docs quote as "attends to nothing in particular": uniform attention under each mask, over the
    action encoder's queries 0..T-2 (its last frame gives no action): 2 (H_T - 1) / (T - 1) shifted-causal,
    H_{T-1} / (T - 1) causal."""
    from lwm.modules.st_transformer import temporal_mask

    def harmonic(n: int) -> float:
        return sum(1 / k for k in range(1, n + 1))

    for T, shifted, causal in ((16, 0.317, 0.221), (8, 0.491, 0.370)):  # (the docs' rounded values)
        for kind, level, closed in (("shifted_causal", shifted, 2 * (harmonic(T) - 1) / (T - 1)),
                                    ("causal", causal, harmonic(T - 1) / (T - 1))):
            allowed = temporal_mask(kind, T).float()
            uniform = allowed / allowed.sum(-1, keepdim=True)
            value = float(attention_diagonality(uniform[None, None, :-1]))
            assert value == pytest.approx(closed, rel=1e-6) and round(value, 3) == level


def test_attention_diagonality_leaves_out_queries_not_given():
    """Queries 0..T-2 on themselves and the next frame score exactly 1 whatever the last query (never trained:
    the action encoder drops its output) does; over all T queries, the untrained uniform row pulls it below."""
    T = 8
    attn = torch.zeros(1, 2, T, T)
    attn[..., torch.arange(T - 1), torch.arange(1, T)] = 1.0  # each query on the next frame
    attn[..., T - 1, :] = 1.0 / T  # the last query: uniform
    assert float(attention_diagonality(attn[..., :-1, :])) == 1.0
    assert float(attention_diagonality(attn)) == pytest.approx((T - 1 + 1 / T) / T)


def test_random_indices_draw_every_code_of_every_level_uniformly():
    sizes, n = (2, 3, 5), 6000
    idx = random_indices(sizes, (n,), torch.Generator().manual_seed(0))
    assert idx.shape == (n, 3)
    for level, k in enumerate(sizes):
        counts = torch.bincount(idx[:, level], minlength=k)
        assert counts.numel() == k and ((counts.float() / n - 1 / k).abs() < 0.03).all(), (level, counts.tolist())

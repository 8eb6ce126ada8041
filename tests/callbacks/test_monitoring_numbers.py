"""Known answers for the monitoring numbers users read (from a mutation review of the callbacks): NMI's normalisation, the
probes' held-out count, sensitivity under the world curriculum and per batch stream, attention diagonality over heads,
blocks and ranks, and validations that start afresh."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lwm.callbacks import GroundTruthProbes, Sensitivity
from lwm.utils.metrics import nmi, probe_train_size, sensitivity
from lwm.training.optim import OptimConfig
from lwm.training.module import WorldModelModule
from lwm.utils.seeds import seeded_generator
from tests.callbacks.test_callbacks import _feed, _probe_windows, _validate
from tests.lightning.helpers import accumulation_counters
from tests.lightning.test_module import NET, _batches


def test_nmi_is_the_arithmetic_normalisation():
    """A refinement of a 2-class labelling into 4 singletons: I = ln 2, H(pred) = 2 ln 2, H(true) = ln 2: the
    arithmetic mean gives 2/3 (geometric 0.707, max 0.5, min 1)."""
    assert nmi(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 1, 1])).item() == pytest.approx(2 / 3, abs=1e-6)


def test_probe_samples_is_the_held_out_count_when_the_count_is_odd():
    """11 windows of 3 transitions: 33 action samples, 16 for training and 17 held out; 11 world samples, 6 and 5."""
    torch.manual_seed(0)
    model = WorldModelModule(net=NET).model
    logged = {}
    trainer = SimpleNamespace(world_size=1, sanity_checking=False, is_global_zero=True,
                              strategy=SimpleNamespace(broadcast=lambda obj, src=0: obj))
    pl_module = SimpleNamespace(model=model, log_dict=lambda logs, **kwargs: logged.update(logs))
    probes = GroundTruthProbes()
    _feed(probes, _probe_windows(n=11), 4, trainer, pl_module)
    probes.on_validation_epoch_end(trainer, pl_module)
    assert probe_train_size(33) == 16 and probe_train_size(11) == 6
    assert logged["Val_Action_Encoder/probe_samples"] == 17.0
    assert logged["Val_World_Encoder/probe_samples"] == 5.0


def test_sensitivity_callback_feeds_the_world_of_the_weights_curriculum_phase():
    """Under world_curriculum=(5, 0) the weights of step 0 are in the "off" phase: the predictor gets no world, a random
    world is none either: the logged world dPSNR is exactly 0, and PSNR_seq is the rollout without a world."""
    torch.manual_seed(0)
    module = WorldModelModule(net=dataclasses.replace(NET, world_curriculum=(5, 0)),
                              optim=OptimConfig(warmup_steps=0))
    assert module.weights_world_phase == "off"
    data = _batches(1)
    logged = _validate(module, Sensitivity(t=4), data)
    module.eval()
    expected = sensitivity(module.model, data[0]["latents"], 4, seeded_generator("cpu", 0, 0, 0), "off")
    quantized = sensitivity(module.model, data[0]["latents"], 4, seeded_generator("cpu", 0, 0, 0), "quantized")
    assert abs(float(quantized["World_Encoder"][0])) > 1e-3  # the phases tell apart here
    assert logged["Val_World_Encoder/dPSNR"] == 0.0
    for i, name in enumerate(Sensitivity.NAMES):
        assert logged[f"Val_World_Encoder/{name}"] == pytest.approx(float(expected["World_Encoder"][i]), abs=1e-5)


def test_sensitivity_random_codes_are_drawn_per_batch_stream():
    """Each validation batch draws its random codes from its own (seed, batch, rank) stream: PSNR_rand of two batches
    is the clip-weighted mean of the per-batch values with those streams."""
    torch.manual_seed(0)
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))
    data = _batches(2)
    logged = _validate(module, Sensitivity(t=4, batches=2, seed=0), data)
    module.eval()
    per = [sensitivity(module.model, b["latents"], 4, seeded_generator("cpu", 0, i, 0)) for i, b in enumerate(data)]
    for q in ("Action_Encoder", "World_Encoder"):
        expected = (float(per[0][q][2]) + float(per[1][q][2])) / 2  # batches of 2 clips each
        assert logged[f"Val_{q}/PSNR_rand"] == pytest.approx(expected, rel=1e-5), q


def test_attention_diagonality_averages_the_heads():
    """Head 0 on itself (1.0), head 1 on frame 0 (query 0 alone on its diagonal: 1/Q): their mean, not the max."""
    from lwm.utils.metrics import attention_diagonality

    T, Q = 5, 4
    attn = torch.zeros(1, 2, Q, T)
    attn[0, 0, torch.arange(Q), torch.arange(Q)] = 1.0
    attn[0, 1, :, 0] = 1.0
    assert float(attention_diagonality(attn)) == pytest.approx((1.0 + 1 / Q) / 2)


def test_attention_diagonality_logs_every_block():
    """depth_action=2: block 0 (shifted mask) and block 1 each logged, each its own block's value."""
    from lwm.callbacks import AttentionDiagonality
    from lwm.utils.metrics import attention_diagonality

    torch.manual_seed(0)
    module = WorldModelModule(net=dataclasses.replace(NET, depth_action=2), optim=OptimConfig(warmup_steps=0))
    data = _batches(1)
    logged = _validate(module, AttentionDiagonality(), data)
    module.eval()
    with torch.no_grad():
        attn = module.model.action_attention(data[0]["latents"])
    assert len(attn) == 2
    values = [float(attention_diagonality(a[..., :-1, :]).mean()) for a in attn]
    assert abs(values[0] - values[1]) > 1e-4
    for block, value in enumerate(values):
        assert logged[f"Val_Action_Encoder/attention_diagonality_block_{block}/mean"] == pytest.approx(value, rel=1e-5)


def test_training_attention_diagonality_is_over_every_ranks_clips(monkeypatch):
    """Under DDP the training histogram holds every rank's clips (faked: the other rank's clips all score 1.0)."""
    import contextlib

    from lwm.callbacks import AttentionDiagonality, attention

    torch.manual_seed(0)
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))
    module.eval()
    x = _batches(1)[0]["latents"]
    other = [torch.ones(3)]
    monkeypatch.setattr(attention, "every_rank", lambda trainer, obj: [obj, other])
    sent = {}
    monkeypatch.setattr(attention, "log_distribution", lambda pl_module, name, values: sent.update({name: values}))
    trainer = SimpleNamespace(world_size=2, log_every_n_steps=2, global_step=1, **accumulation_counters(ended=False),
                              precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext))
    AttentionDiagonality().on_train_batch_start(trainer, module, {"latents": x}, 1)
    with torch.no_grad():
        mine = attention_diagonality_of(module, x)
    values = sent["Train_Action_Encoder/attention_diagonality_block_0"]
    assert torch.allclose(values, torch.cat([mine, torch.ones(3)]))


def attention_diagonality_of(module, x):
    from lwm.utils.metrics import attention_diagonality

    return attention_diagonality(module.model.action_attention(x)[0][..., :-1, :])


@pytest.mark.slow
def test_a_second_validation_logs_its_own_windows_only():
    """The same callback instances validate twice (as in a fit) on other windows: the second logs equal those of a
    fresh callback on the second windows alone (nothing carried over from the first validation)."""
    from lwm.callbacks import AttentionDiagonality, CopyLastBaseline
    from tests.callbacks.test_callbacks import _labelled

    def validate(module, callbacks, data):
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=callbacks)
        trainer.validate(module, torch.utils.data.DataLoader(data, batch_size=None), verbose=False)
        return {k: float(v) for k, v in trainer.callback_metrics.items()}

    make = lambda: [CopyLastBaseline(), AttentionDiagonality(), GroundTruthProbes()]
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))
    first = _labelled(2)
    second = [{**b, "latents": b["latents"].flip(1) * 0.5} for b in _labelled(3)[1:]]
    reused = make()
    validate(module, reused, first)
    again = validate(module, reused, second)
    fresh = validate(module, make(), second)
    keys = ["Val_Dynamics_Predictor/copy_last_loss", "Val_Action_Encoder/attention_diagonality_block_0/mean",
            "Val_Action_Encoder/attention_diagonality_block_0/min", "Val_Action_Encoder/probe_samples"]
    for key in keys:
        assert again[key] == pytest.approx(fresh[key], rel=1e-6), key

"""Each monitoring callback on its own, through a real Trainer.validate / fit on a tiny model: what it logs
equals the metric computed directly on the same batches (an identity), or a known answer."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lwm.callbacks import AttentionDiagonality, CodebookMonitor, DeadCodeRevival, Sensitivity
from lwm.metrics import attention_diagonality, codebook_usage, sensitivity
from lwm.module import OptimConfig, WorldModelModule
from lwm.seeds import seeded_generator
from tests.lightning.test_module import NET, _batches


def _module() -> WorldModelModule:
    torch.manual_seed(0)
    return WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))


def _validate(module, callback, batches) -> dict[str, float]:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    trainer.validate(module, torch.utils.data.DataLoader(batches, batch_size=None), verbose=False)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def _action_codes(module, data) -> torch.Tensor:
    """The action-code tuples ``[N, La]`` of every transition of ``data``, computed directly (eval mode)."""
    module.eval()
    with torch.no_grad():
        return torch.cat([module.model.encode_actions(b["latents"]).indices.flatten(0, 1) for b in data])


def test_attention_diagonality_logs_the_metric_of_the_first_batches():
    module, data = _module(), _batches(3)
    logged = _validate(module, AttentionDiagonality(batches=2), data)
    module.eval()
    with torch.no_grad():
        values = torch.cat([attention_diagonality(module.model.action_attention(b["latents"])[0]) for b in data[:2]])
    for stat, expected in (("min", values.min()), ("mean", values.mean()), ("max", values.max())):
        assert logged[f"Val_Action_Encoder/attention_diagonality_block_0/{stat}"] == pytest.approx(float(expected), rel=1e-5)


def test_attention_diagonality_of_the_training_batch_at_the_logging_steps():
    module = _module()
    seen = []

    class Spy(L.Callback):  # runs before the monitor: records the batch it will see
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(batch["latents"].clone())

    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, log_every_n_steps=2, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[Spy(), AttentionDiagonality()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_batches(4), batch_size=None))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    with torch.no_grad():
        values = attention_diagonality(module.model.action_attention(seen[-1])[0])  # weights after the last step
    for stat, expected in (("min", values.min()), ("mean", values.mean()), ("max", values.max())):
        assert logged[f"Train_Action_Encoder/attention_diagonality_block_0/{stat}"] == pytest.approx(float(expected),
                                                                                                   rel=1e-5)


def test_codebook_monitor_validation_usage_per_batch_and_coverage_of_the_set():
    module, data = _module(), _batches(3)
    logged = _validate(module, CodebookMonitor(), data)
    per_batch = torch.stack([codebook_usage(_action_codes(module, [b]), NET.codebook_sizes_action) for b in data])
    coverage = codebook_usage(_action_codes(module, data), NET.codebook_sizes_action)
    for level in range(len(NET.codebook_sizes_action)):
        assert logged[f"Val_Action_Encoder/codebook_usage_level_{level}"] == pytest.approx(float(per_batch[:, level].mean()))
        assert logged[f"Val_Action_Encoder/codebook_coverage_level_{level}"] == pytest.approx(float(coverage[level]))
    assert any(float(per_batch[:, level].mean()) < float(coverage[level]) for level in range(2))  # they differ
    assert logged["Val_Action_Encoder/codebook_diversity_min_level_0"] >= 0


def test_sensitivity_logs_the_metric_and_zero_when_codes_do_not_matter():
    module, data = _module(), _batches(2)
    logged = _validate(module, Sensitivity(t=4, batches=1, seed=0), data)
    module.eval()
    generator = seeded_generator("cpu", 0, 0, 0)  # the callback's stream for seed 0, batch 0, rank 0
    expected = sensitivity(module.model, data[0]["latents"], 4, generator)
    for name, value in zip(Sensitivity.NAMES, expected["Action_Encoder"]):
        assert logged[f"Val_Action_Encoder/{name}"] == pytest.approx(float(value), rel=1e-5, abs=1e-6)
    with torch.no_grad():
        module.model.dynamics.action_proj.weight.zero_()
        module.model.dynamics.world_proj.weight.zero_()
    logged = _validate(module, Sensitivity(t=4), data)
    assert logged["Val_Action_Encoder/dPSNR"] == pytest.approx(0.0, abs=1e-5)
    assert logged["Val_World_Encoder/dPSNR"] == pytest.approx(0.0, abs=1e-5)


def test_codebook_monitor_training_usage_and_ema_decay_at_the_logging_steps():
    module = _module()
    seen = []

    class Spy(L.Callback):  # runs before the monitor: records what the monitor will see
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((trainer.global_step, outputs["Action_Encoder"].clone()))

    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, log_every_n_steps=2, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[Spy(), CodebookMonitor()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_batches(4), batch_size=None))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    step, last = seen[-1]
    assert logged["Train_Action_Encoder/codebook_usage_level_1"] == pytest.approx(
        float(codebook_usage(last, NET.codebook_sizes_action)[1]))
    # the decay of the update this step made: training_step ran at global step `step - 1` (the optimizer has
    # stepped since); NET's decay schedule is still ramping at step 3, so an off-by-one fails here
    rvq = module.model.action_encoder.rvq
    assert rvq.decay_at(step) != rvq.decay_at(step - 1)
    assert logged["Train_Action_Encoder/ema_decay"] == pytest.approx(rvq.decay_at(step - 1))


def test_revival_validates_its_interval():
    with pytest.raises(ValueError, match="every_n_steps"):
        DeadCodeRevival(every_n_steps=0)


def test_rollout_videos_are_written_every_n_validations_and_sent_to_wandb(tmp_path):
    import imageio.v3 as iio
    import wandb
    from lwm.callbacks import RolloutVideos
    from tests.lightning.helpers import WandbLogger

    wandb_logger = WandbLogger()
    sent = wandb_logger.sent
    module, data = _module(), _batches(4)
    callback = RolloutVideos(every_n_validations=2, clips=2)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=[wandb_logger], default_root_dir=tmp_path,
                        callbacks=[callback], val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer.fit(module, loader, loader)  # validations after steps 1, 2 and 3: the 1st and the 3rd are due
    videos = sorted(p.name for p in (tmp_path / "videos").glob("*.mp4"))
    assert videos == ["step_0000001.mp4", "step_0000003.mp4"]  # named by the weights' step, as checkpoints are
    assert [s["trainer/global_step"] for s in sent] == [0, 2]  # at the step of those validations' scalars
    frames = iio.imread(tmp_path / "videos" / videos[0], plugin="pyav")
    assert frames.shape[0] == 6  # the clip's 6 frames: frame 0, then 5 generated
    assert isinstance(sent[0]["Val_Dynamics_Predictor/rollout_video"], wandb.Video)
    assert callback.state_dict() == {"validations": 3}
    resumed = RolloutVideos(every_n_validations=2)  # a resumed fit keeps the cadence: its next (4th) is not due
    resumed.load_state_dict(callback.state_dict())
    assert resumed._validations == 3
    trainer.validate(module, loader, verbose=False)  # `lwm validate`: always a video
    assert len(sent) == 3


def _labelled(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for b in _batches(n):
        B, T = b["latents"].shape[:2]
        out.append({**b, "actions": torch.randint(0, 5, (B, T), generator=g), "world_label": torch.arange(B) % 2})
    return out


def test_copy_last_baseline_is_the_weighted_mean_over_the_validation_set():
    from lwm.callbacks import CopyLastBaseline
    from lwm.metrics import copy_last_loss

    data = _batches(3)
    logged = _validate(_module(), CopyLastBaseline(), data)
    expected = sum(copy_last_loss(b["latents"]) * b["latents"].shape[0] for b in data) / sum(b["latents"].shape[0] for b in data)
    assert logged["Val_Dynamics_Predictor/copy_last_loss"] == pytest.approx(float(expected), rel=1e-6)
    # PSNRs of the mean MSEs (peak 1): the baseline's and the model's teacher forcing, side by side
    assert logged["Val_Dynamics_Predictor/copy_last_psnr"] == pytest.approx(10 * math.log10(1 / float(expected)), rel=1e-5)
    tf = logged["Val_Dynamics_Predictor/tf_loss"]
    assert logged["Val_Dynamics_Predictor/tf_psnr"] == pytest.approx(10 * math.log10(1 / tf), rel=1e-5)


def test_probes_log_nmi_and_probe_accuracy_of_the_codes_against_the_labels():
    from lwm.callbacks import GroundTruthProbes
    from lwm.metrics import code_ids, nmi

    module, data = _module(), _labelled(3)
    logged = _validate(module, GroundTruthProbes(), data)
    codes = _action_codes(module, data)
    labels = torch.cat([b["actions"][:, :-1].flatten() for b in data])  # a_i <-> the action after frame i
    expected = nmi(code_ids(codes, NET.codebook_sizes_action), labels)
    assert logged["Val_Action_Encoder/nmi"] == pytest.approx(float(expected), abs=1e-6)
    for name in ("Action_Encoder", "World_Encoder"):
        assert 0.0 <= logged[f"Val_{name}/probe_accuracy"] <= 1.0 and 0.0 < logged[f"Val_{name}/probe_chance"] <= 1.0
    # the held-out half: every labelled transition counted, the probe trains on round(n / 2) of them
    assert logged["Val_Action_Encoder/probe_samples"] == len(labels) - round(len(labels) / 2)
    unlabelled = _validate(_module(), GroundTruthProbes(), _batches(2))  # no labels: nothing logged
    assert not any(k.endswith("/nmi") for k in unlabelled)


def test_slurm_requeue_ranks_agree_every_n_steps_and_skip_the_code_dictionaries(tmp_path):
    """With several ranks the requeue decision is a collective (and a host read): taken every n steps only. A
    signal before step 1 is acted on at step 10; the preempted run then writes no code dictionaries."""
    import signal
    from types import SimpleNamespace

    from lwm.callbacks import CodeDictionaries, SlurmRequeue

    requeue = SlurmRequeue(every_n_steps=10)
    requeue._active = True  # as on_train_start does under SLURM with auto-requeue
    decisions, saved = [], []
    trainer = SimpleNamespace(
        world_size=2, global_step=0, is_global_zero=False, should_stop=False, default_root_dir=str(tmp_path),
        strategy=SimpleNamespace(reduce_boolean_decision=lambda d, all: decisions.append(d) or d),
        _checkpoint_connector=SimpleNamespace(hpc_save_path=lambda root: f"{root}/hpc_ckpt_1.ckpt"),
        save_checkpoint=saved.append, checkpoint_callbacks=[],
        fit_loop=SimpleNamespace(_should_accumulate=lambda: False),
    )
    for step in range(1, 30):
        if step == 1:
            requeue._on_signal(signal.SIGUSR1, None)
        trainer.global_step = step
        requeue.on_train_batch_end(trainer)
        if trainer.should_stop:
            break
    # at step 10 only: whether any rank got a signal, then whether any got the requeue one (SIGUSR1)
    assert decisions == [True, True] and trainer.global_step == 10 and saved == [f"{tmp_path}/hpc_ckpt_1.ckpt"]
    assert requeue.preempted

    class NoLoader:
        def code_loader(self, *args):
            raise AssertionError("a preempted run encoded the training windows")

    CodeDictionaries().on_train_end(SimpleNamespace(datamodule=NoLoader(), callbacks=[requeue]), None)


def test_slurm_sigterm_saves_without_requeueing(tmp_path, monkeypatch):
    """SLURM preempts with SIGTERM by default (and scancel sends it): the run saves at the batch end and stops,
    and leaves the requeue to SLURM (no `scontrol requeue`)."""
    import signal
    import subprocess
    from types import SimpleNamespace

    from lwm.callbacks import SlurmRequeue

    calls = []
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: calls.append(a) or 0)
    requeue = SlurmRequeue()
    requeue._active = True
    saved = []
    trainer = SimpleNamespace(
        world_size=1, global_step=3, is_global_zero=True, should_stop=False, default_root_dir=str(tmp_path),
        _checkpoint_connector=SimpleNamespace(hpc_save_path=lambda root: f"{root}/hpc_ckpt_1.ckpt"),
        save_checkpoint=saved.append, checkpoint_callbacks=[],
        fit_loop=SimpleNamespace(_should_accumulate=lambda: False),
    )
    requeue._on_signal(signal.SIGTERM, None)
    requeue.on_train_batch_end(trainer)
    assert saved == [f"{tmp_path}/hpc_ckpt_1.ckpt"] and trainer.should_stop and calls == []
    requeue._on_signal(signal.SIGUSR1, None)  # the requeue signal: saves and requeues
    trainer.should_stop = False
    requeue.on_train_batch_end(trainer)
    assert len(saved) == 2 and trainer.should_stop and calls and calls[0][0][:2] == ["scontrol", "requeue"]


def test_codebook_monitor_training_usage_is_the_mean_over_ranks():
    """Under DDP each rank's batch (of data.batch_size) gives its usage; the logged value is their mean (the
    strategy's reduce, faked here as 2 ranks where the other rank's usage is 1.0 at every level)."""
    from types import SimpleNamespace

    module = _module()
    reduced = []

    def reduce(value, reduce_op):
        reduced.append(reduce_op)
        return (value + 1.0) / 2  # this rank's and a rank that uses every code

    logged = {}
    trainer = SimpleNamespace(global_step=2, log_every_n_steps=2, world_size=2, validating=False,
                              sanity_checking=False, is_global_zero=True, strategy=SimpleNamespace(reduce=reduce))
    pl_module = SimpleNamespace(model=module.model, trainer=trainer, loggers=[],
                                log_dict=lambda logs, **kwargs: logged.update(logs))
    codes = torch.tensor([[[0, 1], [0, 2]]])  # action codes: level 0 uses 1 of 4, level 1 uses 2 of 8
    outputs = {"Action_Encoder": codes, "World_Encoder": torch.tensor([[0, 0]])}
    CodebookMonitor().on_train_batch_end(trainer, pl_module, outputs, None, 0)
    assert reduced[:1] == ["mean"]
    assert logged["Train_Action_Encoder/codebook_usage_level_0"] == pytest.approx((0.25 + 1) / 2)
    assert logged["Train_Action_Encoder/codebook_usage_level_1"] == pytest.approx((0.25 + 1) / 2)

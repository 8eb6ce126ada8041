"""Each monitoring callback on its own, through a real Trainer.validate / fit on a tiny model: what it logs
equals the metric computed directly on the same batches (an identity), or a known answer."""

from __future__ import annotations

import math
import signal
from types import SimpleNamespace
from unittest import mock

import lightning as L
import pytest
import torch

from lwm.callbacks import (
    AttentionDiagonality, CodebookMonitor, CodeDictionaries, DeadCodeRevival, FlopCounter, GroundTruthProbes,
    RolloutVideos, Sensitivity, SlurmRequeue,
)
from lwm.utils.errors import ConfigError
from lwm.utils.metrics import attention_diagonality, codebook_diversity, codebook_usage, sensitivity
from lwm.training.optim import OptimConfig
from lwm.training.module import WorldModelModule
from lwm.utils.seeds import seeded_generator
from tests.lightning.helpers import accumulation_counters
from tests.lightning.test_module import NET, _batches, _fit


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
        values = torch.cat([attention_diagonality(module.model.action_attention(b["latents"])[0][..., :-1, :])
                            for b in data[:2]])
    for stat, expected in (("min", values.min()), ("mean", values.mean()), ("max", values.max())):
        assert logged[f"Val_Action_Encoder/attention_diagonality_block_0/{stat}"] == pytest.approx(float(expected), rel=1e-5)


def test_attention_diagonality_of_the_training_batch_at_the_logging_steps():
    """At the logging steps (the 2nd and 4th of 4: log_every_n_steps=2), of the step's batch under the weights the
    step's losses describe: before its update."""
    import copy

    torch.manual_seed(0)
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0, lr=3e-2))  # steps that move the attention
    seen = []

    class Spy(L.Callback):  # runs before the monitor: records the batch and the weights it will see
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((batch["latents"].clone(), copy.deepcopy(pl_module.model.state_dict())))

    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, log_every_n_steps=2, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[Spy(), AttentionDiagonality()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_batches(4), batch_size=None))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    x, weights = seen[-1]  # the 4th batch, before its update
    before = _module().model.eval()
    before.load_state_dict(weights)
    with torch.no_grad():
        values = attention_diagonality(before.action_attention(x)[0][..., :-1, :])
        after = attention_diagonality(module.model.action_attention(x)[0][..., :-1, :])
    assert (values - after).abs().max() > 1e-4  # the update moved it, far past the tolerance below: told apart
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


def test_sensitivity_logs_the_metric_and_zero_when_codes_do_not_matter():
    module, data = _module(), _batches(2)
    logged = _validate(module, Sensitivity(t=4, batches=1, seed=0), data)
    module.eval()
    generator = seeded_generator("cpu", 0, 0, 0)  # the callback's stream for seed 0, batch 0, rank 0
    expected = sensitivity(module.model, data[0]["latents"], 4, generator)
    for quantizer in ("Action_Encoder", "World_Encoder"):
        for name, value in zip(Sensitivity.NAMES, expected[quantizer]):
            assert logged[f"Val_{quantizer}/{name}"] == pytest.approx(float(value), rel=1e-5, abs=1e-6), (quantizer, name)
    assert abs(float(expected["World_Encoder"][0])) > 1e-3  # a random world changes frame 4 here
    assert float(expected["World_Encoder"][2]) != pytest.approx(float(expected["Action_Encoder"][2]), abs=1e-3)
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
    with pytest.raises(ConfigError, match=r"^revival\.every_n_steps must be >= 1"):
        DeadCodeRevival(every_n_steps=0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DeadCodeRevival(every_n_steps=0),
         "revival.every_n_steps must be >= 1 (or null: the logging interval), got 0"),
        (lambda: Sensitivity(t=0), "sensitivity.t must be >= 1, got 0"),
        (lambda: Sensitivity(batches=0), "sensitivity.batches must be >= 1, got 0"),
        (lambda: RolloutVideos(clips=0), "rollout_videos.clips must be >= 1, got 0"),
        (lambda: RolloutVideos(fps=0), "rollout_videos.fps must be >= 1, got 0"),
        (lambda: RolloutVideos(every_n_validations=0), "rollout_videos.every_n_validations must be >= 1, got 0"),
        (lambda: CodeDictionaries(max_windows=0), "code_dictionaries.max_windows must be >= 1 (or null: all), got 0"),
        (lambda: AttentionDiagonality(batches=-1), "diagonality.batches must be >= 1, got -1"),
        (lambda: SlurmRequeue(every_n_steps=0), "slurm_requeue.every_n_steps must be >= 1, got 0"),
        (lambda: FlopCounter(peak_tflops=-1.0), "flops.peak_tflops must be a finite number > 0 (the device's peak "
                                                "TFLOP/s; null: Lightning's figure for the device), got -1.0"),
        (lambda: FlopCounter(peak_tflops=math.inf), "flops.peak_tflops must be a finite number > 0"),
        (lambda: GroundTruthProbes(max_samples=0), "probes.max_samples must be >= 4 (the probe trains on half of "
                                                   "them and tests on the rest), got 0"),
    ],
)
def test_callback_settings_are_refused_naming_the_config_key(make, message):
    """A ConfigError (one `error:` line from the CLI) naming the key as users type it, not a ValueError traceback."""
    with pytest.raises(ConfigError) as e:
        make()
    assert str(e.value).startswith(message)


def test_sensitivity_frame_must_lie_in_the_window():
    """t >= data.window logged nothing at all; refused before the run, where the data module's window is known."""
    with pytest.raises(ConfigError) as e:
        Sensitivity(t=6).check_window(6)
    assert str(e.value) == "sensitivity.t must be < data.window (6: frames 0..5; frame t is generated from frame 0), got 6"
    Sensitivity(t=5).check_window(6)


@pytest.mark.slow
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
    sent = [row for row in sent if "Val_Dynamics_Predictor/rollout_video" in row]
    assert [s["trainer/global_step"] for s in sent] == [0, 2]  # in the rows of those validations' scalars
    assert all("Val_Total/loss" in s for s in sent)
    frames = iio.imread(tmp_path / "videos" / videos[0], plugin="pyav")
    assert frames.shape[0] == 6  # the clip's 6 frames: frame 0, then 5 generated
    assert isinstance(sent[0]["Val_Dynamics_Predictor/rollout_video"], wandb.Video)
    assert callback.state_dict() == {"validations": 3}
    resumed = RolloutVideos(every_n_validations=2)  # a resumed fit keeps the cadence: its next (4th) is not due
    resumed.load_state_dict(callback.state_dict())
    assert resumed._validations == 3
    trainer.validate(module, loader, verbose=False)  # `lwm validate`: always a video
    assert len([row for row in wandb_logger.sent if "Val_Dynamics_Predictor/rollout_video" in row]) == 3


def _labelled(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for b in _batches(n):
        B, T = b["latents"].shape[:2]
        out.append({**b, "actions": torch.randint(0, 5, (B, T), generator=g), "world_label": torch.arange(B) % 2})
    return out


def test_copy_last_baseline_is_the_weighted_mean_over_the_validation_set():
    from lwm.callbacks import CopyLastBaseline
    from lwm.utils.metrics import copy_last_loss

    data = _batches(3)
    data[1] = {"latents": data[1]["latents"][:1]}  # batches of 2, 1 and 2 clips
    logged = _validate(_module(), CopyLastBaseline(), data)
    per = [float(copy_last_loss(b["latents"])) for b in data]
    expected = (2 * per[0] + 1 * per[1] + 2 * per[2]) / 5
    assert abs(expected - sum(per) / 3) > 1e-4  # (so that the unweighted mean would differ)
    assert logged["Val_Dynamics_Predictor/copy_last_loss"] == pytest.approx(expected, rel=1e-6)
    # PSNRs of the mean MSEs (peak 1): the baseline's and the model's teacher forcing, side by side
    assert logged["Val_Dynamics_Predictor/copy_last_psnr"] == pytest.approx(10 * math.log10(1 / float(expected)), rel=1e-5)
    tf = logged["Val_Dynamics_Predictor/tf_loss"]
    assert logged["Val_Dynamics_Predictor/tf_psnr"] == pytest.approx(10 * math.log10(1 / tf), rel=1e-5)


@pytest.mark.slow
def test_probes_log_nmi_and_probe_accuracy_of_the_codes_against_the_labels():
    from lwm.callbacks import GroundTruthProbes
    from lwm.utils.metrics import code_ids, linear_probe_accuracy, nmi

    module, data = _module(), _labelled(3)
    with torch.no_grad():  # every world code level holds one vector k times: every clip gets the codes (0, ..., 0)
        for level in module.model.world_encoder.rvq.levels:
            level.embed.copy_(level.embed[:1].expand_as(level.embed))
    codes = _action_codes(module, data)  # (validation changes no weight: the codes the callback will see)
    per_batch = codes[:, 0].reshape(len(data), 2, -1)  # the true actions: the level-0 codes, which the probe can read
    data = [{**b, "actions": torch.cat([a, b["actions"][:, -1:]], dim=1)} for b, a in zip(data, per_batch)]
    logged = _validate(module, GroundTruthProbes(), data)
    labels = torch.cat([b["actions"][:, :-1].flatten() for b in data])  # a_i <-> the action after frame i
    expected = nmi(code_ids(codes, NET.codebook_sizes_action), labels)
    assert logged["Val_Action_Encoder/nmi"] == pytest.approx(float(expected), abs=1e-6)
    # the probe: linear_probe_accuracy on the quantized vectors of the codes (batches without file_index keep
    # their order of arrival) against the labels
    with torch.no_grad():
        world_codes = torch.cat([module.model.encode_world(b["latents"]).indices for b in data])
    world_labels = torch.cat([b["world_label"] for b in data])
    direct = {}
    for name, c, y in (("Action_Encoder", codes, labels), ("World_Encoder", world_codes, world_labels)):
        direct[name] = linear_probe_accuracy(module.model.quantizers[name].decode_indices(c), y)
        assert logged[f"Val_{name}/probe_accuracy"] == pytest.approx(direct[name][0], abs=1e-6), name
        assert logged[f"Val_{name}/probe_chance"] == pytest.approx(direct[name][1], abs=1e-6), name
    accuracy, chance = direct["Action_Encoder"]
    assert accuracy > chance + 0.3  # the codes carry these labels (and a swap of the two would show)
    # every clip has the same world code: identical features, a constant prediction, the training majority:
    # accuracy is exactly chance
    assert set(map(tuple, world_codes.tolist())) == {(0,) * len(NET.codebook_sizes_world)}
    assert direct["World_Encoder"][0] == direct["World_Encoder"][1]
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
    requeue._active = requeue._slurm = True  # as on_train_start does under SLURM with auto-requeue
    decisions, saved = [], []
    trainer = SimpleNamespace(
        world_size=2, global_step=0, is_global_zero=False, should_stop=False, default_root_dir=str(tmp_path),
        strategy=SimpleNamespace(reduce_boolean_decision=lambda d, all: decisions.append(d) or d),
        save_checkpoint=saved.append, checkpoint_callbacks=[],
        **accumulation_counters(),
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


def test_slurm_ranks_agree_in_validation_only_at_batches_every_rank_runs(tmp_path, monkeypatch):
    """In a fit's validation several ranks agree every n batches, and only at batches every rank runs (the ranks'
    shares of the validation windows may differ by a batch): a collective another rank never reaches would hang."""
    import signal
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import _TunerExitException

    from lwm.callbacks import SlurmRequeue

    requeue = SlurmRequeue(every_n_steps=4)
    requeue._active = requeue._slurm = True  # under SLURM
    decisions, saved = [], []
    trainer = SimpleNamespace(
        world_size=2, global_step=7, is_global_zero=False, sanity_checking=False, num_val_batches=[9],
        state=SimpleNamespace(fn="fit"), default_root_dir=str(tmp_path),
        strategy=SimpleNamespace(reduce_boolean_decision=lambda d, all: decisions.append(d) or d),
        save_checkpoint=saved.append, checkpoint_callbacks=[], **accumulation_counters(),
    )
    monkeypatch.setattr("lwm.callbacks.slurm.every_rank", lambda trainer, n: [n, n - 1])  # the other rank runs 8
    module = SimpleNamespace(device=torch.device("cpu"))
    requeue.on_validation_epoch_start(trainer, module)
    for batch_idx in range(9):
        requeue.on_validation_batch_end(trainer, module, None, None, batch_idx)
    assert decisions == [False, False] and not saved  # at batches 0 and 4; not 8, which the other rank lacks
    requeue.on_validation_epoch_start(trainer, module)
    requeue.on_validation_batch_end(trainer, module, None, None, 0)
    requeue._on_signal(signal.SIGTERM, None)
    for batch_idx in range(1, 4):  # acted on at the next agreement, batch 4: saved, and the fit ends there
        requeue.on_validation_batch_end(trainer, module, None, None, batch_idx)
    with pytest.raises(_TunerExitException):
        requeue.on_validation_batch_end(trainer, module, None, None, 4)
    assert saved == [f"{tmp_path}/hpc_ckpt_1.ckpt"] and requeue.preempted
    trainer.sanity_checking, requeue.preempted = True, False  # the sanity check: left to the first training batch
    requeue._on_signal(signal.SIGTERM, None)
    requeue.on_validation_batch_end(trainer, module, None, None, 0)
    assert len(saved) == 1 and requeue._requested


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
    requeue._active = requeue._slurm = True  # under SLURM
    saved = []
    trainer = SimpleNamespace(
        world_size=1, global_step=3, is_global_zero=True, should_stop=False, default_root_dir=str(tmp_path),
        save_checkpoint=saved.append, checkpoint_callbacks=[],
        **accumulation_counters(),
    )
    requeue._on_signal(signal.SIGTERM, None)
    requeue.on_train_batch_end(trainer)
    assert saved == [f"{tmp_path}/hpc_ckpt_1.ckpt"] and trainer.should_stop and calls == []
    requeue._on_signal(signal.SIGUSR1, None)  # the requeue signal: saves and requeues
    trainer.should_stop = False
    requeue.on_train_batch_end(trainer)
    assert len(saved) == 2 and trainer.should_stop and calls and calls[0][0][:2] == ["scontrol", "requeue"]


def test_a_preemption_removes_the_older_hpc_checkpoints_once_its_own_is_written(tmp_path):
    """One hpc checkpoint per preemption (Lightning resumes from the highest number and keeps the rest): the new
    one written, the older ones (files, or DeepSpeed folders) are removed; others' files stay."""
    import signal
    from types import SimpleNamespace

    from lwm.callbacks import SlurmRequeue

    (tmp_path / "hpc_ckpt_1.ckpt").write_text("x")
    (tmp_path / "hpc_ckpt_2.ckpt").mkdir()  # DeepSpeed's
    (tmp_path / "hpc_ckpt_2.ckpt/state.pt").write_text("x")
    (tmp_path / "hpc_ckpt_x.ckpt").write_text("x")
    requeue = SlurmRequeue()
    requeue._active = requeue._slurm = True
    trainer = SimpleNamespace(
        world_size=1, global_step=3, is_global_zero=True, should_stop=False, default_root_dir=str(tmp_path),
        save_checkpoint=lambda path: open(path, "w").close(), checkpoint_callbacks=[],
        **accumulation_counters(),
    )
    requeue._on_signal(signal.SIGTERM, None)
    requeue.on_train_batch_end(trainer)
    assert trainer.should_stop
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_3.ckpt", "hpc_ckpt_x.ckpt"]


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
    trainer = SimpleNamespace(global_step=2, log_every_n_steps=2, world_size=2, validating=False, should_stop=False,
                              sanity_checking=False, is_global_zero=True, strategy=SimpleNamespace(reduce=reduce),
                              **accumulation_counters())
    pl_module = SimpleNamespace(model=module.model, trainer=trainer, loggers=[],
                                log_dict=lambda logs, **kwargs: logged.update(logs))
    codes = torch.tensor([[[0, 1], [0, 2]]])  # action codes: level 0 uses 1 of 4, level 1 uses 2 of 8
    outputs = {"Action_Encoder": codes, "World_Encoder": torch.tensor([[0, 0]])}
    CodebookMonitor().on_train_batch_end(trainer, pl_module, outputs, None, 0)
    assert reduced[:1] == ["mean"]
    assert logged["Train_Action_Encoder/codebook_usage_level_0"] == pytest.approx((0.25 + 1) / 2)
    assert logged["Train_Action_Encoder/codebook_usage_level_1"] == pytest.approx((0.25 + 1) / 2)


# the diversity of every level is that level's codebook's (min, max, mean)
def test_codebook_diversity_is_logged_per_level():
    torch.manual_seed(0)
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[CodebookMonitor()])
    trainer.validate(module, torch.utils.data.DataLoader(_batches(2), batch_size=None), verbose=False)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    for name, quantizer in module.model.quantizers.items():
        for level in range(quantizer.num_levels):
            lo, hi, mean = codebook_diversity(quantizer.codebook(level))
            assert lo < hi
            for stat, value in (("min", lo), ("max", hi), ("mean", mean)):
                assert logged[f"Val_{name}/codebook_diversity_{stat}_level_{level}"] == pytest.approx(float(value)), \
                    (name, level, stat)


# sensitivity is the clip-weighted mean over batches of different sizes
def test_sensitivity_is_weighted_by_clips():
    torch.manual_seed(0)
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))
    data = _batches(2)
    data[1] = {"latents": data[1]["latents"][:1]}
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Sensitivity(t=4, batches=2, seed=0)])
    trainer.validate(module, torch.utils.data.DataLoader(data, batch_size=None), verbose=False)
    module.eval()
    per = [sensitivity(module.model, b["latents"], 4, seeded_generator("cpu", 0, i, 0)) for i, b in enumerate(data)]
    expected = (2 * float(per[0]["Action_Encoder"][1]) + float(per[1]["Action_Encoder"][1])) / 3
    assert abs(float(per[0]["Action_Encoder"][1]) - float(per[1]["Action_Encoder"][1])) > 1e-3
    assert float(trainer.callback_metrics["Val_Action_Encoder/PSNR_seq"]) == pytest.approx(expected, rel=1e-5)


# the random codes are the same at every validation (not a function of the step)
def test_sensitivity_random_codes_do_not_depend_on_the_step():
    torch.manual_seed(0)
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))
    expected = {}

    class Expect(L.Callback):  # before Sensitivity: the same weights, the documented stream
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            if batch_idx == 0 and not trainer.sanity_checking:
                r = sensitivity(pl_module.model, batch["latents"], 4, seeded_generator("cpu", 0, 0, 0))
                expected["rand"] = float(r["Action_Encoder"][2])

    loader = torch.utils.data.DataLoader(_batches(2), batch_size=None)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        val_check_interval=1, limit_val_batches=1, callbacks=[Expect(), Sensitivity(t=4)])
    trainer.fit(module, loader, loader)
    assert trainer.global_step == 2
    assert float(trainer.callback_metrics["Val_Action_Encoder/PSNR_rand"]) == pytest.approx(expected["rand"], rel=1e-5)


class _FakeTrainer:
    strategy = object()
    accumulate_grad_batches = 2
    precision_plugin = type("P", (), {"forward_context": staticmethod(lambda: __import__("contextlib").nullcontext())})


# a step of accumulate_grad_batches batches costs that many batches' FLOPs
def test_flops_per_step_count_every_accumulated_batch():
    from lwm.callbacks.flop_counter import FlopCounter

    module = WorldModelModule(net=NET).train()
    x = torch.tanh(torch.randn(2, 6, 4, 16, 16))
    counter = FlopCounter()
    counter.on_train_batch_start(_FakeTrainer(), module, {"latents": x}, 0)
    assert counter.flops_per_step == 2 * FlopCounter()._measure(_FakeTrainer(), module, x)


# cumulative TFLOPs count every rank
def test_cumulative_tflops_count_every_rank():
    from lwm.callbacks.flop_counter import FlopCounter

    counter = FlopCounter()
    counter.flops_per_step = int(1e12)
    assert counter._cumulative_tflops(SimpleNamespace(world_size=2, global_step=3)) == pytest.approx(6.0)


# a run resumed on another number of GPUs goes on from the checkpoint's sum
def test_cumulative_tflops_travel_with_checkpoints_across_world_sizes():
    from lwm.callbacks.flop_counter import FlopCounter

    counter = FlopCounter()
    counter.flops_per_step = int(1e12)
    assert counter._cumulative_tflops(SimpleNamespace(world_size=4, global_step=10)) == pytest.approx(40.0)
    resumed = FlopCounter()
    resumed.load_state_dict(counter.state_dict())
    resumed.flops_per_step = int(1e12)  # measured again on the resumed run's first batch
    assert resumed._cumulative_tflops(SimpleNamespace(world_size=1, global_step=10)) == pytest.approx(40.0)
    assert resumed._cumulative_tflops(SimpleNamespace(world_size=1, global_step=15)) == pytest.approx(45.0)
    # the same step again (the validation after the step's batch) adds nothing; steps 15-17 on 2 ranks add 4
    assert resumed._cumulative_tflops(SimpleNamespace(world_size=1, global_step=15)) == pytest.approx(45.0)
    assert resumed._cumulative_tflops(SimpleNamespace(world_size=2, global_step=17)) == pytest.approx(49.0)


# the step's FLOPs are the useful ones (masked attention for its allowed pairs), below the dense count
def test_flop_counter_counts_useful_attention_flops():
    from lwm.callbacks.flop_counter import FlopCounter
    from lwm.modules.flops import count_flops

    module = WorldModelModule(net=NET).train()
    x = torch.tanh(torch.randn(2, 6, 4, 16, 16))

    def step():
        loss = module.model.compute(x[:1], step=None, generator=torch.Generator().manual_seed(0)).loss
        loss.backward()
        module.zero_grad(set_to_none=True)

    trainer = _FakeTrainer()
    trainer.accumulate_grad_batches = 1
    counted = count_flops(step)
    assert counted.useful < counted.dense
    assert FlopCounter()._measure(trainer, module, x) == counted.useful * 2


def _slurm_trainer(tmp_path, accumulating, callbacks=()):
    saved = []
    trainer = SimpleNamespace(
        world_size=1, global_step=3, is_global_zero=True, should_stop=False, default_root_dir=str(tmp_path),
        save_checkpoint=saved.append, checkpoint_callbacks=list(callbacks),
        **accumulation_counters(lambda: accumulating[0]),
    )
    return trainer, saved


# no save inside a gradient-accumulation window; the save comes at the batch that ends the step
def test_slurm_does_not_save_inside_an_accumulation_window(tmp_path):
    from lwm.callbacks import SlurmRequeue

    requeue = SlurmRequeue()
    requeue._active = requeue._slurm = True  # under SLURM
    accumulating = [True]
    trainer, saved = _slurm_trainer(tmp_path, accumulating)
    requeue._on_signal(signal.SIGTERM, None)
    requeue.on_train_batch_end(trainer)
    assert saved == [] and not trainer.should_stop
    accumulating[0] = False
    requeue.on_train_batch_end(trainer)
    assert saved == [f"{tmp_path}/hpc_ckpt_1.ckpt"] and trainer.should_stop


# a preemption also rewrites last.ckpt (with the step checkpoint if due) through lwm's ModelCheckpoint
def test_slurm_preemption_writes_last_ckpt_too(tmp_path):
    from lwm.callbacks import SlurmRequeue
    from lwm.training.checkpoint import ModelCheckpoint

    stops = []

    class Recording(ModelCheckpoint):
        def save_stop_now(self, trainer):
            stops.append(trainer.global_step)

    requeue = SlurmRequeue()
    requeue._active = requeue._slurm = True  # under SLURM
    trainer, saved = _slurm_trainer(tmp_path, [False], callbacks=[Recording()])
    requeue._on_signal(signal.SIGTERM, None)
    requeue.on_train_batch_end(trainer)
    assert saved and stops == [3]


# revival draws from stream 1 of the step's generator, at the steps divisible by every_n_steps
def test_revival_uses_stream_one_at_its_steps():
    from dataclasses import replace

    from lwm.callbacks.revival import DeadCodeRevival

    net = replace(NET, codebook_sizes_action=(16,), codebook_sizes_world=(16,), dead_code_steps=1)
    torch.manual_seed(0)
    module = WorldModelModule(net=net, optim=OptimConfig(warmup_steps=0))
    calls = []
    for name, quantizer in module.model.quantizers.items():
        original = quantizer.revive

        def revive(generator=None, _original=original):
            step = module.global_step  # one batch per step, one epoch: the batch index is step - 1
            want = module.step_generator(torch.device("cpu"), step - 1, stream=1).get_state()
            calls.append((step, torch.equal(generator.get_state(), want)))
            return _original(generator=generator)

        quantizer.revive = revive
    _fit(module, _batches(4), callbacks=[DeadCodeRevival(every_n_steps=2)])
    assert [s for s, _ in calls] == [2, 2, 4, 4]
    assert all(fresh for _, fresh in calls[::2])  # the first quantizer gets the fresh stream-1 generator


# coverage is the union over every validation batch, not the last batch's (known codes, one rank)
def test_codebook_coverage_is_the_union_of_every_batch():
    torch.manual_seed(0)
    module = WorldModelModule(net=NET)
    logged = {}
    trainer = SimpleNamespace(world_size=1, sanity_checking=False, validating=True, is_global_zero=True)
    pl_module = SimpleNamespace(model=module.model, device=torch.device("cpu"), trainer=trainer, loggers=[],
                                log_dict=lambda logs, **kwargs: logged.update(logs))
    monitor = CodebookMonitor()
    monitor.on_validation_epoch_start(trainer, pl_module)
    world = torch.tensor([[0, 0]])
    for action in (torch.tensor([[[0, 0], [1, 1]]]), torch.tensor([[[2, 0], [2, 0]]])):  # [B, T-1, L]
        monitor.on_validation_batch_end(trainer, pl_module, {"Action_Encoder": action, "World_Encoder": world}, None, 0)
    monitor.on_validation_epoch_end(trainer, pl_module)
    assert float(logged["Val_Action_Encoder/codebook_coverage_level_0"]) == pytest.approx(3 / 4)  # codes 0, 1, 2
    assert float(logged["Val_Action_Encoder/codebook_coverage_level_1"]) == pytest.approx(2 / 8)  # codes 0, 1
    assert float(logged["Val_Action_Encoder/codebook_usage_level_0"]) == pytest.approx((2 / 4 + 1 / 4) / 2)


# world codes are paired with their own clip's world label (what the NMI and the probe are computed on)
def test_probes_pair_world_codes_with_their_clips_labels():
    from lwm.callbacks import GroundTruthProbes
    from lwm.utils.metrics import code_ids, nmi

    torch.manual_seed(0)
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))
    g = torch.Generator().manual_seed(3)
    data = []
    for i, b in enumerate(_batches(3)):
        B, T = b["latents"].shape[:2]
        data.append({**b, "actions": torch.randint(0, 5, (B, T), generator=g), "world_label": torch.tensor([i, 5 + i])})
    captured = []

    def spy(ids, labels):
        captured.append((ids.clone(), labels.clone()))
        return nmi(ids, labels)

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[GroundTruthProbes()])
    with mock.patch("lwm.callbacks.probes.nmi", side_effect=spy):
        trainer.validate(module, torch.utils.data.DataLoader(data, batch_size=None), verbose=False)
    module.eval()
    with torch.no_grad():
        codes = torch.cat([module.model.encode_world(b["latents"]).indices for b in data])
    labels = torch.cat([b["world_label"] for b in data])
    world = [c for c in captured if len(c[1]) == len(labels)]
    assert len(world) == 1
    assert torch.equal(world[0][1], labels)
    assert torch.equal(world[0][0], code_ids(codes, NET.codebook_sizes_world))


def _probe_windows(n=12, T=4, L=2, seed=0) -> list[dict]:
    """Validation windows as a LatentDataModule batches them (file_index, start), with labels and made-up codes."""
    g = torch.Generator().manual_seed(seed)
    return [{"file_index": torch.tensor(i // 2), "start": torch.tensor(4 * (i % 2)),
             "actions": torch.randint(0, 3, (T,), generator=g), "world_label": torch.tensor(i % 3),
             "Action_Encoder": torch.randint(0, 4, (T - 1, L), generator=g),
             "World_Encoder": torch.randint(0, 4, (L,), generator=g)} for i in range(n)]


def _feed(callback, windows, batch_size, trainer=None, pl_module=None) -> None:
    """Run ``callback``'s validation-batch hook over ``windows`` in batches of ``batch_size``."""
    trainer = trainer or SimpleNamespace(world_size=1, sanity_checking=False)
    callback.on_validation_epoch_start(trainer, pl_module)
    for i in range(0, len(windows), batch_size):
        batch = {k: torch.stack([w[k] for w in windows[i: i + batch_size]]) for k in windows[0]}
        outputs = {k: batch.pop(k) for k in ("Action_Encoder", "World_Encoder")}
        callback.on_validation_batch_end(trainer, pl_module, outputs, batch, i // batch_size)


# the probes' samples (what their split and max_samples cut see) do not depend on the ranks or the batching
@pytest.mark.parametrize("max_samples", [20000, 10])
def test_probe_samples_are_the_same_on_one_rank_and_two(monkeypatch, max_samples):
    from lwm.callbacks import GroundTruthProbes
    from lwm.callbacks import probes

    windows = _probe_windows()
    one = GroundTruthProbes(max_samples=max_samples)
    _feed(one, windows, batch_size=4)
    ranks = [GroundTruthProbes(max_samples=max_samples) for _ in range(2)]
    for r, callback in enumerate(ranks):
        _feed(callback, windows[r::2], batch_size=3)  # dealt round-robin, other batches
    sent = []
    monkeypatch.setattr(probes, "every_rank", lambda trainer, obj: sent.append(obj) or [obj])
    ranks[1]._gathered(None, "Action_Encoder"), ranks[1]._gathered(None, "World_Encoder")
    for name, theirs in zip(("Action_Encoder", "World_Encoder"), sent):
        monkeypatch.setattr(probes, "every_rank", lambda trainer, obj, theirs=theirs: [obj, theirs])
        codes, labels = ranks[0]._gathered(None, name)
        monkeypatch.setattr(probes, "every_rank", lambda trainer, obj: [obj])
        expected_codes, expected_labels = one._gathered(None, name)
        assert torch.equal(codes, expected_codes) and torch.equal(labels, expected_labels), name
        assert len(labels) == min(max_samples, 12 * (3 if name == "Action_Encoder" else 1))


# validation codebook usage: runs of data.batch_size windows, whatever the validation batches
def test_validation_codebook_usage_counts_runs_of_the_training_batch_size():
    torch.manual_seed(0)
    model = WorldModelModule(net=NET).model
    windows = _probe_windows(n=10)
    logged = {}
    trainer = SimpleNamespace(world_size=1, sanity_checking=False, validating=True, is_global_zero=True,
                              datamodule=SimpleNamespace(batch_size=4))
    pl_module = SimpleNamespace(model=model, device=torch.device("cpu"), trainer=trainer, loggers=[],
                                log_dict=lambda logs, **kwargs: logged.update(logs))
    results = []
    for val_batch_size in (3, 4, 10):  # 10 windows: runs of 4 at 0..3 and 4..7; the last 2 are left over
        monitor = CodebookMonitor()
        _feed(monitor, windows, val_batch_size, trainer, pl_module)
        monitor.on_validation_epoch_end(trainer, pl_module)
        results.append(float(logged["Val_Action_Encoder/codebook_usage_level_0"]))
    codes = torch.stack([w["Action_Encoder"] for w in windows])
    runs = [codebook_usage(codes[i: i + 4], NET.codebook_sizes_action)[0] for i in (0, 4)]
    assert results == [pytest.approx(float(sum(runs) / 2))] * 3
    short = CodebookMonitor()  # fewer windows than one batch: their usage
    _feed(short, windows[:3], 3, trainer, pl_module)
    short.on_validation_epoch_end(trainer, pl_module)
    assert float(logged["Val_Action_Encoder/codebook_usage_level_0"]) == pytest.approx(
        float(codebook_usage(codes[:3], NET.codebook_sizes_action)[0]))


# the video's second row is the model's rollout from frame 0 (not the ground truth)
def test_rollout_video_rows_are_ground_truth_then_generated(tmp_path):
    from lwm.callbacks import RolloutVideos
    from lwm.utils.video import grid, latent_preview

    torch.manual_seed(0)
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))
    data = _batches(1)
    captured = []

    def spy(rows, *a, **k):
        captured.append([r.copy() if hasattr(r, "copy") else r for r in rows])
        return grid(rows, *a, **k)

    trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[RolloutVideos(clips=1)])
    with mock.patch("lwm.callbacks.videos.grid", side_effect=spy):
        trainer.validate(module, torch.utils.data.DataLoader(data, batch_size=None), verbose=False)
    module.eval()
    clip = data[0]["latents"][:1]
    with torch.no_grad():
        m = module.model
        generated = m.generate(clip[:, :1], m.encode_actions(clip).quantized, m.encode_world(clip).quantized,
                               steps=clip.shape[1] - 1)
    rollout = torch.cat([clip[:, :1], generated], dim=1)[0]
    (rows,) = captured
    import numpy as np
    assert np.array_equal(np.asarray(rows[0]), np.asarray(latent_preview(clip[0])))
    assert np.allclose(np.asarray(rows[1], dtype=float), np.asarray(latent_preview(rollout), dtype=float), atol=1)
    assert not np.array_equal(np.asarray(rows[0]), np.asarray(rows[1]))


# revival is a training setting of its own: logging more or less often neither moves it nor loses its counts
def test_revival_does_not_follow_the_logging_interval_and_logs_what_it_revived_since_the_last_log():
    from dataclasses import replace

    from lwm.callbacks.revival import DeadCodeRevival

    net = replace(NET, codebook_sizes_action=(16,), codebook_sizes_world=(16,), dead_code_steps=1)
    revived_at, logged = {}, []
    for log_every in (1, 3):
        torch.manual_seed(0)
        module = WorldModelModule(net=net, optim=OptimConfig(warmup_steps=0))
        steps = []
        quantizer = module.model.quantizers["World_Encoder"]
        original = quantizer.revive

        def revive(generator=None, _original=original, _steps=steps, _module=module):
            counts = _original(generator=generator)
            _steps.append((_module.global_step, counts[0]))
            return counts

        quantizer.revive = revive

        class Logged(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, *args):
                if log_every == 3 and "Train_World_Encoder/revived_codes_level_0" in trainer.callback_metrics:
                    logged.append((trainer.global_step,
                                   float(trainer.callback_metrics["Train_World_Encoder/revived_codes_level_0"])))

        _fit(module, _batches(6), callbacks=[DeadCodeRevival(every_n_steps=2), Logged()], log_every_n_steps=log_every)
        revived_at[log_every] = steps
    assert [s for s, _ in revived_at[1]] == [s for s, _ in revived_at[3]] == [2, 4, 6]
    assert revived_at[1] == revived_at[3]  # the same codes revived, however often the run logs
    counts = dict(revived_at[3])
    assert counts[4] > 0 and counts[6] > 0  # (so that the sum below is not one of them)
    assert dict(logged)[3] == counts[2] and dict(logged)[6] == counts[4] + counts[6]  # since the last logged step


def test_revival_counts_not_yet_logged_travel_with_the_checkpoint():
    from lwm.callbacks.revival import DeadCodeRevival

    saved = DeadCodeRevival(every_n_steps=2)
    saved._revived = {"Train_World_Encoder/revived_codes_level_0": 3}
    restored = DeadCodeRevival(every_n_steps=2)
    restored.load_state_dict(torch.load(_roundtrip(saved.state_dict()), weights_only=True))
    assert restored._revived == {"Train_World_Encoder/revived_codes_level_0": 3}


def _roundtrip(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


# outside SLURM the first Ctrl-C asks for a save at the batch end; a second one stops at once, unsaved
def test_a_second_ctrl_c_stops_at_once(capsys):
    import signal

    from lwm.callbacks import SlurmRequeue, slurm
    from lwm.cli.main import main

    requeue = SlurmRequeue()
    requeue._active = True
    requeue._on_signal(signal.SIGINT, None)
    assert requeue._requested and not requeue._requeue
    assert "SIGINT: stopping after a checkpoint at the end of this batch (Ctrl-C again" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):  # Lightning's handling: kills the processes it launched, exits 1
        requeue._on_signal(signal.SIGINT, None)
    assert "SIGINT again: stopping now, unsaved" in capsys.readouterr().err
    assert slurm.hard_stopped()  # `lwm` makes Lightning's exit 1 a 130
    with mock.patch("lwm.cli.lightning_cli.LwmCLI", side_effect=SystemExit(1)):
        assert main(["fit"]) == 130
    requeue.setup(None, None, "fit")  # the next fit starts afresh
    assert not slurm.hard_stopped()
    with mock.patch("lwm.cli.lightning_cli.LwmCLI", side_effect=SystemExit(1)), pytest.raises(SystemExit):
        main(["fit"])  # any other exit 1 stays what it was
    term = SlurmRequeue()
    term._active = True
    term._on_signal(signal.SIGTERM, None)
    term._on_signal(signal.SIGTERM, None)  # SIGTERM again: still the save at the batch end
    assert term._requested and term._signal == signal.SIGTERM


# the handlers go in at the start of training and back out when training is over; an ignored SIGINT stays so
def test_interrupt_handlers_are_put_back_when_training_is_over():
    import signal
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment

    from lwm.callbacks import SlurmRequeue

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    trainer = SimpleNamespace(strategy=SimpleNamespace(cluster_environment=LightningEnvironment()),
                              is_global_zero=True, should_stop=False, max_steps=10, global_step=4, max_epochs=-1,
                              current_epoch=0)
    try:
        requeue = SlurmRequeue()
        requeue.on_sanity_check_start(trainer, None)
        requeue.on_train_start(trainer, None)  # installed again: what it replaced is still the original
        assert signal.getsignal(signal.SIGINT) == requeue._on_signal == signal.getsignal(signal.SIGTERM)
        requeue.on_train_epoch_end(trainer, None)  # an epoch ends, training goes on
        assert signal.getsignal(signal.SIGINT) == requeue._on_signal
        trainer.global_step = 10  # max_steps: training is over (the code dictionaries may follow)
        requeue.on_train_epoch_end(trainer, None)
        assert {s: signal.getsignal(s) for s in saved} == saved and not requeue._active

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `lwm fit &` in a script starts
        SlurmRequeue().on_train_start(trainer, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN

        requeue.preempted, requeue.interrupted, requeue._requested = True, signal.SIGINT, True
        requeue.setup(trainer, None, "fit")  # a second fit of the same trainer starts afresh
        assert not requeue.preempted and requeue.interrupted is None and not requeue._requested
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)

"""WorldModelModule: schedule, parameter groups, per-step randomness, the non-finite guard, checkpoints."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import h5py
import lightning as L
import numpy as np
import pytest
import torch

from lwm.callbacks.revival import DeadCodeRevival
from lwm.utils.errors import ConfigError, NonFiniteLossError
from lwm.training.optim import OptimConfig
from lwm.training.module import WorldModelModule
from lwm.modules.world_model import WorldModelConfig
from tests.lightning.helpers import accumulation_counters, C, H, W, make_dataset, run

NET = WorldModelConfig(in_channels=C, height=H, width=W, d_model=32, n_heads=2, depth_action=1, depth_world=1,
                       depth_dynamics=1, d_code_action=8, d_code_world=8, codebook_sizes_action=(4, 8),
                       codebook_sizes_world=(4, 8))


def test_lr_schedule_known_values():
    o = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert o.lr_factor(0, 110) == pytest.approx(1 / 11)
    assert o.lr_factor(9, 110) == pytest.approx(10 / 11)
    assert o.lr_factor(10, 110) == pytest.approx(1.0)
    assert o.lr_factor(60, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert o.lr_factor(110, 110) == pytest.approx(0.1)
    assert o.lr_factor(500, 110) == pytest.approx(0.1)  # stays at the floor past max_steps
    assert OptimConfig(warmup_steps=0).lr_factor(0, 100) == pytest.approx(1.0)


def test_weight_decay_only_on_matrices_and_kernels():
    module = WorldModelModule(net=NET)
    module.trainer = L.Trainer(max_steps=100, logger=False)
    groups = module.configure_optimizers()["optimizer"].param_groups
    decay, no_decay = groups[0]["params"], groups[1]["params"]
    assert groups[0]["weight_decay"] == 0.05 and groups[1]["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay) and all(p.ndim < 2 for p in no_decay)
    assert sorted(map(id, decay + no_decay)) == sorted(id(p) for p in module.parameters())
    assert any(p is module.model.mask_token for p in no_decay)
    frozen = WorldModelModule(net=replace(NET, mask_prob=0.0))  # its mask token is frozen, still in its group:
    frozen.trainer = module.trainer  # the groups (and resumed optimizer states) do not depend on mask_prob
    assert [len(g["params"]) for g in frozen.configure_optimizers()["optimizer"].param_groups] == \
        [len(decay), len(no_decay)]


def test_step_randomness_is_a_function_of_the_batch_index():  # (of the step and rank too: below)
    module = WorldModelModule(net=NET)
    draw = lambda batch_idx: torch.rand(8, generator=module.step_generator(torch.device("cpu"), batch_idx))  # noqa: E731
    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))


def _batches(n: int, nan_at: set[int] = frozenset()) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.tanh(torch.randn(2, 6, C, H, W, generator=g))
        if i in nan_at:
            x[0, 2, 0, 0, 0] = float("nan")
        out.append({"latents": x})
    return out


def _train(batches, max_nonfinite: int = 5, net: WorldModelConfig = NET, callbacks=(), fused: bool | None = None,
           log_every_n_steps: int = 50, ckpt_path=None, **trainer_kwargs) -> WorldModelModule:
    torch.manual_seed(0)
    optim = OptimConfig(warmup_steps=0, min_lr_ratio=1.0, fused=fused)
    module = WorldModelModule(net=net, optim=optim, max_nonfinite=max_nonfinite)
    trainer_kwargs = {"max_steps": len(batches), "logger": False, **trainer_kwargs}
    trainer = L.Trainer(accelerator="cpu", enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=list(callbacks),
                        log_every_n_steps=log_every_n_steps, **trainer_kwargs)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return module


# fused: the sync-free path (the verdict goes to the fused AdamW as a device tensor, as on CUDA by default);
# for-loop AdamW: the host path (the verdict is read every step and the gradients dropped)
@pytest.mark.parametrize("fused", [False, True])
def test_a_non_finite_step_changes_nothing(fused):
    clean = _train(_batches(1), fused=fused)
    with_nan = _train(_batches(2, nan_at={1}), fused=fused)
    assert with_nan.skipped_steps == 1 and clean.skipped_steps == 0
    a, b = clean.state_dict(), with_nan.state_dict()
    for key in a:  # weights, codebooks, EMA statistics and dead-code clocks as after the one good step
        assert torch.equal(a[key], b[key]), key
    opt_a, opt_b = clean.trainer.optimizers[0], with_nan.trainer.optimizers[0]
    assert opt_a.defaults["fused"] == bool(fused)
    for p, q in zip(clean.parameters(), with_nan.parameters()):  # AdamW's moments and step count untouched too
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a.state[p][name], opt_b.state[q][name]), name


@pytest.mark.parametrize("fused", [False, True])
def test_consecutive_non_finite_steps_stop_the_run(fused):
    with pytest.raises(NonFiniteLossError, match="3 consecutive steps had a non-finite"):
        _train(_batches(6, nan_at={1, 2, 3}), max_nonfinite=3, fused=fused, log_every_n_steps=1)
    _train(_batches(6, nan_at={1, 2, 4}), max_nonfinite=3, fused=fused, log_every_n_steps=1)  # not in a row


def test_the_sync_free_path_reads_the_longest_run_at_the_logging_interval():
    # 3 bad steps in a row (steps 1-3) are seen at the next logging step (the 4th), where the count is still 3
    with pytest.raises(NonFiniteLossError, match="3 consecutive steps .*read at the logging interval, at global step 3"):
        _train(_batches(8, nan_at={1, 2, 3}), max_nonfinite=3, fused=True, log_every_n_steps=4)
    # ... and 3 in a row that recover before a logging step stop it there too (the longest run since the last read)
    with pytest.raises(NonFiniteLossError, match="3 consecutive steps .*at global step 7"):
        _train(_batches(8, nan_at={4, 5, 6}), max_nonfinite=3, fused=True, log_every_n_steps=4)
    # two runs of 2 between two reads are not 3 in a row
    module = _train(_batches(8, nan_at={1, 2, 4, 5}), max_nonfinite=3, fused=True, log_every_n_steps=8)
    assert module.skipped_steps == 4


@pytest.mark.parametrize("fused", [False, True])
def test_the_count_in_a_row_survives_a_resume(tmp_path, fused):
    """max_nonfinite=3: steps 3 and 4 skipped, the checkpoint of step 5, then one more skip after the resume: 3 in
    a row stop the resumed run as they stop an uninterrupted one."""
    with pytest.raises(NonFiniteLossError, match="3 consecutive"):
        _train(_batches(6, nan_at={3, 4, 5}), max_nonfinite=3, fused=fused, log_every_n_steps=1)
    first = _train(_batches(5, nan_at={3, 4}), max_nonfinite=3, fused=fused, log_every_n_steps=1)
    first.trainer.save_checkpoint(tmp_path / "step5.ckpt")
    assert torch.load(tmp_path / "step5.ckpt", weights_only=True)["lwm_skipped_in_a_row"] == 2
    every = _batches(6, nan_at=set(range(6)))  # whichever batch the resumed epoch starts at: a bad one
    with pytest.raises(NonFiniteLossError, match="3 consecutive"):
        _train(every, max_nonfinite=3, fused=fused, log_every_n_steps=1, ckpt_path=tmp_path / "step5.ckpt")


def _csv_rows(tmp_path, batches, **kwargs) -> list[dict[str, str]]:
    """Train like ``_train`` with Lightning's CSVLogger under ``tmp_path``: metrics.csv's rows."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    _train(batches, logger=CSVLogger(tmp_path, name="", version=""), **kwargs)
    with open(tmp_path / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_step_is_counted_on_its_own_row(tmp_path, fused):
    rows = _csv_rows(tmp_path, _batches(3, nan_at={1}), fused=fused, log_every_n_steps=1)
    by_step = {int(r["step"]): r for r in rows if r["Train_Total/skipped_steps"]}
    assert [float(by_step[s]["Train_Total/skipped_steps"]) for s in (0, 1, 2)] == [0.0, 1.0, 1.0]
    assert math.isnan(float(by_step[1]["Train_Total/grad_norm"]))  # the same row as the NaN it skipped


def test_accumulated_steps_log_the_mean_of_their_micro_batches(tmp_path, monkeypatch):
    from lwm.modules.world_model import WorldModel

    seen = []  # every micro-batch's total loss, as the model returns it
    original = WorldModel.compute

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(float(out.logs["Total/loss"]))
        return out

    monkeypatch.setattr(WorldModel, "compute", spy)
    batches = _batches(4)
    for i in (1, 3):  # micro-batches of 2 and 1 windows: the step's mean weighs them 2:1
        batches[i] = {"latents": batches[i]["latents"][:1]}
    rows = _csv_rows(tmp_path, batches, accumulate_grad_batches=2, log_every_n_steps=1, max_steps=2)
    logged = {int(r["step"]): float(r["Train_Total/loss"]) for r in rows if r["Train_Total/loss"]}
    assert len(seen) == 4 and sorted(logged) == [0, 1]  # two optimizer steps of two micro-batches each
    assert logged[0] == pytest.approx((2 * seen[0] + seen[1]) / 3, rel=1e-6)
    assert logged[1] == pytest.approx((2 * seen[2] + seen[3]) / 3, rel=1e-6)
    assert logged[0] != pytest.approx((seen[0] + seen[1]) / 2, rel=1e-4)  # not the unweighted mean
    assert logged[0] != pytest.approx(seen[1], rel=1e-6)  # not the last micro-batch's alone
    # an epoch of 3 batches: its last step has one micro-batch (Lightning steps at the epoch's end), logged alone
    seen.clear()
    rows = _csv_rows(tmp_path / "odd", _batches(3), accumulate_grad_batches=2, log_every_n_steps=1, max_steps=2)
    logged = {int(r["step"]): float(r["Train_Total/loss"]) for r in rows if r["Train_Total/loss"]}
    assert logged[0] == pytest.approx((seen[0] + seen[1]) / 2, rel=1e-6) and logged[1] == pytest.approx(seen[2], rel=1e-6)


def test_the_logged_training_values_are_the_means_over_the_logging_interval(tmp_path, monkeypatch):
    """log_every_n_steps=3: each row holds the mean over its interval's windows (batches of 2, 1 and 2 windows
    weigh 2:1:2), not the logged step's batch alone; a skipped step's NaN is left out of the mean."""
    from lwm.modules.world_model import WorldModel

    seen = []
    original = WorldModel.compute

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append((float(out.logs["Total/loss"]), float(out.logs["Dynamics_Predictor/tf_loss"])))
        return out

    monkeypatch.setattr(WorldModel, "compute", spy)
    batches = _batches(6, nan_at={4})
    batches[1] = {"latents": batches[1]["latents"][:1]}
    rows = _csv_rows(tmp_path, batches, log_every_n_steps=3, max_steps=6)
    logged = {int(r["step"]): float(r["Train_Total/loss"]) for r in rows if r.get("Train_Total/loss")}
    assert sorted(logged) == [2, 5] and len(seen) == 6
    assert logged[2] == pytest.approx((2 * seen[0][0] + seen[1][0] + 2 * seen[2][0]) / 5, rel=1e-6)
    assert logged[2] != pytest.approx(seen[2][0], rel=1e-4)  # not the logged step's batch alone
    assert math.isnan(seen[4][0])  # the NaN batch's loss: left out of its interval's mean
    assert logged[5] == pytest.approx((seen[3][0] + seen[5][0]) / 2, rel=1e-6)


def test_a_stop_between_logging_steps_writes_the_intervals_means_on_its_row(tmp_path, monkeypatch):
    """A stop decided in a callback at step 4 (log_every_n_steps=3: not a logging step): Lightning writes that row,
    with the means of steps 3 and 4, not the previous row's values again."""
    from lwm.modules.world_model import WorldModel

    seen = []
    original = WorldModel.compute

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(float(out.logs["Total/loss"]))
        return out

    class StopAt(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 5:  # after the 5th step (logged as 4)
                trainer.should_stop = True

    monkeypatch.setattr(WorldModel, "compute", spy)
    rows = _csv_rows(tmp_path, _batches(8), log_every_n_steps=3, max_steps=8, callbacks=[StopAt()])
    logged = {int(r["step"]): float(r["Train_Total/loss"]) for r in rows if r.get("Train_Total/loss")}
    assert sorted(logged) == [2, 4] and len(seen) == 5
    assert logged[4] == pytest.approx((seen[3] + seen[4]) / 2, rel=1e-6)


def test_a_resume_with_other_rollout_passes_keeps_only_the_sums_of_its_own_losses():
    module = WorldModelModule(net=NET)  # rollout_weights of 3 passes: no rollout_3_loss
    one = (torch.tensor(1.0), torch.tensor(1.0))
    module.on_load_checkpoint({"global_step": 4, "lwm_train_interval": {"Total/loss": one,
                                                                        "Dynamics_Predictor/rollout_3_loss": one}})
    assert set(module._interval) == {"Total/loss"}


def test_a_resumed_run_logs_the_interval_means_of_an_uninterrupted_one(tmp_path):
    """The interval's sums are checkpointed: a run stopped at step 2 of an interval of 3 and resumed logs the same
    means (steps 0-2, 3-5) as the run that went through."""
    batches = _batches(6)
    net = replace(NET, mask_prob=0.0, max_time_offset=0)  # no draws by batch index (a plain loader renumbers them)
    full = _csv_rows(tmp_path / "full", batches, net=net, log_every_n_steps=3, max_steps=6)
    first = _train(batches[:2], net=net, log_every_n_steps=3)
    first.trainer.save_checkpoint(tmp_path / "step2.ckpt")
    assert set(torch.load(tmp_path / "step2.ckpt", weights_only=True)["lwm_train_interval"]) >= {"Total/loss"}
    # (a plain loader restarts at its first batch, the epoch's third: the same epoch length, the batches rotated)
    resumed = _csv_rows(tmp_path / "resumed", batches[2:] + batches[:2], net=net, log_every_n_steps=3, max_steps=6,
                        ckpt_path=tmp_path / "step2.ckpt")
    by_step = lambda rows: {int(r["step"]): float(r["Train_Total/loss"]) for r in rows if r.get("Train_Total/loss")}  # noqa: E731
    assert by_step(resumed)[2] == pytest.approx(by_step(full)[2], rel=1e-6)
    assert by_step(resumed)[5] == pytest.approx(by_step(full)[5], rel=1e-6)


def test_validation_logs_the_window_weighted_mean_of_its_batches(monkeypatch):
    """Val_* is the mean over windows: batches of 2 and 1 windows weigh 2:1 (every key, tf_psnr of that mean)."""
    from lwm.modules.world_model import WorldModel

    seen = []  # every validation batch's logs, as the model returns them
    original = WorldModel.compute

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append({k: float(v) for k, v in out.logs.items()})
        return out

    monkeypatch.setattr(WorldModel, "compute", spy)
    batches = _batches(2)
    batches[1] = {"latents": batches[1]["latents"][:1]}
    torch.manual_seed(0)
    module = WorldModelModule(net=NET)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, torch.utils.data.DataLoader(batches, batch_size=None), verbose=False)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert len(seen) == 2
    for key in seen[0]:
        assert logged[f"Val_{key}"] == pytest.approx((2 * seen[0][key] + seen[1][key]) / 3, rel=1e-5, abs=1e-7), key
    loss = [s["Total/loss"] for s in seen]
    assert (2 * loss[0] + loss[1]) / 3 != pytest.approx((loss[0] + loss[1]) / 2, rel=1e-4)  # (the weights matter)
    tf = (2 * seen[0]["Dynamics_Predictor/tf_loss"] + seen[1]["Dynamics_Predictor/tf_loss"]) / 3
    assert logged["Val_Dynamics_Predictor/tf_psnr"] == pytest.approx(10 * math.log10(1 / tf), rel=1e-5)


class _Gradients(L.Callback):
    """The gradients as backward left them (callbacks' hook runs before the module's) and as the optimizer used them."""

    def __init__(self) -> None:
        self.raw: list[list[torch.Tensor]] = []
        self.used: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.raw.append([p.grad.clone() for p in pl_module.parameters() if p.grad is not None])

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # after the step, before the next zero_grad
        self.used.append([p.grad.clone() for p in pl_module.parameters() if p.grad is not None])


def _fp16(init_scale: float = 2.0**16) -> list:
    """fp16 mixed precision with its GradScaler, on the CPU (as ``16-mixed`` sets it up on a GPU)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]


@pytest.mark.parametrize("clip", [1e-3, 1e3])
@pytest.mark.parametrize("fp16", [False, True])  # fp16: the callback and clipping see the unscaled gradients
def test_clipping_by_norm_reuses_the_norm_of_the_non_finite_check(clip, fp16, monkeypatch):
    from lightning.pytorch.plugins.precision import Precision

    def second_norm(*args, **kwargs):
        raise AssertionError("Lightning computed the gradient norm a second time")

    monkeypatch.setattr(Precision, "clip_grad_by_norm", second_norm)
    grads = _Gradients()
    _train(_batches(2), callbacks=[grads], gradient_clip_val=clip, plugins=_fp16(4.0) if fp16 else None)
    assert len(grads.raw) == len(grads.used) == 2
    for raw, used in zip(grads.raw, grads.used):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in raw]))
        scale = min(1.0, clip / (float(norm) + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
        assert (scale < 1.0) == (clip < 1.0)
        for g, u in zip(raw, used):
            assert torch.allclose(u, g * scale, rtol=1e-5, atol=1e-12)


def test_fp16_overflows_are_the_scalers_until_its_scale_is_below_one():
    """Under fp16 the GradScaler skips an overflowing step itself and halves its scale; lwm counts the step and
    stops the run only for non-finite steps in a row at a scale below 1 (here 2 -> 1 -> 0.5: steps 3 and 4)."""
    module = _train(_batches(4, nan_at={1, 2}), max_nonfinite=2, plugins=_fp16(init_scale=2.0))
    assert module.skipped_steps == 2 and not module.trainer.optimizers[0].defaults["fused"]
    assert all(torch.isfinite(p).all() for p in module.parameters())
    with pytest.raises(NonFiniteLossError, match="2 consecutive steps"):
        _train(_batches(6, nan_at={1, 2, 3, 4, 5}), max_nonfinite=2, plugins=_fp16(init_scale=2.0))


def test_fp16_refuses_a_fused_adamw():
    with pytest.raises(ConfigError, match="model.optim.fused=true with fp16"):
        _train(_batches(1), fused=True, plugins=_fp16())


@pytest.mark.slow
def test_non_finite_data_stops_the_cli_with_one_line_and_keeps_the_checkpoint(tmp_path, capsys):
    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=4", "--checkpoint.every_n_train_steps=2",
               "--data.val_size_percent=0") == 0
    for f in (tmp_path / "data").glob("*.h5"):  # the data goes bad after indexing (a faulty copy, say) ...
        indexed = f.stat()
        with h5py.File(f, "r+") as h:
            h["latents"][...] = np.nan
        os.utime(f, ns=(indexed.st_atime_ns, indexed.st_mtime_ns))  # ... unseen (a changed time is refused at setup)
    capsys.readouterr()
    assert run(manifest, root, "--trainer.max_steps=20", "--checkpoint.every_n_train_steps=2",
               "--data.val_size_percent=0", "--model.max_nonfinite=3", "--ckpt_path=last") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "3 consecutive steps had a non-finite loss or gradient" in err[0]
    assert "The last batch has non-finite latents: " in err[0] and ".h5 (frames " in err[0], err  # named
    last = torch.load(root / "checkpoints/last.ckpt", weights_only=True)
    good = torch.load(root / "checkpoints/step=0000004.ckpt", weights_only=True)
    assert good["lwm_skipped_steps"] == 0 and last["lwm_skipped_steps"] >= 1  # the count survives resumes
    assert last["global_step"] >= 4  # skipped steps still count as steps (the schedule moves on) ...
    for key, value in good["state_dict"].items():  # ... but changed no weight, codebook or EMA statistic
        assert torch.equal(value, last["state_dict"][key]), key


@pytest.mark.slow
def test_validate_on_data_gone_bad_names_the_windows(tmp_path, recwarn):
    """`lwm validate` on a file that went NaN after indexing: the metrics are NaN (it says nothing else), so it
    warns once, naming the windows; with good data it says nothing."""
    import json
    import shutil

    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=2", "--data.val_size_percent=0") == 0
    assert run(manifest, root, "--ckpt_path=last", verb="validate") == 0
    assert not [w for w in recwarn if "non-finite latents" in str(w.message)]
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "data", bad)
    entry = next(e for e in json.loads(manifest.read_text())["files"] if e["split"] == "val")
    indexed = (bad / entry["path"]).stat()
    with h5py.File(bad / entry["path"], "r+") as f:
        f["latents"][0] = np.nan
    os.utime(bad / entry["path"], ns=(indexed.st_atime_ns, indexed.st_mtime_ns))  # unseen by the manifest's stamps
    assert run(bad / manifest.name, root, "--ckpt_path=last", verb="validate") == 0
    said = [str(w.message) for w in recwarn if "non-finite latents" in str(w.message)]
    assert len(said) == 1 and str((bad / entry["path"]).resolve()) + " (frames 0..5)" in said[0], said
    assert "so the Val_* metrics are NaN" in said[0]


@pytest.mark.slow
def test_checkpoint_loads_with_weights_only(tmp_path):
    manifest = make_dataset(tmp_path / "data", files=4)
    assert run(manifest, tmp_path / "run", "--trainer.max_steps=3", "--data.val_size_percent=0") == 0
    path = tmp_path / "run/checkpoints/last.ckpt"
    raw = torch.load(path, weights_only=True)  # refuses anything but tensors and plain containers
    assert raw["hyper_parameters"]["net"]["d_model"] == 32
    module = WorldModelModule.load_from_checkpoint(path, weights_only=True)
    for key, value in module.state_dict().items():
        assert torch.equal(value, raw["state_dict"][key]), key
    assert module.model.config.codebook_sizes_action == (4, 8)
    assert math.isclose(module.optim.lr, 1e-3)


def test_revival_replaces_dead_codes_at_its_steps_with_distinct_batch_vectors():
    net = replace(NET, codebook_sizes_action=(16,), codebook_sizes_world=(16,), dead_code_steps=1)
    module = _train(_batches(4), net=net, callbacks=[DeadCodeRevival(every_n_steps=2)], log_every_n_steps=2)
    revived = {k: float(v) for k, v in module.trainer.callback_metrics.items() if "revived_codes" in k}
    assert set(revived) == {"Train_Action_Encoder/revived_codes_level_0", "Train_World_Encoder/revived_codes_level_0"}
    # step 4: 2 clips give 2 world vectors for >= 14 unused world codes, and 2 x 5 action vectors
    assert revived["Train_World_Encoder/revived_codes_level_0"] == 2
    assert 0 < revived["Train_Action_Encoder/revived_codes_level_0"] <= 10
    for name, quantizer in module.model.quantizers.items():
        codes = quantizer.codebook(0)
        assert len({tuple(c.tolist()) for c in codes}) == len(codes), name  # never two equal codes


def test_bf16_mixed_keeps_the_quantizers_fp32():
    """Lightning's bf16-mixed (autocast on the CPU here, as on a GPU): the model trains and the codebooks and
    their EMA statistics stay fp32 and finite."""
    torch.manual_seed(0)
    module = WorldModelModule(net=NET, optim=OptimConfig(warmup_steps=0))
    seen = {}

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = pl_module.model.compute(batch["latents"], step=None, t0=0)
            seen["loss"] = float(out.loss)

    trainer = L.Trainer(max_steps=3, accelerator="cpu", precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Probe()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_batches(3), batch_size=None))
    for name, quantizer in module.model.quantizers.items():
        for key, buf in quantizer.state_dict().items():
            if buf.is_floating_point():
                assert buf.dtype == torch.float32 and torch.isfinite(buf).all(), f"{name}.{key}: {buf.dtype}"
    assert math.isfinite(seen["loss"]) and module.skipped_steps == 0
    assert all(p.dtype == torch.float32 for p in module.parameters())  # master weights stay fp32


def test_float16_batches_are_cast_on_the_device_and_train_exactly_like_float32():
    half = [{"latents": b["latents"].half()} for b in _batches(3)]
    exact = [{"latents": b["latents"].float()} for b in half]  # float16 -> float32 is exact
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch["latents"].dtype)

    a, b = _train(half, callbacks=[Record()]), _train(exact)
    assert seen == [torch.float32] * 3  # the model and every callback see float32
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


def _fit(module, batches, callbacks=(), **kw):
    trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=list(callbacks), **kw)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return trainer


# the learning rate the optimizer uses at optimizer step s is lr * lr_factor(s, max_steps)
def test_the_optimizer_uses_the_schedule_of_its_step():
    torch.manual_seed(0)
    o = OptimConfig(lr=1e-3, warmup_steps=3, min_lr_ratio=0.1)
    module = WorldModelModule(net=NET, optim=o)
    seen = []

    class LR(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append((trainer.global_step, optimizer.param_groups[0]["lr"]))

    _fit(module, _batches(6), callbacks=[LR()])
    assert [s for s, _ in seen] == list(range(6))
    for step, lr in seen:
        assert lr == pytest.approx(o.lr * o.lr_factor(step, 6)), step
    assert seen[0][1] == pytest.approx(1e-3 / 4)  # (0 + 1) / (3 + 1)


# the skipped-step count is written to the checkpoint (also the device-side count of the
# sync-free path) and read back from it
@pytest.mark.parametrize("fused", [False, True])
def test_the_skipped_step_count_round_trips_through_a_checkpoint(tmp_path, fused):
    module = _train(_batches(3, nan_at={1}), fused=fused)
    assert module.skipped_steps == 1
    path = tmp_path / "x.ckpt"
    module.trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["lwm_skipped_steps"] == 1
    restored = WorldModelModule.load_from_checkpoint(path, weights_only=True)
    assert restored.skipped_steps == 1


# training draws the random temporal-PE start from the step's generator (not t0 = 0)
def test_training_steps_draw_a_random_temporal_pe_start():
    torch.manual_seed(0)
    module = WorldModelModule(net=NET)
    starts, expected = [], []
    original = module.model.pos_embedding

    def spy(T, t0, **kwargs):  # once per step for the predictor's tokens; the action encoder's call adds `spatial`
        if not kwargs:
            starts.append(torch.as_tensor(t0).clone())
        return original(T, t0, **kwargs)

    class Expect(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            g = pl_module.step_generator(torch.device("cpu"), batch_idx)
            expected.append(pl_module.model.sample_time_offset(batch["latents"].shape[0], torch.device("cpu"), g))

    with mock.patch.object(module.model, "pos_embedding", side_effect=spy):
        _fit(module, _batches(3), callbacks=[Expect()])
    assert len(starts) == len(expected) == 3
    for got, want in zip(starts, expected):
        assert torch.equal(got.flatten(), want.flatten())
    assert any(bool((s != 0).any()) for s in starts)


# the step's random stream depends on the global step and on the rank
def test_step_randomness_depends_on_step_and_rank():
    module = WorldModelModule(net=NET)
    cpu = torch.device("cpu")

    def draw(step, rank):
        with mock.patch.object(WorldModelModule, "global_step", new=property(lambda self: step)), \
                mock.patch.object(WorldModelModule, "global_rank", new=property(lambda self: rank)):
            return torch.rand(8, generator=module.step_generator(cpu, 0))

    assert torch.equal(draw(3, 0), draw(3, 0))
    assert not torch.equal(draw(3, 0), draw(4, 0))
    assert not torch.equal(draw(3, 0), draw(3, 1))


@pytest.mark.slow
def test_the_world_curriculum_follows_the_global_step_in_training_and_validation(tmp_path, monkeypatch):
    """model.net.world_curriculum=[2, 2]: steps 0-1 without the world token, 2-3 unquantized, then the code; a
    validation gives the world as the weights' last training step had it (validations after steps 2, 4, 6: the
    phases of steps 1, 3, 5)."""
    from lwm.modules.world_model import WorldModel

    calls, videos = [], []
    original, generate = WorldModel.compute, WorldModel.generate

    def spy(self, x, step, *args, **kwargs):
        calls.append((self.training and step is not None, kwargs.get("world_phase")))
        return original(self, x, step, *args, **kwargs)

    def spy_generate(self, context, actions, world, *args, **kwargs):
        if sys._getframe(1).f_code.co_filename.endswith("videos.py"):  # the rollout videos' (not the dPSNR's)
            videos.append(world)
        return generate(self, context, actions, world, *args, **kwargs)

    monkeypatch.setattr(WorldModel, "compute", spy)
    monkeypatch.setattr(WorldModel, "generate", spy_generate)
    manifest = make_dataset(tmp_path / "data", files=4)
    assert run(manifest, tmp_path / "run", "--trainer.max_steps=6", "--model.net.world_curriculum=[2, 2]",
               "--trainer.val_check_interval=2", "--trainer.check_val_every_n_epoch=null",
               "--data.val_size_percent=0.5") == 0
    training = [phase for train, phase in calls if train]
    assert training == ["off", "off", "unquantized", "unquantized", "quantized", "quantized"]
    validation = [phase for train, phase in calls if not train and phase is not None]
    per = len(validation) // 3  # the same batches each time
    assert validation == ["off"] * per + ["unquantized"] * per + ["quantized"] * per and per >= 1, validation
    # the rollout video of the first validation (every 4th) plays the world as that validation scored it: none
    assert len(videos) == 1 and videos[0].abs().max() == 0


# under DeepSpeed the engine skips overflowing steps itself: its count is read after each step's last batch
def _engine_step(module: WorldModelModule, batch_idx: int) -> None:
    """The module's optimizer_step as Lightning calls it under DeepSpeed (the engine steps inside ``optimizer.step``;
    a stand-in here, whose count the test sets)."""
    module.optimizer_step(0, batch_idx, SimpleNamespace(step=lambda closure=None: None))


def test_deepspeed_skips_count_as_skipped_steps_and_stop_the_run_in_a_row():
    module = WorldModelModule(net=NET, max_nonfinite=3)
    engine = SimpleNamespace(skipped_steps=4,  # a resumed engine's: skips before this process are not new
                             get_global_grad_norm=lambda: 2.5)
    within = [False]  # inside an accumulation window?
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(deepspeed_engine=engine), training=True, global_step=9,
                                      world_size=1,
                                      **accumulation_counters(lambda: within[0]))
    logged = {}
    module.log = lambda key, value, **kwargs: logged.update({key: value})  # (a stand-in trainer: no logger connector)
    module.skips.engine_start(4)  # what on_train_start reads from the engine
    _engine_step(module, 0)
    assert module.skipped_steps == 0 and logged == {"Train_Total/grad_norm": 2.5}  # the engine's own norm
    engine.skipped_steps = 5  # one skipped step
    _engine_step(module, 1)
    assert module.skipped_steps == 1 and module.skips.in_a_row == 1
    _engine_step(module, 2)  # a step that went through: the run of skips is broken
    assert module.skipped_steps == 1 and module.skips.in_a_row == 0
    for i in range(2):
        engine.skipped_steps += 1
        _engine_step(module, 3 + i)
    within[0] = True  # a micro-batch inside an accumulation window: the engine has not stepped, nothing read
    _engine_step(module, 5)
    assert module.skipped_steps == 3 and module.skips.in_a_row == 2
    within[0] = False
    engine.skipped_steps += 1
    with pytest.raises(NonFiniteLossError, match="3 consecutive steps had a non-finite"):
        _engine_step(module, 6)


def test_deepspeed_fp16_overflows_count_towards_the_stop_only_below_a_loss_scale_of_one():
    module = WorldModelModule(net=NET, max_nonfinite=2)
    scaler = SimpleNamespace(dynamic_loss_scale=True, cur_scale=2.0**16)
    engine = SimpleNamespace(skipped_steps=0, optimizer=SimpleNamespace(loss_scale_config=scaler),
                             get_global_grad_norm=lambda: None)
    module._trainer = SimpleNamespace(strategy=SimpleNamespace(deepspeed_engine=engine), training=True, global_step=3,
                                      world_size=1,
                                      **accumulation_counters())
    module.log = lambda *args, **kwargs: None  # (this stand-in trainer has no logger connector)
    module.skips.engine_start(0)
    for i in range(4):  # the scale halving down from 2^16: skipped, counted, never a stop
        engine.skipped_steps += 1
        _engine_step(module, i)
    assert module.skipped_steps == 4 and module.skips.in_a_row == 0
    scaler.cur_scale = 0.5  # below one: the loss or the data, no longer the scale
    engine.skipped_steps += 1
    _engine_step(module, 4)
    engine.skipped_steps += 1
    with pytest.raises(NonFiniteLossError, match="2 consecutive steps"):
        _engine_step(module, 5)


def test_without_deepspeed_there_is_no_engine_count():
    from lwm.training.nonfinite import deepspeed_skipped_steps

    module = _train(_batches(2))
    assert deepspeed_skipped_steps(module.trainer) is None and not module.skips.reading_engine


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(lr=math.inf), "model.optim.lr must be a finite number, got inf"),  # NaNs every weight at step 0
        (dict(lr=math.nan), "model.optim.lr must be a finite number, got nan"),  # passed `lr <= 0`
        (dict(eps=math.inf), "model.optim.eps must be a finite number, got inf"),
        (dict(weight_decay=math.inf), "model.optim.weight_decay must be a finite number, got inf"),
        (dict(betas=(math.nan, 0.9)), "model.optim.betas must be two values in [0, 1), got (nan, 0.9)"),
        (dict(min_lr_ratio=math.inf), "model.optim.min_lr_ratio must lie in [0, 1], got inf"),
        (dict(lr=-1.0), "model.optim.lr must be > 0, got -1.0"),  # the dotted path users type
    ],
)
def test_optim_config_refuses_non_finite_and_names_the_field(fields, message):
    with pytest.raises(ConfigError) as e:
        OptimConfig(**fields)
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("settings", "message", "accepted"),
    [
        (dict(val_check_interval=0), "trainer.val_check_interval must be > 0 (an integer: training batches between "
                                     "validations, a fraction in (0, 1] of the epoch, or null: once per epoch), got 0",
         [dict(val_check_interval=1), dict(val_check_interval=3), dict(val_check_interval=None), dict(),
          dict(val_check_interval="00:00:00:30")]),  # (timed: Lightning leaves the interval unset)
        (dict(val_check_interval=0.0), "trainer.val_check_interval must be > 0",  # validated after every batch
         [dict(val_check_interval=0.25), dict(val_check_interval=1e-3), dict(val_check_interval=1.0)]),
        (dict(accumulate_grad_batches=0), "trainer.accumulate_grad_batches must be >= 1 (1: no accumulation), got 0",
         [dict(accumulate_grad_batches=1), dict(accumulate_grad_batches=2, log_every_n_steps=1)]),
        (dict(accumulate_grad_batches=-2), "trainer.accumulate_grad_batches must be >= 1 (1: no accumulation), got -2",
         [dict(accumulate_grad_batches=1)]),
        (dict(log_every_n_steps=0), "trainer.log_every_n_steps must be >= 1 (the interval, in steps, of the Train_* "
                                    "logs), got 0",
         [dict(log_every_n_steps=1), dict(barebones=True)]),  # (barebones: Lightning's own 0)
    ],
)
def test_check_trainer_refuses_intervals_lightning_accepts_and_takes_the_valid_ones_next_to_them(
        settings, message, accepted):
    """Lightning accepts the refused settings at construction, then divides by zero in the first epoch (or logs
    nothing); the valid values at the boundary, and the other forms of each setting, pass."""
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **settings)
    with pytest.raises(ConfigError) as e:
        WorldModelModule.check_trainer(trainer)
    assert str(e.value).startswith(message)
    for valid in accepted:
        WorldModelModule.check_trainer(L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **valid))


def test_training_steps_update_the_codebooks_at_their_global_step():
    """The EMA decay's schedule runs on the step the module passes the quantizers: the trainer's global step."""
    torch.manual_seed(0)
    module = WorldModelModule(net=NET)
    seen = {"Action_Encoder": [], "World_Encoder": []}
    for name, quantizer in module.model.quantizers.items():
        def spy(residuals, indices, step, _name=name, _update=quantizer._ema_update):
            seen[_name].append(int(step))
            return _update(residuals, indices, step)

        quantizer._ema_update = spy
    _fit(module, _batches(3))
    assert seen == {"Action_Encoder": [0, 1, 2], "World_Encoder": [0, 1, 2]}


def test_revival_waits_for_the_end_of_an_accumulation_window():
    """With gradient accumulation, revival runs once per due optimizer step, at the batch that ends it."""
    net = replace(NET, codebook_sizes_action=(16,), codebook_sizes_world=(16,), dead_code_steps=1)
    torch.manual_seed(0)
    module = WorldModelModule(net=net, optim=OptimConfig(warmup_steps=0))
    calls = []
    for quantizer in module.model.quantizers.values():
        def revive(generator=None, _revive=quantizer.revive):
            calls.append(module.global_step)
            return _revive(generator=generator)

        quantizer.revive = revive
    _fit(module, _batches(8), callbacks=[DeadCodeRevival(every_n_steps=2)], accumulate_grad_batches=2)
    assert calls == [2, 2, 4, 4, 6, 6, 8, 8]  # both quantizers at steps 2, 4, 6, 8 (8 steps of 2 batches)

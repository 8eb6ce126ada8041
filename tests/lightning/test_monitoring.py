"""Monitoring: a tiny CPU fit (wandb disabled) writes every metric of the requirement to the CSV, in the
requirement's namespaces, for training and validation; wandb is offline by default without a login."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lwm.utils.errors import ConfigError
from lwm.training.loggers import RUN_ID_FILE, CSVLogger, WandbConfig, make_loggers, wandb_logged_in, wandb_run_id
from tests.lightning.helpers import make_dataset, read_metrics, run, tiny_args

LOSSES = ["Total/loss", "Dynamics_Predictor/tf_loss", "Dynamics_Predictor/rollout_1_loss",
          "Dynamics_Predictor/rollout_2_loss", "Action_Encoder/commit_loss", "Action_Encoder/codebook_loss",
          "World_Encoder/commit_loss", "World_Encoder/codebook_loss"]
CODEBOOKS = [f"{q}/{m}_level_{l}" for q in ("Action_Encoder", "World_Encoder") for l in (0, 1)
             for m in ("codebook_usage", "codebook_diversity_min", "codebook_diversity_max", "codebook_diversity_mean")]
DIAGONALITY = [f"Action_Encoder/attention_diagonality_block_0/{s}" for s in ("min", "mean", "max")]
TRAIN_ONLY = ["Action_Encoder/ema_decay", "World_Encoder/ema_decay", "Total/grad_norm"]
VAL_ONLY = [f"{q}/{m}" for q in ("Action_Encoder", "World_Encoder") for m in ("dPSNR", "PSNR_seq", "PSNR_rand")] + [
    f"{q}/codebook_coverage_level_{l}" for q in ("Action_Encoder", "World_Encoder") for l in (0, 1)]


@pytest.mark.slow
def test_every_metric_reaches_the_csv_in_its_namespace(tmp_path):
    manifest = make_dataset(tmp_path / "data", files=6)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=4", "--trainer.log_every_n_steps=2", "--data.window=6") == 0
    keys = set().union(*read_metrics(root))
    both = LOSSES + CODEBOOKS + DIAGONALITY
    expected = {f"Train_{k}" for k in both + TRAIN_ONLY} | {f"Val_{k}" for k in both + VAL_ONLY}
    assert expected <= keys, sorted(expected - keys)
    rows = read_metrics(root)
    usage = [r["Train_Action_Encoder/codebook_usage_level_0"] for r in rows if "Train_Action_Encoder/codebook_usage_level_0" in r]
    assert usage and all(0 < u <= 1 for u in usage)
    assert len(usage) == 2  # logged at the logging interval only (steps 2 and 4 of 4)
    for split, times in (("Train", 2), ("Val", None)):
        key = f"{split}_Action_Encoder/attention_diagonality_block_0/mean"
        diag = [r[key] for r in rows if key in r]
        assert diag and all(0 < d <= 1 for d in diag)
        assert times is None or len(diag) == times  # training: at the logging interval only
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps))  # one row per step: training, learning rate and validation joined
    assert any("Val_Total/loss" in r and "Train_Total/loss" in r and "Train_Total/lr/pg1" in r for r in rows)
    assert not (root / "wandb").exists()  # disabled


def test_wandb_is_offline_without_a_login_and_can_be_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert not wandb_logged_in()
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    loggers = make_loggers(str(tmp_path / "run"))
    assert isinstance(loggers[0], CSVLogger) and type(loggers[1]).__name__ == "WandbLogger"
    assert loggers[1]._wandb_init["mode"] == "offline" and loggers[1].save_dir == str(tmp_path / "run")
    assert (loggers[1]._wandb_init["project"], loggers[1]._wandb_init["name"]) == ("lwm", "run")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_logged_in() and make_loggers(str(tmp_path / "r2"))[1]._wandb_init["mode"] == "online"
    assert len(make_loggers(str(tmp_path / "r3"), WandbConfig(mode="disabled"))) == 1


def test_wandbs_environment_variables_keep_their_meaning_where_the_config_leaves_the_key_unset(tmp_path, monkeypatch):
    """WANDB_MODE=disabled started an offline run in RUN_DIR/wandb all the same; WANDB_DIR, WANDB_PROJECT,
    WANDB_NAME and WANDB_RUN_ID were overridden too. A key the config sets wins over its variable."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert len(make_loggers(str(tmp_path / "run"), resume=False)) == 1
    assert make_loggers(str(tmp_path / "run"), WandbConfig(mode="offline"))[1]._wandb_init["mode"] == "offline"
    for var, value in (("WANDB_MODE", "online"), ("WANDB_DIR", str(tmp_path / "elsewhere")),
                       ("WANDB_PROJECT", "theirs"), ("WANDB_NAME", "their-run"), ("WANDB_RUN_ID", "abc123")):
        monkeypatch.setenv(var, value)
    init = make_loggers(str(tmp_path / "run"), resume=False)[1]._wandb_init
    assert {k: init[k] for k in ("mode", "dir", "project", "name", "id")} == {
        "mode": "online", "dir": str(tmp_path / "elsewhere"), "project": "theirs", "name": "their-run", "id": "abc123"}
    init = make_loggers(str(tmp_path / "run"), WandbConfig(mode="offline", project="mine", name="my-run"))[1]._wandb_init
    assert (init["mode"], init["project"], init["name"]) == ("offline", "mine", "my-run")
    monkeypatch.setenv("WANDB_MODE", "offlin")
    with pytest.raises(ConfigError, match="WANDB_MODE=offlin: wandb's modes are online, offline, disabled"):
        make_loggers(str(tmp_path / "run"))


@pytest.mark.slow
def test_wandb_mode_disabled_in_the_environment_writes_no_wandb_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    manifest = make_dataset(tmp_path / "data", files=4)
    args = [a for a in tiny_args(manifest, tmp_path / "run", "--trainer.max_steps=1", "--data.val_size_percent=0")
            if a != "--wandb.mode=disabled"]
    from lwm.cli.main import main

    assert main(args) == 0
    assert (tmp_path / "run/checkpoints/last.ckpt").is_file() and not (tmp_path / "run/wandb").exists()


@pytest.mark.slow
def test_wandb_online_without_a_login_is_one_line(tmp_path, monkeypatch, capsys):
    """wandb's UsageError ("No API key configured") came out as a 55-line traceback."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    manifest = make_dataset(tmp_path / "data", files=4)
    args = [a for a in tiny_args(manifest, tmp_path / "run", "--trainer.max_steps=1") if a != "--wandb.mode=disabled"]
    from lwm.cli.main import main

    assert main([*args, "--wandb.mode=online"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(lines) == 1 and "API key" in lines[0], err  # (wandb's own words)
    assert lines[0].startswith("error: wandb: ") and lines[0].endswith(
        "(or set WANDB_API_KEY; --wandb.mode=offline logs without an account)")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_resumed_fit_continues_its_wandb_run(tmp_path):
    """Each `lwm fit` is its own process (a requeue, a restart): the resumed one logs to the same wandb run id
    (offline: a second offline-run folder of that id, which `wandb sync` appends); a fit that starts afresh in
    the same RUN_DIR, or a fit elsewhere, gets a new id."""
    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"

    def fit(run_dir, steps, *extra):  # -> the run id recorded
        args = [a for a in tiny_args(manifest, run_dir, f"--trainer.max_steps={steps}", "--data.val_size_percent=0",
                                     "--wandb.mode=offline", *extra) if a != "--wandb.mode=disabled"]
        env = {**os.environ, "WANDB_SILENT": "true", "PYTHONPATH": str(Path(__file__).parents[2])}
        done = subprocess.run([sys.executable, "-m", "lwm.cli", *args], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return (run_dir / RUN_ID_FILE).read_text().strip()

    def offline_ids(run_dir):
        return sorted(p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*"))

    first = fit(root, 2)
    assert fit(root, 4, "--ckpt_path=last") == first and offline_ids(root) == [first, first]
    assert fit(tmp_path / "other", 2) != first
    assert wandb_run_id(str(root), resume=True) == first
    assert wandb_run_id(str(root), resume=False) != first  # a fresh start in the same RUN_DIR: a new run
    for resume in (["--ckpt_path=last"], []):  # refused before its wandb run starts, a resume or a fresh fit:
        with pytest.raises(AssertionError, match="window 99 is longer" if resume else "already holds a run"):
            fit(root, 6, *resume, "--data.window=99")
    assert (root / RUN_ID_FILE).read_text().strip() == first and offline_ids(root) == [first, first]  # as it was


def test_which_fits_resume_a_run(tmp_path, monkeypatch):
    """What decides whether a fit continues its wandb run: a checkpoint that exists, or Lightning's SLURM
    requeue checkpoint where Lightning resumes from it (under SLURM, given no --ckpt_path)."""
    from lwm.training.run_dir import RunDir

    def fit_resumes(ckpt_path, root):
        return RunDir(root).resumes(ckpt_path)

    for var in ("SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "run"
    root.mkdir()
    assert not fit_resumes(None, str(root)) and not fit_resumes(str(root / "last.ckpt"), str(root))
    (root / "last.ckpt").write_text("x")
    assert fit_resumes(str(root / "last.ckpt"), str(root))
    (root / "hpc_ckpt_1.ckpt").write_text("x")  # a stale one outside SLURM: Lightning starts afresh, so do we
    assert not fit_resumes(None, str(root)) and fit_resumes("hpc", str(root))
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert fit_resumes(None, str(root))


@pytest.mark.slow
def test_tflops_are_the_measured_step_flops_times_steps(tmp_path, caplog):
    manifest = make_dataset(tmp_path / "data", files=6)
    root = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        assert run(manifest, root, "--trainer.max_steps=5", "--trainer.log_every_n_steps=1") == 0
    series = {int(r["step"]): r["Train_Total/tflops"] for r in read_metrics(root) if "Train_Total/tflops" in r}
    assert len(series) >= 3
    per_step = {v / (s + 1) for s, v in series.items()}  # logged after step s: s + 1 optimizer steps done
    assert max(per_step) == pytest.approx(min(per_step), rel=1e-6) and min(per_step) > 0
    printed = re.search(r"FLOPs of a training step: ([0-9.e+]+) GFLOP per device", caplog.text)
    assert printed and float(printed.group(1)) == pytest.approx(min(per_step) * 1e3, rel=1e-3)
    val = [r["Val_Total/tflops"] for r in read_metrics(root) if "Val_Total/tflops" in r]
    assert val and all(v >= 0 for v in val)
    import torch  # the sum travels with the checkpoint (a resume on another number of GPUs goes on from it)

    callbacks = torch.load(root / "checkpoints/last.ckpt", weights_only=True)["callbacks"]
    state = next(v for k, v in callbacks.items() if k.startswith("FlopCounter"))
    assert state["counted_step"] == 5 and state["tflops"] == pytest.approx(5 * min(per_step), rel=1e-6)


def test_flop_counter_counts_forward_and_backward_of_the_step():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from lwm.callbacks.flop_counter import FlopCounter
    from lwm.training.module import WorldModelModule
    from tests.lightning.test_module import NET

    module = WorldModelModule(net=NET).train()
    x = torch.tanh(torch.randn(2, 6, 4, 16, 16))

    class _Trainer:  # what the counter reads of the trainer
        strategy = object()
        precision_plugin = type("P", (), {"forward_context": staticmethod(lambda: __import__("contextlib").nullcontext())})

    measured = FlopCounter()._measure(_Trainer(), module, x)
    with FlopCounterMode(display=False) as forward_only:
        module.model.compute(x, step=None, generator=torch.Generator().manual_seed(0))
    assert measured > 2 * forward_only.get_total_flops()  # backward costs about twice the forward
    assert all(p.grad is None for p in module.parameters())  # nothing left behind for the real step
    assert measured == FlopCounter()._measure(_Trainer(), module, x)  # deterministic


def test_log_distribution_sends_a_histogram_to_wandb_and_min_mean_max_to_every_logger():
    import lightning as L
    import torch
    import wandb
    from lwm.training.loggers import log_distribution
    from tests.lightning.helpers import WandbLogger
    from lwm.training.module import WorldModelModule
    from tests.lightning.test_module import NET, _batches

    wandb_logger = WandbLogger()
    recorded = wandb_logger.sent

    class Emit(L.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            log_distribution(pl_module, "Val_Test/dist", torch.tensor([1.0, 2.0, 6.0]))

    trainer = L.Trainer(accelerator="cpu", logger=[wandb_logger], callbacks=[Emit()], enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.validate(WorldModelModule(net=NET), torch.utils.data.DataLoader(_batches(1), batch_size=None), verbose=False)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("Val_Test/")}
    assert logged == {"Val_Test/dist/min": 1.0, "Val_Test/dist/mean": 3.0, "Val_Test/dist/max": 6.0}
    assert len(recorded) == 1 and isinstance(recorded[0]["Val_Test/dist"], wandb.Histogram)
    assert recorded[0]["trainer/global_step"] == 0 and "Val_Test/dist/mean" in recorded[0]  # the scalars' row


def test_a_histogram_of_nearly_equal_or_non_finite_values_is_made_not_raised():
    """float32 values a few ulps apart (an attention diagonality that barely moves) made wandb.Histogram raise
    "Too many bins for data range" in the middle of a validation; non-finite values are left out of it."""
    import numpy as np
    import torch
    import wandb
    from lwm.training.loggers import histogram_values

    close = torch.tensor([0.44466572, 0.44466575])  # float32
    with pytest.raises(ValueError, match="Too many bins"):
        wandb.Histogram(close.numpy())
    counts, edges = np.histogram(histogram_values(close), bins=64)
    assert counts.sum() == 2 and len(edges) == 65 and wandb.Histogram(histogram_values(close)) is not None
    assert histogram_values(torch.tensor([float("nan"), 1.0, float("inf"), 2.0])).tolist() == [1.0, 2.0]
    assert histogram_values(torch.tensor([float("nan")])) is None


def test_the_model_summary_has_no_zero_flops_and_no_metric_rows(capsys):
    from lightning.pytorch.utilities.model_summary import summarize

    from lwm.callbacks import ModelSummary
    from lwm.training.module import WorldModelModule
    from tests.lightning.test_module import NET

    s = summarize(WorldModelModule(net=NET), max_depth=2)
    ModelSummary.summarize(s._get_summary_data(), s.total_parameters, s.trainable_parameters, s.model_size,
                           s.total_training_modes, 0)
    out = capsys.readouterr().out
    assert "model.dynamics" in out and "Trainable params" in out
    assert "FLOPs" not in out and "val_metrics" not in out


def test_tflops_per_s_leaves_the_validation_time_out(monkeypatch):
    """On a fake clock: 2 steps of 1 s each around a 10 s validation are 2 s of training."""
    from types import SimpleNamespace

    from lwm.callbacks import flop_counter as flops_module
    from lwm.callbacks.flop_counter import FlopCounter
    from tests.lightning.helpers import accumulation_counters

    clock = [0.0]
    monkeypatch.setattr(flops_module.time, "perf_counter", lambda: clock[0])
    logged = {}
    module = SimpleNamespace(log_dict=lambda logs, **kwargs: logged.update(logs))
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=2, world_size=1, training=True, should_stop=False,
                              **accumulation_counters())
    counter = FlopCounter(peak_tflops=1.0)
    counter.flops_per_step = int(3e12)
    counter.on_train_batch_end(trainer, module, None, None, 0)  # step 0: the interval starts
    for seconds_before in (1.0, 1.0):  # two steps of 1 s, a validation of 10 s between them
        clock[0] += seconds_before
        if trainer.global_step == 0:
            counter.on_validation_start(trainer, module)
            clock[0] += 10.0
            counter.on_validation_end(trainer, module)
        trainer.global_step += 1
    counter.on_train_batch_end(trainer, module, None, None, 1)
    assert logged["Train_Total/tflops_per_s"] == pytest.approx(3.0)  # 2 steps x 3 TFLOP in 2 s
    assert logged["Train_Total/mfu"] == pytest.approx(3.0)


def test_without_wandb_installed_the_default_logs_to_the_csv_and_an_explicit_mode_is_refused(tmp_path, monkeypatch):
    import lwm.training.loggers
    from lwm.utils.errors import ConfigError

    monkeypatch.setattr(lwm.training.loggers, "wandb_installed", lambda: False)
    with pytest.warns(UserWarning, match="wandb is not installed"):
        loggers = make_loggers(str(tmp_path / "run"))
    assert len(loggers) == 1 and isinstance(loggers[0], CSVLogger)
    for mode in ("online", "offline"):
        with pytest.raises(ConfigError, match=f"wandb.mode={mode}, but wandb is not installed"):
            make_loggers(str(tmp_path / "run"), WandbConfig(mode=mode))
    assert len(make_loggers(str(tmp_path / "run"), WandbConfig(mode="disabled"))) == 1
    with pytest.warns(UserWarning, match="wandb is not installed"):  # lwm codes/overfit on a fit's config.yaml
        assert len(make_loggers(str(tmp_path / "run"), WandbConfig(mode="offline"), strict=False)) == 1


def test_histograms_sit_at_the_step_of_their_scalars_and_once_per_accumulated_step(tmp_path):
    """wandb histograms carry the step Lightning writes the same moment's scalars at (training and validation
    inside fit); with gradient accumulation the monitors run once per optimizer step."""
    import lightning as L
    import torch

    from lwm.callbacks import AttentionDiagonality, CodebookMonitor
    from lwm.training.loggers import CSVLogger as LwmCSV
    from tests.lightning.helpers import WandbLogger
    from lwm.training.module import WorldModelModule
    from tests.lightning.test_module import NET, _batches

    wandb_logger = WandbLogger()
    csv_logger = LwmCSV(str(tmp_path))
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=[csv_logger, wandb_logger], log_every_n_steps=2,
                        accumulate_grad_batches=2, val_check_interval=4, limit_val_batches=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, callbacks=[AttentionDiagonality(), CodebookMonitor()])
    loader = torch.utils.data.DataLoader(_batches(8), batch_size=None)
    trainer.fit(WorldModelModule(net=NET), train_dataloaders=loader, val_dataloaders=loader)
    csv_logger.finalize("success")
    rows = read_metrics(tmp_path)
    for split in ("Train", "Val"):
        key = f"{split}_Action_Encoder/attention_diagonality_block_0"
        scalar_steps = sorted(int(r["step"]) for r in rows if f"{key}/mean" in r)
        histogram_steps = sorted(int(sent["trainer/global_step"]) for sent in wandb_logger.sent if key in sent)
        assert scalar_steps and histogram_steps == scalar_steps, (split, scalar_steps, histogram_steps)
    # 4 optimizer steps of 2 batches, logged every 2 steps: one histogram per quantizer at steps 1 and 3
    train_usage = [s["trainer/global_step"] for s in wandb_logger.sent if "Train_Action_Encoder/codebook_usage" in s]
    assert train_usage == [1, 3]


def test_a_new_column_rewrites_metrics_csv_through_a_renamed_temp_file(tmp_path, monkeypatch):
    """A column that appears late (the first validation) rewrites the file's header: streamed into a temp file that
    replaces the file, so a kill mid-rewrite leaves the old file whole (Lightning rewrote it in place)."""
    logger = CSVLogger(str(tmp_path))
    for step in range(3):
        logger.log_metrics({"Train_Total/loss": float(step)}, step=step)
    logger.save()
    logger.log_metrics({"Train_Total/loss": 3.0, "Val_Total/loss": 9.0}, step=3)
    replaced = []
    monkeypatch.setattr(os, "replace", lambda src, dst: replaced.append((Path(src).name, Path(dst).name))
                        or os.rename(src, dst))
    logger.log_metrics({"Train_Total/loss": 4.0}, step=4)  # step 3's row written as step 4's begins
    logger.save()
    logger.finalize("success")
    assert replaced == [(f".metrics.csv.tmp-{socket.gethostname()}-{os.getpid()}", "metrics.csv")]
    rows = read_metrics(tmp_path)
    assert [(int(r["step"]), r["Train_Total/loss"], r.get("Val_Total/loss")) for r in rows] == [
        (0, 0.0, None), (1, 1.0, None), (2, 2.0, None), (3, 3.0, 9.0), (4, 4.0, None)]
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv"]
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f".metrics.csv.tmp-{socket.gethostname()}-{dead.pid}").write_text("torn")  # a rewrite killed mid-way
    CSVLogger(str(tmp_path)).experiment  # the next run's writer removes it
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv"]

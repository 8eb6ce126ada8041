"""Monitoring: a tiny CPU fit (wandb disabled) writes every metric of the requirement to the CSV, in the
requirement's namespaces, for training and validation; wandb is offline by default without a login."""

from __future__ import annotations

import pytest

from lwm.loggers import CSVLogger, WandbConfig, make_loggers, wandb_logged_in
from tests.lightning.helpers import make_dataset, read_metrics, run

LOSSES = ["Total/loss", "Dynamics_Predictor/tf_loss", "Dynamics_Predictor/rollout_1_loss",
          "Dynamics_Predictor/rollout_2_loss", "Action_Encoder/commit_loss", "Action_Encoder/codebook_loss",
          "World_Encoder/commit_loss", "World_Encoder/codebook_loss"]
CODEBOOKS = [f"{q}/{m}_level_{l}" for q in ("Action_Encoder", "World_Encoder") for l in (0, 1)
             for m in ("codebook_usage", "codebook_diversity_min", "codebook_diversity_max", "codebook_diversity_mean")]
TRAIN_ONLY = ["Action_Encoder/ema_decay", "World_Encoder/ema_decay", "Total/grad_norm"]
VAL_ONLY = [f"{q}/{m}" for q in ("Action_Encoder", "World_Encoder") for m in ("dpsnr", "psnr_seq", "psnr_rand")] + [
    f"Action_Encoder/attention_diagonality_block_0/{s}" for s in ("min", "mean", "max")]


def test_every_metric_reaches_the_csv_in_its_namespace(tmp_path):
    manifest = make_dataset(tmp_path / "data", files=6)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=4", "--trainer.log_every_n_steps=2", "--data.window=6") == 0
    keys = set().union(*read_metrics(root))
    expected = {f"Train_{k}" for k in LOSSES + CODEBOOKS + TRAIN_ONLY} | {f"Val_{k}" for k in LOSSES + CODEBOOKS + VAL_ONLY}
    assert expected <= keys, sorted(expected - keys)
    rows = read_metrics(root)
    usage = [r["Train_Action_Encoder/codebook_usage_level_0"] for r in rows if "Train_Action_Encoder/codebook_usage_level_0" in r]
    assert usage and all(0 < u <= 1 for u in usage)
    assert len(usage) == 2  # logged at the logging interval only (steps 2 and 4 of 4)
    diag = [r["Val_Action_Encoder/attention_diagonality_block_0/mean"] for r in rows
            if "Val_Action_Encoder/attention_diagonality_block_0/mean" in r]
    assert diag and all(0 < d <= 1 for d in diag)
    assert not (root / "wandb").exists()  # disabled


def test_wandb_is_offline_without_a_login_and_can_be_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert not wandb_logged_in()
    loggers = make_loggers(str(tmp_path / "run"))
    assert isinstance(loggers[0], CSVLogger) and type(loggers[1]).__name__ == "WandbLogger"
    assert loggers[1]._offline and loggers[1].save_dir == str(tmp_path / "run")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_logged_in() and not make_loggers(str(tmp_path / "r2"))[1]._offline
    assert len(make_loggers(str(tmp_path / "r3"), WandbConfig(mode="disabled"))) == 1

"""The `lwm` command end to end on the tiny config: every Lightning verb, the overfit test, and one clear
error line (exit 2) for each kind of bad input, before any training starts."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import h5py
import numpy as np
import pytest
import torch

from lwm.training.checkpoint import trained_window
from lwm.cli.main import main
from tests.lightning.helpers import make_dataset, read_metrics, run, tiny_args, train_series


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    manifest = make_dataset(tmp / "data")
    root = tmp / "run"
    assert run(manifest, root, "--trainer.max_steps=8", "--data.batches_per_epoch=8") == 0
    return manifest, root


def test_fit_validates_four_times_per_epoch_and_checkpoints(trained):
    manifest, root = trained
    rows = read_metrics(root)
    val_steps = [int(r["step"]) for r in rows if "Val_Total/loss" in r]
    assert val_steps == [1, 3, 5, 7]  # one epoch of 8 batches: after batches 2, 4, 6, 8 (logged at step - 1)
    train = [r for r in rows if "Train_Total/loss" in r]
    assert [int(r["step"]) for r in train] == list(range(8))
    for key in ("Train_Dynamics_Predictor/tf_loss", "Train_Dynamics_Predictor/rollout_1_loss",
                "Train_Dynamics_Predictor/rollout_2_loss", "Train_Action_Encoder/commit_loss",
                "Train_Action_Encoder/codebook_loss", "Train_World_Encoder/commit_loss",
                "Train_World_Encoder/codebook_loss", "Train_Total/grad_norm"):
        assert all(key in r for r in train), key
    assert torch.load(root / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 8
    assert (root / "config.yaml").is_file()


@pytest.mark.slow
def test_validate_test_and_predict_run_from_a_checkpoint_beside_the_fit(trained):
    """In the fit's RUN_DIR they log into RUN_DIR/<verb>/, at the checkpoint's step, and leave the fit's files be."""
    manifest, root = trained
    ckpt = str(root / "checkpoints/last.ckpt")
    fit_files = {name: (root / name).read_bytes() for name in ("metrics.csv", "config.yaml", "hparams.yaml")}
    for verb, prefix, path in (("validate", "Val_", ckpt), ("test", "Test_", "last")):  # last: RUN_DIR/checkpoints
        assert main(tiny_args(manifest, root, f"--ckpt_path={path}", verb=verb)) == 0
        rows = read_metrics(root / verb)
        keys = set().union(*rows)
        assert {f"{prefix}Total/loss", f"{prefix}Dynamics_Predictor/tf_loss", f"{prefix}World_Encoder/codebook_loss"} <= keys
        assert {int(r["step"]) for r in rows if f"{prefix}Total/loss" in r} == {8}  # the checkpoint's global step
        assert (root / verb / "config.yaml").is_file()
    assert [p.name for p in (root / "validate/videos").iterdir()] == ["step_0000008.mp4"]  # the checkpoint's step
    assert main(tiny_args(manifest, root, f"--ckpt_path={ckpt}", verb="predict")) == 0
    assert {name: (root / name).read_bytes() for name in fit_files} == fit_files
    codes = torch.load(root / "predict/codes_per_window.pt", weights_only=True)
    files = [f for f in json.loads(manifest.read_text())["files"] if f["split"] == "val"]
    n = len(codes["file"])  # every non-overlapping validation window of 6 frames
    assert n == sum(f["frames"] // 6 for f in files) and codes["action_indices"].shape == (n, 5, 2) and codes["world_indices"].shape == (n, 2)
    assert codes["global_step"] == 8 and all(f.endswith(".h5") for f in codes["file"])
    with torch.no_grad():  # the codes of the first window, computed directly
        from lwm.training.module import WorldModelModule

        model = WorldModelModule.load_from_checkpoint(ckpt, weights_only=True).model.eval()
        with h5py.File(codes["file"][0]) as f:
            start = int(codes["start"][0])
            x = torch.from_numpy(f["latents"][start:start + 6]).float()[None]
        assert torch.equal(model.encode_actions(x).indices[0], codes["action_indices"][0])
        assert torch.equal(model.encode_world(x).indices[0], codes["world_indices"][0])
    # without --ckpt_path: Lightning's model as initialised, said in one line (a baseline, rarely what was meant)
    with pytest.warns(UserWarning, match=r"^lwm test without --ckpt_path: the untrained model, as initialised "
                                         rf"\(--ckpt_path last takes {re.escape(ckpt)}\)$"):
        assert main(tiny_args(manifest, root, verb="test")) == 0


@pytest.mark.slow
def test_a_checkpoint_brings_its_own_model_shape_or_is_refused_by_field(trained, capsys):
    """validate/test/predict take the model from the checkpoint (`last` too, as Lightning does for a file); a
    fit resumed with another model shape is one error line naming the field, before anything is written."""
    manifest, root = trained
    other = "--model.net.d_model=48"  # the run trained 32
    assert main(tiny_args(manifest, root, other, "--ckpt_path=last", verb="test")) == 0
    before = (root / "checkpoints/last.ckpt").read_bytes(), (root / "metrics.csv").read_bytes()
    capsys.readouterr()
    assert main(tiny_args(manifest, root, other, "--ckpt_path=last", "--trainer.max_steps=12")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.net.d_model=48 (the checkpoint has 32)" in errors[0], errors
    assert ((root / "checkpoints/last.ckpt").read_bytes(), (root / "metrics.csv").read_bytes()) == before


@pytest.mark.slow
def test_data_of_another_shape_than_the_checkpoints_model_names_the_checkpoint(trained, tmp_path, capsys):
    """Under validate (and lwm codes) the model is the checkpoint's: no --model.net setting changes its shape, so
    the refusal names the checkpoint, not settings to change."""
    _, root = trained
    other = make_dataset(tmp_path / "big", files=4, shape=(4, 32, 32))
    ckpt = root / "checkpoints/last.ckpt"
    for argv in (tiny_args(other, root, "--ckpt_path=last", verb="validate"),
                 ["codes", "--ckpt_path", str(ckpt), "--config", str(root / "config.yaml"), f"--data.manifest={other}",
                  "--out", str(tmp_path / "codes.pt")]):
        assert main(argv) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert errors == [f"error: {ckpt}: its model takes [4, 16, 16] frames, but the files of {other} hold "
                          "[4, 32, 32] (use data of the checkpoint's shape, or a checkpoint trained on this data)"], argv


@pytest.mark.slow
def test_validate_with_another_window_than_the_checkpoints_says_so(trained, recwarn, caplog):
    manifest, root = trained  # trained on 6-frame windows
    assert main(tiny_args(manifest, root, "--ckpt_path=last", "--data.window=5", verb="validate")) == 0
    lines = [str(w.message) for w in recwarn if "was trained on" in str(w.message)]
    assert len(lines) == 1 and "data.window = 5, but" in lines[0] and "trained on 6-frame windows" in lines[0], lines
    recwarn.clear()
    with caplog.at_level(logging.INFO):
        assert main(tiny_args(manifest, root, "--ckpt_path=last", verb="validate")) == 0
    assert not [w for w in recwarn if "was trained on" in str(w.message)]
    assert f"lwm validate: its files are in {root / 'validate'}" in caplog.text  # where, said


@pytest.mark.slow
def test_a_resumed_fit_keeps_the_configs_settings_and_may_change_what_is_not_shape(tmp_path, capsys):
    """A fit resumed from a checkpoint file (as the SLURM scripts do) or `last` uses the command line's settings,
    not the checkpoint's: a new learning rate, weight decay, betas and eps reach the optimizer (Lightning restores
    the old ones with its state), the schedule continues from the step with the new peak, and activation
    checkpointing applies. The lr is logged every step (Train_Total/lr/pg1, /pg2)."""
    from lwm.training.optim import OptimConfig

    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=2", "--data.val_size_percent=0") == 0
    warmup = 20  # configs/tiny.yaml
    for path, steps, lr, wd, betas, eps in ((root / "checkpoints/last.ckpt", 3, 0.002, 0.1, (0.8, 0.9), 1e-6),
                                            ("last", 4, 0.003, 0.2, (0.7, 0.8), 1e-7)):
        assert run(manifest, root, f"--trainer.max_steps={steps}", "--data.val_size_percent=0", f"--ckpt_path={path}",
                   f"--model.optim.lr={lr}", f"--model.optim.weight_decay={wd}", f"--model.optim.betas=[{betas[0]}, {betas[1]}]",
                   f"--model.optim.eps={eps}", "--model.net.activation_checkpointing=true") == 0
        ckpt = torch.load(root / "checkpoints/last.ckpt", weights_only=True)
        hparams = ckpt["hyper_parameters"]
        assert hparams["optim"]["lr"] == lr and hparams["net"]["activation_checkpointing"] is True
        factor = OptimConfig(lr=lr, warmup_steps=warmup).lr_factor
        decay, no_decay = ckpt["optimizer_states"][0]["param_groups"]
        for group, weight_decay in ((decay, wd), (no_decay, 0.0)):
            assert group["lr"] == pytest.approx(lr * factor(steps, steps)) and group["initial_lr"] == lr
            assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (weight_decay, betas, eps)
        assert ckpt["lr_schedulers"][0]["base_lrs"] == [lr, lr] and ckpt["lr_schedulers"][0]["last_epoch"] == steps
        logged = train_series(root, "Train_Total/lr/pg1")
        assert logged[steps - 1] == pytest.approx(lr * factor(steps - 1, steps))  # the lr the resumed step used
        assert train_series(root, "Train_Total/lr/pg2") == logged
    assert logged[0] == pytest.approx(1e-3 * OptimConfig(lr=1e-3, warmup_steps=warmup).lr_factor(0, 2))  # the first run's


@pytest.mark.slow
def test_a_resume_may_switch_the_fused_adamw_on_and_off(tmp_path):
    """The restored groups keep the old run's kernel choice: switching it (a CPU run resumed on a GPU, fp16
    resumed as bf16) crashed in AdamW before the groups took this run's."""
    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    for steps, fused in ((2, "false"), (4, "true"), (6, "false")):
        assert run(manifest, root, f"--trainer.max_steps={steps}", "--data.val_size_percent=0",
                   f"--model.optim.fused={fused}", *(["--ckpt_path=last"] if steps > 2 else [])) == 0
        ckpt = torch.load(root / "checkpoints/last.ckpt", weights_only=True)
        assert ckpt["global_step"] == steps
        assert all(g["fused"] is (fused == "true") for g in ckpt["optimizer_states"][0]["param_groups"])
        assert all(int(s["step"]) == steps for s in ckpt["optimizer_states"][0]["state"].values())


@pytest.mark.slow
def test_a_checkpoint_with_unknown_hyperparameters_is_one_error_line(trained, tmp_path, capsys):
    manifest, root = trained
    ckpt = torch.load(root / "checkpoints/last.ckpt", weights_only=True)
    ckpt["hyper_parameters"]["bogus"] = 1  # e.g. a field a later lwm removed
    torch.save(ckpt, tmp_path / "odd.ckpt")
    assert main(tiny_args(manifest, tmp_path / "v", f"--ckpt_path={tmp_path / 'odd.ckpt'}", verb="validate")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.bogus" in errors[0], errors  # jsonargparse's line, naming the field


@pytest.mark.slow
def test_a_fit_into_a_log_file_prints_plain_progress_lines_and_a_summary(tmp_path, capsys):
    """Not on a terminal (SLURM's output, nohup), rich shows its bar only at the end: plain lines say how far the fit
    is, each validation's losses, and where it ended."""
    manifest = make_dataset(tmp_path / "data", files=4)  # 2 training batches per epoch
    assert run(manifest, tmp_path / "run", "--trainer.max_steps=4", "--trainer.enable_progress_bar=true",
               "--progress_bar.text_every_s=1e-9", "--trainer.val_check_interval=2",
               "--trainer.check_val_every_n_epoch=null") == 0
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split(" · ")[0] for line in progress] == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"], lines
    assert all(" steps/s · Train_Total/loss " in line and " elapsed, " in line and " to go" in line for line in progress)
    validations = [line for line in lines if line.startswith("validation at step ")]
    assert [line.split(":")[0] for line in validations] == ["validation at step 2", "validation at step 4"], lines
    assert all("Val_Dynamics_Predictor/tf_loss" in v and "copy_last_loss" in v for v in validations)
    done = [line for line in lines if line.startswith("fit done: step 4/4 in 0:")]
    assert len(done) == 1 and done[0].endswith(f" · checkpoint {tmp_path / 'run/checkpoints/last.ckpt'}")
    assert main(tiny_args(manifest, tmp_path / "quiet", "--trainer.max_steps=1", "--trainer.enable_progress_bar=true",
                          "--progress_bar.text_every_s=0")) == 0  # none, but the summary
    out = capsys.readouterr().out
    assert "steps/s" not in out and "fit done: step 1/1" in out
    assert main(tiny_args(manifest, tmp_path / "bad", "--progress_bar.text_every_s=-1")) == 2
    assert "progress_bar.text_every_s must be >= 0" in capsys.readouterr().err


def test_help_lists_the_verbs(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(verb in out for verb in ("fit", "validate", "test", "predict", "overfit", "data", "demo"))


def test_fit_help_lists_the_keys_and_titles_the_sections(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # (the help wraps to the terminal's width)
    assert "--model.net.d_model D_MODEL token width D (divisible by 4 and by n_heads) (type: int, default: 512)" in out
    assert "--model.optim.lr LR peak learning rate (type: float, default: 0.0003)" in out
    assert "dead-code revival of both quantizers (``revival.*``):" in out


@pytest.mark.slow
def test_overfit_drives_the_tf_loss_towards_zero(tmp_path, capsys):
    manifest = make_dataset(tmp_path / "data", files=4)
    args = tiny_args(manifest, tmp_path / "run", "--model.optim.lr=3e-3", verb="overfit")
    (tmp_path / "run/overfit").mkdir(parents=True)  # empty, as a crashed run may leave it: taken, not skipped
    assert main([*args, "--steps", "120"]) == 0
    rows = [r for r in read_metrics(tmp_path / "run/overfit") if "Train_Dynamics_Predictor/tf_loss" in r]
    tf = [r["Train_Dynamics_Predictor/tf_loss"] for r in rows]
    assert len(tf) == 120
    assert min(tf[-10:]) < 0.1 * tf[0], (tf[0], tf[-10:])
    assert "overfit: teacher-forcing loss" in capsys.readouterr().out
    first = (tmp_path / "run/overfit/metrics.csv").read_bytes()
    # again, with a config that logs rarely, accumulates and validates by steps across epochs (configs/demo.yaml's
    # check_val_every_n_epoch: null): a fresh folder, every step logged, --steps steps
    again = tiny_args(manifest, tmp_path / "run", "--trainer.log_every_n_steps=50",
                      "--trainer.accumulate_grad_batches=3", "--trainer.check_val_every_n_epoch=null",
                      "--trainer.val_check_interval=500", verb="overfit")
    with pytest.warns(UserWarning) as said:
        assert main([*again, "--steps", "4"]) == 0
    said = [str(w.message) for w in said]  # given on the command line: each ignored key said, and the warmup
    assert ("--trainer.accumulate_grad_batches: lwm overfit sets it itself (every step logged, one window, a batch of "
            "one, no validation, checkpoints in its folder): ignored") in said
    assert "--trainer.log_every_n_steps: lwm overfit sets it itself" in " ".join(said)
    assert ("model.optim.warmup_steps 20 >= --steps 4: the whole overfit runs in the warmup, below the peak lr (e.g. "
            "--model.optim.warmup_steps=0)") in said
    rows = [r for r in read_metrics(tmp_path / "run/overfit_2") if "Train_Dynamics_Predictor/tf_loss" in r]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    # its checkpoint names the trained window, as a fit's does (`lwm generate` slides by it)
    ckpt = torch.load(tmp_path / "run/overfit_2/checkpoints/last.ckpt", weights_only=True)
    assert trained_window(ckpt) == 6
    assert (tmp_path / "run/overfit/metrics.csv").read_bytes() == first  # the first run's file as it was


@pytest.mark.slow
def test_overfit_trains_on_the_window_its_file_and_start_name(tmp_path, capsys, monkeypatch):
    import lwm.cli.overfit
    from lwm.data.manifest import Manifest

    manifest = make_dataset(tmp_path / "data", files=4)
    train = [Manifest.load(manifest).resolve(e) for e in Manifest.load(manifest).split("train")]
    seen = []
    loader = lwm.cli.overfit.DataLoader
    monkeypatch.setattr(lwm.cli.overfit, "DataLoader", lambda items, **kw: seen.append(items[0]) or loader(items, **kw))
    assert run(manifest, tmp_path / "run", "--steps=1", "--file=1", "--start=2", verb="overfit") == 0
    with h5py.File(train[1]) as f:  # the second train file's frames 2..7 (window 6), every step
        np.testing.assert_array_equal(seen[0]["latents"].numpy(), f["latents"][2:8])
    assert f"on one window ({train[1]}, frames 2..7)" in capsys.readouterr().out
    frames = len(h5py.File(train[1])["latents"])
    for flag, message in [("--file=3", "--file 3: the train split has 3 usable files (0..2)"),
                          (f"--start={frames - 5}", f"--start {frames - 5}: {train[1]} has {frames} frames, window 6")]:
        assert run(manifest, tmp_path / "run", "--steps=1", "--file=1", flag, verb="overfit") == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {message}"]


@pytest.mark.slow
def test_an_interrupted_overfit_does_not_advise_a_resume_it_refuses(tmp_path, caplog):
    """Stopped by SIGTERM (at the start of step 3: saved at its end), `lwm overfit` saves its last.ckpt and says it does not resume (it takes no --ckpt_path,
    and a new run gets a folder of its own), not the fit's `continue with --ckpt_path last`."""
    import signal

    manifest = make_dataset(tmp_path / "data", files=4)
    sig = ["--trainer.callbacks+=tests.lightning.helpers.SendSignal", "--trainer.callbacks.step=3",
           "--trainer.callbacks.during=training"]
    with caplog.at_level(logging.WARNING):
        assert run(manifest, tmp_path / "run", "--steps=10", *sig, verb="overfit") == 128 + signal.SIGTERM
    assert "SIGTERM: stopped at step 4" in caplog.text and "lwm overfit does not resume" in caplog.text
    assert "--ckpt_path last" not in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model.net.codebook_sizes_action=[]"], "codebook_sizes_action needs at least one level"),
        (["--data.window=3"], "data.window = 3, but the model needs at least 4 frames (teacher forcing + 2 rollout"),
        (["--data.window=1"], "data.window must be >= 2"),
        (["--model.net.in_channels=16"], "model.net.in_channels/height/width = 16/16/16, but the files of"),
        (["--data.window=99"], "window 99 is longer than every 'train' file"),
        (["--model.net.in_channels=16"], "(set --model.net.in_channels=4 --model.net.height=16 --model.net.width=16)"),
        (["--model.optim.lr=-1"], "optim.lr must be > 0, got -1.0"),
        (["--model.optim.betas=[1.5, 0.9]"], "optim.betas must be two values in [0, 1), got (1.5, 0.9)"),
        (["--model.net.tokenizer_hidden=-4"], "tokenizer_hidden must be >= 1 (or null: max(d_model/2, 16)), got -4"),
        (["--model.net.tokenizer_hidden=0"], "tokenizer_hidden must be >= 1"),
        (["--model.net.mlp_ratio=0"], "mlp_ratio must be > 0, got 0.0"),
        (["--model.net.rollout_weights=[1, -5, 0.5]"], "rollout_weights must be >= 0, not all 0, got (1.0, -5.0, 0.5)"),
        (["--model.net.rollout_weights=[0, 0]"], "rollout_weights must be >= 0, not all 0"),
        (["--model.net.beta_action=-1"], "beta_action must be >= 0, got -1.0"),
        (["--trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val must be >= 0 (0 or null: no clipping), got -1"),
        # Parse errors: jsonargparse's own line, not its ~145 lines of usage, naming the key or the file.
        (["--model.net.dmodel=32"], "unrecognized arguments: --model.net.dmodel=32"),
        # a prefix of a key is a typo too, not that key (argparse's abbreviations: --trainer.max_step 8 trained 8 steps)
        (["--trainer.max_step=8"], "unrecognized arguments: --trainer.max_step=8"),
        (["--trainer.max_steps=ten"], "trainer.max_steps … ten"),  # jsonargparse's line: the key and the value
        (["--config=configs/missing.yaml"], "configs/missing.yaml"),
        (["--config=TYPO"], "model.net.d_modle"),
        (["--trainer.limit_val_batches=0.01"], "trainer.limit_val_batches=0.01 leaves the run no batch: 0.01 x its 1 "
                                               "batch of data.val_batch_size=3"),
    ],
)
def test_bad_config_is_one_error_line_before_training(tmp_path, capsys, extra, message):
    manifest = make_dataset(tmp_path / "data", files=4)
    typo = tmp_path / "typo.yaml"  # a misspelt key in a config file: the file named
    typo.write_text("model:\n  net:\n    d_modle: 32\n")
    extra = [a.replace("TYPO", str(typo)) for a in extra]
    message = message.replace("TYPO", str(typo))
    assert run(manifest, tmp_path / "run", *extra) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(part in errors[0] for part in message.split(" … ")), errors
    assert not (tmp_path / "run/checkpoints").exists()


@pytest.mark.slow
def test_bad_data_is_named_before_training_and_nothing_is_lost(tmp_path, capsys):
    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.max_steps=2", "--data.val_size_percent=0") == 0
    before = (root / "checkpoints/last.ckpt").read_bytes(), (root / "metrics.csv").read_text()
    victim = tmp_path / "data/ep01.h5"
    victim.write_bytes(victim.read_bytes()[:300])  # truncated by a failed copy
    capsys.readouterr()
    assert run(manifest, root, "--trainer.max_steps=4", "--ckpt_path=last") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert any(str(victim) in line for line in errors), errors
    assert ((root / "checkpoints/last.ckpt").read_bytes(), (root / "metrics.csv").read_text()) == before
    assert run(manifest, root, "--data.manifest=" + str(tmp_path / "nope.json"), "--ckpt_path=last") == 2
    assert "nope.json: manifest not found" in capsys.readouterr().err


@pytest.mark.slow
def test_a_validation_fraction_that_leaves_one_rank_no_batch_is_one_error_line(tmp_path, capsys):
    """5 validation windows in batches of 2: 2 batches on rank 0, 1 on rank 1, whose half is no batch. Lightning
    raises on rank 1 alone, rank 0 training on and waiting for it in a collective; refused before either starts."""
    manifest = make_dataset(tmp_path / "data")
    ddp = ["--trainer.devices=2", "--trainer.strategy=ddp", "--data.val_batch_size=2"]
    assert run(manifest, tmp_path / "run", *ddp, "--trainer.limit_val_batches=0.5") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "trainer.limit_val_batches=0.5 leaves rank 1 (of 2) no batch" in errors[0], errors
    assert not (tmp_path / "run").exists()
    assert run(manifest, tmp_path / "one", "--data.val_batch_size=2", "--trainer.limit_val_batches=0.5",
               "--trainer.max_steps=1") == 0  # one process: half of its 3 batches is one


@pytest.mark.slow
def test_a_gpu_config_without_a_gpu_is_one_error_line(tmp_path, capsys):
    manifest = make_dataset(tmp_path / "data", files=4)
    assert run(manifest, tmp_path / "run", "--trainer.accelerator=gpu") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: No supported gpu backend found! (trainer.accelerator=gpu, as in configs/base.yaml, "
                      "ddp.yaml and deepspeed.yaml, but this machine has no GPU: use configs/tiny.yaml, or this "
                      "config's model on the CPU with --trainer.accelerator=cpu --trainer.precision=32-true "
                      "--model.compile=false: compiling takes many minutes on a CPU, and bf16 is emulated on one without bf16 "
                      "instructions)"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_the_advice_for_the_base_config_without_a_gpu_trains(tmp_path, capsys):
    """The flags the error line advises, given to configs/base.yaml (its model, at this data's frame size), train
    and write the checkpoint and the code dictionaries (--trainer.accelerator=cpu alone led to bf16 autocast, which
    failed at the end of fit, and to a compile of many minutes)."""
    from tests.lightning.helpers import REPO, C, H, W

    manifest = make_dataset(tmp_path / "data", files=4, dtype=np.float16)
    common = ["fit", "--config", str(REPO / "configs" / "base.yaml"), f"--data.manifest={manifest}", "--wandb.mode=disabled",
              f"--model.net.in_channels={C}", f"--model.net.height={H}", f"--model.net.width={W}", "--data.window=6",
              "--data.batch_size=2", "--data.num_workers=0", "--trainer.max_steps=1", "--data.val_size_percent=0",
              "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    assert main([*common, f"--trainer.default_root_dir={tmp_path / 'gpu'}"]) == 2
    advice = re.search(r"on the CPU with (--.*?): ", capsys.readouterr().err).group(1).split()
    assert main([*common, f"--trainer.default_root_dir={tmp_path / 'run'}", *advice]) == 0
    assert torch.load(tmp_path / "run/checkpoints/codes.pt", weights_only=True)["global_step"] == 1


@pytest.mark.slow
def test_bad_data_is_refused_before_a_wandb_run_starts(tmp_path, capsys):
    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    for bad, message in (("--data.window=99", "window 99 is longer than every 'train' file"),
                         ("--trainer.gradient_clip_val=-1", "trainer.gradient_clip_val must be >= 0")):
        assert run(manifest, root, bad, "--wandb.mode=offline") == 2
        assert message in capsys.readouterr().err
        assert not (root / "wandb").exists() and not (root / "metrics.csv").exists()


@pytest.mark.slow
def test_plot_writes_the_figures_of_a_run(trained, capsys):
    _, root = trained
    assert main(["plot", str(root)]) == 0
    figures = {p.name for p in (root / "figures").glob("*.png")}
    assert {"losses.png", "val_loss_vs_tflops.png", "sensitivity.png", "codebook_usage.png",
            "attention_diagonality.png"} <= figures
    assert main(["plot", str(root / "nope")]) == 2
    assert str(root / "nope") in capsys.readouterr().err  # the path named


@pytest.mark.slow
def test_bf16_weights_train_validate_and_monitor(tmp_path):
    """Half-precision weights (``bf16-true`` here; DeepSpeed's bf16 casts the same way): float32 or float16 batches
    and fp32 codebook entries are cast to bf16 where they enter the model; the fit, its validation and every
    monitoring callback run; the quantizers stay fp32."""
    manifest = make_dataset(tmp_path / "data", files=6)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.precision=bf16-true", "--trainer.max_steps=4",
               "--trainer.val_check_interval=1.0", "--trainer.log_every_n_steps=1") == 0
    state = torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert state["model.tokenizer.net.0.weight"].dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for k, v in state.items() if ".rvq.levels." in k and v.is_floating_point())
    rows = read_metrics(root)
    val = [r for r in rows if "Val_Total/loss" in r]
    assert val and all(torch.isfinite(torch.tensor(r["Val_Total/loss"])) for r in val)
    assert any("Val_Action_Encoder/dPSNR" in r for r in rows)
    assert list((root / "videos").glob("*.mp4")) or list((root / "videos").glob("*.gif"))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_bf16_autocast_on_the_cpu_writes_the_code_dictionaries_at_the_end_of_fit_and_of_a_resume(tmp_path, precision):
    """bf16 autocast on the CPU with float16 files: the end-of-fit code dictionaries read their windows outside the
    autocast (CPU autocast refused to stack float16 windows: no codes.pt, at the end of fit nor of a resume)."""
    manifest = make_dataset(tmp_path / "data", files=4, dtype=np.float16)
    root = tmp_path / "run"
    assert run(manifest, root, f"--trainer.precision={precision}", "--trainer.max_steps=3") == 0
    codes = root / "checkpoints" / "codes.pt"
    assert torch.load(codes, weights_only=True)["global_step"] == 3
    codes.unlink()  # as a fit stopped in them leaves it: the resume with training over writes them
    assert run(manifest, root, f"--trainer.precision={precision}", "--trainer.max_steps=3", "--ckpt_path=last") == 0
    assert torch.load(codes, weights_only=True)["global_step"] == 3


def test_a_path_error_is_one_line_naming_the_path(tmp_path, capsys):
    """Outputs under a file, a folder where a file goes: `error: PATH: reason`, no traceback."""
    (tmp_path / "afile").write_text("x")
    assert main(["data", "synth", "--out", str(tmp_path / "afile" / "x"), "--episodes", "2", "--frames", "4",
                 "--size", "32"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(tmp_path / "afile") in errors[0], errors


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["validate", "predict"])
def test_eval_last_loads_the_runs_latest_whole_deepspeed_directory(tmp_path, monkeypatch, verb):
    """Killed while last.ckpt was rewritten for step 4 after step=0000004.ckpt: `last` is that step directory (Lightning
    would take last.ckpt, cut short)."""
    from lightning.pytorch.trainer.connectors import checkpoint_connector

    from lwm.training.checkpoint import DEEPSPEED_MARK, DEEPSPEED_WRITING
    from tests.test_resume_info import _deepspeed

    manifest = make_dataset(tmp_path / "data", files=4)
    ckpts = tmp_path / "run/checkpoints"
    _deepspeed(ckpts / "last.ckpt", 2, written=1000)
    _deepspeed(ckpts / "step=0000004.ckpt", 4, written=1100)
    os.replace(ckpts / "last.ckpt" / DEEPSPEED_MARK, ckpts / "last.ckpt" / DEEPSPEED_WRITING)
    torch.save({"module": {}, "global_step": 4}, ckpts / "last.ckpt/checkpoint/mp_rank_00_model_states.pt")
    loaded = []

    def select(self, *args, **kwargs):
        loaded.append(select_ckpt_path(self, *args, **kwargs))
        raise SystemExit(0)  # (no DeepSpeed here to load it)

    select_ckpt_path = checkpoint_connector._CheckpointConnector._select_ckpt_path
    monkeypatch.setattr(checkpoint_connector._CheckpointConnector, "_select_ckpt_path", select)
    with contextlib.suppress(SystemExit):
        main(tiny_args(manifest, tmp_path / "run", "--ckpt_path=last", verb=verb))
    assert loaded == [str(ckpts / "step=0000004.ckpt")]


@pytest.mark.slow
def test_a_bad_ckpt_path_is_one_line_before_any_work(trained, tmp_path, capsys):
    manifest, root = trained
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_text("not a checkpoint")
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"a": 1}, foreign)  # loads with weights_only, but no Lightning checkpoint
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes((root / "checkpoints" / "last.ckpt").read_bytes()[:5000])  # a copy cut short
    empty = tmp_path / "empty_run"
    cut = tmp_path / "cut_run/checkpoints/last.ckpt"  # a DeepSpeed directory whose first write a kill cut short:
    (cut / "checkpoint").mkdir(parents=True)  # the model states, no optimizer shard, no completion mark
    torch.save({"module": {}, "global_step": 3}, cut / "checkpoint/mp_rank_00_model_states.pt")
    not_whole = "a DeepSpeed checkpoint that is not whole (no lwm_complete.json of its step: a kill cut its write short"
    config = (root / "config.yaml").read_bytes()
    cases = [
        ("validate", str(tmp_path / "nope.ckpt"), root, "checkpoint not found"),
        ("fit", str(tmp_path / "nope.ckpt"), tmp_path / "fresh", "checkpoint not found"),
        ("test", str(garbage), root, "not a readable checkpoint (not a torch.save file"),  # (not torch's advice)
        ("validate", str(foreign), root, "not a readable checkpoint (not a Lightning checkpoint: it has no "
                                         "pytorch-lightning_version, state_dict, global_step)"),
        ("fit", str(foreign), root, "not a readable checkpoint (not a Lightning checkpoint"),
        ("validate", str(truncated), root, "not a readable checkpoint (truncated or corrupt: a zip archive, as "
                                           "torch.save writes, but not a complete one)"),
        ("validate", "last", empty, "--ckpt_path last: no checkpoint in the run"),
        ("predict", "last", empty, "--ckpt_path last: no checkpoint in the run"),
        # a run's folder (generate and codes take one; Lightning would fail on it after the loggers started)
        ("fit", str(root), tmp_path / "fresh", f"--ckpt_path {root}: a folder without a checkpoint"),
        ("validate", str(root), root, f"--ckpt_path {root}: a folder without a checkpoint"),
        ("fit", "last", tmp_path / "cut_run", f"--ckpt_path last: {cut}: {not_whole}"),  # the run's only one
        ("validate", str(cut), root, f"--ckpt_path {cut}: {not_whole}"),
    ]
    for verb, path, run_dir, message in cases:
        assert main(tiny_args(manifest, run_dir, f"--ckpt_path={path}", verb=verb)) == 2, (verb, path)
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], (verb, errors)
    assert not empty.exists() and not (tmp_path / "fresh").exists()  # nothing started
    assert os.listdir(tmp_path / "cut_run") == ["checkpoints"] and os.listdir(cut.parent) == ["last.ckpt"]
    assert (root / "config.yaml").read_bytes() == config
    deepspeed = tmp_path / "ds"
    (deepspeed / "checkpoints" / "last.ckpt").mkdir(parents=True)  # DeepSpeed's last.ckpt is a directory
    main(tiny_args(manifest, deepspeed, "--ckpt_path=last", verb="validate"))  # (Lightning can't load it on the CPU)
    assert "no checkpoint in the run" not in capsys.readouterr().err


def test_four_validations_per_epoch_without_a_config(tmp_path, capsys):
    """The requirement's 4 validations per epoch are the default, not only the shipped configs' setting."""
    manifest = make_dataset(tmp_path / "data", files=2)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", f"--data.manifest={manifest}", "--print_config"])
    assert exit_.value.code in (0, None)
    assert "  val_check_interval: 0.25\n" in capsys.readouterr().out


@pytest.mark.slow
def test_a_fit_without_a_logger_runs(tmp_path):
    """trainer.logger=false: the always-on callbacks that log (the lr monitor among them) stay quiet."""
    manifest = make_dataset(tmp_path / "data", files=4)
    assert run(manifest, tmp_path / "run", "--trainer.max_steps=2", "--trainer.logger=false",
               "--data.val_size_percent=0") == 0
    assert torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["global_step"] == 2


@pytest.mark.slow
def test_validating_another_runs_checkpoint_says_where_its_files_go(trained, tmp_path, recwarn):
    manifest, root = trained
    ckpt = root / "checkpoints/last.ckpt"
    assert main(tiny_args(manifest, tmp_path / "elsewhere", f"--ckpt_path={ckpt}", verb="validate")) == 0
    lines = [str(w.message) for w in recwarn if "writes its files under" in str(w.message)]
    assert lines == [f"--ckpt_path {ckpt} is the run {root}'s, but this validate writes its files under "
                     f"trainer.default_root_dir {tmp_path / 'elsewhere/validate'} (--trainer.default_root_dir={root} "
                     f"puts them beside its checkpoints)"]
    recwarn.clear()  # a folder above the run is not the run either: its files would go to PARENT/validate
    assert main(tiny_args(manifest, root.parent, f"--ckpt_path={ckpt}", verb="validate")) == 0
    assert [w for w in recwarn if f"writes its files under trainer.default_root_dir {root.parent / 'validate'}"
            in str(w.message)]
    recwarn.clear()
    assert main(tiny_args(manifest, root, f"--ckpt_path={ckpt}", verb="validate")) == 0  # its own run: no warning
    assert not [w for w in recwarn if "writes its files under" in str(w.message)]


@pytest.mark.slow
def test_lightning_verbs_edge_cases(tmp_path, caplog, recwarn):
    """A fit with --ckpt_path last and no checkpoint yet starts fresh (the SLURM script's first start) and says
    so (without Lightning's save_last hint); a val_check_interval equal to the epoch's batches passes the early
    check; validate --ckpt_path last takes the checkpoint's model shape over the config's."""
    manifest = make_dataset(tmp_path / "data", files=4)  # 2 training batches per epoch at the tiny args
    with caplog.at_level(logging.INFO):
        assert run(manifest, tmp_path / "fresh", "--trainer.max_steps=1", "--ckpt_path=last") == 0
    assert "this fit starts a new run" in caplog.text
    assert not [w for w in recwarn if "save_last=True" in str(w.message)]
    assert run(manifest, tmp_path / "equal", "--trainer.max_steps=2", "--trainer.val_check_interval=2") == 0
    assert main(tiny_args(manifest, tmp_path / "fresh", "--ckpt_path=last", "--model.net.d_model=64",
                          "--checkpoint.every_n_train_steps=7", verb="validate")) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert run(manifest, tmp_path / "fresh", "--trainer.max_steps=2", "--ckpt_path=last") == 0  # a resume
    # Lightning's notes that do not apply: the resume's checkpoint folder is not empty, of course; validating
    # needs none of the checkpoint's callback states (another checkpoint setting above); our model summary
    noise = ("exists and is not empty", "callbacks used to create the checkpoint", "already configured with model summary")
    assert not [w for w in recwarn if any(n in str(w.message) for n in noise)], [str(w.message) for w in recwarn]
    assert not any(n in caplog.text for n in noise)


@pytest.mark.slow
def test_a_fresh_fit_into_a_run_dir_holding_a_run_is_refused(tmp_path, capsys):
    """Without --ckpt_path, a fit into a RUN_DIR whose checkpoints exist would start over, replace last.ckpt and
    splice a second run into metrics.csv: one line instead, nothing touched; --ckpt_path last continues it."""
    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    common = ["--data.val_size_percent=0", "--checkpoint.every_n_train_steps=1"]
    assert run(manifest, root, "--trainer.max_steps=2", *common) == 0
    before = {p.name: p.read_bytes() for p in [*(root / "checkpoints").iterdir(), root / "metrics.csv"]}
    capsys.readouterr()
    assert run(manifest, root, "--trainer.max_steps=1", *common) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {root}/checkpoints/last.ckpt: trainer.default_root_dir={root} already holds a run; "
                      "continue it with --ckpt_path last, or start a new one in another trainer.default_root_dir"]
    assert {p.name: p.read_bytes() for p in [*(root / "checkpoints").iterdir(), root / "metrics.csv"]} == before
    assert run(manifest, tmp_path / "other", "--trainer.max_steps=1", *common) == 0  # a new RUN_DIR is fine
    other = tmp_path / "other/checkpoints/last.ckpt"  # another run's checkpoint into this one: refused too
    assert run(manifest, root, "--trainer.max_steps=3", *common, f"--ckpt_path={other}") == 2
    assert f"already holds a run (--ckpt_path {other} is not one of its checkpoints)" in capsys.readouterr().err
    # a kill during the first last.ckpt write leaves a step checkpoint alone: `last` continues from it
    (root / "checkpoints/last.ckpt").unlink()
    assert run(manifest, root, "--trainer.max_steps=1", *common) == 2
    assert "step=0000002.ckpt: trainer.default_root_dir" in capsys.readouterr().err
    assert run(manifest, root, "--trainer.max_steps=3", *common, "--ckpt_path=last") == 0
    assert torch.load(root / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 3
    assert [int(r["step"]) for r in read_metrics(root) if "Train_Total/loss" in r] == [0, 1, 2]  # no second run


@pytest.mark.slow
def test_a_runs_config_yaml_starts_a_new_run_elsewhere_not_a_resume_of_it(tmp_path):
    """RUN_DIR/config.yaml records the run's settings, not the checkpoint a start resumed from: a copy of it
    pointed at another folder starts a new run (it resumed the first run's last.ckpt silently)."""
    import yaml

    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    common = ["--data.val_size_percent=0", "--checkpoint.every_n_train_steps=1"]
    assert run(manifest, root, "--trainer.max_steps=2", *common) == 0
    assert run(manifest, root, "--trainer.max_steps=3", *common, "--ckpt_path=last") == 0
    saved = yaml.safe_load((root / "config.yaml").read_text())
    assert saved["ckpt_path"] is None and saved["trainer"]["max_steps"] == 3
    new = tmp_path / "new"
    assert main(["fit", "--config", str(root / "config.yaml"), f"--trainer.default_root_dir={new}",
                 "--trainer.max_steps=2"]) == 0
    assert [int(r["step"]) for r in read_metrics(new) if "Train_Total/loss" in r] == [0, 1]  # from step 0
    assert main(["fit", "--config", str(root / "config.yaml"), "--trainer.max_steps=4", "--ckpt_path=last"]) == 0
    assert torch.load(root / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 4  # `last` continues it


@pytest.mark.slow
def test_a_fast_dev_run_leaves_no_files(tmp_path):
    """Lightning's trial run writes no checkpoint: lwm's last.ckpt, code dictionaries and videos neither (its
    last.ckpt refused the real fit after it as a second run)."""
    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    assert run(manifest, root, "--trainer.fast_dev_run=true") == 0
    assert not root.exists() or not [p for p in root.rglob("*") if p.is_file()]
    assert run(manifest, root, "--trainer.max_steps=1") == 0
    for video in (root / "videos").glob("*.mp4"):  # (a trial's video of the step would be the same bytes)
        video.unlink()
    files = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    # the evaluation verbs' trial runs neither (a video and codes_per_window.pt went into the fit's own folder)
    for verb in ("validate", "predict"):
        assert run(manifest, root, "--trainer.fast_dev_run=true", "--ckpt_path=last", verb=verb) == 0
        assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == files, verb
    # without a logger, validate's files go into RUN_DIR/validate as with one (config.yaml replaced the fit's)
    assert run(manifest, root, "--trainer.logger=false", "--ckpt_path=last", verb="validate") == 0
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and "validate" not in p.parts} == files
    assert (root / "validate" / "config.yaml").is_file() and list((root / "validate" / "videos").glob("*.mp4"))


@pytest.mark.slow
def test_one_fit_at_a_time_in_a_run_dir(tmp_path, capsys, monkeypatch):
    """Two fits into one folder (the same job submitted twice) wrote one metrics.csv and last.ckpt: the second
    is one line naming the first (host, pid), before any work; the lock goes with the fit."""
    import os
    import socket

    from lwm.utils.errors import ConfigError
    from lwm.training.run_dir import RunLock

    manifest = make_dataset(tmp_path / "data", files=4)
    root = tmp_path / "run"
    holder = RunLock(str(root))  # another fit, as far as the lock goes (a lock is per open file)
    assert run(manifest, root, "--trainer.max_steps=1", "--wandb.mode=offline") == 2  # (its wandb run started, and
    # replaced the running fit's id in wandb/run_id: Lightning starts it before the callbacks' setup, the lock's)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: trainer.default_root_dir={root}: another lwm fit is running in it (pid {os.getpid()} "
                      f"on {socket.gethostname()}; {root}/.lwm.lock); wait for it, or start this one in another "
                      f"folder"], errors
    assert sorted(p.name for p in root.iterdir()) == [".lwm.lock"]  # nothing else written
    holder.release()
    assert run(manifest, root, "--trainer.max_steps=1", "--wandb.mode=offline") == 0
    assert (root / "wandb" / "run_id").is_file()  # the fit that holds the lock starts its wandb run
    assert not (root / ".lwm.lock").exists()  # released at the end
    # a SLURM requeue of the holder's own job goes on (its previous start is over); another job's does not
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    first = RunLock(str(tmp_path / "slurm"))
    with pytest.warns(UserWarning, match="held by this SLURM job's previous start"):
        RunLock(str(tmp_path / "slurm")).release()
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    with pytest.raises(ConfigError, match="SLURM job 7"):
        RunLock(str(tmp_path / "slurm"))
    first.release()


@pytest.mark.slow
def test_validates_results_table_is_whole_in_a_log(trained, tmp_path, capsys):
    """Not on a terminal (a log file, SLURM's output) rich cut Lightning's table to 80 columns: six rows read
    `Val_Action_Encoder/attention_diagona…`, which no one can tell apart."""
    manifest, root = trained
    assert main(tiny_args(manifest, root, "--ckpt_path=last", verb="validate")) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "Val_Action_Encoder/attention_diagonality_block_0/mean" in out

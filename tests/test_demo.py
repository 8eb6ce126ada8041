"""`lwm demo` end to end at a small size, and its report's arithmetic."""

from __future__ import annotations

import math

import imageio.v3 as iio
import pytest
import torch
from rich.console import Console

from lwm.cli.main import main
from lwm.cli.demo import report
from lwm.inference.study import probe_margin


@pytest.mark.slow
def test_the_demo_pipeline_end_to_end(tmp_path, capsys, recwarn):
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--steps", "12", "--episodes", "24", "--frames", "10",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for path in ("data/manifest.json", "run/config.yaml", "run/validate/metrics.csv", "run/checkpoints/last.ckpt",
                 "run/checkpoints/codes.pt"):  # (12 steps log no training row into run/metrics.csv)
        assert (out / path).is_file(), path
    # the verdicts are those of the validation the run wrote: its MSEs, and "yes" exactly where the model's is lower
    from tests.lightning.helpers import read_metrics

    rows = [r for r in read_metrics(out / "run/validate") if "Val_Dynamics_Predictor/tf_loss" in r]
    tf, copy = rows[-1]["Val_Dynamics_Predictor/tf_loss"], rows[-1]["Val_Dynamics_Predictor/copy_last_loss"]
    flat = " ".join(printed.split())
    verdict = "yes" if tf < copy else "not yet"
    assert f"{verdict} beats copy-last-frame: MSE {tf:.4f} {'<' if tf < copy else '>='} {copy:.4f}" in flat, flat
    assert "latent actions carry information about the true actions: probe" in flat
    assert not [w for w in recwarn if "dirpath has changed" in str(w.message)]  # (Lightning's, at the validate stage)
    assert str(out / "rollout_inferred.mp4") in printed.replace("\n", "")
    assert f"lwm play --ckpt_path {out / 'run'} --manifest {out / 'data' / 'manifest.json'}" in flat
    assert "action sensitivity at frame 4" in flat and "the world code is the world's" in flat
    # 9 generated frames after the first (min(frames - 1, 2 * (window - 1))); pixel-decoded 32x32 rows:
    # ground truth above the rollout, 4 px apart
    inferred = iio.imread(out / "rollout_inferred.mp4", plugin="pyav")
    assert inferred.shape == (10, 2 * 32 + 4, 32, 3)
    sampled = iio.imread(out / "rollout_sampled.mp4", plugin="pyav")
    assert sampled.shape == (10, 5 * 32 + 4 * 4, 32, 3)  # ground truth and 4 sampled futures

    # the validation videos are decoded by the files' pixel codec: 32 px wide (a latent preview would be 16 x 4)
    videos = sorted((out / "run").glob("**/videos/*.mp4"))
    assert videos and iio.imread(videos[-1], plugin="pyav").shape[2] == 32

    # again: the run resumes from last.ckpt (finished, so it stops at once) and reports the same numbers
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert "resuming that run" in again
    line = next(x for x in printed.splitlines() if "beats copy-last-frame" in x)
    assert line in again.splitlines()
    assert torch.load(out / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 12  # no more steps

    # more episodes: the run of 24 would be resumed on other data and reported as the demo's result
    assert main([*argv[:6], "30", *argv[7:]]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {out / 'data' / 'manifest.json'}: lists 24 episodes (this run: --episodes 30); run the demo with "
        f"its earlier settings, or into another --out"]
    assert len(list((out / "data").glob("*.h5"))) == 24


def test_bad_demo_arguments(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err  # jsonargparse's line
    assert main(["demo", "--out", str(tmp_path), "--size", "40"]) == 2
    assert "multiple of 16" in capsys.readouterr().err
    # the keys the demo sets (the later stages read the run, its checkpoints and its data where the demo put them:
    # a --trainer.default_root_dir ended in a traceback after the whole fit), refused before any work
    for key in ("--ckpt_path", "--trainer.default_root_dir", "--checkpoint.dirpath", "--data.manifest"):
        for given in ([key, "x"], [f"{key}=x"]):
            assert main(["demo", "--out", str(tmp_path), *given]) == 2
            assert capsys.readouterr().err.splitlines() == [
                f"error: {key}: lwm demo sets it (its run lives in --out; run it again with the same --out to resume it)"]
    # what the fit would refuse once the data is made (and then the corrected run, as other data): refused first
    assert main(["demo", "--out", str(tmp_path), "--frames", "7"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --frames 7: shorter than the fit's window (data.window 8): the episodes must hold one"]
    assert main(["demo", "--out", str(tmp_path), "--frames", "10", "--data.window=12"]) == 2
    assert "--frames 10: shorter than the fit's window (data.window 12)" in capsys.readouterr().err
    assert main(["demo", "--out", str(tmp_path), "--episodes", "1"]) == 2
    assert "argument --episodes: expected an integer in [2, inf], got '1'" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()
    assert main(["demo", "--out", str(tmp_path), "--model.net.dmodel=32"]) == 2  # checked before the data is made
    assert "--model.net.dmodel" in capsys.readouterr().err and not (tmp_path / "data").exists()  # jsonargparse's line
    assert main(["demo", "--out", str(tmp_path), "--model.net.mlp_ratio=0"]) == 2
    assert "mlp_ratio must be > 0" in capsys.readouterr().err and not (tmp_path / "data").exists()


def test_report_arithmetic_and_verdicts():
    assert probe_margin(0.2, 900) == pytest.approx(3 * math.sqrt(0.2 * 0.8 / 900))
    metrics = {"Val_Dynamics_Predictor/tf_loss": 0.01, "Val_Dynamics_Predictor/copy_last_loss": 0.05,
               "Val_Dynamics_Predictor/tf_psnr": 20.0, "Val_Dynamics_Predictor/copy_last_psnr": 13.0,
               "Val_Action_Encoder/probe_accuracy": 0.30, "Val_Action_Encoder/probe_chance": 0.20,
               "Val_Action_Encoder/probe_samples": 900.0, "Val_World_Encoder/probe_samples": 100.0,
               "Val_Action_Encoder/nmi": 0.1, "Val_World_Encoder/probe_accuracy": 0.9,
               "Val_World_Encoder/probe_chance": 0.25, "Val_World_Encoder/nmi": 0.5}
    console = Console(width=200, record=True)
    report(console, metrics, times={"total": 1.0})
    text = console.export_text()
    assert "yes  beats copy-last-frame: MSE 0.0100 < 0.0500" in text
    assert "yes  latent actions carry information" in text  # 0.30 > 0.20 + 0.04
    assert "yes  the world codes carry information" in text  # 0.9 > 0.25 + 0.13
    report(console, {**metrics, "Val_Action_Encoder/probe_accuracy": 0.23, "Val_World_Encoder/probe_accuracy": 0.37},
           times={})
    text = console.export_text()
    assert "not yet  latent actions carry information" in text  # 0.23 < 0.24
    assert "not yet  the world codes carry information" in text  # 0.37 < 0.38


def test_report_of_the_held_out_study():
    metrics = {"Val_Dynamics_Predictor/tf_loss": 0.01, "Val_Dynamics_Predictor/copy_last_loss": 0.05,
               "Val_Dynamics_Predictor/tf_psnr": 20.0, "Val_Dynamics_Predictor/copy_last_psnr": 13.0}
    study = {"psnr": [24.0, 22.0, 20.0, 19.0], "copy_psnr": [12.0, 10.0, 9.0, 8.5],
             "action_dpsnr": {"random": 13.0, "dictionary": 12.5, "other_clip": 12.0},
             "world_dpsnr": {"random": 2.0, "same_world": 0.1}}
    console = Console(width=200, record=True)
    report(console, metrics, {}, study)
    text = console.export_text()
    assert "24.00 / 19.00" in text and "12.00 / 8.50" in text
    assert "yes  the latent actions steer the predictions: 12.50 dB" in text
    assert "yes  the world code is the world's, not the clip's: another clip of the same world's code predicts 0.10 dB" in text
    study["action_dpsnr"]["dictionary"], study["world_dpsnr"]["same_world"] = 0.5, 0.6
    report(console, metrics, {}, study)
    text = console.export_text()
    assert "not yet  the latent actions steer the predictions" in text
    assert "not yet  the world code is the world's" in text

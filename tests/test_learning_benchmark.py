"""benchmarks/learning.py at its smoke size: a real fit and the study of its checkpoint (no learning is asserted:
a few steps learn nothing), the copy-last baseline it prints is that of the held-out clips, a second call refits
nothing, --no-fit reports the finished runs."""

from __future__ import annotations

import json

import pytest
import torch


def test_learning_benchmark_at_the_smoke_size(tmp_path, capsys, monkeypatch):
    import benchmarks.learning as learning
    from lwm.inference.study import load_clips

    out = tmp_path / "learning"
    argv = ["--size", "smoke", "--out", str(out), "--datasets", "synth", "--recipes", "recipe", "--steps", "2"]
    assert learning.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "learning.json").read_text())["synth/recipe/2"]
    assert (out / "learning.png").stat().st_size > 0
    # the baseline: frames 1..4 against frame 0 of every held-out window
    clips = load_clips(out / "data" / "synth_test" / "manifest.json", None, 8, per_file=16)
    copy = (clips.latents[:, 1:5] - clips.latents[:, :1]).pow(2).flatten(2).mean(-1).mean(0)
    assert result["copy_psnr"] == pytest.approx((10 * torch.log10(1 / copy)).tolist(), abs=1e-4)
    assert result["clips"] == len(clips) and result["steps"] == 2
    assert f"| synth | recipe | 2 | {result['psnr'][0]:.2f} / {result['copy_psnr'][0]:.2f} |" in printed

    monkeypatch.setattr(learning, "fit", lambda *args: pytest.fail("refitted a finished run"))
    assert learning.main(argv) == 0
    assert json.loads((out / "learning.json").read_text())["synth/recipe/2"] == result

    # --no-fit reports the finished runs; under a folder without any it names the folder
    assert learning.main(["--size", "smoke", "--out", str(out), "--no-fit"]) == 0
    assert json.loads((out / "learning.json").read_text())["synth/recipe/2"] == result
    with pytest.raises(SystemExit) as stop:
        learning.main(["--out", str(tmp_path / "none"), "--no-fit"])
    assert stop.value.code == 2 and str(tmp_path / "none" / "results") in capsys.readouterr().err


@pytest.mark.slow
def test_the_footage_rows_at_the_smoke_size(tmp_path, capsys):
    """Atari at 64x64 through configs/footage.yaml with the label head: the model the config asks for, and the
    label-efficiency table of its action codes per game."""
    import benchmarks.learning as learning

    out = tmp_path / "learning"
    argv = ["--size", "smoke", "--out", str(out), "--datasets", "atari64", "--recipes", "labels", "--steps", "2",
            "--games", "pong", "boxing"]
    assert learning.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "learning.json").read_text())["atari64/labels/2"]
    hparams = (out / "runs" / "atari64" / "labels__2" / "hparams.yaml").read_text()
    assert "height: 32" in hparams and "action_labels: 18" in hparams
    for world, game in enumerate(("pong", "boxing")):
        fitted = result["per_world"][str(world)]["labelled"]["50"]
        assert 0 <= fitted["chance"] <= 1 and 0 <= fitted["accuracy"] <= 1
        assert f"| atari64 | labels | 2 | {game} | {fitted['accuracy']:.2f} ({fitted['chance']:.2f}+" in printed

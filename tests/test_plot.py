"""``lwm plot``: reading metrics.csv (last row wins per step and column) and the figures it writes."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from lwm.utils.errors import DataError
from lwm.cli.plot import FIGURES, main, plot_run, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TFLOPS = ("Train_Total/tflops", "Val_Total/tflops")
BASELINE = "Val_Dynamics_Predictor/copy_last_loss"


def every_column() -> list[str]:
    """Each metric column the figures read (two RVQ levels, two attention blocks, the copy-last baseline)."""
    columns = [*TFLOPS, "Train_Total/loss", "Val_Total/loss", BASELINE]
    for split in ("Train", "Val"):
        columns += [f"{split}_Dynamics_Predictor/{k}" for k in ("tf_loss", "rollout_1_loss", "rollout_2_loss",
                                                                "prediction_loss")]
        for q in ("Action", "World"):
            columns += [f"{split}_{q}_Encoder/{k}" for k in ("commit_loss", "codebook_loss")]
            columns += [f"{split}_{q}_Encoder/codebook_usage_level_{level}" for level in (0, 1)]
    for q in ("Action", "World"):
        columns += [f"Val_{q}_Encoder/{k}" for k in ("dPSNR", "PSNR_seq", "PSNR_rand")]
    columns += [f"Val_Action_Encoder/attention_diagonality_block_{b}/{stat}"
                for b in (0, 1) for stat in ("min", "mean", "max")]
    return columns


def write_run(run_dir: Path, columns: list[str], steps: int = 8) -> Path:
    """A Lightning-like metrics.csv: train rows on odd steps, val rows on even ones, other cells empty."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*columns, "epoch", "step"])
        writer.writeheader()
        for step in range(steps):
            split = "Val_" if step % 2 == 0 else "Train_"
            row: dict[str, object] = {"epoch": 0, "step": step}
            for i, column in enumerate(columns):
                if column.startswith(split):
                    row[column] = value_of(column, step, i)
            writer.writerow(row)
    return run_dir


def value_of(column: str, step: int, i: int) -> float:
    if column.endswith("tflops"):
        return 0.5 * step  # cumulative; 0 at step 0, which a log axis drops
    if "usage" in column or "diagonality" in column:
        return 0.5 + 0.05 * math.sin(step + i)
    if "psnr" in column.lower():
        return 20.0 + step + 0.1 * i
    return 2.0 / (1 + step) + 0.01 * i  # losses


def test_read_metrics_keeps_the_last_row_per_step_and_drops_empty_cells(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(
        "Train_Total/loss,Val_Total/loss,epoch,step\n"
        "1.0,,0,0\n"
        ",5.0,0,0\n"           # the same step in another row (validation): both columns kept
        "0.9,,0,1\n"
        "0.8,,0,2\n"
        "0.85,,0,1\n"          # a resume re-logs step 1: the last row wins
        ",4.0,0,2\n"
        ",,0,3\n"              # nothing but epoch/step
        "0.7,,1,3\n"
    )
    assert read_metrics(path) == {
        "Train_Total/loss": [(0, 1.0), (1, 0.85), (2, 0.8), (3, 0.7)],
        "Val_Total/loss": [(0, 5.0), (2, 4.0)],
    }


@pytest.mark.slow
def test_every_column_writes_the_five_figures(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", every_column())
    assert main([str(run_dir)]) == 0
    out = run_dir / "figures"
    assert sorted(p.name for p in out.iterdir()) == sorted(FIGURES)
    for name in FIGURES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, name
    printed = capsys.readouterr().out
    assert "skipped" not in printed
    assert all(f"wrote {out / name}" in printed for name in FIGURES)


@pytest.mark.slow
def test_a_run_without_tflops_skips_that_figure_and_says_why(tmp_path, capsys):
    # only the total loss of the loss panels: a 1-panel losses.png keeps the test fast
    columns = [c for c in every_column() if c not in TFLOPS and ("loss" not in c or c.endswith("Total/loss"))]
    run_dir = write_run(tmp_path / "run", columns)
    out = tmp_path / "elsewhere"
    assert main([str(run_dir), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(set(FIGURES) - {"val_loss_vs_tflops.png"})
    printed = capsys.readouterr().out
    assert "skipped val_loss_vs_tflops.png" in printed and "Val_Total/tflops" in printed


def test_a_run_with_only_losses_writes_only_the_loss_figure(tmp_path):
    run_dir = write_run(tmp_path / "run", ["Train_Total/loss", "Val_Total/loss"])
    written, skipped = plot_run(run_dir)
    assert [p.name for p in written] == ["losses.png"]
    assert set(skipped) == set(FIGURES) - {"losses.png"}


def test_a_missing_metrics_file_or_run_dir_is_an_os_error_naming_it(tmp_path, capsys):
    from lwm.cli.main import main as lwm

    with pytest.raises(FileNotFoundError) as error:
        plot_run(tmp_path)
    assert error.value.filename == str(tmp_path / "metrics.csv")
    assert lwm(["plot", str(tmp_path / "nowhere")]) == 2  # the lwm command: one line naming the file
    assert capsys.readouterr().err.splitlines() == [f"error: {tmp_path / 'nowhere' / 'metrics.csv'}: No such file or "
                                                    f"directory"]


def test_a_metrics_file_itself_and_an_out_that_is_a_file(tmp_path):
    run_dir = write_run(tmp_path / "run", ["Train_Total/loss", "Val_Total/loss"])
    assert [p.name for p in plot_run(run_dir / "metrics.csv")[0]] == ["losses.png"]  # its folder's figures/
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError) as error:
        main([str(run_dir), "--out", str(tmp_path / "notes.txt")])
    assert error.value.filename == str(tmp_path / "notes.txt") and (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(("content", "message"), [
    (b"", "no 'step' column"),
    (b"loss\n1.0\n", "no 'step' column"),
    (b"step,epoch\n", {}),  # nothing logged yet: every figure skipped, saying why
    (b"step,Train_Total/loss\n0,\xff\xfe\n1,2.0\n", {"Train_Total/loss": [(1, 2.0)]}),  # an undecodable cell: none
    (b"\xef\xbb\xbfstep,Train_Total/loss\n0,1.5\n", None),  # a byte-order mark: read as any other
    (b"step,Train_Total/loss\n0,1.5,9,9\n1,1.0\n", None),  # a row longer than its header: the extra cells dropped
])
def test_odd_metrics_files_are_read_or_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "metrics.csv"
    path.write_bytes(content)
    if message is None:
        assert read_metrics(path)["Train_Total/loss"][0] == (0, 1.5)
        return
    if isinstance(message, dict):
        assert read_metrics(path) == message
        return
    with pytest.raises(DataError) as error:
        read_metrics(path)
    assert message in str(error.value) and str(path) in str(error.value) and "\n" not in str(error.value)


def test_read_metrics_sorts_each_series_by_step(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("Val_Total/loss,step\n3.0,20\n2.0,10\n1.0,30\n")  # e.g. a resumed run's validation rows
    assert read_metrics(path) == {"Val_Total/loss": [(10, 2.0), (20, 3.0), (30, 1.0)]}


def test_a_log_axis_needs_every_finite_value_positive():
    from lwm.cli.plot import losses_figure

    def y_scale(train, val=()):
        fig = losses_figure({"Train_Total/loss": list(enumerate(train)), "Val_Total/loss": list(enumerate(val))})
        return fig.axes[0].get_yscale()

    assert y_scale([float("nan"), 1.0, float("inf")]) == "log"  # non-finite: ignored
    assert y_scale([1.0, float("-inf")]) == "log"  # a diverged step's -inf too
    assert y_scale([1.0, 0.0]) == "linear"  # zero: no log axis
    assert y_scale([1.0], [-1.0]) == "linear"
    assert y_scale([float("nan")]) == "linear"


def test_loss_vs_tflops_keeps_only_points_a_log_log_axis_shows():
    from lwm.cli.plot import _against

    tflops = [(0, 0.0), (2, 1.0), (4, 2.0), (6, 3.0)]
    loss = [(0, 5.0), (2, 4.0), (4, 0.0), (5, 9.0), (6, 3.0)]
    assert _against(tflops, loss) == [(1.0, 4.0), (3.0, 3.0)]


def test_the_min_max_band_pairs_values_by_step(monkeypatch):
    from matplotlib.axes import Axes

    from lwm.cli.plot import attention_diagonality_figure

    calls = []
    monkeypatch.setattr(Axes, "fill_between", lambda self, *a, **kw: calls.append(a))
    key = "World_Encoder/attention_diagonality_block_0"
    attention_diagonality_figure({f"{key}/mean": [(0, 0.5), (1, 0.5), (2, 0.5)],
                                  f"{key}/min": [(0, 0.1), (1, 0.2), (2, 0.3)], f"{key}/max": [(1, 0.9), (2, 1.0)]})
    assert calls == [((1, 2), (0.2, 0.3), (0.9, 1.0))]


def test_codebook_usage_of_validation_alone_is_drawn():
    from lwm.cli.plot import codebook_usage_figure

    fig = codebook_usage_figure({"Val_Action_Encoder/codebook_usage_level_0": [(0, 0.5), (1, 0.6)]})
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["level 0 val"]


def test_the_teacher_forced_panel_draws_the_copy_last_frame_baseline_from_the_csv(tmp_path):
    """The val TF loss must beat copy-last-frame: its panel draws the logged baseline dashed, at the CSV's steps and
    values; the other panels, and a run that did not log it, have no such line."""
    from lwm.cli.plot import losses_figure

    tf = ["Train_Dynamics_Predictor/tf_loss", "Val_Dynamics_Predictor/tf_loss"]
    run_dir = write_run(tmp_path / "run", ["Train_Total/loss", "Val_Total/loss", *tf, BASELINE])
    with open(run_dir / "metrics.csv", newline="") as f:
        expected = [(int(row["step"]), float(row[BASELINE])) for row in csv.DictReader(f) if row[BASELINE]]
    assert [step for step, _ in expected] == [0, 2, 4, 6]  # the validation rows
    fig = losses_figure(read_metrics(run_dir / "metrics.csv"))
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert sorted(panels) == ["Teacher-forced loss", "Total loss"]
    lines = {line.get_label(): line for line in panels["Teacher-forced loss"].get_lines()}
    assert list(lines) == ["train", "val", "copy-last-frame baseline (val)"]
    baseline = lines["copy-last-frame baseline (val)"]
    assert list(zip(baseline.get_xdata(), baseline.get_ydata())) == expected
    assert baseline.get_linestyle() == "--"
    assert [line.get_label() for line in panels["Total loss"].get_lines()] == ["train", "val"]
    assert panels["Teacher-forced loss"].get_yscale() == "log"  # every loss and baseline value > 0

    without = write_run(tmp_path / "old", ["Train_Total/loss", "Val_Total/loss", *tf])
    fig = losses_figure(read_metrics(without / "metrics.csv"))
    tf_panel = next(ax for ax in fig.axes if ax.get_title() == "Teacher-forced loss")
    assert [line.get_label() for line in tf_panel.get_lines()] == ["train", "val"]

"""``lwm plot RUN_DIR [--out DIR]``: figures of a run from ``RUN_DIR/metrics.csv``."""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lwm.utils.args import ArgumentParser
from lwm.utils.errors import DataError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Series = list[tuple[int, float]]
Metrics = dict[str, Series]

_MARKER_MAX_POINTS = 60  # series this short are drawn with markers


def read_metrics(path: str | Path) -> Metrics:
    """``{column: [(step, value), ...]}`` of a Lightning ``metrics.csv`` by step (a step's last row wins)."""
    values: dict[str, dict[int, float]] = {}
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        reader = csv.DictReader(f)
        if "step" not in (reader.fieldnames or ()):
            raise DataError(f"{path}: no 'step' column (empty, or not a Lightning metrics.csv)")
        for row in reader:
            step, _ = _parse(row.pop("step")), row.pop("epoch", None)
            for column, cell in row.items() if step is not None else ():
                if (value := _parse(cell)) is not None:  # (a row longer than the header: its extra cells, a list)
                    values.setdefault(column, {})[int(step)] = value
    return {column: sorted(by_step.items()) for column, by_step in values.items()}


def _parse(cell: object) -> float | None:
    try:
        return float(cell)
    except (TypeError, ValueError):
        return None


LOSS_PANELS = (
    ("Total loss", "Total/loss"),
    ("Teacher-forced loss", "Dynamics_Predictor/tf_loss"),
    ("Rollout-1 loss", "Dynamics_Predictor/rollout_1_loss"),
    ("Rollout-2 loss", "Dynamics_Predictor/rollout_2_loss"),
    ("Prediction loss", "Dynamics_Predictor/prediction_loss"),
    ("Action commitment loss", "Action_Encoder/commit_loss"),
    ("Action codebook loss", "Action_Encoder/codebook_loss"),
    ("World commitment loss", "World_Encoder/commit_loss"),
    ("World codebook loss", "World_Encoder/codebook_loss"),
)
QUANTIZERS = ("Action_Encoder", "World_Encoder")
_USAGE = re.compile(r"^(Train|Val)_(\w+?)/codebook_usage_level_(\d+)$")
_DIAGONALITY = re.compile(r"^(\w+?)/attention_diagonality_block_(\d+)/mean$")
# what a panel's val loss must beat, drawn dashed beside it where the run logged it
LOSS_BASELINES = {
    "Dynamics_Predictor/tf_loss": ("copy-last-frame baseline (val)", "Val_Dynamics_Predictor/copy_last_loss")}


def losses_figure(metrics: Metrics) -> Figure | str:
    panels = [(title, key) for title, key in LOSS_PANELS if f"Train_{key}" in metrics or f"Val_{key}" in metrics]
    if not panels:
        return "no Train_*/Val_* loss columns"
    fig, axes = _grid(len(panels), ncols=3)
    for ax, (title, key) in zip(axes, panels):
        _plot(ax, metrics.get(f"Train_{key}"), label="train")
        _plot(ax, metrics.get(f"Val_{key}"), label="val")
        label, baseline = LOSS_BASELINES.get(key, (None, None))
        if baseline is not None:
            _plot(ax, metrics.get(baseline), label=label, color="grey", linestyle="--")
        finite = [v for c in (f"Train_{key}", f"Val_{key}", baseline) for _, v in metrics.get(c) or ()
                  if math.isfinite(v)]  # a log axis where every one is > 0
        _style(ax, title, xlabel="step", ylabel="loss", log_y=bool(finite) and min(finite) > 0)
    fig.suptitle("Losses: train vs val")
    return fig


def val_loss_vs_tflops_figure(metrics: Metrics) -> Figure | str:
    tflops = metrics.get("Val_Total/tflops")
    if not tflops:
        return "no Val_Total/tflops column (no validation during the fit, or a run that logged no TFLOPs)"
    lines = [(label, points) for label, key in (("val total", "Val_Total/loss"),
                                                ("val teacher-forced", "Val_Dynamics_Predictor/tf_loss"))
             if (points := _against(tflops, metrics.get(key)))]
    if not lines:
        return "no Val_Total/loss or Val_Dynamics_Predictor/tf_loss with a positive Val_Total/tflops at its step"
    fig, (ax,) = _grid(1, ncols=1)
    for label, points in lines:
        ax.plot(*zip(*points), label=label, marker="o" if len(points) <= _MARKER_MAX_POINTS else None, markersize=3)
    ax.set_xscale("log")
    ax.tick_params(axis="x", which="both", labelrotation=30)  # minor labels of a short span would overlap
    _style(ax, "Val loss vs training compute", xlabel="cumulative training TFLOPs", ylabel="loss", log_y=True)
    return fig


def sensitivity_figure(metrics: Metrics) -> Figure | str:
    dpsnr = {q: metrics.get(f"Val_{q}/dPSNR") for q in QUANTIZERS}
    psnr = {(q, kind): metrics.get(f"Val_{q}/PSNR_{kind}") for q in QUANTIZERS for kind in ("seq", "rand")}
    if not any(dpsnr.values()) and not any(psnr.values()):
        return "no Val_*_Encoder/dPSNR or PSNR_seq/PSNR_rand columns"
    fig, (left, *right) = _grid(1 + len(QUANTIZERS), ncols=3)
    for color, q, ax in zip(("C0", "C1"), QUANTIZERS, right):
        name = q.removesuffix("_Encoder").lower()
        _plot(left, dpsnr[q], label=name, color=color)
        _plot(ax, psnr[q, "seq"], label="own codes (seq)", color=color)
        _plot(ax, psnr[q, "rand"], label="random codes (rand)", color="grey", linestyle="--")
        _style(ax, f"PSNR, {name} codes own vs random", xlabel="step", ylabel="dB")
    left.axhline(0.0, color="grey", linewidth=0.8)
    _style(left, "Delta-PSNR (seq - rand)", xlabel="step", ylabel="dB")
    fig.suptitle("Sensitivity of the dynamics predictor to its codes (val)")
    return fig


def codebook_usage_figure(metrics: Metrics) -> Figure | str:
    found: dict[str, dict[tuple[str, int], Series]] = {}
    for column, series in metrics.items():
        if (match := _USAGE.match(column)) and series:
            found.setdefault(match[2], {})[match[1], int(match[3])] = series
    if not found:
        return "no {Train,Val}_*/codebook_usage_level_<l> columns"
    quantizers = sorted(found, key=lambda q: (QUANTIZERS.index(q) if q in QUANTIZERS else len(QUANTIZERS), q))
    fig, axes = _grid(len(quantizers), ncols=2)
    for ax, quantizer in zip(axes, quantizers):
        for split, level in sorted(found[quantizer], key=lambda k: (k[1], k[0] != "Train")):
            _plot(ax, found[quantizer][split, level], label=f"level {level} {split.lower()}", color=f"C{level % 10}",
                  linestyle="-" if split == "Train" else "--")
        ax.set_ylim(-0.02, 1.02)
        name = quantizer.removesuffix("_Encoder").lower()
        _style(ax, f"{name} codebook usage", xlabel="step", ylabel="fraction of codes used")
    fig.suptitle("Codebook usage per RVQ level (solid: train, dashed: val)")
    return fig


def attention_diagonality_figure(metrics: Metrics) -> Figure | str:
    found: dict[str, list[int]] = {}
    for column, series in metrics.items():
        if (match := _DIAGONALITY.match(column)) and series:
            found.setdefault(match[1], []).append(int(match[2]))
    if not found:
        return "no *_Encoder/attention_diagonality_block_<k>/mean columns"
    fig, axes = _grid(len(found), ncols=2)
    for ax, prefix in zip(axes, sorted(found)):
        for block in sorted(found[prefix]):
            key, color = f"{prefix}/attention_diagonality_block_{block}", f"C{block % 10}"
            _plot(ax, metrics[f"{key}/mean"], label=f"block {block}", color=color)
            highs = dict(metrics.get(f"{key}/max") or ())  # the min-max band, at the steps of both
            if band := [(step, low, highs[step]) for step, low in metrics.get(f"{key}/min") or () if step in highs]:
                ax.fill_between(*zip(*band), color=color, alpha=0.2, linewidth=0)
        _style(ax, prefix.replace("_", " "), xlabel="step", ylabel="diagonality")
    fig.suptitle("Attention diagonality per block (mean, min-max band)")
    return fig


FIGURES: dict[str, Callable[[Metrics], Figure | str]] = {  # a figure, or why it cannot be drawn
    "losses.png": losses_figure,
    "val_loss_vs_tflops.png": val_loss_vs_tflops_figure,
    "sensitivity.png": sensitivity_figure,
    "codebook_usage.png": codebook_usage_figure,
    "attention_diagonality.png": attention_diagonality_figure,
}


def _grid(n: int, ncols: int) -> tuple[Figure, list[Axes]]:
    from matplotlib.figure import Figure  # the Agg canvas draws it

    ncols = min(ncols, n)
    fig = Figure(figsize=(5.0 * ncols, 3.6 * math.ceil(n / ncols)), layout="constrained")
    axes = list(fig.subplots(math.ceil(n / ncols), ncols, squeeze=False).flat)
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _plot(ax: Axes, series: Series | None, label: str, **kwargs: object) -> None:
    if series:
        ax.plot(*zip(*series), label=label, marker="o" if len(series) <= _MARKER_MAX_POINTS else None, markersize=3,
                **kwargs)


def _style(ax: Axes, title: str, xlabel: str, ylabel: str, log_y: bool = False) -> None:
    if log_y:
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", useOffset=False)  # 0.5113, not 1e-5 + 5.113e-1
    if xlabel == "step":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _against(x: Series, y: Series | None) -> list[tuple[float, float]]:
    """``(x, y)`` at the steps both series have, where a log-log axis shows them."""
    xs = dict(x)
    return [(xs[step], value) for step, value in y or () if step in xs and xs[step] > 0 and value > 0]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> tuple[list[Path], dict[str, str]]:
    """The figures of ``run_dir`` (or a ``metrics.csv``) in ``out``: ``(PNGs written, {figure: why skipped})``."""
    csv_path = Path(run_dir) if Path(run_dir).is_file() else Path(run_dir) / "metrics.csv"
    out = Path(out) if out is not None else csv_path.parent / "figures"
    metrics = read_metrics(csv_path)
    written, skipped = [], {}
    for name, builder in FIGURES.items():
        fig = builder(metrics)
        if isinstance(fig, str):
            skipped[name] = fig
            continue
        out.mkdir(parents=True, exist_ok=True)  # (a file there: the OSError names it)
        fig.savefig(out / name, dpi=110)
        written.append(out / name)
    return written, skipped


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="lwm plot", description="Plot a run's RUN_DIR/metrics.csv as PNG figures.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (trainer.default_root_dir), or its "
                        "metrics.csv")
    parser.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR/figures)")
    args = parser.parse_args(list(argv))
    written, skipped = plot_run(args.run_dir, args.out)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    for path in written:
        print(f"wrote {path}")
    return 0

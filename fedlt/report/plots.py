"""Figures of runs and studies, written as PNG files on matplotlib's Agg canvas (no display, no
pyplot state; matplotlib is imported only when a figure is drawn).

- ``accuracy.png``: top-1 and balanced accuracy per evaluated round, every run on the same axes
  (a study: per cell, the mean with a ±std band over seeds);
- ``per_class.png``: the final per-class accuracy, as grouped bars; beyond ``MAX_BARS`` classes
  as lines over at most ``MAX_POINTS`` bins of classes (each bin's mean), so a long per-class list
  draws in bounded time;
- ``per_client.png`` (runs with per-client modes, SPEC §7): each mode's mean accuracy over
  clients per evaluated round, beside a box per run and mode of the last evaluated round's
  per-client accuracies (their spread: the minimum and worst clients the mean hides);
- ``partition-<run>.png``: each run's clients × classes count heatmap (``fedlt.plots``).

Each figure is first drawn as a ``Figure`` (``accuracy_figure``, ``per_class_figure``, ...), then
written as a PNG file or rendered to PNG bytes (``png_bytes``) for the HTML page (``fedlt.report.html``),
which adds the many/medium/few bars (``groups_figure``) and, for a study, the per-client boxes.

Labels are copied as text (a ``$`` is escaped: never read as mathtext). The files are written
through ``fedlt.outputs`` (never over a file fedlt did not write). Imports: fedlt.errors,
fedlt.outputs, fedlt.plots, fedlt.report.runs / study.
"""

from __future__ import annotations

import io as stdio
import re
import warnings
from pathlib import Path

import numpy as np

from fedlt import outputs
from fedlt.errors import FedltError
from fedlt.plots import heatmap_figure, new_figure
from fedlt.report.runs import Run, modes_of
from fedlt.report.study import Cell

MAX_BARS = 100  # classes drawn as grouped bars; beyond, lines over binned classes
MAX_POINTS = 1000  # bins of classes on a line (a per-class list of 10^6 draws in bounded time)


def png_bytes(fig, dpi: int = 120) -> bytes:
    """The figure as PNG, rendered in memory."""
    buffer = stdio.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _save(fig, path: Path) -> Path:
    """PNG rendered in memory, then written atomically and marked as fedlt's (``fedlt.outputs``)."""
    return outputs.write_bytes(path, png_bytes(fig))


def _text(label: str) -> str:
    """A label as plain text for matplotlib: ``$`` would start mathtext (a parse error or markup)."""
    return str(label).replace("$", r"\$")


def _pct_or_nan(value: float | None) -> float:
    return float("nan") if value is None else 100 * value


def _style(ax, title: str | None = None, legend: bool = True) -> None:
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_accuracy(runs: list[Run], path: Path) -> Path:
    return _save(accuracy_figure(runs), path)


def accuracy_figure(runs: list[Run]):
    """Top-1 and balanced accuracy per evaluated round, every run on the same axes."""
    from matplotlib.ticker import MaxNLocator

    fig = new_figure(11, 4.2)
    top, balanced = fig.subplots(1, 2, sharey=True)
    for run in runs:
        x = [r["round"] for r in run.metrics]
        marker = "o" if len(x) <= 30 else None
        line, = top.plot(x, [100 * r["accuracy"] for r in run.metrics], marker=marker, markersize=3,
                         label=_text(run.label))
        balanced.plot(x, [_pct_or_nan(r.get("balanced_accuracy")) for r in run.metrics], marker=marker, markersize=3,
                      color=line.get_color(), label=_text(run.label))
    for ax, title in ((top, "top-1 accuracy"), (balanced, "balanced accuracy")):
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _style(ax, title, legend=ax is balanced)
    top.set_ylabel("test accuracy (%)")
    return fig


def binned(values: np.ndarray, bins: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(first class of each bin, the bin's mean over its classes that have a value): at most
    ``bins`` points, whatever the number of classes."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) <= bins:
        return np.arange(len(values)), values
    edges = np.linspace(0, len(values), bins + 1).astype(np.int64)
    sums = np.add.reduceat(np.nan_to_num(values), edges[:-1])
    counts = np.add.reduceat((~np.isnan(values)).astype(np.int64), edges[:-1])
    with np.errstate(invalid="ignore", divide="ignore"):
        return edges[:-1], np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _per_class_axes(series: list[tuple[str, np.ndarray, np.ndarray | None]], title: str):
    """``series``: (label, per-class accuracy in %, its std or None); grouped bars up to
    ``MAX_BARS`` classes, else one line per series over binned classes."""
    num_classes = max(max((len(v) for _, v, _ in series), default=0), 1)
    many = num_classes > MAX_BARS
    fig = new_figure(24 if many else float(np.clip(0.35 * num_classes * len(series) ** 0.5 + 3, 6, 24)), 4.2)
    ax = fig.add_subplot()
    width = 0.8 / max(len(series), 1)
    for k, (label, values, std) in enumerate(series):
        if many:
            x, y = binned(values)
            ax.plot(x, y, linewidth=1, label=_text(label))
        else:
            ax.bar(np.arange(len(values)) + (k - (len(series) - 1) / 2) * width, values, width=width,
                   yerr=std, capsize=2 if std is not None else 0, label=_text(label))
    ax.set_xlabel(f"class ({num_classes} classes, mean per bin of {-(-num_classes // MAX_POINTS)})"
                  if many and num_classes > MAX_POINTS else "class")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_ylim(0, 100)
    if num_classes <= 40:
        ax.set_xticks(range(num_classes))
    _style(ax, title)
    return fig


def _percent(values: list[float | None]) -> np.ndarray:
    """Accuracies in %, a missing one (None) as NaN; vectorised (a list may hold 10^6 classes)."""
    return 100 * np.array(values, dtype=np.float64).reshape(-1)


def plot_per_class(runs: list[Run], path: Path) -> Path:
    return _save(per_class_figure(runs), path)


def per_class_figure(runs: list[Run]):
    """The final per-class accuracy of each run, as grouped bars (lines beyond ``MAX_BARS`` classes)."""
    series = [(f"{run.label} (round {run.final['round']})", _percent(run.final.get("per_class_accuracy") or []), None)
              for run in runs]
    return _per_class_axes(series, "per-class accuracy")


def plot_per_client(runs: list[Run], path: Path) -> Path:
    return _save(per_client_figure(runs), path)


def per_client_figure(runs: list[Run]):
    """Left: each (run, mode)'s mean per-client accuracy per evaluated round (dashed: weighted by
    test-set size); right: a box per (run, mode) of the last evaluated round's client accuracies."""
    from matplotlib.ticker import MaxNLocator

    shown = [(run, mode) for run in runs for mode in modes_of(run)]
    fig = new_figure(12, 4.4)
    curves, boxes = fig.subplots(1, 2, width_ratios=[3, 2])
    spreads, labels = [], []
    for run, mode in shown:
        rows = [r for r in run.metrics if r.get(f"{mode}_mean") is not None]
        x = [r["round"] for r in rows]
        marker = "o" if len(x) <= 30 else None
        line, = curves.plot(x, [100 * r[f"{mode}_mean"] for r in rows], marker=marker, markersize=3,
                            label=_text(f"{run.label}: {mode}"))
        curves.plot(x, [_pct_or_nan(r.get(f"{mode}_mean_weighted")) for r in rows], linestyle="--",
                    color=line.get_color())
        last = next((r for r in reversed(run.metrics) if r.get(f"{mode}_client_accuracy")), {})
        spreads.append(_percent([a for a in last.get(f"{mode}_client_accuracy", []) if a is not None]))
        labels.append(_text(f"{run.label}\n{mode} (r{last.get('round', '–')})"))
    curves.set_xlabel("round")
    curves.set_ylabel("mean client accuracy (%)")
    curves.xaxis.set_major_locator(MaxNLocator(integer=True))
    _style(curves, "per-client accuracy, mean over clients (dashed: weighted by test size)", legend=False)
    curves.legend(fontsize=7, loc="best")
    _client_boxes(boxes, spreads, labels)
    return fig


def _client_boxes(ax, spreads: list[np.ndarray], labels: list[str]) -> None:
    ax.boxplot(spreads, showmeans=True)
    ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("client accuracy (%), last evaluated round")
    ax.set_ylim(0, 100)
    _style(ax, "per-client distribution", legend=False)


def _file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def plot_names(runs: list[Run]) -> dict[str, Run | None]:
    """The files ``write_plots`` writes: name -> the run whose partition it shows (None: all runs)."""
    names: dict[str, Run | None] = {"accuracy.png": None, "per_class.png": None}
    if any(modes_of(run) for run in runs):
        names["per_client.png"] = None
    for run in runs:
        if run.manifest is None or "class_counts" not in run.manifest:
            continue
        name = _file_label(run.label)
        while f"partition-{name}.png" in names:  # two labels that differ only in characters a file name cannot hold
            name += "_"
        names[f"partition-{name}.png"] = run
    return names


def write_plots(runs: list[Run], folder: str | Path, force: bool = False) -> list[Path]:
    """Write the figures into ``folder`` (created if needed), never over a file fedlt did not
    write there (``fedlt.outputs``; ``force`` replaces fedlt's own); returns the files written."""
    folder = Path(folder)
    names = plot_names(runs)
    outputs.check([folder / n for n in names], "--plot", force=force)
    written = [plot_accuracy(runs, folder / "accuracy.png"), plot_per_class(runs, folder / "per_class.png")]
    if "per_client.png" in names:
        written.append(plot_per_client(runs, folder / "per_client.png"))
    for name, run in names.items():
        if run is None:
            continue
        written.append(_save(partition_figure(run), folder / name))
    return written


def partition_figure(run: Run):
    """The run's clients × classes count heatmap (``fedlt.plots.heatmap_figure``)."""
    title = _text(f"{run.label}: {run.manifest.get('name', 'partition')} partition")
    return heatmap_figure(run.manifest["class_counts"], title=title)


GROUPS = ("many", "medium", "few")


def groups_figure(series: list[tuple[str, np.ndarray, np.ndarray | None]], title: str):
    """``series``: (label, [many, medium, few] accuracy in %, their std or None): grouped bars, one
    group per class group, one bar per series (a group no class falls in is left empty)."""
    fig = new_figure(float(np.clip(2.5 + 1.2 * len(series), 6, 14)), 3.8)
    ax = fig.add_subplot()
    width = 0.8 / max(len(series), 1)
    for k, (label, values, std) in enumerate(series):
        ax.bar(np.arange(len(GROUPS)) + (k - (len(series) - 1) / 2) * width, values, width=width, yerr=std,
               capsize=2 if std is not None else 0, label=_text(label))
    ax.set_xticks(range(len(GROUPS)), [f"{g} classes" for g in GROUPS])
    ax.set_ylabel("final test accuracy (%)")
    ax.set_ylim(0, 100)
    _style(ax, title)
    return fig


def run_groups_figure(runs: list[Run]):
    """Each run's final many / medium / few accuracy (the class groups of its ``groups`` rule)."""
    series = [(run.label, _percent([run.final.get(f"{g}_accuracy") for g in GROUPS]), None) for run in runs]
    return groups_figure(series, "many / medium / few classes")


STUDY_PLOTS = ("accuracy.png", "per_class.png")


def study_curves_figure(shown: list[Cell]):
    """Per cell, the mean top-1 accuracy per evaluated round with a ±std band over its seeds
    (rounds every seed evaluated)."""
    from matplotlib.ticker import MaxNLocator

    fig = new_figure(11, 4.5)
    ax = fig.add_subplot()
    for cell in shown:
        rounds = sorted(set.intersection(*({r["round"] for r in run.metrics} for run in cell.runs)))
        curves = np.array([[100 * {r["round"]: r["accuracy"] for r in run.metrics}[x] for x in rounds]
                           for run in cell.runs], dtype=np.float64)
        mean = curves.mean(0)
        std = curves.std(0, ddof=1) if len(curves) > 1 else np.zeros_like(mean)
        line, = ax.plot(rounds, mean, marker="o" if len(rounds) <= 30 else None, markersize=3,
                        label=_text(f"{cell.name} (n={len(curves)})"))
        ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%), mean ± std over seeds")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _style(ax)
    return fig


def _mean_std(lists: list[list[float | None]]) -> tuple[np.ndarray, np.ndarray]:
    """Per position, the mean and sample std (in %) over the lists, a missing value left out (NaN
    where no list has one)."""
    width = max((len(v) for v in lists), default=0)
    values = np.full((len(lists), width), np.nan)
    for i, v in enumerate(lists):
        values[i, :len(v)] = _percent(v)
    with warnings.catch_warnings():  # a position no seed has: its mean is NaN, drawn as a gap
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(values, 0) if width else np.zeros(0)
        std = np.nanstd(values, 0, ddof=1) if len(values) > 1 and width else np.zeros(width)
    return mean, std


def study_per_class_figure(shown: list[Cell]):
    """Per cell, the mean final per-class accuracy with ±std bars over its seeds."""
    series = [(cell.name, *_mean_std([run.final.get("per_class_accuracy") or [] for run in cell.runs]))
              for cell in shown]
    return _per_class_axes(series, "per-class accuracy, mean ± std over seeds")


def study_groups_figure(shown: list[Cell]):
    """Per cell, the final many / medium / few accuracy, mean ± std over its seeds."""
    series = [(cell.name, *_mean_std([[run.final.get(f"{g}_accuracy") for g in GROUPS] for run in cell.runs]))
              for cell in shown]
    return groups_figure(series, "many / medium / few classes, mean ± std over seeds")


def study_per_client_figure(shown: list[Cell]):
    """A box per (cell, per-client mode) of the client accuracies of every seed's last evaluated
    round, pooled (K clients × n seeds values); None when no run has a per-client mode."""
    spreads, labels = [], []
    for cell in shown:
        for mode in dict.fromkeys(m for run in cell.runs for m in modes_of(run)):
            pooled = []
            for run in cell.runs:
                last = next((r for r in reversed(run.metrics) if r.get(f"{mode}_client_accuracy")), {})
                pooled += [a for a in last.get(f"{mode}_client_accuracy", []) if a is not None]
            spreads.append(_percent(pooled))
            labels.append(_text(f"{cell.name}\n{mode} (n={len(cell.runs)})"))
    if not spreads:
        return None
    fig = new_figure(float(np.clip(3 + 1.0 * len(spreads), 6, 16)), 4.6)
    _client_boxes(fig.add_subplot(), spreads, labels)
    return fig


def plot_study(cells: list[Cell], folder: str | Path, force: bool = False) -> list[Path]:
    """``accuracy.png`` (``study_curves_figure``) and ``per_class.png`` (``study_per_class_figure``) in
    ``folder``, never over a file fedlt did not write there (``fedlt.outputs``)."""
    folder = Path(folder)
    shown = [c for c in cells if c.runs]
    if not shown:
        raise FedltError("no finished run to plot yet")
    outputs.check([folder / n for n in STUDY_PLOTS], "--plot", force=force)
    return [_save(study_curves_figure(shown), folder / STUDY_PLOTS[0]),
            _save(study_per_class_figure(shown), folder / STUDY_PLOTS[1])]

"""Compare finished (or stopped) runs: one table, and figures written as PNG files.

A run directory is read, never written: ``summary.json`` when the run finished, else
``metrics.jsonl`` (and ``checkpoint.json`` for how far it got), plus ``config.json`` and
``partition.json``. ``rows(runs)`` is the table as plain data; ``table(runs)`` renders it with
rich; ``write_plots(runs, folder)`` draws

- ``accuracy.png``: top-1 and balanced accuracy per evaluated round, every run on the same axes;
- ``per_class.png``: the final per-class accuracy of every run, as grouped bars;
- ``partition-<run>.png``: each run's clients × classes count heatmap (``fedlt.plots``).

matplotlib is imported only when a figure is drawn, on its Agg canvas (no display, no pyplot
state).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlt import io
from fedlt.errors import FedltError


@dataclass
class Run:
    path: Path
    label: str
    config: dict[str, Any]
    metrics: list[dict[str, Any]]  # one row per evaluated round
    summary: dict[str, Any] | None  # None while the run is unfinished
    manifest: dict[str, Any] | None  # the partition manifest, if the run saved one
    checkpoint_round: int | None
    participation: list[dict[str, Any]] = field(default_factory=list)  # per round: sampled, returned, dropped

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def final(self) -> dict[str, Any]:
        return self.metrics[-1]

    @property
    def best(self) -> dict[str, Any]:
        return max(self.metrics, key=lambda r: r["accuracy"])  # the earliest round on ties


NUMBER_FIELDS = ("balanced_accuracy", "loss", "train_loss", "many_accuracy", "medium_accuracy", "few_accuracy",
                 "client_mean_accuracy", "client_min_accuracy", "client_std_accuracy")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_row(row: Any, where: str) -> dict[str, Any]:
    """A metrics row as the engine writes it, or a FedltError naming the line and the field."""
    if not isinstance(row, dict):
        raise FedltError(f"{where} is not a JSON object")
    r, acc = row.get("round"), row.get("accuracy")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise FedltError(f"{where}: 'round' is {r!r}, not a round number")
    if acc is not None and (not _is_number(acc) or not 0 <= acc <= 1):  # rounds not evaluated have none
        raise FedltError(f"{where}: 'accuracy' is {acc!r}, not a number in [0, 1]")
    for key in NUMBER_FIELDS:
        if row.get(key) is not None and not _is_number(row[key]):
            raise FedltError(f"{where}: {key!r} is {row[key]!r}, not a number")
    per_class = row.get("per_class_accuracy")
    if per_class is not None and (not isinstance(per_class, list)
                                  or not all(a is None or _is_number(a) for a in per_class)):
        raise FedltError(f"{where}: 'per_class_accuracy' is not a list of numbers")
    return row


def _read_text(path: Path, encoding: str, where: str, not_text: str) -> str:
    """The file's text; a one-line FedltError when it cannot be read (``where``) or is not UTF-8
    (``not_text``)."""
    try:
        return path.read_bytes().decode(encoding)
    except UnicodeDecodeError as exc:
        raise FedltError(f"{not_text}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise FedltError(f"{where} cannot be read ({exc.strerror or exc})") from None


def _read_metrics(path: Path, participation: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The evaluated rounds' rows; every round's participation (docs/faults.md) into ``participation``."""
    if not path.is_file():
        return []
    text = _read_text(path, "utf-8", str(path), f"{path} is not a metrics file")
    rows, lines = [], text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            if number == len(lines):  # a run killed mid-write leaves a torn last line; its resume rewrites it
                break
            raise FedltError(f"{path}: line {number} is not JSON") from None
        _check_row(row, f"{path}: line {number}")
        if "accuracy" in row:  # an evaluated round
            rows.append(row)
        if participation is not None and isinstance(row.get("sampled"), list) and isinstance(row.get("dropped"), dict):
            participation.append({"round": row.get("round"), "sampled": row["sampled"],
                                  "returned": row.get("returned", []), "dropped": row["dropped"]})
    return rows


def _check_summary(summary: dict[str, Any], path: Path) -> dict[str, Any]:
    done, wall = summary.get("rounds"), summary.get("wall_time_s")
    if isinstance(done, bool) or not isinstance(done, int) or done < 0:
        raise FedltError(f"{path}: 'rounds' is {done!r}, not a round count")
    if wall is not None and not _is_number(wall):
        raise FedltError(f"{path}: 'wall_time_s' is {wall!r}, not a number")
    return summary


def _check_manifest(manifest: dict[str, Any], path: Path) -> dict[str, Any]:
    counts = manifest.get("class_counts")
    if counts is not None:
        rectangular = (isinstance(counts, list) and counts and all(isinstance(r, list) for r in counts)
                       and len({len(r) for r in counts}) == 1 and len(counts[0]) > 0)
        if not rectangular or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                      for r in counts for c in r):
            raise FedltError(f"{path}: 'class_counts' is not a K×C table of counts")
    return manifest


def _optional_json(path: Path, what: str) -> dict[str, Any] | None:
    return io.read_json(path, what, dict) if path.is_file() else None


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read one run directory, checking every file it reads; a one-line FedltError naming the file
    and the field when it is not a run or is damaged."""
    path = Path(path)
    if not path.is_dir():
        raise FedltError(f"{path} is not a directory")
    if not (path / "config.json").is_file():
        raise FedltError(f"{path} is not a fedlt run directory (no config.json)")
    config = io.read_json(path / "config.json", "run configuration", dict)
    summary = _optional_json(path / "summary.json", "run summary")
    if summary is not None:
        _check_summary(summary, path / "summary.json")
    manifest = _optional_json(path / "partition.json", "partition manifest")
    if manifest is not None:
        _check_manifest(manifest, path / "partition.json")
    checkpoint = _optional_json(path / "checkpoint.json", "checkpoint record") or {}
    done = checkpoint.get("round")
    if done is not None and (isinstance(done, bool) or not isinstance(done, int) or done < 0):
        raise FedltError(f"{path / 'checkpoint.json'}: 'round' is {done!r}, not a round count")
    participation: list[dict[str, Any]] = []
    metrics = _read_metrics(path / "metrics.jsonl", participation)
    if not metrics:
        raise FedltError(f"{path} has no evaluated round yet (metrics.jsonl is empty)")
    return Run(path, label or path.name, config, metrics, summary, manifest, done, participation)


def _labels(paths: list[Path]) -> list[str]:
    """Directory names, or paths where names repeat."""
    names = [p.resolve().name for p in paths]
    return [p.name if names.count(p.resolve().name) == 1 else str(p) for p in paths]


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Runs labelled by their directory name, or by their path where names repeat; the first run
    that cannot be read raises its FedltError."""
    paths = [Path(p) for p in paths]
    return [load_run(p, label) for p, label in zip(paths, _labels(paths))]


def read_runs(paths: list[str | Path]) -> tuple[list[Run], list[str]]:
    """Like ``load_runs``, but a run that cannot be read is skipped: returns the runs read and
    one line per run skipped (its FedltError)."""
    paths = [Path(p) for p in paths]
    runs, problems = [], []
    for p, label in zip(paths, _labels(paths)):
        try:
            runs.append(load_run(p, label))
        except FedltError as exc:
            problems.append(str(exc).splitlines()[0] if str(exc) else f"{p}: unreadable")
    return runs, problems


def rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One dict per run: what the table shows, unformatted."""
    out = []
    for run in runs:
        final, best = run.final, run.best
        target = run.config.get("rounds")
        done = run.summary["rounds"] if run.summary else (run.checkpoint_round or final["round"])
        out.append({
            "run": run.label, "algorithm": run.config.get("algorithm"), "dataset": run.config.get("dataset"),
            "rounds": done, "target_rounds": target, "finished": run.finished,
            "final_accuracy": final["accuracy"], "best_accuracy": best["accuracy"], "best_round": best["round"],
            "balanced_accuracy": final.get("balanced_accuracy"), "many_accuracy": final.get("many_accuracy"),
            "medium_accuracy": final.get("medium_accuracy"), "few_accuracy": final.get("few_accuracy"),
            "wall_time_s": run.summary.get("wall_time_s") if run.summary else None,
        })
    return out


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def table(runs: list[Run]):
    """A rich Table comparing the runs (accuracies in %)."""
    from rich.table import Table

    t = Table(title="fedlt runs (accuracies in %)")
    for name in ("run", "algorithm", "dataset", "rounds"):
        t.add_column(name, no_wrap=True)
    for name in ("final", "best (round)", "balanced", "many", "medium", "few", "wall"):
        t.add_column(name, justify="right", no_wrap=True)
    for r in rows(runs):
        rounds = f"{r['rounds']}/{r['target_rounds']}" + ("" if r["finished"] else " unfinished")
        wall = "–" if r["wall_time_s"] is None else f"{r['wall_time_s']:.1f}s"
        t.add_row(r["run"], str(r["algorithm"]), str(r["dataset"]), rounds, _pct(r["final_accuracy"]),
                  f"{_pct(r['best_accuracy'])} ({r['best_round']})", _pct(r["balanced_accuracy"]),
                  _pct(r["many_accuracy"]), _pct(r["medium_accuracy"]), _pct(r["few_accuracy"]), wall)
    return t


def participation_table(runs: list[Run]):
    """Per round of every run that lost clients: how many were sampled and returned, and who was
    dropped and why (docs/faults.md); None when no run lost any."""
    from rich.table import Table

    lost = [(run, p) for run in runs for p in run.participation if p["dropped"]]
    if not lost:
        return None
    t = Table(title="participation: rounds that lost clients")
    for name, justify in (("run", "left"), ("round", "right"), ("returned", "right"), ("dropped (client: reason)", "left")):
        t.add_column(name, justify=justify)
    for run, p in lost:
        dropped = "; ".join(f"{c}: {reason}" for c, reason in p["dropped"].items())
        t.add_row(run.label, str(p["round"]), f"{len(p['returned'])}/{len(p['sampled'])}", dropped)
    return t


# -- figures ------------------------------------------------------------------------------------
def _save(fig, path: Path) -> Path:
    # PNG through a temporary file: a half-drawn figure never replaces a good one
    io._atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    return path


def _pct_or_nan(value: float | None) -> float:
    return float("nan") if value is None else 100 * value


def plot_accuracy(runs: list[Run], path: Path) -> Path:
    from fedlt.plots import new_figure

    fig = new_figure(11, 4.2)
    top, balanced = fig.subplots(1, 2, sharey=True)
    for run in runs:
        x = [r["round"] for r in run.metrics]
        marker = "o" if len(x) <= 30 else None
        line, = top.plot(x, [100 * r["accuracy"] for r in run.metrics], marker=marker, markersize=3, label=run.label)
        balanced.plot(x, [_pct_or_nan(r.get("balanced_accuracy")) for r in run.metrics], marker=marker, markersize=3,
                      color=line.get_color(), label=run.label)
    from matplotlib.ticker import MaxNLocator

    for ax, title in ((top, "top-1 accuracy"), (balanced, "balanced accuracy")):
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    top.set_ylabel("test accuracy (%)")
    balanced.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_per_class(runs: list[Run], path: Path) -> Path:
    import numpy as np

    from fedlt.plots import new_figure

    num_classes = max(max(len(run.final.get("per_class_accuracy") or []) for run in runs), 1)
    fig = new_figure(float(np.clip(0.35 * num_classes * max(len(runs), 1) ** 0.5 + 3, 6, 24)), 4.2)
    ax = fig.add_subplot()
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        acc = [_pct_or_nan(a) for a in run.final.get("per_class_accuracy") or []]
        ax.bar(np.arange(len(acc)) + (k - (len(runs) - 1) / 2) * width, acc, width=width,
               label=f"{run.label} (round {run.final['round']})")
    ax.set_xlabel("class")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("per-class accuracy")
    ax.set_ylim(0, 100)
    if num_classes <= 40:
        ax.set_xticks(range(num_classes))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def write_plots(runs: list[Run], folder: str | Path) -> list[Path]:
    """Write the figures into ``folder`` (created if needed); returns the files written."""
    from fedlt.plots import partition_heatmap

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [plot_accuracy(runs, folder / "accuracy.png"), plot_per_class(runs, folder / "per_class.png")]
    used: set[str] = set()
    for run in runs:
        if run.manifest is None or "class_counts" not in run.manifest:
            continue
        name = _file_label(run.label)
        while name in used:  # two labels that differ only in characters a file name cannot hold
            name += "_"
        used.add(name)
        title = f"{run.label}: {run.manifest.get('name', 'partition')} partition"
        written.append(partition_heatmap(run.manifest["class_counts"], folder / f"partition-{name}.png", title=title))
    return written


# -- studies: a grid of runs aggregated over its seeds (docs/sweeps.md) ---------------------------
# what `fedlt report STUDY_DIR` shows without --metric: the paper's columns
STUDY_METRICS = ("final_accuracy", "best_accuracy", "balanced_accuracy", "many_accuracy", "medium_accuracy",
                 "few_accuracy")
FORMATS = ("markdown", "csv", "latex", "json")


@dataclass
class Cell:
    """The runs of one cell of a study's grid, one per seed."""

    label: dict[str, str]  # axis -> value as written (dirichlet(beta=0.05))
    runs: list[Run]  # the finished ones
    seeds: list[int]  # theirs
    failed: dict[str, str]  # run id -> its one-line error
    unfinished: list[str]  # run ids neither finished nor failed (pending, running, stopped)

    @property
    def name(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.label.items())


def is_study(path: str | Path) -> bool:
    from fedlt.sweep.study import MANIFEST

    return (Path(path) / MANIFEST).is_file()


def load_study(path: str | Path, seeds: list[int] | None = None) -> tuple[dict[str, Any], list[Cell], list[str]]:
    """A study directory's manifest, its cells in grid order, and one line per run directory that
    could not be read (damaged: left out of its cell). ``seeds``: only these seeds' runs (e.g. the
    seeds every cell has finished, while a further seed is still running)."""
    from fedlt.sweep.study import read_manifest, status_on_disk

    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        raise FedltError(f"{path} is not a study directory (no study.json)")
    if seeds is not None:
        known = sorted({entry["seed"] for entry in manifest["runs"]})
        unknown = [s for s in seeds if s not in known]
        if unknown:
            raise FedltError(f"--seeds {unknown[0]}: the study {path} has seeds {', '.join(map(str, known))}")
    cells: dict[str, Cell] = {}
    problems = []
    for entry in manifest["runs"]:
        label = dict(entry["label"])
        key = json.dumps(label, sort_keys=True)
        cell = cells.setdefault(key, Cell(label, [], [], {}, []))
        if seeds is not None and entry["seed"] not in seeds:
            continue  # the cell stays (its row), without this run
        run_dir = path / entry["dir"]
        if status_on_disk(run_dir) == "done":
            try:
                cell.runs.append(load_run(run_dir, entry["id"]))
                cell.seeds.append(entry["seed"])
            except FedltError as exc:
                problems.append(str(exc).splitlines()[0])
                cell.failed[entry["id"]] = "unreadable"
        elif entry.get("status") == "failed":
            cell.failed[entry["id"]] = entry.get("error") or "failed"
        else:
            cell.unfinished.append(entry["id"])
    return manifest, list(cells.values()), problems


def _wall_time(run: Run) -> float | None:
    wall = run.summary.get("wall_time_s") if run.summary else None
    return float(wall) if _is_number(wall) else None


# metrics of a whole run rather than of a metrics column; looked up before the best_/final_ prefixes
# (``best_round`` is not the maximum of the ``round`` column)
RUN_METRICS = {
    "best_round": lambda run: float(run.best["round"]),  # the round of the best top-1 accuracy, earliest on ties
    "wall_time_s": _wall_time,  # summary.json: the rounds' training and evaluation time, summed over resumes
}
# decimals shown per metric (accuracies: 2, in %)
DECIMALS = {"best_round": 1, "wall_time_s": 1}


def metric_value(run: Run, metric: str) -> float | None:
    """A run's value of ``metric``: ``final_accuracy`` / ``best_accuracy``; ``final_<column>`` (the
    last evaluated round's), ``best_<column>`` (its maximum over evaluated rounds) or a bare
    ``<column>`` (= final) of any numeric metrics column, e.g. ``balanced_accuracy``,
    ``few_accuracy``, ``loss``, ``tau_norm_accuracy``; or one of ``RUN_METRICS``: ``best_round``
    (the round of the best accuracy) and ``wall_time_s`` (the run's time, from summary.json)."""
    if metric in RUN_METRICS:
        return RUN_METRICS[metric](run)
    if metric.startswith("best_"):
        column = metric.removeprefix("best_")
        values = [r[column] for r in run.metrics if _is_number(r.get(column))]
        return float(max(values)) if values else None
    value = run.final.get(metric.removeprefix("final_"))
    return float(value) if _is_number(value) else None


def _columns(cells: list[Cell]) -> set[str]:
    return {k for cell in cells for run in cell.runs for row in run.metrics for k, v in row.items() if _is_number(v)}


def check_metrics(cells: list[Cell], metrics: list[str]) -> None:
    known = _columns(cells)
    if not known:
        return  # nothing finished yet: every cell reads '–'
    for metric in metrics:
        column = metric.removeprefix("best_").removeprefix("final_")
        if metric not in RUN_METRICS and column not in known:
            raise FedltError(f"--metric {metric}: no run has a {column!r} column (columns: "
                             f"{', '.join(sorted(known - {'round'}))}; prefix best_ or final_; or "
                             f"{', '.join(RUN_METRICS)})")


def aggregate(cells: list[Cell], metrics: list[str]) -> list[dict[str, Any]]:
    """Per cell and metric: the mean, the sample standard deviation (n - 1; None for one run) and
    n over the cell's finished runs, with the values per seed; plus the cell's failures."""
    import numpy as np

    out = []
    for cell in cells:
        stats: dict[str, Any] = {}
        for metric in metrics:
            pairs = [(seed, metric_value(run, metric)) for seed, run in zip(cell.seeds, cell.runs)]
            values = np.array([v for _, v in pairs if v is not None], dtype=np.float64)
            stats[metric] = {
                "mean": float(values.mean()) if values.size else None,
                "std": float(values.std(ddof=1)) if values.size > 1 else None,
                "n": int(values.size), "values": {str(s): v for s, v in pairs if v is not None},
            }
        out.append({"cell": cell.label, "n": len(cell.runs), "failed": cell.failed,
                    "unfinished": len(cell.unfinished), "metrics": stats})
    return out


def _scaled(metric: str, value: float) -> float:
    return 100 * value if "accuracy" in metric else value  # accuracies in %, as the papers print them


def format_stat(metric: str, stat: dict[str, Any], entry: dict[str, Any], latex: bool = False) -> str:
    """``95.25 ± 0.31``, with ``(n=2, 1 failed)`` when a seed is missing; ``failed`` / ``–``."""
    notes = []
    if entry["failed"]:
        notes.append(f"{len(entry['failed'])} failed")
    if entry["unfinished"]:
        notes.append(f"{entry['unfinished']} unfinished")
    if stat["mean"] is None:
        return "failed" if entry["failed"] else ("--" if latex else "–")
    pm = r" \pm " if latex else " ± "
    digits = DECIMALS.get(metric, 2)
    text = f"{_scaled(metric, stat['mean']):.{digits}f}"
    if stat["std"] is not None:
        text += f"{pm}{_scaled(metric, stat['std']):.{digits}f}"
    if latex:
        text = f"${text}$"
    if notes:
        text += f" (n={stat['n']}, {', '.join(notes)})"
    return text


def layout(manifest: dict[str, Any], rows_axes: list[str] | None,
           cols_axes: list[str] | None) -> tuple[list[str], list[str]]:
    axes = list(manifest["study"]["axes"]) or sorted({a for r in manifest["runs"] for a in r["label"]})
    for included in manifest["study"].get("include", []):
        axes += [a for a in included if a not in axes]
    cols = list(cols_axes or [])
    rows = list(rows_axes) if rows_axes else [a for a in axes if a not in cols]
    for axis in rows + cols:
        if axis not in axes:
            raise FedltError(f"--rows/--cols {axis!r} is not an axis of the study (axes: {', '.join(axes) or 'none'})")
    if set(rows) & set(cols):
        raise FedltError(f"{', '.join(sorted(set(rows) & set(cols)))} is in both --rows and --cols")
    missing = [a for a in axes if a not in rows + cols]
    if missing:
        raise FedltError(f"axis {', '.join(missing)} is in neither --rows nor --cols: its cells would share "
                         f"a table cell; add it to one of them")
    return rows, cols


@dataclass(frozen=True)
class Reference:
    """Values published elsewhere (a paper's table), printed beside a study's rows: ``--reference
    FILE.csv``. The CSV's columns named after axes of the study are the keys; the others are
    copied as they are written into extra columns of the rows whose cells match the keys (a row
    with no reference line shows ``–``). Lines starting with ``#`` are comments (cite the source)."""

    path: Path
    keys: list[str]  # axes, as the study names them
    columns: list[str]  # the values' headers
    lines: dict[tuple[str, ...], list[str]]  # key values -> the values, in ``columns`` order

    def values(self, label: dict[str, str]) -> list[str] | None:
        return self.lines.get(tuple(label.get(axis, "") for axis in self.keys))


def read_reference(path: str | Path, axes: list[str]) -> Reference:
    """A reference CSV (``Reference``) for a study with ``axes``; a one-line FedltError naming the
    file, the line and what is allowed when it is unreadable or malformed."""
    import csv

    path = Path(path)
    where = f"--reference {path}"
    text = _read_text(path, "utf-8-sig", where, where)
    parsed = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        try:  # line by line, so an error names its line (a value cannot span lines)
            row = next(csv.reader([line], strict=True))
        except csv.Error as exc:
            raise FedltError(f"{where} line {number}: not CSV ({exc})") from None
        parsed.append((number, [field.strip() for field in row]))
    if not parsed:
        raise FedltError(f"{where} is empty: expected a header line such as 'algorithm,paper %' and one line per row")
    header = parsed[0][1]
    if len(set(header)) != len(header) or not all(header):
        raise FedltError(f"{where}: the header {','.join(header)!r} has an empty or repeated column name")
    keys = [h for h in header if h in axes]
    columns = [h for h in header if h not in axes]
    if not keys or not columns:
        raise FedltError(f"{where}: the header needs at least one column named after an axis of the study "
                         f"({', '.join(axes) or 'none'}) and one value column, got {','.join(header)!r}")
    lines: dict[tuple[str, ...], list[str]] = {}
    for number, row in parsed[1:]:
        if len(row) != len(header):
            raise FedltError(f"{where} line {number}: {len(row)} fields, the header has {len(header)}")
        record = dict(zip(header, row))
        key = tuple(record[k] for k in keys)
        if key in lines:
            raise FedltError(f"{where} line {number}: {', '.join(f'{k}={v}' for k, v in zip(keys, key))} "
                             "is given twice")
        lines[key] = [record[c] for c in columns]
    return Reference(path, keys, columns, lines)


def _check_reference(reference: Reference, aggregated: list[dict[str, Any]], rows: list[str],
                     cols: list[str]) -> None:
    """Every key is a row axis and every reference line names a row of the table."""
    across = [k for k in reference.keys if k in cols]
    if across:
        raise FedltError(f"--reference {reference.path}: column {across[0]!r} is a --cols axis; key the reference "
                         f"by --rows axes ({', '.join(rows)})")
    present = {tuple(e["cell"].get(k, "") for k in reference.keys) for e in aggregated}
    for key in reference.lines:
        if key not in present:
            allowed = "; ".join(f"{k}: {', '.join(sorted({e['cell'].get(k, '') for e in aggregated}))}"
                                for k in reference.keys)
            raise FedltError(f"--reference {reference.path}: {', '.join(f'{k}={v}' for k, v in zip(reference.keys, key))}"
                             f" matches no row of the table (values: {allowed})")


def study_table(aggregated: list[dict[str, Any]], metrics: list[str], rows: list[str], cols: list[str],
                latex: bool = False, reference: Reference | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and body of the table: one line per row key; without ``cols`` one column per
    metric, with ``cols`` one column per column key holding the first metric; then the
    reference's columns."""
    def key(entry: dict, axes: list[str]) -> tuple[str, ...]:
        return tuple(entry["cell"].get(a, "–") for a in axes)

    def published(row_key: tuple[str, ...]) -> list[str]:
        if reference is None:
            return []
        values = reference.values(dict(zip(rows, row_key)))
        missing = "--" if latex else "–"
        return [v or missing for v in values] if values is not None else [missing] * len(reference.columns)

    extra = reference.columns if reference is not None else []
    if not cols:
        header = rows + ["n"] + list(metrics) + extra
        body = [list(key(e, rows)) + [str(e["n"])] + [format_stat(m, e["metrics"][m], e, latex) for m in metrics]
                + published(key(e, rows)) for e in aggregated]
        return header, body
    metric = metrics[0]
    row_keys = list(dict.fromkeys(key(e, rows) for e in aggregated))
    col_keys = list(dict.fromkeys(key(e, cols) for e in aggregated))
    table_cells = {(key(e, rows), key(e, cols)): format_stat(metric, e["metrics"][metric], e, latex)
                   for e in aggregated}
    header = rows + [", ".join(c) for c in col_keys] + extra
    body = [list(r) + [table_cells.get((r, c), "") for c in col_keys] + published(r) for r in row_keys]
    return header, body


def _latex_escape(text: str) -> str:
    special = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
               "$": r"\$", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
    return "".join(special.get(char, char) for char in text)


def _sorted(aggregated: list[dict[str, Any]], sort: str, metrics: list[str], cols: list[str]) -> list[dict[str, Any]]:
    """The cells by their mean of ``sort``, highest first (cells without a value last, in grid order)."""
    if sort not in metrics:
        raise FedltError(f"--sort {sort}: not one of the table's metrics ({', '.join(metrics)})")
    if cols:
        raise FedltError("--sort orders the rows of a table without --cols")
    return sorted(aggregated, key=lambda e: (e["metrics"][sort]["mean"] is None, -(e["metrics"][sort]["mean"] or 0)))


def render_study(manifest: dict[str, Any], cells: list[Cell], fmt: str = "markdown", *,
                 metrics: list[str] | None = None, rows: list[str] | None = None,
                 cols: list[str] | None = None, reference: str | Path | None = None,
                 sort: str | None = None) -> str:
    """The study's table as text: ``markdown``, ``csv``, ``latex`` or ``json`` (every cell and
    metric with its values per seed, whatever the layout, and the study's definition).
    ``reference``: a CSV of published values merged per row (``Reference``); ``sort``: a metric
    whose mean orders the rows, highest first."""
    import csv
    import io as text_io

    if fmt not in FORMATS:
        raise FedltError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if metrics:
        check_metrics(cells, list(metrics))  # the defaults may be absent (no 'few' class): shown as '–'
    metrics = list(metrics or STUDY_METRICS)
    row_axes, col_axes = layout(manifest, rows, cols)
    aggregated = aggregate(cells, metrics)
    if sort is not None:
        aggregated = _sorted(aggregated, sort, metrics, col_axes)
    published = None
    if reference is not None:
        published = read_reference(reference, row_axes + col_axes)
        _check_reference(published, aggregated, row_axes, col_axes)
    if fmt == "json":
        for e in aggregated:
            if published is not None:
                values = published.values(e["cell"])
                e["reference"] = dict(zip(published.columns, values)) if values is not None else None
        return json.dumps({"study": manifest["study"], "metrics": metrics, "cells": aggregated}, indent=2)
    if fmt == "csv":
        buffer = text_io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        extra = published.columns if published is not None else []

        def ref_values(label: dict[str, str]) -> list[str]:
            values = published.values(label) if published is not None else None
            return values if values is not None else [""] * len(extra)

        if not col_axes:
            writer.writerow(row_axes + ["n", "failed", "unfinished"]
                            + [f"{m}_{s}" for m in metrics for s in ("mean", "std")] + extra)
            for e in aggregated:
                writer.writerow([e["cell"].get(a, "") for a in row_axes] + [e["n"], len(e["failed"]), e["unfinished"]]
                                + [e["metrics"][m][s] if e["metrics"][m][s] is not None else ""
                                   for m in metrics for s in ("mean", "std")] + ref_values(e["cell"]))
        else:
            metric = metrics[0]
            col_keys = list(dict.fromkeys(tuple(e["cell"].get(a, "") for a in col_axes) for e in aggregated))
            row_keys = list(dict.fromkeys(tuple(e["cell"].get(a, "") for a in row_axes) for e in aggregated))
            by = {(tuple(e["cell"].get(a, "") for a in row_axes), tuple(e["cell"].get(a, "") for a in col_axes)): e
                  for e in aggregated}
            writer.writerow(row_axes + [f"{', '.join(c)} {s}" for c in col_keys for s in ("mean", "std", "n")] + extra)
            for r in row_keys:
                line = list(r)
                for c in col_keys:
                    stat = by[(r, c)]["metrics"][metric] if (r, c) in by else {"mean": None, "std": None, "n": 0}
                    line += ["" if stat[s] is None else stat[s] for s in ("mean", "std", "n")]
                writer.writerow(line + ref_values(dict(zip(row_axes, r))))
        return buffer.getvalue()
    latex = fmt == "latex"
    header, body = study_table(aggregated, metrics, row_axes, col_axes, latex, published)
    if latex:
        lines = ["% fedlt report: mean \\pm sample std over seeds" + (f" of {metrics[0]}" if col_axes else "")
                 + "; needs \\usepackage{booktabs}",
                 "\\begin{tabular}{" + "l" * len(row_axes) + "r" * (len(header) - len(row_axes)) + "}", "\\toprule",
                 " & ".join(_latex_escape(h) for h in header) + " \\\\", "\\midrule"]
        lines += [" & ".join(c if c.startswith("$") else _latex_escape(c) for c in row) + " \\\\" for row in body]
        return "\n".join(lines + ["\\bottomrule", "\\end{tabular}"]) + "\n"
    note = f"mean ± sample std over seeds{' of ' + metrics[0] if col_axes else ''}; accuracies in %"
    if published is not None:
        note += f"; {', '.join(published.columns)} from {published.path.name}"
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    failures = [f"- {rid}: {error}" for e in aggregated for rid, error in e["failed"].items()]
    tail = ["", "Failed runs:", *failures] if failures else []
    return "\n".join([f"<!-- {note} -->", *lines, *tail]) + "\n"


def plot_study(cells: list[Cell], folder: str | Path) -> list[Path]:
    """``accuracy.png``: per cell, the mean top-1 accuracy per evaluated round with a ±std band
    over its seeds (rounds every seed evaluated); ``per_class.png``: per cell, the mean final
    per-class accuracy with ±std bars."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    from fedlt.plots import new_figure

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shown = [c for c in cells if c.runs]
    if not shown:
        raise FedltError("no finished run to plot yet")
    fig = new_figure(11, 4.5)
    ax = fig.add_subplot()
    for cell in shown:
        rounds = sorted(set.intersection(*({r["round"] for r in run.metrics} for run in cell.runs)))
        curves = np.array([[100 * {r["round"]: r["accuracy"] for r in run.metrics}[x] for x in rounds]
                           for run in cell.runs], dtype=np.float64)
        mean = curves.mean(0)
        std = curves.std(0, ddof=1) if len(curves) > 1 else np.zeros_like(mean)
        line, = ax.plot(rounds, mean, marker="o" if len(rounds) <= 30 else None, markersize=3,
                        label=f"{cell.name} (n={len(curves)})")
        ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%), mean ± std over seeds")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    written = [_save(fig, folder / "accuracy.png")]

    per_class = []
    for cell in shown:
        lists = [run.final.get("per_class_accuracy") or [] for run in cell.runs]
        width = max(len(v) for v in lists)
        values = np.array([[_pct_or_nan(a) for a in v] + [np.nan] * (width - len(v)) for v in lists])
        per_class.append((cell, np.nanmean(values, 0) if values.size else values,
                          np.nanstd(values, 0, ddof=1) if len(values) > 1 else np.zeros(width)))
    num_classes = max(max(len(m) for _, m, _ in per_class), 1)
    fig = new_figure(float(np.clip(0.35 * num_classes * len(shown) ** 0.5 + 3, 6, 24)), 4.2)
    ax = fig.add_subplot()
    bar = 0.8 / len(per_class)
    for k, (cell, mean, std) in enumerate(per_class):
        ax.bar(np.arange(len(mean)) + (k - (len(per_class) - 1) / 2) * bar, mean, width=bar, yerr=std,
               capsize=2, label=cell.name)
    ax.set_xlabel("class")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("per-class accuracy, mean ± std over seeds")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    written.append(_save(fig, folder / "per_class.png"))
    return written

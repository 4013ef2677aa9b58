"""Study aggregation: a study directory's cells (one run per seed), each metric's mean and sample
standard deviation over seeds, the table's layout, and published reference values (docs/sweeps.md).

Imports: fedlt.errors, fedlt.sweep.study (the manifest), fedlt.report.runs.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedlt.errors import FedltError
from fedlt.report.runs import Run, _is_number, _read_text, load_run
from fedlt.sweep.study import MANIFEST, read_manifest, status_on_disk

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
    return (Path(path) / MANIFEST).is_file()


def load_study(path: str | Path, seeds: list[int] | None = None) -> tuple[dict[str, Any], list[Cell], list[str]]:
    """A study directory's manifest, its cells in grid order, and one line per run directory that
    could not be read (damaged: left out of its cell). ``seeds``: only these seeds' runs (e.g. the
    seeds every cell has finished, while a further seed is still running)."""
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



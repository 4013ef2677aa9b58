"""Tables of runs: read a finished (or stopped) run directory and compare runs.

A run directory is read, never written: ``summary.json`` when the run finished, else
``metrics.jsonl`` (and ``checkpoint.json`` for how far it got), plus ``config.json`` and
``partition.json``. ``rows(runs)`` is the table as plain data; ``table(runs)`` renders it with
rich (copied text as ``rich.text.Text``: a label's ``[bold]`` is shown, never read as markup).
Imports: fedlt.io, fedlt.errors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlt import io
from fedlt.errors import FedltError, terminal_safe


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
                 "client_mean_accuracy", "client_min_accuracy", "client_std_accuracy", "new_clients_client_mean_accuracy",
                 "new_clients_client_min_accuracy", "new_clients_client_std_accuracy")


# SPEC §7's per-client modes, the prefixes of their fields; then the same over the clients that never
# trained (new_clients, docs/evaluation.md), reported apart
PER_CLIENT_MODES = ("global_local", "personal", "finetune",
                    "new_clients_global_local", "new_clients_personal", "new_clients_finetune")
PER_CLIENT_SHOWN = ("mean", "mean_weighted", "min", "worst10", "std", "many", "medium", "few")
# a per-client mode's accuracy fields (SPEC §7), whatever comes before the mode (``new_`` clients')
_PER_CLIENT_ACCURACY = re.compile(rf"(^|_)({'|'.join(PER_CLIENT_MODES)})_({'|'.join(PER_CLIENT_SHOWN)})$")


def is_accuracy(metric: str) -> bool:
    """Whether a metric (a column, or ``best_`` / ``final_`` of one) is an accuracy, a fraction
    that every table prints in % with the same decimals: ``accuracy``, any ``*_accuracy`` column,
    and the per-client modes' accuracies (``global_local_mean``, ``personal_worst10``, ...; their
    spread ``_std`` too, in points). Not ``_loss``, ``_clients``, ``best_round``, ``wall_time_s``."""
    column = metric.removeprefix("best_").removeprefix("final_")
    return "accuracy" in column or _PER_CLIENT_ACCURACY.search(column) is not None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_fraction(value: Any) -> bool:
    """An accuracy: a number in [0, 1] (NaN is not)."""
    return _is_number(value) and 0 <= value <= 1


def _cell(value: Any):
    """Copied text for a table: never read as markup, its control characters escaped."""
    from rich.text import Text

    return Text(terminal_safe(str(value)))


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
        fits = _is_fraction if key.endswith("accuracy") else _is_number
        if row.get(key) is not None and not fits(row[key]):
            raise FedltError(f"{where}: {key!r} is {row[key]!r}, not a number"
                             + (" in [0, 1]" if fits is _is_fraction else ""))
    for mode in PER_CLIENT_MODES:
        for key in PER_CLIENT_SHOWN:  # accuracies over clients (and their std): each in [0, 1]
            if row.get(f"{mode}_{key}") is not None and not _is_fraction(row[f"{mode}_{key}"]):
                raise FedltError(f"{where}: '{mode}_{key}' is {row[f'{mode}_{key}']!r}, not a number in [0, 1]")
        spread = row.get(f"{mode}_client_accuracy")
        if spread is not None and (not isinstance(spread, list)
                                   or not all(a is None or _is_fraction(a) for a in spread)):
            raise FedltError(f"{where}: '{mode}_client_accuracy' is not a list of numbers in [0, 1]")
    per_class = row.get("per_class_accuracy")
    if per_class is not None and (not isinstance(per_class, list)
                                  or not all(a is None or _is_fraction(a) for a in per_class)):
        raise FedltError(f"{where}: 'per_class_accuracy' is not a list of numbers in [0, 1]")
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
        if row.get("accuracy") is not None:  # an evaluated round (a null accuracy: not evaluated)
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


RUN_COLUMNS = ("run", "algorithm", "dataset", "rounds", "final", "best (round)", "balanced", "many", "medium",
               "few", "wall")


def table_lines(runs: list[Run]) -> list[list[str]]:
    """The comparison table's cells (``RUN_COLUMNS``), formatted: accuracies in % (``_pct``)."""
    lines = []
    for r in rows(runs):
        rounds = f"{r['rounds']}/{r['target_rounds']}" + ("" if r["finished"] else " unfinished")
        wall = "–" if r["wall_time_s"] is None else f"{r['wall_time_s']:.1f}s"
        lines.append([r["run"], str(r["algorithm"]), str(r["dataset"]), rounds, _pct(r["final_accuracy"]),
                      f"{_pct(r['best_accuracy'])} ({r['best_round']})", _pct(r["balanced_accuracy"]),
                      _pct(r["many_accuracy"]), _pct(r["medium_accuracy"]), _pct(r["few_accuracy"]), wall])
    return lines


def table(runs: list[Run]):
    """A rich Table comparing the runs (accuracies in %)."""
    from rich.table import Table

    t = Table(title="fedlt runs (accuracies in %)")
    for name in RUN_COLUMNS[:4]:
        t.add_column(name, no_wrap=True)
    for name in RUN_COLUMNS[4:]:
        t.add_column(name, justify="right", no_wrap=True)
    for line in table_lines(runs):
        t.add_row(*(_cell(v) for v in line[:3]), *line[3:])
    return t


def modes_of(run: Run) -> list[str]:
    """The per-client modes (SPEC §7) a run's evaluated rows hold."""
    return [m for m in PER_CLIENT_MODES if any(_is_number(r.get(f"{m}_mean")) for r in run.metrics)]


def per_client_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One dict per run and per-client mode: each field's last value (``<key>``) and its best over
    the evaluated rounds (``best_<key>``, ``best_<key>_round``; the std aside, where lower is not
    "best")."""
    out = []
    for run in runs:
        for mode in modes_of(run):
            row: dict[str, Any] = {"run": run.label, "mode": mode, "round": run.final["round"]}
            for key in PER_CLIENT_SHOWN:
                row[key] = run.final.get(f"{mode}_{key}")
                if key == "std":
                    continue
                found = [(r[f"{mode}_{key}"], r["round"]) for r in run.metrics if _is_number(r.get(f"{mode}_{key}"))]
                best = max(found, key=lambda v: (v[0], -v[1])) if found else (None, None)
                row[f"best_{key}"], row[f"best_{key}_round"] = best
            out.append(row)
    return out


PER_CLIENT_COLUMNS = ("run", "mode", "mean", "weighted", "min", "worst 10%", "std", "many", "medium", "few")


def per_client_lines(runs: list[Run]) -> list[list[str]]:
    """The per-client table's cells (``PER_CLIENT_COLUMNS``): each field's last value and its best
    (round), in % (``_pct``, as every accuracy of the reports)."""
    lines = []
    for r in per_client_rows(runs):
        cells = []
        for key in PER_CLIENT_SHOWN:
            last = _pct(r[key])
            best = r.get(f"best_{key}")
            cells.append(last if key == "std" or best is None else f"{last} / {_pct(best)} ({r[f'best_{key}_round']})")
        lines.append([r["run"], r["mode"], *cells])
    return lines


def per_client_table(runs: list[Run]):
    """A rich Table of the runs' per-client numbers (accuracies in %), last and best; None when no
    run has any."""
    from rich.table import Table

    lines = per_client_lines(runs)
    if not lines:
        return None
    t = Table(title="per-client accuracy over each client's own test set (in %; last, and best (round))")
    for name in PER_CLIENT_COLUMNS[:2]:
        t.add_column(name, no_wrap=True)
    for name in PER_CLIENT_COLUMNS[2:]:
        t.add_column(name, justify="right", no_wrap=True)
    for line in lines:
        t.add_row(_cell(line[0]), _cell(line[1]), *line[2:])
    return t


def participation_rows(runs: list[Run]) -> list[tuple[str, int, str, str]]:
    """(run, round, returned/sampled, "client: reason; ...") per round of every run that lost
    clients (docs/faults.md)."""
    return [(run.label, p["round"], f"{len(p['returned'])}/{len(p['sampled'])}",
             "; ".join(f"{c}: {reason}" for c, reason in p["dropped"].items()))
            for run in runs for p in run.participation if p["dropped"]]


def participation_table(runs: list[Run]):
    """Per round of every run that lost clients: how many were sampled and returned, and who was
    dropped and why (docs/faults.md); None when no run lost any."""
    from rich.table import Table

    lost = participation_rows(runs)
    if not lost:
        return None
    t = Table(title="participation: rounds that lost clients")
    for name, justify in (("run", "left"), ("round", "right"), ("returned", "right"), ("dropped (client: reason)", "left")):
        t.add_column(name, justify=justify)
    for label, number, returned, dropped in lost:
        t.add_row(_cell(label), str(number), returned, _cell(dropped))
    return t

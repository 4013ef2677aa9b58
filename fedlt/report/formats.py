"""Output formats of a study's table: Markdown, CSV, LaTeX and JSON, each escaping what it copies.

Text copied from the study (axis values, run ids, failure messages) and from a ``--reference``
CSV is neutralised for the format it lands in, so that opening the output never runs it:

- CSV: a cell starting with ``= + - @``, a tab or a carriage return gets a leading ``'`` (OWASP's
  advice for CSV injection), except a real number such as ``-3.5``;
- LaTeX: ``\\ & % # _ { } $ ~ ^ < > |`` escaped (no ``\\input`` / ``\\write18`` survives);
- Markdown: HTML's ``& < >`` as entities and ``| [ ] ` \\`` backslash-escaped; the note in the
  leading HTML comment cannot close it (``--`` is broken up).

Only what fedlt formats itself (``$95.25 \\pm 0.31$``) is written as markup.
Imports: fedlt.errors, fedlt.report.runs / study.
"""

from __future__ import annotations

import csv
import io as text_io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlt.errors import FedltError
from fedlt.report.runs import is_accuracy
from fedlt.report.study import (DECIMALS, FORMATS, STUDY_METRICS, Cell, Reference, _check_reference, aggregate,
                                check_metrics, layout, read_reference)

# -- escaping what is copied ----------------------------------------------------------------------
CSV_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")
LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
                 "$": r"\$", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"\textless{}",
                 ">": r"\textgreater{}", "|": r"\textbar{}", "\n": " ", "\r": " "}
MARKDOWN_SPECIAL = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "\\": "\\\\", "|": "\\|", "`": "\\`", "[": "\\[",
                    "]": "\\]", "\n": " ", "\r": " "}


def _is_number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def csv_cell(value: Any) -> Any:
    """A CSV cell that a spreadsheet cannot run: text starting with ``= + - @``, tab or CR gets a
    leading ``'`` (OWASP, CSV injection); numbers, and text that is a number (``-3.5``), stay."""
    if not isinstance(value, str) or not value.startswith(CSV_TRIGGERS) or _is_number_text(value):
        return value
    return "'" + value


def latex_escape(text: str) -> str:
    """Text as LaTeX prints it literally: every special character escaped."""
    return "".join(LATEX_SPECIAL.get(char, char) for char in str(text))


def markdown_escape(text: str) -> str:
    """Text as a Markdown table cell shows it literally: HTML and the table's syntax escaped."""
    return "".join(MARKDOWN_SPECIAL.get(char, char) for char in str(text))


def comment_text(text: str) -> str:
    """Text safe inside an HTML comment: it can neither close it (``--``, ``>``) nor open tags."""
    text = markdown_escape(text)
    while "--" in text:
        text = text.replace("--", "- -")
    return text


# -- the table ------------------------------------------------------------------------------------
def _scaled(metric: str, value: float) -> float:
    return 100 * value if is_accuracy(metric) else value  # accuracies in %, as the papers print them


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


def _key(entry: dict, axes: list[str], missing: str = "–") -> tuple[str, ...]:
    return tuple(entry["cell"].get(a, missing) for a in axes)


def study_table(aggregated: list[dict[str, Any]], metrics: list[str], rows: list[str], cols: list[str],
                latex: bool = False, reference: Reference | None = None,
                escape: Any = str) -> tuple[list[str], list[list[str]]]:
    """Header and body of the table: one line per row key; without ``cols`` one column per
    metric, with ``cols`` one column per column key holding the first metric; then the
    reference's columns. Copied text (axes, values, reference) goes through ``escape``; the
    statistics fedlt formats do not."""
    missing = "--" if latex else "–"

    def published(row_key: tuple[str, ...]) -> list[str]:
        if reference is None:
            return []
        values = reference.values(dict(zip(rows, row_key)))
        return [escape(v) or missing for v in values] if values is not None else [missing] * len(reference.columns)

    def copied(values: tuple[str, ...] | list[str]) -> list[str]:
        return [escape(v) for v in values]

    extra = copied(reference.columns) if reference is not None else []
    if not cols:
        header = copied(rows) + ["n"] + copied(metrics) + extra
        body = [copied(_key(e, rows)) + [str(e["n"])] + [format_stat(m, e["metrics"][m], e, latex) for m in metrics]
                + published(_key(e, rows)) for e in aggregated]
        return header, body
    metric = metrics[0]
    row_keys = list(dict.fromkeys(_key(e, rows) for e in aggregated))
    col_keys = list(dict.fromkeys(_key(e, cols) for e in aggregated))
    cells = {(_key(e, rows), _key(e, cols)): format_stat(metric, e["metrics"][metric], e, latex) for e in aggregated}
    header = copied(rows) + [escape(", ".join(c)) for c in col_keys] + extra
    body = [copied(r) + [cells.get((r, c), "") for c in col_keys] + published(r) for r in row_keys]
    return header, body


def _sorted(aggregated: list[dict[str, Any]], sort: str, metrics: list[str], cols: list[str]) -> list[dict[str, Any]]:
    """The cells by their mean of ``sort``, highest first (cells without a value last, in grid order)."""
    if sort not in metrics:
        raise FedltError(f"--sort {sort}: not one of the table's metrics ({', '.join(metrics)})")
    if cols:
        raise FedltError("--sort orders the rows of a table without --cols")
    return sorted(aggregated, key=lambda e: (e["metrics"][sort]["mean"] is None, -(e["metrics"][sort]["mean"] or 0)))


# -- the formats ----------------------------------------------------------------------------------
def _csv_lines(aggregated: list[dict[str, Any]], metrics: list[str], row_axes: list[str], col_axes: list[str],
               published: Reference | None) -> list[list[Any]]:
    extra = published.columns if published is not None else []

    def ref_values(label: dict[str, str]) -> list[str]:
        values = published.values(label) if published is not None else None
        return values if values is not None else [""] * len(extra)

    def blank(value: Any) -> Any:
        return "" if value is None else value

    if not col_axes:
        lines = [row_axes + ["n", "failed", "unfinished"] + [f"{m}_{s}" for m in metrics for s in ("mean", "std")]
                 + extra]
        for e in aggregated:
            lines.append(list(_key(e, row_axes, "")) + [e["n"], len(e["failed"]), e["unfinished"]]
                         + [blank(e["metrics"][m][s]) for m in metrics for s in ("mean", "std")]
                         + ref_values(e["cell"]))
        return lines
    metric = metrics[0]
    col_keys = list(dict.fromkeys(_key(e, col_axes, "") for e in aggregated))
    row_keys = list(dict.fromkeys(_key(e, row_axes, "") for e in aggregated))
    by = {(_key(e, row_axes, ""), _key(e, col_axes, "")): e for e in aggregated}
    lines = [row_axes + [f"{', '.join(c)} {s}" for c in col_keys for s in ("mean", "std", "n")] + extra]
    for r in row_keys:
        line = list(r)
        for c in col_keys:
            stat = by[(r, c)]["metrics"][metric] if (r, c) in by else {"mean": None, "std": None, "n": 0}
            line += [blank(stat[s]) for s in ("mean", "std", "n")]
        lines.append(line + ref_values(dict(zip(row_axes, r))))
    return lines


def render_csv(aggregated: list[dict[str, Any]], metrics: list[str], row_axes: list[str], col_axes: list[str],
               published: Reference | None) -> str:
    """One line per row; every copied cell through ``csv_cell``."""
    buffer = text_io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for line in _csv_lines(aggregated, metrics, row_axes, col_axes, published):
        writer.writerow([csv_cell(v) for v in line])
    return buffer.getvalue()


def render_latex(aggregated: list[dict[str, Any]], metrics: list[str], row_axes: list[str], col_axes: list[str],
                 published: Reference | None) -> str:
    """A booktabs tabular; copied text through ``latex_escape``."""
    header, body = study_table(aggregated, metrics, row_axes, col_axes, True, published, latex_escape)
    lines = ["% fedlt report: mean \\pm sample std over seeds" + (f" of {latex_escape(metrics[0])}" if col_axes else "")
             + "; needs \\usepackage{booktabs}",
             "\\begin{tabular}{" + "l" * len(row_axes) + "r" * (len(header) - len(row_axes)) + "}", "\\toprule",
             " & ".join(header) + " \\\\", "\\midrule"]
    lines += [" & ".join(row) + " \\\\" for row in body]
    return "\n".join(lines + ["\\bottomrule", "\\end{tabular}"]) + "\n"


def render_markdown(aggregated: list[dict[str, Any]], metrics: list[str], row_axes: list[str],
                    col_axes: list[str], published: Reference | None) -> str:
    """A pipe table under an HTML comment saying what the numbers are; then the failed runs.
    Copied text through ``markdown_escape`` (the comment: ``comment_text``)."""
    header, body = study_table(aggregated, metrics, row_axes, col_axes, False, published, markdown_escape)
    note = f"mean ± sample std over seeds{' of ' + metrics[0] if col_axes else ''}; accuracies in %"
    if published is not None:
        note += f"; {', '.join(published.columns)} from {published.path.name}"
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    failures = [f"- {markdown_escape(rid)}: {markdown_escape(error)}" for e in aggregated
                for rid, error in e["failed"].items()]
    tail = ["", "Failed runs:", *failures] if failures else []
    return "\n".join([f"<!-- {comment_text(note)} -->", *lines, *tail]) + "\n"


def render_json(manifest: dict[str, Any], aggregated: list[dict[str, Any]], metrics: list[str],
                published: Reference | None) -> str:
    """Every cell and metric with its values per seed, and the study's definition (JSON escapes
    what it copies)."""
    for e in aggregated:
        if published is not None:
            values = published.values(e["cell"])
            e["reference"] = dict(zip(published.columns, values)) if values is not None else None
    return json.dumps({"study": manifest["study"], "metrics": metrics, "cells": aggregated}, indent=2)


@dataclass
class StudyTable:
    """What a study's table shows, before a format writes it: the metrics, the axes down and across,
    each cell's statistics (``aggregate``) in the rows' order, and the reference values."""

    metrics: list[str]
    rows: list[str]
    cols: list[str]
    aggregated: list[dict[str, Any]]
    published: Reference | None


def prepare_study(manifest: dict[str, Any], cells: list[Cell], *, metrics: list[str] | None = None,
                  rows: list[str] | None = None, cols: list[str] | None = None,
                  reference: str | Path | None = None, sort: str | None = None) -> StudyTable:
    """The study's table (``render_study``'s options), checked: a one-line FedltError naming the
    option when a metric, an axis, ``sort`` or the reference does not fit the study."""
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
    return StudyTable(metrics, row_axes, col_axes, aggregated, published)


def render_study(manifest: dict[str, Any], cells: list[Cell], fmt: str = "markdown", *,
                 metrics: list[str] | None = None, rows: list[str] | None = None,
                 cols: list[str] | None = None, reference: str | Path | None = None,
                 sort: str | None = None) -> str:
    """The study's table as text: ``markdown``, ``csv``, ``latex`` or ``json`` (every cell and
    metric with its values per seed, whatever the layout, and the study's definition).
    ``reference``: a CSV of published values merged per row (``Reference``); ``sort``: a metric
    whose mean orders the rows, highest first."""
    if fmt not in FORMATS:
        raise FedltError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return render_table(manifest, prepare_study(manifest, cells, metrics=metrics, rows=rows, cols=cols,
                                                reference=reference, sort=sort), fmt)


def render_table(manifest: dict[str, Any], t: StudyTable, fmt: str) -> str:
    """A prepared table (``prepare_study``) in ``fmt``: ``markdown``, ``csv``, ``latex`` or ``json``."""
    if fmt not in FORMATS:
        raise FedltError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "json":
        return render_json(manifest, t.aggregated, t.metrics, t.published)
    render = {"csv": render_csv, "latex": render_latex, "markdown": render_markdown}[fmt]
    return render(t.aggregated, t.metrics, t.rows, t.cols, t.published)

"""One self-contained HTML page of runs or of a study: ``fedlt report ... --html FILE``.

The page holds its tables, its figures and its configuration inline and loads nothing: the
figures are matplotlib's PNGs (the very figures ``--plot`` writes, from ``fedlt.report.plots``)
as ``data:`` URIs, the style sheet is inline, and there is no script. Its Content-Security-Policy
(``default-src 'none'``) makes a browser refuse any request the page could make, so it reads the
same offline, from a file, an e-mail or an artifact store. Why PNG and not inline SVG: its size
is bounded whatever the number of rounds, classes or clients (an SVG grows with every point),
several SVGs in one document can collide on matplotlib's element ids, and the page then shows
exactly what ``--plot`` writes. Why matplotlib and not a JavaScript plotting library: it is
already fedlt's plotting dependency, and an interactive library would have to be inlined (several
MB of script per page) to read offline.

Every string copied from a run or a study (run names, axis values, config values, error messages)
goes through ``html.escape`` (``& < > " '``), like the CSV, LaTeX and Markdown formats escape theirs
(``fedlt.report.formats``). Imports: fedlt.report.runs / study / formats / plots.
"""

from __future__ import annotations

import base64
import html
import json
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fedlt.report.formats import StudyTable, study_table
from fedlt.report.plots import (accuracy_figure, partition_figure, per_class_figure, per_client_figure, png_bytes,
                                run_groups_figure, study_curves_figure, study_groups_figure, study_per_class_figure,
                                study_per_client_figure)
from fedlt.report.runs import (PER_CLIENT_COLUMNS, RUN_COLUMNS, Run, modes_of, participation_rows, per_client_lines,
                               table_lines)
from fedlt.report.study import Cell

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
MAX_HEATMAPS = 12  # partition heat maps on one page (each is a figure of its own)
PACKAGES = ("fedlt", "torch", "numpy", "matplotlib", "flwr")
STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1280px;
       padding: 0 1.5em; color: #222; background: #fff; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; }
p.note { color: #555; margin-top: 0; }
table { border-collapse: collapse; margin: .6em 0 1.2em; font-variant-numeric: tabular-nums; display: block;
        max-width: 100%; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
td.num { text-align: right; white-space: nowrap; } th { background: #f3f3f3; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figure.heatmap { display: inline-block; margin-right: 1em; } figure.heatmap img { max-width: 600px; }
figcaption { color: #555; font-size: .9em; }
details { margin: .4em 0; } summary { cursor: pointer; font-weight: 600; }
code, td.cfg { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: .92em; }
ul.problems li { color: #a00; }
"""


def _e(value: Any) -> str:
    """Copied text as HTML shows it literally (quotes too: safe inside an attribute)."""
    return html.escape(str(value), quote=True)


def _figure(fig: Any, caption: str, kind: str = "plot") -> str:
    """The figure as an inline PNG (``data:`` URI), with its caption as alt text; ``kind`` its CSS class."""
    data = base64.b64encode(png_bytes(fig, dpi=100)).decode("ascii")
    return (f'<figure class={kind}><img src="data:image/png;base64,{data}" alt="{_e(caption)}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _table(header: list[str], body: list[list[Any]], first_text: int = 1) -> str:
    """A table, every cell escaped; the columns from ``first_text`` on hold numbers (right-aligned)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    lines = ["".join(f'<td{"" if i < first_text else " class=num"}>{_e(v)}</td>' for i, v in enumerate(line))
             for line in body]
    body_rows = "".join(f"<tr>{t}</tr>" for t in lines)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body_rows}</tbody></table>"


def _flat(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """A nested config as (dotted key, JSON value) pairs, in its own order."""
    if isinstance(value, dict) and value:
        return [pair for k, v in value.items() for pair in _flat(v, f"{prefix}.{k}" if prefix else str(k))]
    return [(prefix, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))]


def _config(title: str, config: dict[str, Any], open_: bool = False) -> str:
    pairs = "".join(f"<tr><th>{_e(k)}</th><td class=cfg>{_e(v)}</td></tr>" for k, v in _flat(config))
    return f"<details{' open' if open_ else ''}><summary>{_e(title)}</summary><table>{pairs}</table></details>"


def _versions(recorded: dict[str, Any]) -> str:
    """What the run recorded of its versions (any ``*version*`` field of its files), and the
    versions of the software that wrote this page (read without importing them)."""
    found = []
    for package in PACKAGES:
        try:
            found.append((package, version(package)))
        except PackageNotFoundError:
            continue
    found.append(("python", platform.python_version()))
    mine = _table(["package", "version"], found)
    theirs = [(where, key, value) for where, config in recorded.items() for key, value in _flat(config)
              if "version" in key.rsplit(".", 1)[-1].lower()]
    own = _table(["run", "field", "value"], theirs) if theirs else "<p class=note>(none in the run files)</p>"
    return (f"<h2>Versions</h2><p class=note>recorded by the runs:</p>{own}"
            f"<p class=note>this page written with:</p>{mine}")


def _page(title: str, note: str, sections: list[str]) -> str:
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1><p class=note>{_e(note)}</p>", *sections, "</body></html>", ""])


# -- runs -------------------------------------------------------------------------------------------
def _per_client_section(runs: list[Run]) -> str:
    lines = per_client_lines(runs)
    if not lines:
        return ""
    return ("<h2>Per-client accuracy</h2><p class=note>each client on its own test set, in %: last, and best "
            "(round)</p>" + _table(list(PER_CLIENT_COLUMNS), lines, first_text=2))


def _participation_section(runs: list[Run]) -> str:
    lost = participation_rows(runs)
    if not lost:
        return ""
    header = ["run", "round", "returned", "dropped (client: reason)"]
    return "<h2>Rounds that lost clients</h2>" + _table(header, [list(r) for r in lost])


def _heatmaps(shown: list[tuple[str, Run]]) -> list[str]:
    """Partition heat maps of (caption, run) pairs, at most ``MAX_HEATMAPS``."""
    with_counts = [(caption, run) for caption, run in shown if run.manifest and "class_counts" in run.manifest]
    figures = [_figure(partition_figure(run), caption, "heatmap") for caption, run in with_counts[:MAX_HEATMAPS]]
    if len(with_counts) > MAX_HEATMAPS:
        figures.append(f"<p class=note>{len(with_counts) - MAX_HEATMAPS} more partitions not drawn.</p>")
    return figures


def run_page(runs: list[Run], problems: list[str] | None = None) -> str:
    """The page of ``runs`` (``fedlt report RUN_DIR... --html FILE``): the comparison table, the
    per-client table, accuracy curves, per-class and many/medium/few bars, per-client curves and
    boxes, each run's partition heat map, config and versions; ``problems``: runs left out."""
    figures = [_figure(accuracy_figure(runs), "top-1 and balanced accuracy per evaluated round"),
               _figure(per_class_figure(runs), "final per-class accuracy"),
               _figure(run_groups_figure(runs), "final accuracy on the many / medium / few classes")]
    if any(modes_of(run) for run in runs):
        figures.append(_figure(per_client_figure(runs), "per-client accuracy: mean per round, and each "
                                                        "client's in the last evaluated round"))
    figures += _heatmaps([(f"{run.label}: partition (clients × classes)", run) for run in runs])
    configs = [_config(f"{run.label}: config.json", run.config) for run in runs]
    recorded = {run.label: {"config": run.config, "summary": run.summary or {}} for run in runs}
    tables = ["<h2>Runs</h2>", _table(list(RUN_COLUMNS), table_lines(runs), first_text=3),
              _per_client_section(runs), _participation_section(runs), _problems(problems or [])]
    return _page(f"fedlt report: {', '.join(run.label for run in runs)}", "accuracies in %",
                 [*tables, "<h2>Figures</h2>", *figures, "<h2>Configuration</h2>", *configs, _versions(recorded)])


def _problems(problems: list[str]) -> str:
    if not problems:
        return ""
    return "<h2>Left out</h2><ul class=problems>" + "".join(f"<li>{_e(p)}</li>" for p in problems) + "</ul>"


# -- a study ----------------------------------------------------------------------------------------
def _study_table(t: StudyTable) -> str:
    header, body = study_table(t.aggregated, t.metrics, t.rows, t.cols, False, t.published)
    failures = [f"{rid}: {error}" for e in t.aggregated for rid, error in e["failed"].items()]
    what = f" of {t.metrics[0]}" if t.cols else ""
    return (f"<p class=note>mean ± sample std over seeds{_e(what)}; accuracies in %</p>"
            + _table(header, body, first_text=len(t.rows))
            + ("<p>Failed runs:</p><ul class=problems>" + "".join(f"<li>{_e(f)}</li>" for f in failures) + "</ul>"
               if failures else ""))


def _study_heatmaps(shown: list[Cell]) -> list[str]:
    """One heat map per distinct partition (its sha256): cells that differ only in the method share
    their seeds' partitions."""
    seen, pairs = set(), []
    for cell in shown:
        for seed, run in zip(cell.seeds, cell.runs):
            key = (run.manifest or {}).get("sha256") or id(run)
            if key not in seen:
                seen.add(key)
                pairs.append((f"{cell.name}, seed {seed}: partition (clients × classes)", run))
    return _heatmaps(pairs)


def study_page(name: str, manifest: dict[str, Any], cells: list[Cell], t: StudyTable,
               problems: list[str] | None = None) -> str:
    """The page of a study (``fedlt report STUDY_DIR --html FILE``): its mean ± std table (as laid
    out by ``prepare_study``), curves with ±std bands, per-class and many/medium/few bars with
    ±std, per-client boxes (clients of every seed pooled), the partitions' heat maps, the study's
    definition, one run's resolved config and the versions."""
    shown = [c for c in cells if c.runs]
    sections = ["<h2>Table</h2>", _study_table(t), _problems(problems or [])]
    if shown:
        figures = [_figure(study_curves_figure(shown), "top-1 accuracy per round, mean ± std over seeds"),
                   _figure(study_per_class_figure(shown), "final per-class accuracy, mean ± std over seeds"),
                   _figure(study_groups_figure(shown), "many / medium / few classes, mean ± std over seeds")]
        boxes = study_per_client_figure(shown)
        if boxes is not None:
            figures.append(_figure(boxes, "each client's accuracy in the last evaluated round, seeds pooled"))
        first = shown[0].runs[0]
        sections += ["<h2>Figures</h2>", *figures, *_study_heatmaps(shown), "<h2>Configuration</h2>",
                     _config("the study (study.json: base settings, axes, seeds)", manifest["study"], open_=True),
                     _config(f"{first.label}: its resolved config.json (every run's is in runs/<id>/)", first.config),
                     _versions({first.label: {"config": first.config, "summary": first.summary or {}}})]
    else:
        sections.append("<p>No run has finished yet: nothing to draw.</p>")
    runs = sum(len(c.runs) for c in cells)
    return _page(f"fedlt study: {name}", f"{len(cells)} cells, {runs} finished runs", sections)



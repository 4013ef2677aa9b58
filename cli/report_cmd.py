"""``fedlt report RUN_DIR...`` (a table comparing runs) or ``fedlt report STUDY_DIR`` (the
study's table, mean ± std over seeds); ``--plot DIR`` writes PNG figures, ``--html FILE`` one
self-contained page of tables, figures, config and versions."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from fedlt import outputs
from fedlt.cli.app import app
from fedlt.errors import FedltError


@app.command("report")
def report(
    runs: list[Path] = typer.Argument(..., help="run directories (written by fedlt run), or one study directory "
                                      "(written by fedlt sweep)"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write accuracy curves, per-class bars, per-client "
                                                              "distributions and partition heatmaps as PNG files into this folder (a study: "
                                                              "curves with ±std bands over seeds)"),
    rows: Optional[list[str]] = typer.Option(None, "--rows", help="study: the axes down the table (repeatable; "
                                             "default: every axis not in --cols)"),
    cols: Optional[list[str]] = typer.Option(None, "--cols", help="study: the axes across the table (repeatable); "
                                             "each cell then shows the first --metric"),
    metric: Optional[list[str]] = typer.Option(None, "--metric", help="study: final_accuracy, best_accuracy, or any "
                                               "metrics column, as final_<col> / best_<col> (repeatable; default: "
                                               "final and best accuracy, balanced, many/medium/few)"),
    fmt: str = typer.Option("markdown", "--format", help="study: markdown, csv, latex or json"),
    output: Optional[Path] = typer.Option(None, "--output", help="study: write the table to this file too"),
    reference: Optional[Path] = typer.Option(None, "--reference", help="study: a CSV of published values to print "
                                             "beside the rows (columns named after --rows axes are the keys, the "
                                             "others are copied; '#' lines are comments)"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="study: only these seeds' runs, e.g. 0,1 (the seeds "
                                        "every cell finished while another seed is still running)"),
    sort: Optional[str] = typer.Option(None, "--sort", help="study: order the rows by this --metric's mean, highest "
                                       "first (a table without --cols)"),
    html: Optional[Path] = typer.Option(None, "--html", help="write one self-contained HTML page to this file: the "
                                        "table, accuracy curves, per-class, many/medium/few and per-client figures, "
                                        "partition heat maps, the config and versions; it loads nothing (offline)"),
    force: bool = typer.Option(False, "--force", help="replace fedlt's own earlier --output / --plot / --html files "
                               "(never a file fedlt did not write, never an input)"),
) -> None:
    """Compare runs: final/best accuracy, balanced, many/medium/few, rounds, wall time; or
    aggregate a study over its seeds: mean ± std (n) per cell, laid out with --rows / --cols.
    --html FILE writes it all as one self-contained page, figures, configs and versions included.

    A run that cannot be read (not a run, or a damaged file) is named on stderr, one line each,
    and left out; the others are still reported, and the exit code is then 2. A study's failed
    runs are marked in their cell and listed under the table. An existing --output, --plot or --html file
    is refused unless fedlt wrote it (then --force replaces it); an input never is."""
    from fedlt.report import is_study
    from fedlt.rundir import check_directory, check_file

    if plot is not None:
        check_directory(plot, "--plot")  # before any work: a bad folder is one line, not a traceback
    if html is not None:
        check_file(html, "--html")
    studies = [p for p in runs if is_study(p)]
    if studies:
        if len(runs) > 1:
            raise FedltError("report one study directory at a time (or run directories only)")
        if output is not None:
            check_file(output, "--output")
            outputs.check([output], "--output", force=force, inputs=_inputs(studies[0], reference))
        if html is not None:
            outputs.check([html], "--html", force=force, inputs=_inputs(studies[0], reference))
        _study(studies[0], plot, rows, cols, metric, fmt, output, reference, sort, seeds, force, html)
        return
    if (rows or cols or metric or output is not None or fmt != "markdown" or reference is not None or sort
            or seeds is not None):  # --force applies to --plot too
        raise FedltError("--rows, --cols, --metric, --format, --output, --reference, --seeds and --sort apply to a "
                         "study directory (written by fedlt sweep)")
    if html is not None:
        outputs.check([html], "--html", force=force, inputs=[p / name for p in runs for name in RUN_INPUTS])
    _runs(runs, plot, force, html)


RUN_INPUTS = ("config.json", "metrics.jsonl", "summary.json", "partition.json", "checkpoint.json")


def _inputs(study: Path, reference: Optional[Path]) -> list[Path]:
    """What a study's report reads: never a place to write it."""
    return [study / "study.json", *([reference] if reference is not None else [])]


def _study(path: Path, plot: Optional[Path], rows, cols, metric, fmt: str, output: Optional[Path],
           reference: Optional[Path], sort: Optional[str], seeds: Optional[str], force: bool,
           html: Optional[Path]) -> None:
    from fedlt.cli.sweep_cmd import parse_seeds
    from fedlt.report import FORMATS, STUDY_PLOTS, load_study, plot_study, prepare_study, render_table, study_page

    if fmt not in FORMATS:
        raise FedltError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    manifest, cells, problems = load_study(path, parse_seeds(seeds) if seeds is not None else None)
    prepared = prepare_study(manifest, cells, metrics=metric, rows=rows, cols=cols, reference=reference, sort=sort)
    text = render_table(manifest, prepared, fmt)
    if plot is not None:  # refused before anything is written
        if not any(cell.runs for cell in cells):
            raise FedltError("no finished run to plot yet")
        outputs.check([plot / name for name in STUDY_PLOTS], "--plot", force=force)
    typer.echo(text, nl=False)
    if output is not None:
        outputs.write_bytes(output, text.encode())
        typer.echo(f"wrote {output}", err=True)
    if plot is not None:
        for written in plot_study(cells, plot, force):
            typer.echo(f"wrote {written}", err=True)
    if html is not None:
        page = study_page(path.resolve().name, manifest, cells, prepared, problems)
        typer.echo(f"wrote {outputs.write_bytes(html, page.encode())}", err=True)
    for problem in problems:
        typer.echo(f"error: skipped {problem}", err=True)
    if problems:
        raise typer.Exit(2)


def _runs(runs: list[Path], plot: Optional[Path], force: bool, html: Optional[Path]) -> None:
    from fedlt.report import participation_table, per_client_table, read_runs, run_page, table, write_plots

    loaded, problems = read_runs(runs)
    if not loaded:
        raise FedltError("; ".join(problems) if len(problems) > 1 else problems[0])
    console = Console()
    if not console.is_terminal:  # piped or captured: don't squeeze the table into 80 columns
        console.width = 160
    console.print(table(loaded))
    personal = per_client_table(loaded)
    if personal is not None:
        console.print(personal)
    lost = participation_table(loaded)
    if lost is not None:
        console.print(lost)
    if plot is not None:
        for path in write_plots(loaded, plot, force):
            typer.echo(f"wrote {path}")
    if html is not None:
        typer.echo(f"wrote {outputs.write_bytes(html, run_page(loaded, problems).encode())}")
    for problem in problems:
        typer.echo(f"error: skipped {problem}", err=True)
    if problems:
        raise typer.Exit(2)

"""``fedlt report RUN_DIR...``: a table comparing runs and, with ``--plot DIR``, PNG figures."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from fedlt.cli.app import app


@app.command("report")
def report(
    runs: list[Path] = typer.Argument(..., help="run directories (written by fedlt run)"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write accuracy curves, per-class bars and partition "
                                                              "heatmaps as PNG files into this folder"),
) -> None:
    """Compare runs: final/best accuracy, balanced, many/medium/few, rounds, wall time."""
    from fedlt.report import load_runs, table, write_plots

    loaded = load_runs(runs)
    console = Console()
    if not console.is_terminal:  # piped or captured: don't squeeze the table into 80 columns
        console.width = 160
    console.print(table(loaded))
    if plot is not None:
        for path in write_plots(loaded, plot):
            typer.echo(f"wrote {path}")

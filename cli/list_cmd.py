"""``fedlt list [KIND]``: what is registered (built-ins and installed plugins)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from fedlt.cli.app import app
from fedlt.errors import FedltError


def registries() -> dict:
    import fedlt.aggregators
    import fedlt.algorithms
    import fedlt.datasets
    import fedlt.losses
    import fedlt.models
    import fedlt.partitioners
    from fedlt.models.splitting import SPLITTERS

    return {"algorithms": fedlt.algorithms.REGISTRY, "datasets": fedlt.datasets.REGISTRY,
            "partitioners": fedlt.partitioners.REGISTRY, "models": fedlt.models.REGISTRY,
            "losses": fedlt.losses.REGISTRY, "aggregators": fedlt.aggregators.REGISTRY,
            "splitters": SPLITTERS}


def summary_line(obj) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


@app.command("list")
def list_components(kind: Optional[str] = typer.Argument(None, help="algorithms, datasets, partitioners, models, losses, aggregators, splitters"),
                    pattern: str = typer.Option("*", help="shell-style filter, e.g. 'fed*'")) -> None:
    """List registered components of one kind, or of every kind."""
    regs = registries()
    if kind is not None and kind not in regs:
        raise FedltError(f"unknown kind {kind!r} (valid: {', '.join(regs)})")
    table = Table("kind", "name", "description")
    for name, reg in regs.items():
        if kind in (None, name):
            for item in reg.list(pattern):
                table.add_row(name, item, summary_line(reg.get(item)))
    Console().print(table)

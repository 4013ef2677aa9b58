"""``fedlt list [KIND [NAME]]``: what is registered (built-ins and installed plugins), and what
one component takes."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fedlt.cli.app import app
from fedlt.errors import FedltError


SUPPLIED_BY = {"losses": "the client's data, the round, the global model", "models": "from the dataset",
               "datasets": "--data-root, --download", "engines": "the run's settings and callbacks",
               "posthoc": "the global model"}
SUPPLIED = "supplied"  # the default column of a parameter fedlt fills in: no user sets it


def show_component(kind: str, name: str) -> None:
    """One component: where it comes from, its parameters with defaults (those fedlt supplies
    itself last, marked as supplied), and its docstring."""
    from fedlt.components import docstring, parameters, registries, supplied  # see list_components

    reg = registries()[kind]
    obj = reg.get(name)
    console = Console()
    console.print(f"[bold]{name}[/bold]  ({kind}, {reg.origin(name)})", highlight=False)
    auto = supplied(kind)
    params = sorted(parameters(obj), key=lambda p: p.name in auto)  # stable: the user's first, in order
    if params:
        table = Table("parameter", "default", "type", "description")
        for p in params:
            if p.name in auto:
                why = f"set by fedlt ({SUPPLIED_BY.get(kind, 'the run')})"
                row = (p.name, SUPPLIED, p.annotation, f"{why}: {p.description}" if p.description else why)
            else:
                row = (p.name, p.default, p.annotation, p.description)
            table.add_row(*map(escape, row))
        console.print(table)
    else:
        console.print("no parameters")
    doc = docstring(obj)
    if doc:
        console.print(Text(doc), soft_wrap=True)  # the docstring's own line breaks
    if kind == "algorithms":
        show_authors_settings(console, name)


def show_authors_settings(console: Console, name: str) -> None:
    """An algorithm's authors' training settings beside fedlt's defaults, each with its source."""
    from fedlt.algorithms.authors import _same, _show, algorithm_default, authors_settings, lookup, why_none
    from fedlt.config import RunConfig

    settings = authors_settings(name)
    if settings is None:
        console.print(Text(f"authors' settings: {why_none(name)} (--preset authors does not apply to {name})"),
                      soft_wrap=True)
        return
    defaults = RunConfig.model_construct().model_dump(mode="json")
    table = Table("setting", "fedlt default", "authors'", "", "source", title=f"the authors' settings "
                  f"(--preset authors): {settings.code}", title_justify="left")
    for s in settings.settings:
        if s.key.startswith("algorithm_params."):
            ours = algorithm_default(name, s.key.split(".", 1)[1])
        else:
            ours = lookup(defaults, s.key)[1]
        table.add_row(*map(escape, (s.key, _show(ours), _show(s.value), "" if _same(ours, s.value) else "differs",
                                    s.source.removeprefix(settings.code + ":"))))
    console.print(table)
    if settings.note:
        console.print(Text(f"note: {settings.note}"), soft_wrap=True)


@app.command("list")
def list_components(kind: Optional[str] = typer.Argument(None, help="algorithms, datasets, partitioners, models, "
                                                          "losses, aggregators, splitters"),
                    name: Optional[str] = typer.Argument(None, help="one component: its parameters and docstring"),
                    pattern: str = typer.Option("*", help="shell-style filter, e.g. 'fed*'")) -> None:
    """List registered components of one kind, or of every kind; with a NAME, show its parameters and docstring."""
    # imported here, not at the top: fedlt.components loads every registry (all of fedlt), which
    # `fedlt --help` and the other commands would otherwise pay for at start-up
    from fedlt.components import registries, summary_line

    regs = registries()
    if kind is not None and kind not in regs:
        raise FedltError(f"unknown kind {kind!r} (valid: {', '.join(regs)})")
    if name is not None:
        show_component(kind, name)
        return
    table = Table("kind", "name", "description")
    for kind_name, reg in regs.items():
        if kind in (None, kind_name):
            for item in reg.list(pattern):
                table.add_row(kind_name, item, escape(summary_line(reg.get(item))))  # docstrings hold [brackets]
    Console().print(table)

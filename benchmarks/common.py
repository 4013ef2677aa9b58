"""Shared helpers for the benchmark scripts: a results table printed with rich and saved as JSON."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # timm imports triton; there is no GPU here

RESULTS = Path(__file__).with_name("results")


def report(name: str, columns: list[str], rows: list[list], meta: dict | None = None,
           out_dir: Path | None = None) -> None:
    """Print ``rows`` as a table and write them with ``meta`` to ``<out_dir>/<name>.json``
    (default: benchmarks/results/)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns, title=name)
    for row in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row])
    Console(width=max(160, len(columns) * 14)).print(table)  # the whole table, even through a pipe
    out_dir = RESULTS if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
               "meta": meta or {}, "columns": columns, "rows": rows}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")

"""Figures written to files with matplotlib's Agg canvas.

matplotlib is imported inside each function (it is slow to import and only plots need it), and
figures are drawn on ``matplotlib.figure.Figure`` + ``FigureCanvasAgg`` rather than pyplot, so no
global backend is switched and nothing is left open between calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedlt.errors import FedltError


def new_figure(width: float, height: float) -> Any:
    """A constrained-layout ``Figure`` on its own Agg canvas (no pyplot state); also used by ``fedlt.report``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=dpi)
    except ValueError as exc:  # e.g. an unsupported file extension
        raise FedltError(f"cannot write the figure to {path}: {exc}".splitlines()[0]) from None
    return path


def partition_heatmap(class_counts: Any, path: str | Path, title: str | None = None) -> Path:
    """Clients × classes heatmap of the per-client class counts (``heatmap_figure``), written to
    ``path``; the format follows its suffix (png, pdf, svg, ...). Returns ``path``."""
    return _save(heatmap_figure(class_counts, title), path)


def heatmap_figure(class_counts: Any, title: str | None = None) -> Any:
    """Clients × classes heatmap of the per-client class counts (like FedLC's Figure 4), as a Figure.

    Rows are clients, columns classes, colour the number of samples; with at most 400 cells the
    count is written in each cell, as in the paper.
    """
    counts = np.asarray(class_counts, dtype=np.int64)
    if counts.ndim != 2 or counts.size == 0:
        raise FedltError(f"class_counts must be a non-empty K×C matrix, got shape {counts.shape}")
    num_clients, num_classes = counts.shape
    annotate = counts.size <= 400
    cell = 0.55 if annotate else 0.12  # inches per cell: room for the numbers when they are drawn
    width = float(np.clip(num_classes * cell + 2.5, 4.0, 16.0))
    height = float(np.clip(num_clients * cell + 1.5, 3.0, 14.0))
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    image = ax.imshow(counts, aspect="auto", cmap="YlGnBu", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="samples")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=min(num_classes, 20), integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=min(num_clients, 25), integer=True))
    if annotate:
        dark = counts > 0.6 * max(int(counts.max()), 1)  # white text on the darkest cells
        for (k, c), value in np.ndenumerate(counts):
            ax.text(c, k, str(value), ha="center", va="center", fontsize=7,
                    color="white" if dark[k, c] else "black")
    ax.set_title(title or f"class counts of {num_clients} clients × {num_classes} classes", fontsize=10)
    return fig

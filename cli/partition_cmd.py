"""``fedlt partition``: partition a dataset's training labels, print per-client class counts and
the summary, and optionally write a heatmap (``--plot``) and a reusable partition file (``--save``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from fedlt import outputs
from fedlt.cli.app import app
from fedlt.cli.flags import PARTITION_OPTIONS, PartitionFlag, resolve_partition
from fedlt.errors import FedltError
from fedlt.registry import create_from_spec
from fedlt.spec import DEFAULT_PARTITION

WIDE = 20  # above this many classes, one column per class is unreadable


def class_count_table(class_counts, max_rows: int) -> Table:
    """Rows = clients: samples, classes held, and the count of every class (or the five largest
    when there are more than ``WIDE`` classes); a zero count is shown as a dim dot."""
    num_clients, num_classes = class_counts.shape
    wide = num_classes > WIDE
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_footer=not wide, title="class counts per client")
    table.add_column("client", justify="right", footer="total")
    table.add_column("samples", justify="right", footer=str(int(class_counts.sum())))
    table.add_column("classes", justify="right")
    if wide:
        table.add_column("largest classes (class:count)")
    else:
        for c in range(num_classes):
            table.add_column(str(c), justify="right", footer=str(int(class_counts[:, c].sum())))
    shown = num_clients if max_rows <= 0 else min(num_clients, max_rows)
    for k in range(shown):
        row = class_counts[k]
        cells = [str(k), str(int(row.sum())), str(int((row > 0).sum()))]
        if wide:
            top = [c for c in row.argsort(kind="stable")[::-1][:5] if row[c] > 0]
            cells.append("  ".join(f"{c}:{row[c]}" for c in top))
        else:
            cells += [str(int(v)) if v else "[dim]·[/dim]" for v in row]
        table.add_row(*cells)
    if shown < num_clients:
        table.caption = f"… {num_clients - shown} more clients (--max-rows 0 shows all)"
    return table


def summary_table(part, describe: str) -> Table:
    m, s = part.manifest, part.manifest["summary"]
    table = Table(box=None, show_header=False, title="summary", title_justify="left", pad_edge=False)
    table.add_column(style="bold")
    table.add_column()

    def spread(d: dict) -> str:
        return f"min {d['min']}  median {d['median']:g}  max {d['max']}  mean {d['mean']:.4g}"

    ds = m["dataset"]
    imbalance = s["global_imbalance_factor"]
    table.add_row("partitioner", f"{describe}  ·  {m['num_clients']} clients  ·  seed {m['seed']}")
    table.add_row("dataset", f"{ds['name']}  ·  {ds['size']} training samples  ·  {m['num_classes']} classes")
    table.add_row("samples per client", spread(s["samples_per_client"]))
    table.add_row("classes per client", spread(s["classes_per_client"]))
    table.add_row("vacant classes per client", spread(s["vacant_classes_per_client"]))
    table.add_row("assigned samples", f"{s['assigned_samples']} of {ds['size']}"
                  + (f"  ·  {s['absent_classes']} classes absent" if s["absent_classes"] else ""))
    table.add_row("global imbalance factor", f"{imbalance:.4g}" if imbalance is not None else "—")
    table.add_row("sha256", m["sha256"])
    return table


def _print(renderable) -> None:
    console = Console()
    if not console.is_terminal:  # piped output: widen rather than wrap or truncate the numbers
        natural = Console(width=100_000).measure(renderable).maximum  # measure() clamps to the width
        console = Console(width=max(console.width, natural))
    console.print(renderable)


def figure_path(path: Path) -> Path:
    """The file a figure is written to: matplotlib adds ``.png`` to a name without a suffix (so
    that is the name reported), and a suffix it cannot write is refused up front."""
    if path.is_dir():
        raise FedltError(f"--plot {path} is a directory; name a file")
    if not path.suffix:
        return path.with_name(path.name + ".png")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise FedltError(f"--plot {path}: matplotlib cannot write {path.suffix!r} files "
                         f"(use one of {', '.join('.' + f for f in sorted(formats))})")
    return path


@app.command("partition")
def partition_command(
    dataset: str = typer.Option("mnist", help="dataset whose training labels are partitioned (fedlt list datasets)"),
    data_root: Optional[Path] = typer.Option(None, help="folder holding the torchvision datasets"),
    download: bool = typer.Option(False, "--download", help="let torchvision download a missing dataset"),
    partition: PartitionFlag = PARTITION_OPTIONS["partition"],
    alpha: Optional[int] = PARTITION_OPTIONS["alpha"],
    beta: Optional[float] = PARTITION_OPTIONS["beta"],
    min_size: Optional[int] = PARTITION_OPTIONS["min_size"],
    shards_per_client: Optional[int] = PARTITION_OPTIONS["shards_per_client"],
    imbalance_factor: Optional[float] = PARTITION_OPTIONS["imbalance_factor"],
    then: PartitionFlag = PARTITION_OPTIONS["then"],
    clients: int = typer.Option(100, help="number of clients K"),
    seed: int = typer.Option(0, help="the data seed (fedlt run --data-seed)"),
    plot: Optional[Path] = typer.Option(None, help="write a clients × classes heatmap (png, pdf, svg)"),
    save: Optional[Path] = typer.Option(None, help="write the partition (.npz, reusable with fedlt run "
                                        "--partition-file) and its manifest beside it (.json)"),
    max_rows: int = typer.Option(100, help="clients shown in the table; 0 shows all"),
    force: bool = typer.Option(False, "--force", help="replace fedlt's own earlier --save / --plot files (never a "
                               "file fedlt did not write)"),
) -> None:
    """Partition a dataset's training set among clients and show the class counts per client."""
    import fedlt.datasets
    import fedlt.partitioners
    from fedlt import io
    from fedlt.rundir import check_file

    # checked here, before the dataset is loaded (typer's own range errors bypass the one-line handler)
    if clients < 1 or seed < 0:
        raise FedltError(f"--clients must be at least 1 and --seed at least 0 (got {clients} and {seed})")
    if save is not None and save.suffix != ".npz":
        raise FedltError(f"--save {save}: the partition file must end in .npz (its manifest goes beside it as .json)")
    if save is not None:  # every output path is checked before the dataset is loaded
        check_file(save, "--save")
        check_file(save.with_suffix(".json"), "--save")
        outputs.check([save, save.with_suffix(".json")], "--save", force=force)  # never a file fedlt did not write
    if plot is not None:
        plot = figure_path(plot)
        check_file(plot, "--plot")
        outputs.check([plot], "--plot", force=force)
    flags = dict(alpha=alpha, beta=beta, min_size=min_size, shards_per_client=shards_per_client,
                 imbalance_factor=imbalance_factor)
    spec = resolve_partition(partition, then, flags, DEFAULT_PARTITION) or dict(DEFAULT_PARTITION)
    try:
        partitioner = create_from_spec(fedlt.partitioners.REGISTRY, spec, "--partition")  # as fedlt run checks it
    except ValueError as exc:
        raise FedltError(f"partition: {exc}") from None
    data = fedlt.datasets.load(dataset, root=data_root, download=download)
    part = fedlt.partitioners.partition_data(partitioner, data, clients, seed)  # with the dataset's groups, if any
    describe = partitioner.describe() if hasattr(partitioner, "describe") else part.manifest["name"]

    _print(class_count_table(part.class_counts, max_rows))
    _print(summary_table(part, describe))
    if save is not None:
        part.save(save)
        io.write_json(save.with_suffix(".json"), part.manifest)
        outputs.record([save, save.with_suffix(".json")])
        typer.echo(f"saved {save} and {save.with_suffix('.json')}")
    if plot is not None:
        from fedlt.plots import partition_heatmap

        title = f"{describe}\n{clients} clients, seed {seed}, {data.name}"
        typer.echo(f"plot {partition_heatmap(part.class_counts, plot, title=title)}")
        outputs.record([plot])

"""``fedlt splits MODEL [--dataset D]``: the valid cut points of a model for a dataset's input,
with the activation the client sends and the parameter count on each side."""

from __future__ import annotations

import math
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from fedlt.cli.app import app
from fedlt.errors import FedltError

# (in_chans, image_size, num_classes) of the built-in datasets, so listing cuts loads no data.
DATASET_SHAPES: dict[str, tuple[int, int, int]] = {
    "mnist": (1, 28, 10),
    "fashion_mnist": (1, 28, 10),
    "cifar10": (3, 32, 10),
    "cifar100": (3, 32, 100),
    "svhn": (3, 32, 10),
}


def input_shape(dataset: str) -> tuple[int, int, int]:
    """``(in_chans, image_size, num_classes)`` of a dataset: the table above, else the loaded data."""
    if dataset in DATASET_SHAPES:
        return DATASET_SHAPES[dataset]
    import fedlt.datasets

    data = fedlt.datasets.create(dataset)  # a plugin dataset: its tensors say what it is
    return data.in_chans, data.image_size, int(data.num_classes)


def splits_table(model_name: str, points, chans: int, size: int, num_classes: int) -> Table:
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"cut points of {model_name} for {chans}x{size}x{size} inputs, {num_classes} classes",
    )
    table.add_column("--split", justify="right")
    table.add_column("name")
    table.add_column("client ends at")
    table.add_column("activation (per sample)")
    table.add_column("activation size", justify="right")
    table.add_column("client params", justify="right")
    table.add_column("server params", justify="right")
    for p in points:
        table.add_row(
            str(p.index), p.name, p.module, "×".join(map(str, p.activation_shape)),
            f"{math.prod(p.activation_shape):,}", f"{p.client_params:,}", f"{p.server_params:,}",
        )
    return table


@app.command("splits")
def splits(
    model: str = typer.Argument(..., help="a registered model (alexnet, mlp) or timm:<name>"),
    dataset: str = typer.Option("cifar10", help="sets the input channels, image size and classes"),
    in_chans: Optional[int] = typer.Option(None, help="override the dataset's input channels"),
    image_size: Optional[int] = typer.Option(None, help="override the dataset's image size"),
    num_classes: Optional[int] = typer.Option(None, help="override the dataset's number of classes"),
) -> None:
    """List the valid cut points of MODEL: the value for --split, the activation the client sends
    and the parameter count on each side."""
    import torch

    from fedlt.models import build, check_fits
    from fedlt.models.splitting import split_points

    given = {"--in-chans": in_chans, "--image-size": image_size, "--num-classes": num_classes}
    bad = [f"{flag} {value}" for flag, value in given.items() if value is not None and value < 1]
    if bad:
        raise FedltError(f"{', '.join(bad)}: --in-chans, --image-size and --num-classes must be >= 1")
    chans, size, classes = input_shape(dataset)
    chans, size, classes = [d if v is None else v for v, d in zip(given.values(), (chans, size, classes))]
    check_fits(model, in_chans=chans, num_classes=classes, image_size=size)  # before anything is allocated
    net = build(model, in_chans=chans, num_classes=classes, image_size=size)
    points = split_points(net, torch.zeros(1, chans, size, size))
    if not points:
        raise FedltError(f"{model} has no valid cut point")
    Console(width=max(Console().width, 130)).print(splits_table(model, points, chans, size, classes))

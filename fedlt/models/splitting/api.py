"""The public entry points: which splitter cuts a model, its cut points, and the cut itself."""

from __future__ import annotations

import torch
from torch import nn

from fedlt.errors import FedltError
from fedlt.models.splitting.base import SPLITTERS, Splitter, SplitPoint, _num_params


def find_splitter(model: nn.Module) -> Splitter:
    """The splitter with the lowest priority that applies to ``model``."""
    candidates = sorted((SPLITTERS.get(n).priority, n) for n in SPLITTERS.list())
    for _, name in candidates:
        splitter = SPLITTERS.get(name)
        if splitter.applies(model):
            return splitter
    raise FedltError(f"{type(model).__name__} cannot be split: no splitter applies to it")


def cut_points(model: nn.Module) -> list[tuple[str, str]]:
    """``(name, module at the boundary)`` of every valid cut, in forward order; ``at`` indexes it."""
    return find_splitter(model).cut_points(model)


def resolve_cut(model: nn.Module, at: str | int) -> int:
    """The index of cut ``at`` (an index, its string form, or a cut point's name)."""
    points = cut_points(model)
    index: int | None = None
    if isinstance(at, int) and not isinstance(at, bool):
        index = at if 0 <= at < len(points) else None
    elif isinstance(at, str):
        key = at.strip()
        if key.isdigit():
            index = int(key) if int(key) < len(points) else None
        else:
            index = next((i for i, (name, _) in enumerate(points) if name == key), None)
    if index is None:
        valid = ", ".join(f"{i}={name}" for i, (name, _) in enumerate(points))
        raise FedltError(
            f"split {at!r} is not a cut point of {type(model).__name__} (valid: {valid or 'none'})"
        )
    return index


def split(model: nn.Module, at: str | int) -> tuple[nn.Module, nn.Module]:
    """``(client, server)`` sharing ``model``'s tensors, cut at ``at`` (see the module docstring)."""
    splitter = find_splitter(model)
    return splitter.split(model, resolve_cut(model, at))


@torch.no_grad()
def split_points(model: nn.Module, example_input: torch.Tensor) -> list[SplitPoint]:
    """Every valid cut with the client's activation shape for ``example_input`` (batch first)
    and the parameter count on each side. Runs the client parts in eval mode."""
    splitter = find_splitter(model)
    modes = [(m, m.training) for m in model.modules()]  # restored one by one: some may be frozen
    model.eval()
    try:
        out = []
        for i, (name, module) in enumerate(splitter.cut_points(model)):
            client, server = splitter.split(model, i)
            client.eval()
            activation = client(example_input)
            if not isinstance(activation, torch.Tensor):
                raise FedltError(f"cut {name!r} of {type(model).__name__} does not send a single tensor")
            out.append(
                SplitPoint(i, name, module, tuple(activation.shape[1:]), _num_params(client), _num_params(server))
            )
        return out
    finally:
        for module, mode in modes:
            module.training = mode

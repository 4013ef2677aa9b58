"""The model and splitter contract (SPEC §3): a model built for a dataset's shape gives finite
(B, C) logits; at every split point listed, ``server(client(x)) == model(x)`` and the model's
parameters are partitioned between the two sides (each on exactly one side)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fedlt.models
from fedlt.errors import FedltError
from fedlt.models.splitting import SPLITTERS, cut_points, find_splitter, split
from fedlt.spec import format_spec
from fedlt.testing.base import Contract, registered


def _ids(module: nn.Module) -> set[int]:
    return {id(p) for p in module.parameters()}


def _check_cuts(c: Contract, model: nn.Module, names: list[str], split, x: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad():
        want = model(x)
    everything = _ids(model)
    for index, cut in enumerate(names):
        with c.property("every split point listed works", f"at {cut!r}"):
            client, server = split(model, index)
            client.eval(), server.eval()
            with torch.no_grad():
                got = server(client(x))
        c.check(isinstance(got, torch.Tensor) and got.shape == want.shape
                and torch.allclose(got, want, rtol=1e-5, atol=1e-5), "server(client(x)) == model(x)",
                f"at {cut!r}: the two sides differ from the whole model by "
                f"{(got - want).abs().max().item() if isinstance(got, torch.Tensor) and got.shape == want.shape else 'shape'}")
        a, b = _ids(client), _ids(server)
        c.check(not (a & b), "parameters partitioned", f"at {cut!r}: {len(a & b)} parameters are on both sides")
        c.check(a | b == everything, "parameters partitioned",
                f"at {cut!r}: {len(everything - (a | b))} of the model's parameters are on neither side")


def check_model(model: Any, params: dict[str, Any] | None = None, *, in_chans: int = 1, num_classes: int = 10,
                image_size: int = 28, splittable: bool | None = None) -> None:
    """Check a model, given by registered name (or ``timm:<name>``) or as its factory, built for
    inputs of ``in_chans``×``image_size``² and ``num_classes`` classes with ``params``.

    Properties: [builds]; [logits] (a batch gives finite (B, num_classes) logits); and, when a
    splitter applies to it (required with ``splittable=True``), [every split point listed works],
    [server(client(x)) == model(x)] and [parameters partitioned] at each one.
    """
    with registered(fedlt.models.REGISTRY, model, "contract_model") if not (
            isinstance(model, str) and model.startswith("timm:")) else _as_is(model) as name:
        c = Contract(f"model {name!r}")
        with c.property("builds"):
            net = fedlt.models.build(format_spec({"name": name, **(params or {})}), in_chans=in_chans,
                                     num_classes=num_classes, image_size=image_size)
        x = torch.randn(3, in_chans, image_size, image_size, generator=torch.Generator().manual_seed(0))
        net.eval()
        with c.property("logits"), torch.no_grad():
            logits = net(x)
        c.check(isinstance(logits, torch.Tensor) and tuple(logits.shape) == (3, num_classes), "logits",
                f"a batch of 3 gave {tuple(getattr(logits, 'shape', ()))}, expected (3, {num_classes})")
        c.check(bool(torch.isfinite(logits).all()), "logits", "non-finite logits")
        try:
            find_splitter(net)
        except FedltError as exc:
            c.check(splittable is not True, "every split point listed works", f"no splitter applies: {exc}")
            return
        with c.property("every split point listed works"):
            names = [n for n, _ in cut_points(net)]
        c.check(bool(names), "every split point listed works", "a splitter applies but lists no split point")
        _check_cuts(c, net, names, lambda m, i: split(m, i), x)


def check_splitter(splitter: Any, model: nn.Module, example_input: torch.Tensor) -> None:
    """Check a splitter (registered name or object) on a model it should apply to.

    Properties: [applies]; [every split point listed works], [server(client(x)) == model(x)] and
    [parameters partitioned] for each of its ``cut_points(model)``.
    """
    obj = SPLITTERS.get(splitter) if isinstance(splitter, str) else splitter
    c = Contract(f"splitter {splitter if isinstance(splitter, str) else type(splitter).__name__!r}")
    with c.property("applies"):
        applies = obj.applies(model)
    c.check(bool(applies), "applies", f"does not apply to {type(model).__name__}")
    with c.property("every split point listed works"):
        names = [n for n, _ in obj.cut_points(model)]
    c.check(bool(names), "every split point listed works", f"lists no split point for {type(model).__name__}")
    _check_cuts(c, model, names, obj.split, example_input)


class _as_is:
    """A timm spec is not in the registry: use it as it is."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> str:
        return self.name

    def __exit__(self, *exc: object) -> None:
        return None

"""The server-step contract (fedlt.server_steps): what an algorithm carrying a step relies on.

A step is created with its parameters, ``setup`` with the initial classifier, asked for a
``payload``, run on each client (``collect``) and on the server (``apply``)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import fedlt.models.heads
import fedlt.server_steps
from fedlt import wire
from fedlt.testing.base import Contract, registered

D, C = 6, 4  # the tiny model's feature width and classes


class _Tiny(nn.Module):
    """A two-layer model whose final linear layer is its ``get_classifier()``."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.body, self.head = nn.Linear(3, D), nn.Linear(D, C)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))

    def get_classifier(self) -> nn.Linear:
        return self.head


def _client_batches(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Client ``k``'s data in two batches; every client lacks one class, class 0 is everywhere."""
    g = torch.Generator().manual_seed(10 + k)
    y = torch.tensor([c for c in range(C) if c != 1 + k % (C - 1)] * 4)
    x = torch.randn(len(y), 3, generator=g)
    return [(x[:5], y[:5]), (x[5:], y[5:])]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[k].double(), b[k].double(), rtol=1e-5, atol=1e-6) for k in ("weight", "bias"))


def check_server_step(step: Any, params: dict[str, Any] | None = None) -> None:
    """Check a server step, given by registered name or as its class (created with ``params``).

    Properties: [interface] (``fresh`` is a bool, ``due`` is true on the last round, ``requires``
    names capabilities of fedlt.models.heads.CAPABILITIES); [uploads
    travel] (a client's ``collect`` crosses fedlt's wire format unchanged and does not change the
    model); [classifier shape] (``apply`` gives ``weight`` and ``bias`` of the classifier's shapes
    and dtype, finite); [order independent] (reversing the uploads changes nothing beyond float
    rounding); [state round trip] (a fresh step loaded with another's ``state_dict`` after a
    round gives the same payload and the same next classifier).
    """
    with registered(fedlt.server_steps.REGISTRY, step, "contract_server_step") as name:
        c = Contract(f"server step {name!r}")

        def make() -> Any:
            with c.property("construction"):
                s = fedlt.server_steps.create(name, **(params or {}))
                s.setup(_Tiny().head, torch.Generator().manual_seed(0))
                return s

        def run_round(s: Any, order: slice = slice(None), seed: int = 1) -> dict[str, torch.Tensor]:
            model = _Tiny()
            uploads = [s.collect(model, _client_batches(k), s.payload(), C, torch.Generator().manual_seed(k))
                       for k in range(3)]
            return s.apply(model.head, uploads[order], torch.Generator().manual_seed(seed))

        first = make()
        c.check(isinstance(first.fresh, bool), "interface", f"fresh is {first.fresh!r}, not a bool")
        c.check(bool(first.due(4, 5)), "interface", "due(round, rounds) is false on the last round")
        needs = getattr(first, "requires", frozenset())
        c.check(isinstance(needs, (set, frozenset)) and needs <= set(fedlt.models.heads.CAPABILITIES), "interface",
                f"requires is {needs!r}, not a set of {', '.join(fedlt.models.heads.CAPABILITIES)}")
        model = _Tiny()
        before = copy.deepcopy(model.state_dict())
        with c.property("uploads travel"):
            upload = first.collect(model, _client_batches(0), first.payload(), C, torch.Generator().manual_seed(0))
            back = wire.decode(*wire.encode(upload))
        c.check(_same(back, upload), "uploads travel", "a client's upload changed crossing the wire format")
        c.check(_same(model.state_dict(), before), "uploads travel", "collect changed the model's weights")

        a = make()
        with c.property("classifier shape"):
            head = run_round(a)
        c.check(isinstance(head, dict) and {"weight", "bias"} <= set(head), "classifier shape",
                f"apply returned {type(head).__name__} {sorted(head) if isinstance(head, dict) else ''}")
        ref = _Tiny().head
        for k, want in (("weight", ref.weight), ("bias", ref.bias)):
            c.check(head[k].shape == want.shape and head[k].dtype == want.dtype, "classifier shape",
                    f"{k}: {tuple(head[k].shape)} {head[k].dtype}, expected {tuple(want.shape)} {want.dtype}")
            c.check(bool(torch.isfinite(head[k]).all()), "classifier shape", f"{k} is not finite")

        with c.property("order independent"):
            reversed_ = run_round(make(), slice(None, None, -1))
        c.check(_close(head, reversed_), "order independent", "reversing the uploads changed the classifier")

        fresh = make()
        with c.property("state round trip"):
            fresh.load_state_dict(copy.deepcopy(a.state_dict()))
        c.check(_same(fresh.payload(), a.payload()), "state round trip", "the loaded step's payload differs")
        with c.property("state round trip"):
            x, y = run_round(a, seed=2), run_round(fresh, seed=2)
        c.check(_same(x, y), "state round trip", "after load_state_dict the next round's classifier differs")

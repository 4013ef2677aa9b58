"""The aggregator contract (SPEC §4): identical client models give the global model back exactly,
the result does not depend on the clients' order, and server state (momentum, Adam moments)
round-trips through ``state_dict`` / ``load_state_dict``.

An aggregator is called as ``aggregator(global_state, results, trainable)`` with the clients'
``(state_dict, |D_k|)`` pairs (fedlt.aggregators)."""

from __future__ import annotations

import copy
from typing import Any

import torch

import fedlt.aggregators
from fedlt.testing.base import Contract, registered

State = dict[str, torch.Tensor]
TRAINABLE = ("layer.weight", "layer.bias")  # the float buffer and the integer one are not


def _state(seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(4, 3, generator=g), "layer.bias": torch.randn(4, generator=g),
            "bn.running_mean": torch.randn(3, generator=g),
            "bn.num_batches_tracked": torch.tensor(seed + 3, dtype=torch.int64)}


def _equal(a: State, b: State, exact: bool) -> bool:
    if a.keys() != b.keys():
        return False
    if exact:
        return all(torch.equal(a[k], b[k]) for k in a)
    return all(torch.allclose(a[k].double(), b[k].double(), rtol=1e-6, atol=1e-7) for k in a)


def check_aggregator(aggregator: Any, params: dict[str, Any] | None = None) -> None:
    """Check an aggregator, given by registered name or as its class (created with ``params``).

    Properties: [keys and dtypes] (the result has the model's keys, shapes and dtypes); [identical
    inputs] (a fresh aggregator given clients that all return the global model gives it back
    exactly); [order independent] (permuting the clients changes nothing beyond float rounding);
    [state round trip] (a fresh aggregator loaded with another's ``state_dict`` after a round
    continues identically, for two more rounds).
    """
    with registered(fedlt.aggregators.REGISTRY, aggregator, "contract_aggregator") as name:
        c = Contract(f"aggregator {name!r}")

        def make() -> Any:
            with c.property("construction"):
                return fedlt.aggregators.create(name, **(params or {}))

        global_state = _state(0)
        updates = [(_state(s), float(w)) for s, w in ((1, 30), (2, 10), (3, 25), (4, 10))]
        with c.property("keys and dtypes"):
            out = make()(global_state, updates, TRAINABLE)
        c.check(isinstance(out, dict) and out.keys() == global_state.keys(), "keys and dtypes",
                f"result keys {sorted(out) if isinstance(out, dict) else type(out).__name__}")
        for k, ref in global_state.items():
            c.check(out[k].shape == ref.shape and out[k].dtype == ref.dtype, "keys and dtypes",
                    f"{k}: {tuple(out[k].shape)} {out[k].dtype}, expected {tuple(ref.shape)} {ref.dtype}")

        with c.property("identical inputs"):
            out = make()(global_state, [(copy.deepcopy(global_state), w) for w in (5.0, 1.0, 3.0)], TRAINABLE)
        c.check(_equal(out, global_state, exact=True), "identical inputs",
                "three clients holding the global model did not give it back exactly")

        first = make()
        with c.property("order independent"):
            a = first(global_state, updates, TRAINABLE)
            b = make()(global_state, updates[::-1], TRAINABLE)
        c.check(_equal(a, b, exact=False), "order independent", "reversing the clients changed the result")

        fresh = make()
        with c.property("state round trip"):
            fresh.load_state_dict(copy.deepcopy(first.state_dict()))
        x, y = a, a
        for seed in (10, 20):
            results = [(_state(seed + 1), 5.0), (_state(seed + 2), 7.0)]
            x, y = first(x, results, TRAINABLE), fresh(y, results, TRAINABLE)
            c.check(_equal(x, y, exact=True), "state round trip",
                    "after load_state_dict the next aggregation differs")

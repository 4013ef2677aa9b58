"""The update-transform contract (docs/transforms.md): what the engine relies on when a transform
runs on a client's upload.

A transform is ``apply(update, state) -> (update, state)`` and ``encode`` (its wire form, read back
by :func:`fedlt.transforms.unpack`), composed with ``+`` (fedlt.transforms)."""

from __future__ import annotations

from typing import Any

import torch

import fedlt.transforms
from fedlt import wire
from fedlt.testing.base import Contract, differences, registered


def _update(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(6, 5, generator=g), "layer.bias": torch.randn(6, generator=g) * 1e-3,
            "head.weight": torch.randn(3, 6, generator=g) * 10}


def _seeded(call: Any, *args: Any) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return call(*args)


def check_transform(transform: Any, params: dict[str, Any] | None = None) -> None:
    """Check an update transform, given by registered name or as its class (created with ``params``).

    Properties: [shapes and dtypes] (apply returns every entry of the update, in its shape and
    dtype, finite, and a dict of state); [zero update] (an all-zero update stays finite);
    [encode is apply] (``unpack`` of the wire form equals the dense result, same random draws);
    [travels] (the wire form and the state cross the wire format unchanged); [deterministic]
    (the same draws give the same result); [state carries] (three rounds with the state passed
    through the wire give what three rounds with the state kept in memory give); [composes]
    (``t + t`` is a Chain applying it twice, each link with its own state).
    """
    with registered(fedlt.transforms.REGISTRY, transform, "contract_transform") as name:
        c = Contract(f"transform {name!r}")
        with c.property("construction"):
            t = fedlt.transforms.create(name, **(params or {}))
        update = _update(0)
        with c.property("shapes and dtypes"):
            out, state = _seeded(t.apply, update, {})
        c.check(isinstance(out, dict) and out.keys() == update.keys(), "shapes and dtypes",
                f"keys {sorted(out) if isinstance(out, dict) else type(out).__name__}")
        c.check(isinstance(state, dict), "shapes and dtypes", f"state is a {type(state).__name__}, not a dict")
        for k, v in update.items():
            c.check(out[k].shape == v.shape and out[k].dtype == v.dtype, "shapes and dtypes",
                    f"{k}: {out[k].dtype}{list(out[k].shape)} for {v.dtype}{list(v.shape)}")
            c.check(bool(torch.isfinite(out[k]).all()), "shapes and dtypes", f"{k} is not finite")
        with c.property("zero update"):
            zero, _ = _seeded(t.apply, {k: torch.zeros_like(v) for k, v in update.items()}, {})
        c.check(all(bool(torch.isfinite(v).all()) for v in zero.values()), "zero update", "non-finite values")
        with c.property("encode is apply"):
            forms, encoded_state = _seeded(t.encode, update, {})
            opened = {k: fedlt.transforms.unpack(f, update[k]) for k, f in forms.items()}
        found = differences(opened, out, 0.0, rtol=0.0) + differences(encoded_state, state, 0.0, "state", rtol=0.0)
        c.check(not found, "encode is apply", "; ".join(found[:3]))
        with c.property("travels"):
            back = wire.decode(*wire.encode((forms, state)))
        found = differences(back, (forms, state), 0.0, rtol=0.0)
        c.check(not found, "travels", "; ".join(found[:3]))
        again, _ = _seeded(t.apply, update, {})
        found = differences(again, out, 0.0, rtol=0.0)
        c.check(not found, "deterministic", "; ".join(found[:3]))
        _check_state(c, t)
        with c.property("composes"):
            twice = t + t
            chained, chained_state = _seeded(twice.apply, update, {})
        c.check(isinstance(twice, fedlt.transforms.Chain) and len(twice.links) == 2, "composes", "t + t is not a Chain of two")
        c.check(set(chained_state) <= {"0", "1"}, "composes", f"chain state keys {sorted(chained_state)}")


def _check_state(c: Contract, t: Any) -> None:
    kept: dict[str, Any] = {}
    carried: dict[str, Any] = {}
    for r in range(3):
        update = _update(r + 1)
        with c.property("state carries", f"round {r + 1}"):
            a, kept = _seeded(t.apply, update, kept)
            b, carried = _seeded(t.apply, update, wire.decode(*wire.encode(carried)))
        found = differences(b, a, 0.0, rtol=0.0)
        c.check(not found, "state carries", f"round {r + 1}: " + "; ".join(found[:3]))

"""The loss-term contract (SPEC §2): a finite scalar with a finite gradient in every corner a
round can reach, invariance to a per-row logit constant for softmax losses, an exact
``state_dict`` round trip, and the same value inside an expression."""

from __future__ import annotations

import functools
from typing import Any

import torch

import fedlt.losses
from fedlt.context import RoundContext
from fedlt.losses.compose import build, create_term
from fedlt.testing.base import Contract, registered

C = 4  # classes in every case
# name -> (class counts, targets): the corners a client's round can reach
CASES: dict[str, tuple[list[float], list[int]]] = {
    "all classes present": ([5, 3, 2, 4], [0, 1, 2, 3, 0, 3, 2, 0]),
    "zero counts": ([6, 0, 4, 0], [0, 2, 0, 2, 2, 0]),
    "one present class": ([0, 0, 9, 0], [2, 2, 2, 2, 2]),
    "a batch of one label": ([0, 1, 0, 0], [1]),
}
EXTREME = 1e4


def _setup(counts: list[float], seed: int) -> dict[str, Any]:
    """Every value a term may name: the client's own, and every round-context field (round 2 of
    5 here, so a term that schedules on the round has a round to read)."""
    g = torch.Generator().manual_seed(seed)
    global_counts = torch.tensor([50.0, 30.0, 20.0, 40.0], dtype=torch.float64)
    context = RoundContext(round_index=1, rounds=5, num_clients=4, participants=(0, 2), num_classes=C,
                           global_counts=global_counts, participant_counts=global_counts[None].repeat(2, 1) / 2,
                           classifier_weight=torch.randn(C, 6, generator=g), sampling_seed=seed)
    values = {k: v for k, v in context.values().items() if k != "fused"}  # the implementation stays the caller's
    return values | {"class_counts": torch.tensor(counts, dtype=torch.float64),
                     "global_params": [torch.randn(C, 6, generator=g)], "seed": seed}


def _call(term, logits, targets, teacher, params) -> torch.Tensor:
    return term(logits, targets, teacher_logits=teacher if term.needs_teacher else None,
                params=params if term.needs_params else None)


def _inputs(targets: list[int], scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = len(targets)
    if scale == EXTREME:  # every logit at ±1e4: softmax saturates, exp overflows if computed naively
        logits = (torch.randint(0, 2, (n, C), generator=g).double() * 2 - 1) * EXTREME
        teacher = (torch.randint(0, 2, (n, C), generator=g).double() * 2 - 1) * EXTREME
    else:
        logits, teacher = torch.randn(n, C, generator=g, dtype=torch.float64) * scale, torch.randn(n, C, generator=g,
                                                                                                    dtype=torch.float64)
    params = [torch.randn(C, 6, generator=g, dtype=torch.float64).requires_grad_()]
    return logits.float().requires_grad_(), torch.tensor(targets), teacher.float(), params


def check_loss_term(term: Any, params: dict[str, Any] | None = None, *, shift_invariant: bool = True) -> None:
    """Check a loss term, given by registered name or as its class/factory, created with
    ``params`` (its own parameters) and the round's setup values its constructor names.

    Properties: [scalar], [finite value], [finite gradient] in each case of ``CASES`` with normal
    and ±1e4 logits; [shift invariance] (a constant added to each row of logits changes nothing;
    pass ``shift_invariant=False`` for a term that is not a softmax loss); [state round trip]
    (a fresh term loaded with another's ``state_dict`` continues identically); [expression] (the
    term inside ``0.5*term + ce`` gives 0.5·term + ce).
    """
    params = dict(params or {})
    with registered(fedlt.losses.REGISTRY, term, "contract_term") as name:
        c = Contract(f"loss {name!r}")

        def make(counts: list[float], seed: int = 0):
            with c.property("construction"):
                return create_term(name, params, _setup(counts, seed))

        for case, (counts, targets) in CASES.items():
            for scale in (3.0, EXTREME):
                where = f"{case}, logits {'±1e4' if scale == EXTREME else 'N(0, 9)'}"
                t = make(counts)
                logits, y, teacher, weights = _inputs(targets, scale, seed=len(targets))
                with c.property("scalar"):
                    value = _call(t, logits, y, teacher, weights)
                c.check(isinstance(value, torch.Tensor) and value.dim() == 0, "scalar",
                        f"returned {type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))} ({where})")
                c.check(bool(torch.isfinite(value.detach())), "finite value", f"value {value.item()} ({where})")
                with c.property("finite gradient"):
                    value.backward()
                grads = [g for g in (logits.grad, *(w.grad for w in weights)) if g is not None]
                c.check(all(bool(torch.isfinite(g).all()) for g in grads), "finite gradient",
                        f"a gradient holds nan/inf ({where})")

        counts, targets = CASES["all classes present"]
        logits, y, teacher, weights = _inputs(targets, 3.0, seed=1)
        if shift_invariant:
            shift = torch.linspace(5, 50, len(targets))[:, None]  # one constant per row, not summing to 0
            a = _call(make(counts), logits.detach(), y, teacher, weights)
            b = _call(make(counts), logits.detach() + shift, y, teacher, weights)
            c.check(torch.allclose(a, b, rtol=1e-4, atol=1e-4), "shift invariance",
                    f"{a.item()} becomes {b.item()} when a constant is added to each row of logits "
                    "(pass shift_invariant=False for a term that is not a softmax loss)")

        # state: run a few steps, move the state to a fresh term, continue both identically
        first, second = make(counts, seed=3), make(counts, seed=3)
        batches = [_inputs(targets, 3.0, seed=10 + i) for i in range(4)]
        for lg, yy, tt, ww in batches[:3]:
            with c.property("state round trip"):
                _call(first, lg, yy, tt, ww).backward()
        with c.property("state round trip"):
            state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in first.state_dict().items()}
            second.load_state_dict(state)
        lg, yy, tt, ww = batches[3]
        lg2 = lg.detach().clone().requires_grad_()
        va, vb = _call(first, lg, yy, tt, ww), _call(second, lg2, yy, tt, ww)
        va.backward(), vb.backward()
        same_grad = (lg.grad is None and lg2.grad is None) or (
            lg.grad is not None and lg2.grad is not None and torch.equal(lg.grad, lg2.grad))
        c.check(torch.equal(va, vb) and same_grad, "state round trip",
                f"after load_state_dict the next value is {vb.item()} (gradient alike: {same_grad}), not {va.item()}")
        sa, sb = first.state_dict(), second.state_dict()
        same = sa.keys() == sb.keys() and all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)
        c.check(same, "state round trip", f"states differ after one more step (keys {sorted(sa)})")

        # inside an expression: registered under a temporary name with its parameters bound
        factory = functools.partial(fedlt.losses.REGISTRY.get(name), **params)
        with fedlt.losses.REGISTRY.temporary("contract_expression_term", factory):
            with c.property("expression"):
                objective = build("0.5*contract_expression_term + ce", **_setup(counts, 0))
                got = _call(objective, logits.detach(), y, teacher, weights)
            direct = 0.5 * _call(make(counts), logits.detach(), y, teacher, weights) \
                + fedlt.losses.create("ce")(logits.detach(), y)
            c.check(torch.allclose(got, direct, rtol=1e-5, atol=1e-6), "expression",
                    f"0.5*term + ce gives {got.item()}, not {direct.item()}")

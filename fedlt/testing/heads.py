"""The classifier-head contract (fedlt.models.heads): a head maps the representation to finite
logits, is built the same on every node, keeps its fixed part fixed through training, attaches
to a model in place of its classifier, and round-trips through ``state_dict``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import fedlt.models
from fedlt.models import heads
from fedlt.testing.base import Contract, registered

D, C, B = 12, 5, 7  # representation size, classes and batch of every case


def _check_declarations(c: Contract, provides: frozenset[str], head: Any, h: torch.Tensor,
                        logits: torch.Tensor) -> None:
    """[declares]: each capability the head's factory declares (fedlt.models.heads.CAPABILITIES) is true of it."""
    unknown = sorted(provides - set(heads.CAPABILITIES))
    c.check(not unknown, "declares", f"unknown capabilities {unknown} (known: {', '.join(heads.CAPABILITIES)})")
    if "in_features" in provides:
        c.check(getattr(head, "in_features", None) == D, "declares", f"in_features is not the input width {D}")
    if "linear" in provides:
        w, b = getattr(head, "weight", None), getattr(head, "bias", None)
        fits = isinstance(b, torch.Tensor) and tuple(w.shape) == (C, D) and tuple(b.shape) == (C,)
        c.check(fits and torch.allclose(logits, h @ w.t() + b, atol=1e-5), "declares",
                "'linear': the logits are not h·weightᵀ + bias with weight C×d and bias C")
    if "prototypes" in provides:
        c.check(any(t is head.weight for t in head.buffers()) and tuple(head.weight.shape) == (C, D), "declares",
                "'prototypes': weight is not a C×d buffer")
    if "etf" in provides:
        c.check(isinstance(getattr(head, "linear_proto", None), torch.nn.Linear)
                and isinstance(getattr(head, "proto", None), torch.Tensor), "declares",
                "'etf': no linear_proto projection and proto ETF")


def check_head(head: Any, params: dict[str, Any] | None = None) -> None:
    """Check a classifier head, given by registered name or as its factory, built for a
    d = 12 → C = 5 classifier with ``params``.

    Properties: [builds]; [logits] (a batch of representations gives finite (B, C) logits and
    the head's ``weight`` is C×d'); [same on every node] (two builds are identical: parameters and
    buffers); [fixed part stays fixed] (an SGD step on CE moves no buffer; every parameter and
    the representation get a finite gradient); [attaches] (on fedlt's ``mlp`` the model's logits come
    from the head and ``get_classifier()`` returns it); [state round trip] (a fresh head loaded
    with a trained one's ``state_dict`` gives the same logits); [declares] (what its factory's
    ``provides`` declares is true of it: ``in_features``, ``linear`` logits = h·Wᵀ + b, ...).
    """
    params = dict(params or {})
    with registered(heads.REGISTRY, head, "contract_head") as name:
        c = Contract(f"head {name!r}")
        spec = {"name": name, **params}
        with c.property("builds"):
            first, second = (heads.build_head(spec, D, C) for _ in range(2))
        a, b = first.state_dict(), second.state_dict()
        buffers_a, buffers_b = dict(first.named_buffers()), dict(second.named_buffers())
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and buffers_a.keys() == \
            buffers_b.keys() and all(torch.equal(buffers_a[k], buffers_b[k]) for k in buffers_a)
        c.check(same, "same on every node", "two builds of the same spec differ (seed what the head draws)")

        h = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
        y = torch.arange(B) % C
        with c.property("logits"):
            logits = first(h)
            weight = first.weight
        c.check(isinstance(logits, torch.Tensor) and tuple(logits.shape) == (B, C), "logits",
                f"a batch of {B} gave {tuple(getattr(logits, 'shape', ()))}, expected ({B}, {C})")
        c.check(bool(torch.isfinite(logits).all()), "logits", "non-finite logits")
        _check_declarations(c, heads.provided(name), first, h, logits)
        c.check(isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.shape[0] == C, "logits",
                f"weight has shape {tuple(getattr(weight, 'shape', ()))}, expected ({C}, d')")
        before = {k: v.clone() for k, v in first.named_buffers()}
        trainable = list(first.parameters())  # a wholly fixed head (FedLoGe's SSE-C) has none
        with c.property("fixed part stays fixed"):
            loss = F.cross_entropy(first(h.requires_grad_()), y)
            loss.backward()
            if trainable:
                torch.optim.SGD(trainable, lr=0.5).step()
        moved = [k for k, v in first.named_buffers() if not torch.equal(v, before[k])]
        c.check(not moved, "fixed part stays fixed", f"an SGD step moved the buffers {moved}")
        bad = [n for n, p in first.named_parameters() if p.grad is None or not bool(torch.isfinite(p.grad).all())]
        c.check(not bad, "fixed part stays fixed", f"parameters {bad} got no finite gradient")
        c.check(h.grad is not None and bool(torch.isfinite(h.grad).all()), "fixed part stays fixed",
                "the representation got no finite gradient through the head (the backbone could not learn)")
        h = h.detach()

        with c.property("attaches"):
            model = heads.attach(fedlt.models.build("mlp", in_chans=1, num_classes=C, image_size=4), spec)
            x = torch.randn(B, 1, 4, 4, generator=torch.Generator().manual_seed(1))
            out = model(x)
            attached = fedlt.models.classifier(model)
        c.check(type(attached) is type(first) and tuple(out.shape) == (B, C), "attaches",
                f"get_classifier() is {type(attached).__name__} and the logits have shape {tuple(out.shape)}")

        with c.property("state round trip"):
            fresh = heads.build_head(spec, D, C)
            fresh.load_state_dict(first.state_dict())
            same_logits = torch.equal(fresh(h), first(h))
        c.check(same_logits, "state round trip", "a fresh head loaded with a trained head's state_dict differs")

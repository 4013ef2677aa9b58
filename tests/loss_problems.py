"""Hypothesis strategies and helpers shared by the loss tests (test_losses*.py)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

F64 = torch.float64


@st.composite
def loss_problems(draw, counts_kind=None, min_classes=2, max_classes=7, max_batch=6):
    """Random (logits, teacher, targets, counts as a list) in float64, with the corner cases: zero
    counts, a single present class (``counts_kind`` "single"), equal counts ("equal"), many vacant
    classes ("many_vacant"), logits up to ±1e4 and, sometimes, every logit exactly ±1e4."""
    C = draw(st.integers(min_classes, max_classes))
    B = draw(st.integers(1, max_batch))
    kind = counts_kind or draw(st.sampled_from(["random", "random", "single", "many_vacant"]))
    if kind == "single":
        counts = [0] * C
        counts[draw(st.integers(0, C - 1))] = draw(st.integers(1, 50))
    elif kind == "equal":
        counts = [draw(st.integers(1, 50))] * C
    elif kind == "many_vacant":
        counts = [0] * C
        for c in draw(st.sets(st.integers(0, C - 1), min_size=1, max_size=max(1, C - 2))):
            counts[c] = draw(st.integers(1, 50))
    else:
        counts = draw(st.lists(st.integers(0, 50), min_size=C, max_size=C))
        if sum(counts) == 0:
            counts[draw(st.integers(0, C - 1))] = 1
    present = [c for c in range(C) if counts[c] > 0]
    targets = torch.tensor(draw(st.lists(st.sampled_from(present), min_size=B, max_size=B)))
    scale = draw(st.sampled_from([1.0, 10.0, 1e4]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(B, C, generator=gen, dtype=F64) * scale
    teacher = torch.randn(B, C, generator=gen, dtype=F64) * scale
    if draw(st.booleans()):  # the extreme corners: every logit exactly ±1e4
        logits = torch.where(logits >= 0, 1e4, -1e4).to(F64)
    return logits, teacher, targets, counts


def value_and_grad(fn, logits, *args, **kwargs):
    z = logits.detach().clone().requires_grad_(True)
    value = fn(z, *args, **kwargs)
    (grad,) = torch.autograd.grad(value, z, allow_unused=True)
    return value.detach(), (torch.zeros_like(z) if grad is None else grad)

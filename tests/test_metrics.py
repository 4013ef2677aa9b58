"""Evaluation metrics (SPEC §5) against direct counting."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.metrics import class_groups, classification_metrics


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 6), st.integers(1, 60), st.integers(0, 10_000))
def test_accuracy_balanced_and_per_class_match_counting(C, n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, C, (n,), generator=g)
    logits = torch.randn(n, C, generator=g)
    m = classification_metrics(logits, labels, C)
    pred = logits.argmax(1).tolist()
    ys = labels.tolist()
    assert abs(m["accuracy"] - sum(p == y for p, y in zip(pred, ys)) / n) < 1e-12
    per_class = []
    for c in range(C):
        rows = [i for i, y in enumerate(ys) if y == c]
        if rows:
            acc = sum(pred[i] == c for i in rows) / len(rows)
            per_class.append(acc)
            assert abs(m["per_class_accuracy"][c] - acc) < 1e-6
        else:
            assert m["per_class_accuracy"][c] is None
    assert abs(m["balanced_accuracy"] - sum(per_class) / len(per_class)) < 1e-12


def test_groups_by_count_and_by_cumulative_share():
    counts = np.array([500, 150, 100, 60, 20, 19, 3])
    g = class_groups(counts)
    assert g["many"].tolist() == [0, 1] and g["medium"].tolist() == [2, 3, 4] and g["few"].tolist() == [5, 6]
    shares = class_groups(np.array([70, 20, 5, 3, 2]), rule="share")
    # share held by the classes before each one: 0, .70, .90, .95, .98 (many < .75 <= medium < .95 <= few)
    assert shares["many"].tolist() == [0, 1] and shares["medium"].tolist() == [2] and shares["few"].tolist() == [3, 4]

"""Client test sets (SPEC §7) and the per-client numbers, against loops written from the SPEC."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt import client_tests, partitioners
from pydantic import ValidationError
from fedlt.metrics import class_groups, client_class_tallies, per_client_summary
from fedlt.testing import ContractError, check_client_test


@pytest.mark.parametrize("name", client_tests.list())
def test_every_registered_client_test_holds_the_contract(name):
    check_client_test(name)


def test_the_contract_rejects_a_scheme_that_trains_on_its_test_samples():
    class Leaky(client_tests.Holdout):
        def __call__(self, partition, y_train, y_test, seed):
            sets = super().__call__(partition, y_train, y_test, seed)
            sets.train_indices = [np.sort(np.concatenate([a, b])) for a, b in zip(sets.train_indices, sets.test_indices)]
            return sets

    with pytest.raises(ContractError, match="indices valid"):
        check_client_test(Leaky)


def _problem(seed: int, clients: int, classes: int):
    rng = np.random.default_rng(seed)
    y_train = rng.integers(0, classes, 400)
    y_train[:classes] = np.arange(classes)
    y_test = rng.integers(0, classes, 200)
    part = partitioners.create("dirichlet", beta=0.3)(y_train, clients, seed=seed)
    return part, y_train, y_test


def matched_reference(counts, y_test, size):
    """Per client and class, how many test samples SPEC §7 asks for and how many it gets."""
    wanted = np.zeros(counts.shape, dtype=np.int64)
    for k in range(counts.shape[0]):
        n_k = sum(int(v) for v in counts[k])
        largest = max(sum(int(v) for v in row) for row in counts)
        m = size if size is not None else n_k * min(largest, 500) / largest
        for c in range(counts.shape[1]):
            wanted[k, c] = math.floor(m * int(counts[k, c]) / n_k + 0.5)
    have = np.bincount(y_test, minlength=counts.shape[1])
    return wanted, np.minimum(wanted, have[None, :])


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 10**6), st.integers(2, 8), st.integers(2, 6), st.one_of(st.none(), st.integers(1, 120)))
def test_matched_sets_follow_each_clients_training_labels(seed, clients, classes, size):
    part, y_train, y_test = _problem(seed, clients, classes)
    sets = client_tests.create("matched", size=size)(part, y_train, y_test, seed)
    wanted, got = matched_reference(part.class_counts, y_test, size)
    for k, test in enumerate(sets.test_indices):
        assert np.array_equal(np.bincount(y_test[test], minlength=classes), got[k])
    assert sets.manifest["shortfall"] == int((wanted - got).sum())


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 10**6), st.integers(2, 8), st.integers(2, 6), st.floats(0.05, 0.95))
def test_holdout_moves_the_share_of_each_class_the_spec_names(seed, clients, classes, fraction):
    part, y_train, y_test = _problem(seed, clients, classes)
    sets = client_tests.create("holdout", fraction=fraction)(part, y_train, y_test, seed)
    for k, own in enumerate(part.client_indices):
        for c in range(classes):
            n = int((y_train[own] == c).sum())
            t = 0 if n < 2 else min(max(math.floor(fraction * n + 0.5), 1), n - 1)
            assert int((y_train[sets.test_indices[k]] == c).sum()) == t, (k, c, n)
    assert sets.manifest["train_sizes"] == [len(t) for t in sets.train_indices]


def test_one_clients_draw_does_not_move_anothers():
    part, y_train, y_test = _problem(3, 5, 4)
    full = client_tests.create("matched")(part, y_train, y_test, 7)
    fewer = partitioners.Partition(part.client_indices[:3], {**part.manifest, "class_counts": part.class_counts[:3].tolist()})
    sub = client_tests.create("matched", size=None)(fewer, y_train, y_test, 7)
    # the default size depends on the largest client, so compare with a fixed size
    a = client_tests.create("matched", size=30)(part, y_train, y_test, 7)
    b = client_tests.create("matched", size=30)(fewer, y_train, y_test, 7)
    assert all(np.array_equal(x, y) for x, y in zip(a.test_indices, b.test_indices))
    assert len(sub.test_indices) == 3 and len(full.test_indices) == 5


@pytest.mark.parametrize("bad", [{"fraction": 0.0}, {"fraction": 1.0}, {"fraction": True}, {"nope": 1}])
def test_bad_parameters_are_refused_naming_the_field(bad):
    """As for partitioners: a pydantic error naming the field, which the config boundary turns
    into one line (``registry.from_spec``)."""
    with pytest.raises(ValidationError, match=next(iter(bad))):
        client_tests.create("holdout", **bad)


# -- the per-client numbers --------------------------------------------------------------------
def summary_reference(correct, total, train_counts, worst_share=0.1):
    """SPEC §7 by loops over clients and classes, in float64."""
    accs, weighted_c, weighted_t = [], 0.0, 0.0
    groups = {"many": [], "medium": [], "few": []}
    for k in range(len(correct)):
        t = sum(float(v) for v in total[k])
        if t == 0:
            continue
        cor = sum(float(v) for v in correct[k])
        accs.append(cor / t)
        weighted_c, weighted_t = weighted_c + cor, weighted_t + t
        for g, members in class_groups(train_counts[k]).items():
            vals = [correct[k][c] / total[k][c] for c in members if total[k][c] > 0]
            if vals:
                groups[g].append(sum(vals) / len(vals))
    if not accs:
        return None
    mean = sum(accs) / len(accs)
    worst = sorted(accs)[: max(1, math.ceil(worst_share * len(accs)))]
    return {"mean_weighted": weighted_c / weighted_t, "mean": mean,
            "std": math.sqrt(sum((a - mean) ** 2 for a in accs) / len(accs)), "min": min(accs),
            "worst10": sum(worst) / len(worst), "clients": len(accs),
            **{g: (sum(v) / len(v) if v else None) for g, v in groups.items()}}


@settings(deadline=None, max_examples=60)
@given(st.integers(0, 10**6), st.integers(1, 25), st.integers(1, 7))
def test_per_client_summary_matches_the_loops(seed, clients, classes):
    rng = np.random.default_rng(seed)
    total = rng.integers(0, 6, (clients, classes)) * rng.integers(0, 2, (clients, classes))
    correct = rng.integers(0, total + 1)
    train = rng.integers(0, 200, (clients, classes))
    got = per_client_summary(correct, total, train, "p")
    want = summary_reference(correct, total, train)
    if want is None:
        assert got["p_mean"] is None and got["p_clients"] == 0
        return
    for key, value in want.items():
        if value is None:
            assert got[f"p_{key}"] is None, key
        else:
            assert got[f"p_{key}"] == pytest.approx(value, abs=1e-12), key


def test_worst10_is_the_mean_of_the_lowest_tenth_not_the_minimum():
    correct = np.array([[k] for k in range(20)])
    total = np.full((20, 1), 19)
    got = per_client_summary(correct, total, np.full((20, 1), 50), "p")
    assert got["p_worst10"] == pytest.approx(0.5 / 19) and got["p_min"] == 0.0  # clients 0 and 1


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 10**6), st.integers(1, 6), st.integers(1, 5))
def test_client_tallies_count_each_clients_own_test_samples(seed, clients, classes):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, 50)
    is_correct = rng.integers(0, 2, 50).astype(bool)
    sets = [np.sort(rng.choice(50, rng.integers(0, 20), replace=False)) for _ in range(clients)]
    correct, total = client_class_tallies(is_correct, labels, sets, classes)
    for k, test in enumerate(sets):
        for c in range(classes):
            assert total[k, c] == sum(1 for i in test if labels[i] == c)
            assert correct[k, c] == sum(1 for i in test if labels[i] == c and is_correct[i])

"""Aggregators (SPEC §4): identical models -> that model; order-independent; weights respected."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.aggregators import fedavg, mean
from fedlt.models.alexnet import MLP


def random_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "steps": torch.tensor(seed % 7)}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=6))
def test_identical_models_give_that_model_exactly(weights):
    state = MLP(12, 5, hidden=(7,)).state_dict()
    out = fedavg([(state, float(w)) for w in weights])
    assert all(torch.equal(out[k], state[k]) for k in state)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 500)), min_size=2, max_size=6), st.randoms())
def test_result_does_not_depend_on_client_order(clients, rnd):
    states = [(random_state(seed), float(w)) for seed, w in clients]
    shuffled = list(states)
    rnd.shuffle(shuffled)
    a, b = fedavg(states), fedavg(shuffled)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_weighted_mean_matches_float64_loop_and_integer_buffers_take_max():
    states = [(random_state(s), float(w)) for s, w in [(1, 10), (2, 30), (3, 60)]]
    out = fedavg(states)
    total = sum(w for _, w in states)
    for i in range(4):
        for j in range(3):
            want = sum(float(s["w"][i, j]) * w for s, w in states) / total
            assert abs(float(out["w"][i, j]) - want) < 1e-6
    assert int(out["steps"]) == max(int(s["steps"]) for s, _ in states)
    unweighted = mean(states)
    torch.testing.assert_close(unweighted["b"], torch.stack([s["b"] for s, _ in states]).mean(0))

"""Aggregators (SPEC §4): identical models -> that model; order-independent; weights respected;
server optimisers against float64 element loops; fedavgm(β=0, η=1) is fedavg bitwise; state
survives a checkpoint; buffers are fedavg; bad parameters are one line naming the field."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import fedlt.aggregators
from fedlt.aggregators import Aggregator, weighted_average
from fedlt.errors import FedltError, describe
from fedlt.models.alexnet import MLP
from fedlt.registry import create_from_spec

NAMES = ["fedavg", "mean", "fedavgm", "fedadagrad", "fedadam", "fedyogi", "fedexp"]
SERVER_OPTIMISERS = ["fedavgm", "fedadagrad", "fedadam", "fedyogi"]
TRAINABLE = ("w", "b")


def random_state(seed: int, like: dict[str, torch.Tensor] | None = None, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A client state: trainable 'w', 'b', a float buffer 'running' and an integer buffer 'steps';
    ``like`` + noise when given (a client that trained from the global model)."""
    g = torch.Generator().manual_seed(seed)
    noise = {"w": torch.randn(4, 3, generator=g) * scale, "b": torch.randn(3, generator=g) * scale,
             "running": torch.randn(3, generator=g)}
    base = like or {k: torch.zeros_like(v) for k, v in noise.items()}
    state = {k: base[k] + noise[k].to(base[k].dtype) for k in noise}
    state["steps"] = torch.tensor(seed % 7)
    return state


def run_rounds(agg: Aggregator, start: dict[str, torch.Tensor], rounds: list[list[tuple[int, float]]],
               shuffle=None, first_round: int = 0) -> list[dict[str, torch.Tensor]]:
    """Drive ``agg`` over ``rounds[first_round:]``, each a list of (client seed, weight); the clients
    train from the current global model. Returns the global state after each round."""
    x, history = start, []
    for r in range(first_round, len(rounds)):
        clients = rounds[r]
        results = [(random_state(1000 * r + seed, like=x, scale=0.1), w) for seed, w in clients]
        if shuffle is not None:
            shuffle(results)
        x = agg(x, results, TRAINABLE)
        history.append(x)
    return history


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as integers: equality is bitwise (it tells -0.0 from 0.0)."""
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])), k


rounds_strategy = st.lists(st.lists(st.tuples(st.integers(0, 999), st.integers(1, 500)), min_size=2, max_size=5),
                           min_size=1, max_size=3)


# -- fedavg / mean ----------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["fedavg", "mean"]), st.lists(st.integers(1, 10_000), min_size=1, max_size=6))
def test_identical_models_give_that_model_exactly(name, weights):
    state = MLP(12, 5, hidden=(7,)).state_dict()
    out = fedlt.aggregators.create(name)(state, [(state, float(w)) for w in weights], list(state))
    assert_bitwise(out, state)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 999), st.integers(1, 500)), min_size=1, max_size=5))
def test_fedavg_respects_the_weights_and_mean_ignores_them(clients):
    states = [(random_state(seed), float(w)) for seed, w in clients]
    out = fedlt.aggregators.create("fedavg")(states[0][0], states, TRAINABLE)
    total = sum(w for _, w in states)
    for name in ("w", "b", "running"):
        flat = [(s[name].double().flatten().tolist(), w) for s, w in states]
        want = [sum(v[i] * w for v, w in flat) / total for i in range(len(flat[0][0]))]
        assert out[name].flatten().double().tolist() == pytest.approx(want, abs=1e-6)
    assert int(out["steps"]) == max(int(s["steps"]) for s, _ in states)
    mean = fedlt.aggregators.create("mean")
    assert_bitwise(mean(states[0][0], states, TRAINABLE), mean(states[0][0], [(s, 1.0) for s, _ in states], TRAINABLE))


def test_unweighted_mean_is_the_plain_mean():
    states = [(random_state(s), float(w)) for s, w in [(1, 10), (2, 30), (3, 60)]]
    out = fedlt.aggregators.create("mean")(states[0][0], states, TRAINABLE)
    torch.testing.assert_close(out["b"], torch.stack([s["b"] for s, _ in states]).mean(0))


# -- every aggregator -------------------------------------------------------------------------------
def test_registry_lists_every_aggregator_and_creates_instances():
    assert [n for n in fedlt.aggregators.list() if fedlt.aggregators.REGISTRY.origin(n) == "built-in"] == sorted(NAMES)
    for name in NAMES:
        agg = fedlt.aggregators.create(name)
        assert isinstance(agg, fedlt.aggregators.get(name)) and isinstance(agg, Aggregator) and agg.name == name


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(NAMES), rounds_strategy, st.randoms())
def test_result_does_not_depend_on_client_order(name, rounds, rnd):
    start = random_state(7)
    a = run_rounds(fedlt.aggregators.create(name), start, rounds)
    b = run_rounds(fedlt.aggregators.create(name), start, rounds, shuffle=rnd.shuffle)
    for x, y in zip(a, b):
        assert_bitwise(x, y)


@pytest.mark.parametrize("name", SERVER_OPTIMISERS)
def test_buffers_are_fedavg_and_untouched_by_the_optimiser(name):
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = [n for n, _ in model.named_parameters()]
    assert "1.running_mean" in start and "1.num_batches_tracked" in start and "1.running_mean" not in trainable
    agg = fedlt.aggregators.create(name, eta=0.5)
    x = start
    for r in range(3):
        results = []
        for k, w in enumerate((3.0, 5.0, 11.0)):
            g = torch.Generator().manual_seed(10 * r + k)
            client = {n: (t + torch.randn(t.shape, generator=g) if t.is_floating_point() else t + k + r)
                      for n, t in x.items()}
            results.append((client, w))
        x_next = agg(x, results, trainable)
        plain = weighted_average(results)
        for n in x:
            same = torch.equal(bits(x_next[n]), bits(plain[n]))
            assert same == (n not in trainable), n  # buffers: fedavg exactly; parameters: moved by the optimiser
            assert x_next[n].dtype == x[n].dtype
        assert int(x_next["1.num_batches_tracked"]) == max(int(c["1.num_batches_tracked"]) for c, _ in results)
        x = x_next


# -- server optimisers against float64 element loops -------------------------------------------------
def reference(name: str, params: dict, start: dict, rounds_results: list) -> list[dict[str, list[float]]]:
    """Reddi et al. 2021 Algorithm 2 / Hsu et al. 2019, element by element in Python floats."""
    eta = params.get("eta", 1.0 if name == "fedavgm" else 0.01)
    beta = params.get("beta", 0.9)
    b1, b2, tau = params.get("beta1", 0.9), params.get("beta2", 0.99), params.get("tau", 1e-3)
    x = {n: start[n].double().flatten().tolist() for n in TRAINABLE}
    m = {n: [0.0] * len(x[n]) for n in TRAINABLE}
    v = {n: [0.0 if name == "fedavgm" else tau * tau] * len(x[n]) for n in TRAINABLE}
    history = []
    for results in rounds_results:
        total = sum(w for _, w in results)
        for n in TRAINABLE:
            clients = [(s[n].double().flatten().tolist(), w) for s, w in results]
            for i in range(len(x[n])):
                delta = sum(c[i] * w for c, w in clients) / total - x[n][i]
                if name == "fedavgm":
                    v[n][i] = beta * v[n][i] + delta
                    x[n][i] += eta * v[n][i]
                    continue
                m[n][i] = b1 * m[n][i] + (1 - b1) * delta
                d2 = delta * delta
                if name == "fedadagrad":
                    v[n][i] = v[n][i] + d2
                elif name == "fedadam":
                    v[n][i] = b2 * v[n][i] + (1 - b2) * d2
                else:  # fedyogi
                    sign = (v[n][i] > d2) - (v[n][i] < d2)
                    v[n][i] = v[n][i] - (1 - b2) * d2 * sign
                x[n][i] += eta * m[n][i] / (math.sqrt(v[n][i]) + tau)
        history.append({n: list(x[n]) for n in TRAINABLE})
    return history


@pytest.mark.parametrize("name,params", [
    ("fedavgm", {}), ("fedavgm", {"beta": 0.5, "eta": 0.7}),
    ("fedadagrad", {}), ("fedadagrad", {"eta": 0.05, "beta1": 0.8, "tau": 1e-2}),
    ("fedadam", {}), ("fedadam", {"eta": 0.05, "beta1": 0.8, "beta2": 0.95, "tau": 1e-2}),
    ("fedyogi", {}), ("fedyogi", {"eta": 0.05, "beta1": 0.8, "beta2": 0.95, "tau": 1e-2}),
])
def test_server_optimiser_matches_float64_loop_over_rounds(name, params):
    agg = fedlt.aggregators.create(name, **params)
    x = random_state(99)
    # clients' states change every round and are independent of the global model, so the
    # reference sees exactly the same inputs whatever the implementation did
    rounds_results = [[(random_state(100 * r + k, scale=0.3 + 0.2 * r), float(w))
                       for k, w in enumerate((5, 17, 40, 2)[: 2 + r % 3])] for r in range(5)]
    want = reference(name, params, x, rounds_results)
    for results, expected in zip(rounds_results, want):
        x = agg(x, results, TRAINABLE)
        for n in TRAINABLE:
            assert x[n].flatten().double().tolist() == pytest.approx(expected[n], abs=1e-6), n
            assert x[n].dtype == torch.float32


@settings(max_examples=15, deadline=None)
@given(rounds_strategy, st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_fedavgm_without_momentum_and_unit_lr_is_fedavg_bitwise(rounds, dtype):
    start = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in random_state(3).items()}
    momentum_free = run_rounds(fedlt.aggregators.create("fedavgm", beta=0.0, eta=1.0), start, rounds)
    plain = run_rounds(fedlt.aggregators.create("fedavg"), start, rounds)
    for a, b in zip(momentum_free, plain):
        assert_bitwise(a, b)


def test_fedavgm_keeps_the_sign_of_a_zero_average():
    """-0.0 in the average stays -0.0 (a naive avg + 0·Δ would give +0.0)."""
    x = {"w": torch.tensor([1.0, -1.0]), "b": torch.tensor([2.0, 0.5])}
    client = {"w": torch.tensor([-0.0, 0.0]), "b": torch.tensor([2.0, -0.0])}
    out = fedlt.aggregators.create("fedavgm", beta=0.0, eta=1.0)(x, [(client, 1.0), (client, 3.0)], TRAINABLE)
    assert_bitwise(out, fedlt.aggregators.create("fedavg")(x, [(client, 1.0), (client, 3.0)], TRAINABLE))


# -- state -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_state_survives_a_checkpoint_bitwise(name):
    rounds = [[(1, 10.0), (2, 30.0)], [(3, 5.0), (4, 1.0), (5, 9.0)], [(6, 2.0), (7, 2.0)], [(8, 4.0), (9, 7.0)]]
    start = random_state(11)
    uninterrupted = run_rounds(fedlt.aggregators.create(name), start, rounds)

    first = fedlt.aggregators.create(name)
    x = run_rounds(first, start, rounds[:2])[-1]
    buffer = io.BytesIO()
    torch.save({"aggregator": first.state_dict(), "model": x}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed = fedlt.aggregators.create(name)
    resumed.load_state_dict(checkpoint["aggregator"])
    continued = run_rounds(resumed, checkpoint["model"], rounds, first_round=2)
    for a, b in zip(uninterrupted[2:], continued):
        assert_bitwise(a, b)
    if name in SERVER_OPTIMISERS:  # the state matters: without it the run differs
        stateless = run_rounds(fedlt.aggregators.create(name), checkpoint["model"], rounds, first_round=2)
        assert not torch.equal(stateless[-1]["w"], uninterrupted[-1]["w"])
    else:
        assert first.state_dict() == {}


def test_load_state_dict_rejects_a_foreign_state():
    adam = fedlt.aggregators.create("fedadam")
    adam(random_state(1), [(random_state(2), 1.0)], TRAINABLE)
    with pytest.raises(FedltError, match=r"keys \['v'\], got \['m', 'v'\]"):
        fedlt.aggregators.create("fedavgm").load_state_dict(adam.state_dict())
    with pytest.raises(FedltError, match="no state"):
        fedlt.aggregators.create("fedavg").load_state_dict(adam.state_dict())
    with pytest.raises(FedltError, match=r"saved state for 'b' has shape \(3,\), the parameter \(5,\)"):
        resumed = fedlt.aggregators.create("fedadam")
        resumed.load_state_dict(adam.state_dict())
        resumed({"w": torch.zeros(4, 3), "b": torch.zeros(5)}, [({"w": torch.ones(4, 3), "b": torch.ones(5)}, 1.0)],
                TRAINABLE)


# -- parameters --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params,field", [
    ("fedavgm", {"eta": 0.0}, "eta"), ("fedavgm", {"beta": 1.0}, "beta"), ("fedavgm", {"beta": -0.1}, "beta"),
    ("fedadam", {"eta": -1e-3}, "eta"), ("fedadam", {"beta1": 1.0}, "beta1"), ("fedyogi", {"beta2": 1.5}, "beta2"),
    ("fedadagrad", {"tau": 0.0}, "tau"), ("fedyogi", {"tau": float("nan")}, "tau"),
    ("fedadam", {"eta": float("inf")}, "eta"), ("fedadam", {"lr": 0.1}, "lr"), ("fedavg", {"eta": 1.0}, "eta"),
])
def test_bad_parameters_are_one_line_naming_the_field(name, params, field):
    with pytest.raises(ValidationError) as exc:
        fedlt.aggregators.create(name, **params)
    line = describe(exc.value)
    assert "\n" not in line and line.startswith(f"{field}:")
    with pytest.raises(ValueError) as exc2:
        create_from_spec(fedlt.aggregators.REGISTRY, {"name": name, **params}, "aggregator")
    assert str(exc2.value) == f"{name}: {line}"

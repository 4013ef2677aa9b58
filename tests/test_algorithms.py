"""Algorithms: every registered one runs; the FedAvg family really uses its local objective."""

from __future__ import annotations

import json

import pytest
import torch

import fedlt.algorithms
import fedlt.datasets
from fedlt.algorithms.base import ClientData, LocalSchedule, RunContext, client_generator
from fedlt.algorithms.fedavg_family import local_update
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.models.alexnet import MLP

C = 10


@pytest.fixture(scope="module")
def mnist_clients() -> list[ClientData]:
    """Four clients of real MNIST with skewed labels (two or three classes each)."""
    data = fedlt.datasets.create("mnist")
    clients = []
    for cid, classes in enumerate([(0, 1), (2, 3, 4), (5, 6), (7, 8, 9)]):
        idx = torch.cat([torch.nonzero(data.y_train[:6000] == c).flatten()[:40] for c in classes])
        y = data.y_train[idx]
        clients.append(ClientData(cid, data.x_train[idx], y, torch.bincount(y, minlength=C)))
    return clients


def one_round(name: str, clients, **params) -> tuple[dict, object]:
    torch.manual_seed(0)
    init = MLP(784, C).state_dict()

    def build():
        model = MLP(784, C)
        model.load_state_dict(init)
        return model

    ctx = RunContext(num_classes=C, input_shape=(1, 28, 28), build_model=build, split=None, server_batch=64,
                     local_iters=3, local_epochs=None, batch_size=32, lr=0.05, momentum=0.9, weight_decay=5e-4,
                     clip=10.0, sampling_seed=0, device=torch.device("cpu"))
    algorithm = fedlt.algorithms.create(name, **params)
    algorithm.setup(ctx)
    algorithm.train_round(0, clients)
    return {k: v.clone() for k, v in algorithm.global_model().state_dict().items()}, algorithm


def differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["fedprox", "fedlogit", "fedlc", "fedvls", "fedgrab"])
def test_each_family_member_changes_the_model_differently_from_fedavg(name, mnist_clients):
    baseline, _ = one_round("fedavg", mnist_clients)
    params = {"loss": "ce + fedprox(mu=1.0)"} if name == "fedprox" else {}  # the default mu barely moves weights
    other, _ = one_round(name, mnist_clients, **params)
    assert differs(baseline, other)


def test_fedprox_with_mu_zero_is_fedavg(mnist_clients):
    baseline, _ = one_round("fedavg", mnist_clients)
    same, _ = one_round("fedprox", mnist_clients, loss="ce + fedprox(mu=0)")
    assert not differs(baseline, same)


def test_fedgrab_keeps_sgb_state_per_client_across_rounds(mnist_clients):
    _, algorithm = one_round("fedgrab", mnist_clients)
    states = algorithm._client_states
    assert set(states) == {c.cid for c in mnist_clients}
    first = {cid: {k: v.clone() if torch.is_tensor(v) else v for k, v in _flat(s).items()} for cid, s in states.items()}
    assert any(torch.is_tensor(v) and v.abs().sum() > 0 for v in first[0].values())  # pos/neg collected
    algorithm.train_round(1, mnist_clients[:2])
    assert differs(_tensors(first[0]), _tensors(_flat(algorithm._client_states[0])))  # moved on
    assert not differs(_tensors(first[3]), _tensors(_flat(algorithm._client_states[3])))  # not sampled: kept


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _tensors(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if torch.is_tensor(v)}


def test_local_update_is_a_pure_function(mnist_clients):
    model = MLP(784, C)
    global_state = {k: v.clone() for k, v in MLP(784, C).state_dict().items()}
    frozen = {k: v.clone() for k, v in global_state.items()}
    schedule = LocalSchedule(16, epochs=2, lr=0.05)
    data = mnist_clients[1]
    runs = [local_update(model, global_state, data, {}, "fedgrab", schedule, client_generator(0, 3, data.cid), C,
                         seed=7) for _ in range(2)]
    (w1, s1, m1), (w2, s2, m2) = runs
    assert not differs(w1, w2) and m1 == m2
    assert not differs(_tensors(_flat(s1)), _tensors(_flat(s2)))
    assert not differs(global_state, frozen)  # the received weights are not modified
    # epoch-based schedule: 2 epochs of ceil(120 / 16) = 8 batches
    assert m1["steps"] == 2 * 8


def test_iteration_schedule_draws_without_replacement_then_reshuffles():
    schedule = LocalSchedule(4, iters=5)
    batches = list(schedule.batches(10, torch.Generator().manual_seed(0)))
    assert [len(b) for b in batches] == [4] * 5
    first_pass = torch.cat(batches[:2])
    assert len(set(first_pass.tolist())) == 8  # no repeats before the permutation is exhausted


@pytest.mark.parametrize("name", fedlt.algorithms.list())
def test_every_registered_algorithm_runs_two_rounds_on_mnist(name, tmp_path):
    config = RunConfig(algorithm=name, rounds=2, eval_every=1, clients=6, participation=0.5, train_limit=1200, test_limit=300,
                       local_iters=2, server_batch=64, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5},
                       out=tmp_path / name)
    summary = run(config)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(0 <= r["accuracy"] <= 1 and r["loss"] == r["loss"] for r in rows)
    assert summary["rounds"] == 2

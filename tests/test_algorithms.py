"""Algorithms: every registered one runs; the FedAvg family really uses its local objective."""

from __future__ import annotations

import json

import pytest
import torch

import fedlt.algorithms
import fedlt.datasets
from fedlt.algorithms.base import ClientData, LocalSchedule, RunContext
from fedlt.algorithms.split import classifier_of
from fedlt.context import ModelSpec, RoundContext
from fedlt.engine import train_round
from fedlt.algorithms.fedavg_family import client_update
from fedlt.algorithms.protocol import ClientStates, ClientTask
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.models.alexnet import MLP

import cheap

C = 10
STATES: dict[int, ClientStates] = {}  # id(algorithm) -> the engine's client-state store
CONTEXTS: dict[int, RunContext] = {}  # id(algorithm) -> its run context


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
    STATES[id(algorithm)] = ClientStates()  # the engine's store, kept beside the algorithm for these tests
    CONTEXTS[id(algorithm)] = ctx
    train_round(algorithm, ctx, 0, clients, STATES[id(algorithm)])
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
    states = STATES[id(algorithm)]
    assert set(states) == {c.cid for c in mnist_clients}
    first = {cid: {k: v.clone() if torch.is_tensor(v) else v for k, v in _flat(states.get(cid)).items()}
             for cid in states}
    assert any(torch.is_tensor(v) and v.abs().sum() > 0 for v in first[0].values())  # pos/neg collected
    train_round(algorithm, CONTEXTS[id(algorithm)], 1, mnist_clients[:2], states)
    assert differs(_tensors(first[0]), _tensors(_flat(states.get(0))))  # moved on
    assert not differs(_tensors(first[3]), _tensors(_flat(states.get(3))))  # not sampled: kept


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _tensors(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if torch.is_tensor(v)}


def fedgrab_task(data: ClientData, global_state: dict) -> ClientTask:
    model = MLP(784, C)
    model.load_state_dict(global_state)
    context = RoundContext(round_index=3, rounds=5, num_clients=4, participants=(data.cid,), num_classes=C,
                           global_counts=data.class_counts, participant_counts=data.class_counts[None],
                           classifier_weight=classifier_of(model), sampling_seed=7, model=ModelSpec("mlp", 1, C, 28))
    return ClientTask(data.cid, context, global_state, data, {}, LocalSchedule(16, epochs=2, lr=0.05), "fedgrab")


def test_client_update_is_a_pure_function_of_its_task(mnist_clients):
    model = MLP(784, C)
    global_state = {k: v.clone() for k, v in MLP(784, C).state_dict().items()}
    frozen = {k: v.clone() for k, v in global_state.items()}
    task = fedgrab_task(mnist_clients[1], global_state)
    first, second = client_update(task, model), client_update(task, model)
    assert not differs(first.weights, second.weights) and first.train_loss == second.train_loss
    assert not differs(_tensors(_flat(first.state)), _tensors(_flat(second.state)))
    assert _tensors(_flat(first.state))  # Fed-GraB's collector state came back
    assert not differs(global_state, frozen)  # the received weights are not modified
    # epoch-based schedule: 2 epochs of ceil(120 / 16) = 8 batches
    assert first.steps == 2 * 8
    # a work module that already trained another client changes nothing (it holds no state)
    client_update(fedgrab_task(mnist_clients[2], global_state), model)
    third = client_update(task, model)
    assert not differs(first.weights, third.weights)


def test_client_update_gives_the_same_result_in_a_fresh_process(mnist_clients, tmp_path):
    import pickle
    import subprocess
    import sys

    global_state = {k: v.clone() for k, v in MLP(784, C).state_dict().items()}
    task = fedgrab_task(mnist_clients[0], global_state)
    here = client_update(task)  # no work module: built from the task's ModelSpec, as on another node
    (tmp_path / "task.pkl").write_bytes(pickle.dumps(task))
    script = ("import pickle, sys, torch; from fedlt.algorithms.fedavg_family import client_update; "
              "torch.set_num_threads(int(sys.argv[3])); "  # as here: float reductions split by thread
              "task = pickle.load(open(sys.argv[1], 'rb')); r = client_update(task); "
              "torch.save({'weights': r.weights, 'state': r.state, 'loss': r.train_loss}, sys.argv[2])")
    subprocess.run([sys.executable, "-c", script, tmp_path / "task.pkl", tmp_path / "out.pt", str(torch.get_num_threads())],
                   check=True, timeout=120)
    there = torch.load(tmp_path / "out.pt", weights_only=True)
    assert not differs(here.weights, there["weights"]) and here.train_loss == there["loss"]
    assert not differs(_tensors(_flat(here.state)), _tensors(_flat(there["state"])))


def test_iteration_schedule_draws_without_replacement_then_reshuffles():
    schedule = LocalSchedule(4, iters=5)
    batches = list(schedule.batches(10, torch.Generator().manual_seed(0)))
    assert [len(b) for b in batches] == [4] * 5
    first_pass = torch.cat(batches[:2])
    assert len(set(first_pass.tolist())) == 8  # no repeats before the permutation is exhausted


@pytest.mark.parametrize("name", fedlt.algorithms.list())
def test_every_registered_algorithm_runs_two_rounds_on_mnist(name, tmp_path):
    # the default model (AlexNet) at the least cost that runs every step: two rounds of two clients
    # (an aggregation of two), one local step each, small batches and 20 test images (AlexNet's
    # 3.4M weights, not its batches, set the cost of a step); the MLP runs of the algorithm contract
    # (tests/test_contracts.py) check the same two rounds' metrics and an exact resume on top
    config = RunConfig(algorithm=name, algorithm_params=cheap.params(name),  # tests/cheap.py
                       rounds=2, eval_every=1, clients=4, participation=0.5, train_limit=200, test_limit=20,
                       local_iters=1, server_batch=8, batch_size=8,
                       partition={"name": "dirichlet", "beta": 0.5, "min_size": 5}, out=tmp_path / name)
    summary = run(config)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(0 <= r["accuracy"] <= 1 and r["loss"] == r["loss"] for r in rows)
    assert summary["rounds"] == 2


def test_posthoc_tau_norm_is_reported_beside_the_raw_model(tmp_path):
    """The tau_norm_* fields are the accuracy of the tau-normalised checkpointed global model,
    recomputed here by hand (classifier rows divided by their norms, bias dropped)."""
    import fedlt.io
    from fedlt.metrics import predict

    config = RunConfig(algorithm="fedavg", model="mlp", rounds=1, clients=4, participation=1.0, train_limit=800,
                       test_limit=300, partition={"name": "iid"}, posthoc=["tau_norm"], out=tmp_path / "run")
    run(config)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    model = MLP(784, C)
    model.load_state_dict(fedlt.io.load_checkpoint(tmp_path / "run" / "checkpoint.pt")["algorithm"]["model"])
    head = model.get_classifier()
    with torch.no_grad():
        head.weight.div_(head.weight.norm(dim=1, keepdim=True))
        head.bias.zero_()
    data = fedlt.datasets.create("mnist").limit(None, 300)
    want = float((predict(model, data.x_test, 300, "cpu").argmax(1) == data.y_test).double().mean())
    assert row["tau_norm_accuracy"] == pytest.approx(want, abs=1e-12)
    assert "accuracy" in row and "tau_norm_balanced_accuracy" in row

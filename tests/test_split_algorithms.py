"""Split learning's mechanics beyond the numbers: SCALA's composable losses on both sides, BatchNorm,
teachers, weight terms, refusals. The rounds of SplitFed V1/V2/V3 and SFL-LocalLoss are checked
against float64 references in test_splitfed_reference.py (SCALA's in test_scala.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import fedlt.algorithms
from fedlt.algorithms.base import ClientData, RunContext
from fedlt.algorithms.split import classifier_of
from fedlt.engine import train_round
from fedlt.algorithms.protocol import ClientStates
from fedlt.algorithms.split import SplitLearning, SplitStrategy
from fedlt.algorithms.split_client import ActivationClient
from fedlt.algorithms.split_server import CopiesServer
from fedlt.errors import FedltError
from fedlt.models.alexnet import AlexNet

C = 10
STATES: dict[int, ClientStates] = {}  # id(algorithm) -> the engine's client-state store


def clients_with(seed: int = 0, sizes=(12, 20, 8)) -> list[ClientData]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for cid, n in enumerate(sizes):
        y = torch.randint(0, 3 + 2 * cid, (n,), generator=g) % C
        out.append(ClientData(cid, torch.randn(n, 1, 28, 28, generator=g), y, torch.bincount(y, minlength=C)))
    return out


class BNNet(nn.Module):
    """A small conv net with BatchNorm on both sides of its cut ``act`` (split by torch.fx)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn(self.conv(x)))
        return self.fc(self.pool(torch.relu(self.bn2(self.conv2(x)))).flatten(1))

    def get_classifier(self) -> nn.Linear:
        return self.fc


def make(name: str, local_iters: int = 2, model_state=None, net=AlexNet, split="s2", **params) -> SplitLearning:
    if model_state is None:
        torch.manual_seed(0)
        model_state = (net(1, C) if net is AlexNet else net()).state_dict()

    def build():
        model = net(1, C) if net is AlexNet else net()
        model.load_state_dict(model_state)
        return model

    ctx = RunContext(num_classes=C, input_shape=(1, 28, 28), build_model=build, split=split, server_batch=24,
                     local_iters=local_iters, local_epochs=None, batch_size=0, lr=0.05, momentum=0.9,
                     weight_decay=5e-4, clip=10.0, sampling_seed=0, device=torch.device("cpu"))
    algorithm = fedlt.algorithms.create(name, **params)
    algorithm.setup(ctx)
    STATES[id(algorithm)] = ClientStates()  # the engine's store, kept beside the algorithm for these tests
    CONTEXTS[id(algorithm)] = ctx
    return algorithm


CONTEXTS: dict[int, RunContext] = {}


def train(algorithm: SplitLearning, round_index: int, clients: list[ClientData]) -> None:
    train_round(algorithm, CONTEXTS[id(algorithm)], round_index, clients, STATES[id(algorithm)])


def server(algorithm: SplitLearning) -> nn.Module:
    return algorithm.strategy.server.module


def client_part(algorithm: SplitLearning) -> nn.Module:
    return algorithm.strategy.client_side


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_v1_equals_v2_for_a_single_client_in_the_first_round():
    """A single server copy trained on one client's batches is the sequential server."""
    a, b = make("splitfed_v1"), make("splitfed_v2")
    clients = clients_with(sizes=(16,))
    train(a, 0, clients)
    train(b, 0, clients)
    assert not differs(snapshot(a.global_model()), snapshot(b.global_model()))


@pytest.mark.parametrize("client_loss", ["fedvls", "logit_adjust + 0.5*fedlc", "fedgrab"])
def test_scala_with_another_client_loss_changes_the_client_update_only(client_loss):
    clients = clients_with()
    default = make("scala", local_iters=1)
    other = make("scala", local_iters=1, client_loss=client_loss)
    train(default, 0, clients)
    train(other, 0, clients)
    assert differs(snapshot(client_part(default)), snapshot(client_part(other)))
    # with T=1 the server step uses the server loss only, at the same pre-step weights
    assert not differs(snapshot(server(default)), snapshot(server(other)))


def test_scala_client_side_weight_term_pulls_clients_towards_the_global_model():
    """fedprox on SCALA's client side acts on the client weights directly (the server never sees
    it): with a huge mu the client parts stay closer to where the round started."""
    clients = clients_with()
    start = snapshot(client_part(make("scala")))
    plain, prox = make("scala", local_iters=3), make("scala", local_iters=3, client_loss="logit_adjust + fedprox(mu=5)")
    train(plain, 0, clients)
    train(prox, 0, clients)

    def distance(algorithm):
        end = snapshot(client_part(algorithm))
        return sum(float((end[k] - start[k]).pow(2).sum()) for k in start)

    assert distance(prox) < distance(plain)


def test_split_algorithms_refuse_epoch_based_local_training():
    torch.manual_seed(0)
    state = AlexNet(1, C).state_dict()
    ctx = RunContext(num_classes=C, input_shape=(1, 28, 28), build_model=lambda: AlexNet(1, C), split="s2",
                     server_batch=24, local_iters=2, local_epochs=1, batch_size=8, lr=0.05, momentum=0.9,
                     weight_decay=5e-4, clip=10.0, sampling_seed=0, device=torch.device("cpu"))
    assert state  # the model builds; only the schedule is refused
    with pytest.raises(FedltError, match="local_epochs"):
        fedlt.algorithms.create("scala").setup(ctx)


# -- any loss on the server side ----------------------------------------------------------------
@pytest.mark.parametrize("server_loss", ["fedvls", "fedgrab", "logit_adjust + fedprox(mu=0.5)", "ce + sgb"])
@pytest.mark.parametrize("name", ["scala", "splitfed_v1", "splitfed_v2"])
def test_the_server_side_takes_any_loss_expression_and_really_uses_it(name, server_loss):
    other = make(name, local_iters=2, server_loss=server_loss)
    train(other, 0, clients_with())
    assert differs(default_server_after_a_round(name), snapshot(server(other)))


@functools.cache  # only read: trained once per algorithm, not once per server loss (-5 s)
def default_server_after_a_round(name: str) -> dict[str, torch.Tensor]:
    default = make(name, local_iters=2)
    train(default, 0, clients_with())
    return snapshot(server(default))


def test_the_server_side_sgb_state_persists_across_iterations_rounds_and_checkpoints():
    clients = clients_with()
    algorithm = make("scala", local_iters=3, server_loss="ce + sgb")
    train(algorithm, 0, clients)
    state = algorithm.state_dict()["server_side"]["loss_state"]
    steps = {k: int(v) for k, v in state.items() if k.endswith(".steps")}
    assert list(steps.values()) == [3]  # one server forward per local iteration, one state
    train(algorithm, 1, clients)
    assert [int(v) for k, v in algorithm.state_dict()["server_side"]["loss_state"].items() if k.endswith(".steps")] == [6]
    resumed = make("scala", local_iters=3, server_loss="ce + sgb")
    resumed.load_state_dict(algorithm.state_dict())  # in memory: nothing may stay shared with the source
    train(algorithm, 2, clients)
    train(resumed, 2, clients)
    assert not differs(snapshot(algorithm.global_model()), snapshot(resumed.global_model()))


def test_a_server_loss_that_cannot_work_on_the_model_fails_at_setup():
    """fedgrab's DPA prior reads the classifier: a model without get_classifier is refused when
    the algorithm is set up (before a run writes anything), not inside round 1."""

    class NoHead(BNNet):
        get_classifier = None

    with pytest.raises(FedltError, match="fedgrab.*needs classifier_weight"):
        make("scala", net=NoHead, split="act", server_loss="fedgrab")


# -- BatchNorm -----------------------------------------------------------------------------------
def test_the_teacher_is_the_round_start_global_model_in_eval_mode_and_moves_no_statistics():
    """The client computes the received client part on its inputs, the server finishes the
    forward with its round-start weights: together the global model in eval mode."""
    import copy

    algorithm = make("scala", net=BNNet, split="act", client_loss="fedvls")
    clients = clients_with()
    train(algorithm, 0, clients)  # BatchNorm statistics away from their initial values
    model = copy.deepcopy(algorithm.global_model())
    round = CONTEXTS[id(algorithm)].round(1, clients, classifier_of(algorithm.global_model()))
    tasks = algorithm.strategy.configure(round, clients, STATES[id(algorithm)])
    idx, _, _ = next(ActivationClient(tasks[0], client_part(algorithm)).batches)  # the same stream, replayed
    session = ActivationClient(tasks[0], client_part(algorithm))
    before = snapshot(algorithm.global_model())
    upload = session.forward()
    side = algorithm.strategy.server
    side.begin_round(round, tasks)
    got = side.teacher(upload.teacher_activations)
    model.eval()
    with torch.no_grad():
        want = model(clients[0].x[idx])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not differs(before, snapshot(algorithm.global_model())) and algorithm.global_model().training


@pytest.mark.parametrize("name", ["scala", "splitfed_v1"])
def test_batchnorm_statistics_are_averaged_by_data_size_with_the_parameters(name, monkeypatch):
    """Client side (all algorithms) and server copies (V1/V3): parameters AND BatchNorm running
    statistics are averaged weighted by |D_k|; num_batches_tracked is a count, not averaged."""
    algorithm = make(name, net=BNNet, split="act")
    clients = clients_with(sizes=(12, 30, 6))
    captured = {"servers": None}
    original_aggregate, original_end = SplitStrategy.aggregate, CopiesServer.end_round

    def spy_aggregate(self, round_index, results):
        captured["clients"] = [{k: v.clone() for k, v in r.weights.items()} for r in results]
        return original_aggregate(self, round_index, results)

    def spy_end(self):
        captured["servers"] = [{k: v.clone() for k, v in s.state().items()} for s in self.servers]
        return original_end(self)

    monkeypatch.setattr(SplitStrategy, "aggregate", spy_aggregate)
    monkeypatch.setattr(CopiesServer, "end_round", spy_end)
    train(algorithm, 0, clients)
    weights = [len(c) / 48 for c in clients]
    sides = [(captured["clients"], client_part(algorithm).state_dict())]
    if captured["servers"] is not None:
        sides.append((captured["servers"], server(algorithm).state_dict()))
    for copies, merged in sides:
        stats = [k for k in merged if "running_" in k]
        assert stats and differs({k: copies[0][k] for k in stats}, {k: copies[1][k] for k in stats})
        for key, value in merged.items():
            if key.endswith("num_batches_tracked"):
                assert int(value) == max(int(c[key]) for c in copies)
                continue
            want = torch.zeros_like(value, dtype=torch.float64)
            for w, c in zip(weights, copies):  # float64 loop, independent of the aggregator
                want += w * c[key].double()
            torch.testing.assert_close(value.double(), want, atol=1e-6, rtol=0)


def test_v3_weight_terms_anchor_at_each_clients_own_round_start_weights():
    """SplitFed V3 with FedProx: each client's anchor is its own kept part, not the participants'
    average. With T = 1 the only step of a round starts at the anchor, where the proximal gradient
    is 0, so adding fedprox changes nothing — in round 2 too, when own parts and their average differ."""
    plain, prox = make("splitfed_v3", local_iters=1), make("splitfed_v3", local_iters=1, client_loss="ce + fedprox(mu=1)")
    clients = clients_with()
    for round_index in range(2):
        train(plain, round_index, clients)
        train(prox, round_index, clients)
    for c in clients:
        own_plain = STATES[id(plain)].get(c.cid)["client_model"]
        own_prox = STATES[id(prox)].get(c.cid)["client_model"]
        assert not differs(own_plain, own_prox)
    # the parts did diverge, so an anchor at their average would have pulled them
    kept = [STATES[id(plain)].get(c.cid)["client_model"] for c in clients]
    assert differs(kept[0], kept[1])


def test_scala_with_a_distilling_client_loss_when_only_some_clients_distil(tmp_path, one_thread):
    """fedvls's vacant_kd needs the teacher only for clients with two or more vacant classes: a
    round mixing such clients with others concatenates the teacher activations of those alone."""
    import numpy as np

    from fedlt.config import RunConfig
    from fedlt.engine import prepare, run

    config = RunConfig(algorithm="scala", algorithm_params={"client_loss": "fedvls(lam=0.1)"}, rounds=1,
                       partition={"name": "dirichlet", "beta": 0.1, "min_size": 10}, clients=5, participation=1.0,
                       train_limit=1000, test_limit=100, local_iters=1, server_batch=24, out=tmp_path / "run")
    vacant = (np.asarray(prepare(config).partition.class_counts) == 0).sum(axis=1)
    assert (vacant >= 2).any() and (vacant <= 1).any(), vacant  # the mix this test is about
    summary = run(config)
    assert summary["rounds"] == 1

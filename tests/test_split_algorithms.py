"""SplitFed V1/V2/V3, SFL-LocalLoss and SCALA's composable losses: the mechanics each one claims."""

from __future__ import annotations

import pytest
import torch

import fedlt.algorithms
from fedlt.algorithms.base import ClientData, RunContext
from fedlt.algorithms.split import PersistentServer, Replica, SplitLearning
from fedlt.models.alexnet import AlexNet

C = 10


def clients_with(seed: int = 0, sizes=(12, 20, 8)) -> list[ClientData]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for cid, n in enumerate(sizes):
        y = torch.randint(0, 3 + 2 * cid, (n,), generator=g) % C
        out.append(ClientData(cid, torch.randn(n, 1, 28, 28, generator=g), y, torch.bincount(y, minlength=C)))
    return out


def make(name: str, local_iters: int = 2, model_state=None, **params) -> SplitLearning:
    if model_state is None:
        torch.manual_seed(0)
        model_state = AlexNet(1, C).state_dict()

    def build():
        net = AlexNet(1, C)
        net.load_state_dict(model_state)
        return net

    ctx = RunContext(num_classes=C, input_shape=(1, 28, 28), build_model=build, split="s2", server_batch=24,
                     local_iters=local_iters, local_epochs=None, batch_size=0, lr=0.05, momentum=0.9,
                     weight_decay=5e-4, clip=10.0, sampling_seed=0, device=torch.device("cpu"))
    algorithm = fedlt.algorithms.create(name, **params)
    algorithm.setup(ctx)
    return algorithm


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_v2_updates_one_server_once_per_client_batch_in_sequence(monkeypatch):
    algorithm = make("splitfed_v2", local_iters=3)
    clients = clients_with()
    seen: list[int] = []
    original = SplitLearning._server_step

    def spy(self, server, activations, *args):
        assert isinstance(server, PersistentServer) and len(activations) == 1
        seen.append(args[3][0])  # client_ids: the client index of this server step
        return original(self, server, activations, *args)

    monkeypatch.setattr(SplitLearning, "_server_step", spy)
    algorithm.train_round(0, clients)
    assert seen == [0, 1, 2] * 3  # each client's batch in turn, every iteration


def test_v1_and_v3_average_the_server_copies_weighted_by_data_size(monkeypatch):
    for name in ("splitfed_v1", "splitfed_v3"):
        algorithm = make(name)
        clients = clients_with()
        captured = {}
        original = SplitLearning._finish_round

        def spy(self, clients_, replicas, servers, objectives):
            captured["servers"] = [s.state() for s in servers]
            return original(self, clients_, replicas, servers, objectives)

        monkeypatch.setattr(SplitLearning, "_finish_round", spy)
        algorithm.train_round(0, clients)
        copies = captured["servers"]
        assert len(copies) == len(clients) and differs(copies[0], copies[1])
        sizes = torch.tensor([len(c) for c in clients], dtype=torch.float64)
        for key, value in algorithm._server.state_dict().items():
            want = sum(w * s[key].double() for w, s in zip(sizes / sizes.sum(), copies))
            torch.testing.assert_close(value.double(), want, atol=1e-6, rtol=0)
        monkeypatch.undo()


def test_v1_equals_v2_for_a_single_client_in_the_first_round():
    """A single server copy trained on one client's batches is the sequential server."""
    a, b = make("splitfed_v1"), make("splitfed_v2")
    clients = clients_with(sizes=(16,))
    a.train_round(0, clients)
    b.train_round(0, clients)
    assert not differs(snapshot(a.global_model()), snapshot(b.global_model()))


def test_v3_keeps_distinct_client_models_across_rounds(monkeypatch):
    algorithm = make("splitfed_v3")
    clients = clients_with()
    algorithm.train_round(0, clients)
    kept = [algorithm._client_states[c.cid]["client_model"] for c in clients]
    assert differs(kept[0], kept[1]) and differs(kept[1], kept[2])
    starts = []
    original_init = Replica.__init__

    def spy(self, module, start, schedule):
        starts.append(start)
        original_init(self, module, start, schedule)

    monkeypatch.setattr(Replica, "__init__", spy)
    algorithm.train_round(1, clients)
    for own, start in zip(kept, starts):  # each client resumed from its own model, not an average
        assert not differs(own, start)


def test_local_loss_clients_get_no_gradient_from_the_server():
    """Perturbing the server changes nothing on the client side: no gradient flows back."""
    clients = clients_with()
    a = make("sfl_localloss")
    b = make("sfl_localloss")
    with torch.no_grad():
        for p in b._server.parameters():
            p.add_(torch.randn_like(p))
    a.train_round(0, clients)
    b.train_round(0, clients)
    assert not differs(snapshot(a._client_side), snapshot(b._client_side))
    assert differs(snapshot(a._server), snapshot(b._server))
    # while in SplitFed V2 the same perturbation does reach the clients
    c, d = make("splitfed_v2"), make("splitfed_v2")
    with torch.no_grad():
        for p in d._server.parameters():
            p.add_(torch.randn_like(p))
    c.train_round(0, clients)
    d.train_round(0, clients)
    assert differs(snapshot(c._client), snapshot(d._client))


@pytest.mark.parametrize("client_loss", ["fedvls", "logit_adjust + 0.5*fedlc", "fedgrab"])
def test_scala_with_another_client_loss_changes_the_client_update_only(client_loss):
    clients = clients_with()
    default = make("scala", local_iters=1)
    other = make("scala", local_iters=1, client_loss=client_loss)
    default.train_round(0, clients)
    other.train_round(0, clients)
    assert differs(snapshot(default._client), snapshot(other._client))
    # with T=1 the server step uses the server loss only, at the same pre-step weights
    assert not differs(snapshot(default._server), snapshot(other._server))


def test_scala_client_side_weight_term_pulls_clients_towards_the_global_model():
    """fedprox on SCALA's client side acts on the client weights directly (the server never sees
    it): with a huge mu the client parts stay closer to where the round started."""
    clients = clients_with()
    start = snapshot(make("scala")._client)
    plain, prox = make("scala", local_iters=3), make("scala", local_iters=3, client_loss="logit_adjust + fedprox(mu=5)")
    plain.train_round(0, clients)
    prox.train_round(0, clients)

    def distance(algorithm):
        end = snapshot(algorithm._client)
        return sum(float((end[k] - start[k]).pow(2).sum()) for k in start)

    assert distance(prox) < distance(plain)

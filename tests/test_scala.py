"""SCALA's fused step (one server forward on the concatenation) against the authors' way.

The reference below shares no code with fedlt's engine: one server forward per client for that
client's gradient, one on the concatenation for the server's, logit adjustment written out as
log-softmax by hand, SGD written out by hand, and client averaging by |D_k| in a loop.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fedlt.algorithms.base import ClientData, RunContext
from fedlt.algorithms.split import Replica, SplitLearning
from fedlt.models.alexnet import AlexNet

LR, MOMENTUM, WD, C = 0.05, 0.9, 5e-4, 10


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def make_clients(generator: torch.Generator) -> list[ClientData]:
    """Three clients with skewed labels; client 1 misses most classes."""
    label_sets = [torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([3, 3, 3, 3, 3, 4, 4, 4, 4]), torch.tensor([5, 6, 7, 8, 9])]
    clients = []
    for cid, y in enumerate(label_sets):
        x = torch.randn(len(y), 1, 28, 28, generator=generator)
        clients.append(ClientData(cid, x, y, torch.bincount(y, minlength=C)))
    return clients


def adjusted_ce(logits: torch.Tensor, labels: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    shifted = logits + torch.log(prior + 1e-12)
    log_prob = shifted - shifted.exp().sum(1, keepdim=True).log()
    return -log_prob[torch.arange(len(labels)), labels].mean()


def reference_round(model: AlexNet, clients: list[ClientData]):
    """One SCALA local iteration, each client's batch = its whole local set (T=1)."""
    client_ref = torch.nn.Sequential(*list(model)[:6])
    server_ref = torch.nn.Sequential(*list(model)[6:])
    client_grads, new_clients = [], []
    for data in clients:
        local = copy.deepcopy(client_ref)
        prior = data.class_counts.double() / data.class_counts.sum()
        loss = adjusted_ce(server_ref(local(data.x)), data.y, prior)  # a server forward per client
        grads = torch.autograd.grad(loss, list(local.parameters()))
        client_grads.append(grads)
        new_clients.append([p.detach() - LR * (g + WD * p.detach()) for p, g in zip(local.parameters(), grads)])
    acts = torch.cat([client_ref(d.x).detach() for d in clients])  # the concatenated batch
    labels = torch.cat([d.y for d in clients])
    batch_prior = torch.bincount(labels, minlength=C).double() / len(labels)
    server_loss = adjusted_ce(server_ref(acts), labels, batch_prior)
    server_grads = torch.autograd.grad(server_loss, list(server_ref.parameters()))
    new_server = [p.detach() - LR * (g + WD * p.detach()) for p, g in zip(server_ref.parameters(), server_grads)]
    sizes = [len(d) for d in clients]
    averaged = [sum(n * w[i] for n, w in zip(sizes, new_clients)) / sum(sizes) for i in range(len(new_clients[0]))]
    return client_grads, server_grads, averaged, new_server


def make_algorithm(model_state, clients, local_iters: int = 1) -> SplitLearning:
    def build():
        net = AlexNet(1, C)
        net.load_state_dict(model_state)
        return net

    ctx = RunContext(num_classes=C, input_shape=(1, 28, 28), build_model=build, split="s2", server_batch=sum(len(c) for c in clients),
                     local_iters=local_iters, local_epochs=None, batch_size=0, lr=LR, momentum=MOMENTUM,
                     weight_decay=WD, clip=None, sampling_seed=0, device=torch.device("cpu"))
    algorithm = SplitLearning()
    algorithm.setup(ctx)
    return algorithm


def test_fused_step_matches_authors_way(float64, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = AlexNet(1, C)
    clients = make_clients(generator)
    algorithm = make_algorithm(model.state_dict(), clients)

    recorded_client_grads: list[list[torch.Tensor]] = []
    original_step = Replica.step

    def recording_step(self, activations, activation_grad, param_grads=None):
        original_step(self, activations, activation_grad, param_grads)
        recorded_client_grads.append([p.grad.clone() for p in self.params.values()])

    monkeypatch.setattr(Replica, "step", recording_step)
    recorded_server_grads: list[torch.Tensor] = []
    server_optimiser = algorithm._server_optimiser
    original_server_step = server_optimiser.step

    def recording_server_step(*args, **kwargs):
        recorded_server_grads.extend(p.grad.clone() for p in algorithm._server.parameters())
        return original_server_step(*args, **kwargs)

    monkeypatch.setattr(server_optimiser, "step", recording_server_step)

    algorithm.train_round(0, clients)
    ref_client_grads, ref_server_grads, ref_client_weights, ref_server_weights = reference_round(model, clients)

    assert len(recorded_client_grads) == len(clients)
    for got, want in zip(recorded_client_grads, ref_client_grads):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    for g, w in zip(recorded_server_grads, ref_server_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    for got, want in zip(algorithm._client.parameters(), ref_client_weights):
        torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=0)
    for got, want in zip(algorithm._server.parameters(), ref_server_weights):
        torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=0)
    # the grads are not trivially zero: the comparison could fail
    assert max(float(g.abs().max()) for g in recorded_server_grads) > 1e-4


def test_server_forwards_once_per_local_iteration(float64):
    generator = torch.Generator().manual_seed(1)
    clients = make_clients(generator)
    algorithm = make_algorithm(AlexNet(1, C).state_dict(), clients, local_iters=3)
    calls = []
    algorithm._server.register_forward_hook(lambda *_: calls.append(1))
    algorithm.train_round(0, clients)
    assert len(calls) == 3


def test_server_optimiser_persists_and_client_models_are_averaged(float64):
    generator = torch.Generator().manual_seed(2)
    clients = make_clients(generator)
    algorithm = make_algorithm(AlexNet(1, C).state_dict(), clients, local_iters=2)
    algorithm.train_round(0, clients)
    state = algorithm._server_optimiser.state_dict()["state"]
    assert state and all("momentum_buffer" in s for s in state.values())
    # the evaluated model is the averaged client part followed by the current server part
    x = clients[0].x
    torch.testing.assert_close(algorithm.global_model()(x), algorithm._server(algorithm._client(x)))

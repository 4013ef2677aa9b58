"""FedVLS over several rounds equals a hand-written loop that follows the authors' code.

The reference below is written from FedVLS's released client (clientVLS.train) and server
(FedVLS.aggregate_parameters), not from fedlt's loss functions: per client and round a fresh
SGD(momentum 0.9, no weight decay), the received global model as teacher, the prior
p = n / Σn over the client's whole local set, and per step
CE(z + log(p + 1e-9), y) + 0.005·LADE + lam·KL(softmax(t[:, O]) ‖ softmax(z[:, O])) (batchmean),
then |D_k|-weighted averaging. Float64, so any difference beyond rounding is a real one.
(The side-by-side runs against the authors' code itself are in tools/fedvls_repro/.)
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fedlt.algorithms
import fedlt.datasets
from fedlt.algorithms.base import ClientData, RunContext, client_generator
from fedlt.engine import train_round
from fedlt.algorithms.protocol import ClientStates
from fedlt.models.alexnet import MLP

C = 10
LAM = 0.1


@pytest.fixture(scope="module")
def clients() -> list[ClientData]:
    """Two label-skewed MNIST clients with rare classes (1–3 samples), ≥ 2 vacant classes and sizes
    that are not multiples of the batch."""
    data = fedlt.datasets.create("mnist")
    wants = [{0: 30, 1: 9, 2: 1}, {3: 25, 4: 3, 5: 1, 6: 12}]
    out = []
    for cid, want in enumerate(wants):
        idx = torch.cat([torch.nonzero(data.y_train[:3000] == c).flatten()[:n] for c, n in want.items()])
        y = data.y_train[idx]
        out.append(ClientData(cid, data.x_train[idx].double(), y, torch.bincount(y, minlength=C)))
    return out


def authors_step_loss(z, y, t, counts):
    """clientVLS: PriorCELoss + new_LADEloss + lamda·VLSloss, written out from the authors' code."""
    prior = counts / counts.sum()
    prior_ce = F.cross_entropy(z + torch.log(prior + 1e-9), y)
    spread = (z - torch.log(prior + 1e-9) + math.log(1.0 / C + 1e-9)).T * (y != torch.arange(C).view(-1, 1))
    lade = 0.005 * (prior * (torch.logsumexp(spread, -1) - math.log(z.shape[0]))).sum()
    vacant = torch.nonzero(prior == 0).flatten()
    kl = F.kl_div(F.log_softmax(z[:, vacant], dim=1), F.softmax(t[:, vacant], dim=1), reduction="batchmean")
    return prior_ce + lade + LAM * kl


def authors_rounds(init: dict, clients: list[ClientData], rounds: int, epochs: int, batch: int, lr: float) -> dict:
    global_model = MLP(784, C).double()
    global_model.load_state_dict(init)
    for r in range(rounds):
        teacher = copy.deepcopy(global_model)
        updates = []
        for c in clients:
            model = copy.deepcopy(global_model)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=0.0)
            counts = torch.bincount(c.y, minlength=C).double()
            gen = client_generator(0, r, c.cid)  # the minibatch order fedlt draws (any order would do)
            for _ in range(epochs):
                for idx in torch.randperm(len(c), generator=gen).split(batch):
                    x, y = c.x[idx], c.y[idx]
                    opt.zero_grad()
                    loss = authors_step_loss(model(x), y, teacher(x).detach(), counts)
                    loss.backward()
                    opt.step()
            updates.append((model.state_dict(), len(c)))
        total = sum(n for _, n in updates)
        global_model.load_state_dict({k: sum(w[k] * (n / total) for w, n in updates) for k in init})
    return global_model.state_dict()


def test_fedvls_rounds_match_the_authors_loop(clients, one_thread):
    rounds, epochs, batch, lr = 3, 2, 16, 0.05
    torch.manual_seed(0)
    init = MLP(784, C).double().state_dict()

    def build():
        model = MLP(784, C).double()
        model.load_state_dict(init)
        return model

    ctx = RunContext(num_classes=C, input_shape=(1, 28, 28), build_model=build, split=None, server_batch=64,
                     local_iters=0, local_epochs=epochs, batch_size=batch, lr=lr, momentum=0.9, weight_decay=0.0,
                     clip=None, sampling_seed=0, device=torch.device("cpu"))
    algorithm = fedlt.algorithms.create("fedvls")
    algorithm.setup(ctx)
    states = ClientStates()
    for r in range(rounds):
        train_round(algorithm, ctx, r, clients, states)
    ours = algorithm.global_model().state_dict()
    reference = authors_rounds(init, clients, rounds, epochs, batch, lr)
    moved = max(float((reference[k] - init[k]).abs().max()) for k in init)
    assert moved > 1e-2  # the rounds really trained
    for k in init:
        torch.testing.assert_close(ours[k], reference[k], rtol=0, atol=1e-10)

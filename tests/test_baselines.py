"""The stateful baselines (issue 16): each against an independent float64 re-implementation of
its paper's update (two rounds, partial participation, so client state is carried and reused),
the special cases that are FedAvg exactly, and a real change from FedAvg on MNIST."""

from __future__ import annotations

import math

import pytest
import torch

import fedlt.algorithms
import fedlt.datasets
from fedlt.algorithms.base import ClientData, LocalSchedule, RunContext, client_generator
from fedlt.engine import train_round
from fedlt.algorithms.protocol import ClientStates
from fedlt.models.alexnet import MLP

pytestmark = pytest.mark.usefixtures("one_thread")

C, D, H = 3, 4, 5  # classes, input features, hidden units of the tiny MLP
LR, EPOCHS, BATCH = 0.1, 2, 4
ROUNDS = [[0, 1], [1, 2]]  # participants per round: client 2 joins late, client 1 carries its state
SIZES = [8, 12, 6]


def tiny_clients() -> list[ClientData]:
    g = torch.Generator().manual_seed(1)
    clients = []
    for cid, n in enumerate(SIZES):
        x = torch.randn(n, D, generator=g, dtype=torch.float64)
        y = torch.randint(0, C, (n,), generator=g)
        clients.append(ClientData(cid, x, y, torch.bincount(y, minlength=C)))
    return clients


def initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return MLP(D, C, hidden=(H,)).double().state_dict()


def context(momentum: float = 0.0, weight_decay: float = 0.0, epochs: int | None = EPOCHS) -> RunContext:
    init = initial()

    def build():
        model = MLP(D, C, hidden=(H,)).double()
        model.load_state_dict(init)
        return model

    return RunContext(num_classes=C, input_shape=(1, 1, D), build_model=build, split=None, server_batch=10,
                      local_iters=3, local_epochs=epochs, batch_size=BATCH, lr=LR, momentum=momentum,
                      weight_decay=weight_decay, clip=None, sampling_seed=0, device=torch.device("cpu"),
                      num_clients=len(SIZES))


def library(name: str, ctx: RunContext, rounds=ROUNDS, clients=None, **params):
    clients = clients or tiny_clients()
    algorithm = fedlt.algorithms.create(name, **params)
    algorithm.setup(ctx)
    states = ClientStates()
    for r, part in enumerate(rounds):
        train_round(algorithm, ctx, r, [clients[i] for i in part], states)
    return {k: v.clone() for k, v in algorithm.global_model().state_dict().items()}, algorithm, states


# -- the independent reference: a hand-written MLP and the papers' update equations -------------
NAMES = ["1.weight", "1.bias", "3.weight", "3.bias"]


def features(w, x):
    return torch.relu(x @ w["1.weight"].T + w["1.bias"])


def logits_of(w, x):
    return features(w, x) @ w["3.weight"].T + w["3.bias"]


def cross_entropy(z, y):
    return sum(torch.logsumexp(z[i], 0) - z[i, y[i]] for i in range(len(y))) / len(y)


def gradient(loss_fn, w):
    """∇ of loss_fn(w) w.r.t. every tensor of w (a dict of float64 tensors)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in w.items()}
    grads = torch.autograd.grad(loss_fn(leaves), [leaves[k] for k in NAMES])
    return dict(zip(NAMES, grads))


def batches(r: int, cid: int):
    """The minibatch order the client draws (data plumbing shared with the library, not the math)."""
    return list(LocalSchedule(BATCH, epochs=EPOCHS).batches(SIZES[cid], client_generator(0, r, cid)))


def copy(w):
    return {k: v.detach().clone() for k, v in w.items()}


def sq_norm(w):
    return sum(float((w[k] ** 2).sum()) for k in NAMES)


def local_sgd(w, data, r, loss_fn, correction=lambda w: {k: 0.0 for k in NAMES}, momentum=0.0):
    """SGD (heavy ball as torch's, buf₁ = d₁) on loss_fn(w, x, y) with correction(w) added to the
    gradient; returns (w, steps)."""
    w, buf = copy(w), None
    steps = 0
    for idx in batches(r, data.cid):
        x, y = data.x[idx], data.y[idx]
        g = gradient(lambda v: loss_fn(v, x, y), w)
        extra = correction(w)
        d = {k: g[k] + extra[k] for k in NAMES}
        buf = d if buf is None else {k: momentum * buf[k] + d[k] for k in NAMES}
        w = {k: w[k] - LR * buf[k] for k in NAMES}
        steps += 1
    return w, steps


def ce_loss(w, x, y):
    return cross_entropy(logits_of(w, x), y)


def weighted(ws, sizes):
    total = sum(sizes)
    return {k: sum(n / total * w[k] for w, n in zip(ws, sizes)) for k in NAMES}


def close(library_state, reference):
    return max(float((library_state[k] - reference[k]).abs().max()) for k in NAMES)


def reference_scaffold(momentum=0.0):
    clients, x = tiny_clients(), initial()
    c = {k: torch.zeros_like(x[k]) for k in NAMES}
    c_i = {cid: {k: torch.zeros_like(x[k]) for k in NAMES} for cid in range(len(SIZES))}
    for r, part in enumerate(ROUNDS):
        ys, dcs = [], []
        for k in part:
            y, steps = local_sgd(x, clients[k], r, ce_loss, lambda w, k=k: {n: c[n] - c_i[k][n] for n in NAMES},
                                 momentum)
            effective = sum((1 - momentum ** j) / (1 - momentum) for j in range(1, steps + 1))  # = steps at 0
            new = {n: c_i[k][n] - c[n] + (x[n] - y[n]) / (effective * LR) for n in NAMES}  # option II
            dcs.append({n: new[n] - c_i[k][n] for n in NAMES})
            c_i[k] = new
            ys.append(y)
        x = {n: x[n] + sum(y[n] - x[n] for y in ys) / len(part) for n in NAMES}  # η_g = 1
        c = {n: c[n] + sum(d[n] for d in dcs) / len(SIZES) for n in NAMES}  # |S|/N · mean
    return x, c, c_i


def reference_feddyn(alpha):
    clients, x = tiny_clients(), initial()
    g_k = {cid: {k: torch.zeros_like(x[k]) for k in NAMES} for cid in range(len(SIZES))}
    h = {k: torch.zeros_like(x[k]) for k in NAMES}
    for r, part in enumerate(ROUNDS):
        thetas = []
        for k in part:
            theta, _ = local_sgd(x, clients[k], r, ce_loss,
                                 lambda w, k=k: {n: -g_k[k][n] + alpha * (w[n] - x[n]) for n in NAMES})
            g_k[k] = {n: g_k[k][n] - alpha * (theta[n] - x[n]) for n in NAMES}
            thetas.append(theta)
        h = {n: h[n] - alpha / len(SIZES) * sum(t[n] - x[n] for t in thetas) for n in NAMES}
        x = {n: sum(t[n] for t in thetas) / len(thetas) - h[n] / alpha for n in NAMES}
    return x, h


def cosine(a, b):
    return (a * b).sum() / (a.norm() * b.norm())


def reference_moon(mu, tau):
    clients, x = tiny_clients(), initial()
    previous: dict[int, dict] = {}
    for r, part in enumerate(ROUNDS):
        ys = []
        for k in part:
            prev, glob = previous.get(k, x), x

            def loss(w, xb, yb):
                z, zg, zp = features(w, xb), features(glob, xb), features(prev, xb)
                con = 0.0
                for i in range(len(yb)):
                    sg, sp = cosine(z[i], zg[i]) / tau, cosine(z[i], zp[i]) / tau
                    con = con - torch.log(torch.exp(sg) / (torch.exp(sg) + torch.exp(sp)))
                return ce_loss(w, xb, yb) + mu * con / len(yb)

            y, _ = local_sgd(x, clients[k], r, loss)
            previous[k] = y
            ys.append(y)
        x = weighted(ys, [SIZES[k] for k in part])
    return x


def reference_fedsam(rho):
    clients, x = tiny_clients(), initial()
    for r, part in enumerate(ROUNDS):
        ys = []
        for k in part:
            w = copy(x)
            for idx in batches(r, k):
                xb, yb = clients[k].x[idx], clients[k].y[idx]
                g = gradient(lambda v: ce_loss(v, xb, yb), w)
                norm = math.sqrt(sq_norm(g))
                perturbed = {n: w[n] + rho * g[n] / norm for n in NAMES}
                g_sam = gradient(lambda v: ce_loss(v, xb, yb), perturbed)
                w = {n: w[n] - LR * g_sam[n] for n in NAMES}
            ys.append(w)
        x = weighted(ys, [SIZES[k] for k in part])
    return x


def reference_feddecorr(beta):
    clients, x = tiny_clients(), initial()

    def decorr(z):
        b, d = z.shape
        if b < 2:
            return 0.0
        std = (z - z.mean(0)) / torch.sqrt(1e-8 + ((z - z.mean(0)) ** 2).sum(0) / (b - 1))
        total = 0.0
        for i in range(d):
            for j in range(d):
                if i != j:
                    total = total + sum(std[s, i] * std[s, j] for s in range(b)) ** 2
        return total / (d * (d - 1)) / b

    for r, part in enumerate(ROUNDS):
        ys = []
        for k in part:
            y, _ = local_sgd(x, clients[k], r, lambda w, xb, yb: ce_loss(w, xb, yb) + beta * decorr(features(w, xb)))
            ys.append(y)
        x = weighted(ys, [SIZES[k] for k in part])
    return x


def reference_fednova(rho, wd):
    clients, x = tiny_clients(), initial()
    for r, part in enumerate(ROUNDS):
        ys, a = [], []
        for k in part:
            w, buf, tau = copy(x), None, 0
            for idx in batches(r, k):  # torch's SGD with momentum and weight decay, written out
                xb, yb = clients[k].x[idx], clients[k].y[idx]
                g = gradient(lambda v: ce_loss(v, xb, yb), w)
                d = {n: g[n] + wd * w[n] for n in NAMES}
                buf = d if buf is None else {n: rho * buf[n] + d[n] for n in NAMES}
                w = {n: w[n] - LR * buf[n] for n in NAMES}
                tau += 1
            ys.append(w)
            a.append(sum((1 - rho ** j) / (1 - rho) for j in range(1, tau + 1)))  # ‖a_i‖₁
        p = [SIZES[k] / sum(SIZES[k] for k in part) for k in part]
        tau_eff = sum(pi * ai for pi, ai in zip(p, a))
        x = {n: x[n] + tau_eff * sum(pi * (y[n] - x[n]) / ai for pi, y, ai in zip(p, ys, a)) for n in NAMES}
    return x


def reference_fedexp(eps):
    clients, x, etas = tiny_clients(), initial(), []
    for r, part in enumerate(ROUNDS):
        deltas = []
        for k in part:
            y, _ = local_sgd(x, clients[k], r, ce_loss)
            deltas.append({n: y[n] - x[n] for n in NAMES})
        mean = {n: sum(d[n] for d in deltas) / len(deltas) for n in NAMES}
        eta = max(1.0, sum(sq_norm(d) for d in deltas) / (2 * len(deltas) * (sq_norm(mean) + eps)))
        etas.append(eta)
        x = {n: x[n] + eta * mean[n] for n in NAMES}
    return x, etas


# -- against the references ----------------------------------------------------------------------
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_scaffold_matches_the_paper_option_two(momentum):
    ref_x, ref_c, ref_ci = reference_scaffold(momentum)
    got, algorithm, states = library("scaffold", context(momentum=momentum))
    assert close(got, ref_x) < 1e-6
    assert close(algorithm.state_dict()["server"], ref_c) < 1e-6
    for cid in range(len(SIZES)):
        assert close(states.get(cid)["c"], ref_ci[cid]) < 1e-6
    assert sq_norm(ref_c) > 0  # the control variates really took part in round 2


def test_feddyn_matches_the_paper():
    ref_x, ref_h = reference_feddyn(0.1)
    got, algorithm, _ = library("feddyn", context(), alpha=0.1)
    assert close(got, ref_x) < 1e-6
    assert close(algorithm.state_dict()["server"], ref_h) < 1e-6


def test_moon_matches_the_paper():
    ref = reference_moon(mu=1.0, tau=0.5)
    got, _, states = library("moon", context(), mu=1.0, temperature=0.5)
    assert close(got, ref) < 1e-6
    assert set(states) == {0, 1, 2}  # every participant keeps its previous local model


def test_fedsam_matches_sam_local_steps():
    got, _, _ = library("fedsam", context(), rho=0.05)
    assert close(got, reference_fedsam(0.05)) < 1e-6


def test_feddecorr_matches_the_authors_term():
    got, _, _ = library("feddecorr", context(), beta=0.5)
    assert close(got, reference_feddecorr(0.5)) < 1e-6


def test_fednova_matches_normalised_averaging_with_momentum():
    got, _, _ = library("fednova", context(momentum=0.9, weight_decay=5e-4))
    assert close(got, reference_fednova(0.9, 5e-4)) < 1e-6


def test_fedexp_matches_the_extrapolated_step():
    ref, etas = reference_fedexp(1e-3)
    got, _, _ = library("fedexp", context())
    assert max(etas) > 1  # the extrapolation was active, not clamped to 1
    assert close(got, ref) < 1e-6


# -- the special cases that are FedAvg exactly ---------------------------------------------------
def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_scaffold_first_round_is_fedavg_then_it_differs():
    """c = c_i = 0 in the first round: local SGD is plain SGD and the server step the mean."""
    first, _, _ = library("scaffold", context(), rounds=ROUNDS[:1])
    assert same(first, library("fedavg", context(), rounds=ROUNDS[:1], aggregator="mean")[0])
    assert not same(library("scaffold", context())[0], library("fedavg", context(), aggregator="mean")[0])


@pytest.mark.parametrize("name, params, fedavg", [
    ("feddyn", {"alpha": 0.0}, {"aggregator": "mean"}),
    ("moon", {"mu": 0.0}, {}),
    ("fedsam", {"rho": 0.0}, {}),
    ("feddecorr", {"beta": 0.0}, {}),
])
def test_zero_strength_is_fedavg_exactly(name, params, fedavg):
    assert same(library(name, context(), **params)[0], library("fedavg", context(), **fedavg)[0])


def test_fednova_with_equal_steps_and_no_momentum_is_fedavg_exactly():
    ctx = lambda: context(momentum=0.0, epochs=None)  # noqa: E731  iterations: every client takes 3 steps
    assert same(library("fednova", ctx())[0], library("fedavg", ctx())[0])
    # unequal step counts (epochs over unequal data) move it away
    assert not same(library("fednova", context())[0], library("fedavg", context())[0])


def test_fedexp_without_extrapolation_is_the_mean_exactly():
    """One participant: Σ‖Δ_k‖²/(2M(‖Δ̄‖² + ε)) < 1/2, so η_g = 1."""
    rounds = [[0], [2]]
    assert same(library("fedexp", context(), rounds=rounds)[0],
                library("fedavg", context(), rounds=rounds, aggregator="mean")[0])


def test_fedexp_aggregator_step_size_is_clamped_at_one():
    agg = fedlt.aggregators.create("fedexp")
    x = {"w": torch.zeros(3)}
    # identical updates: Σ‖Δ‖²/(2M‖Δ̄‖²) = 1/2 → 1; opposite updates: Δ̄ = 0 → M‖Δ‖²/(2Mε) large
    assert agg.step_size(x, [{"w": torch.ones(3)}] * 2, {"w": torch.ones(3)}, ["w"]) == 1.0
    states = [{"w": torch.ones(3)}, {"w": -torch.ones(3) * 0.5}]
    assert agg.step_size(x, states, {"w": torch.full((3,), 0.25)}, ["w"]) == pytest.approx(
        (3 + 0.75) / (2 * 2 * (3 * 0.0625 + 1e-3)))


# -- on MNIST: composition with loss expressions, and a different model from FedAvg ---------------
NEW = ["scaffold", "feddyn", "moon", "fednova", "fedexp", "fedsam", "feddecorr"]


@pytest.fixture(scope="module")
def mnist_clients() -> list[ClientData]:
    data = fedlt.datasets.create("mnist")
    clients = []
    for cid, (classes, n) in enumerate([((0, 1), 30), ((2, 3, 4), 20), ((5, 6), 45), ((7, 8, 9), 12)]):
        idx = torch.cat([torch.nonzero(data.y_train[:6000] == c).flatten()[:n] for c in classes])
        y = data.y_train[idx]
        clients.append(ClientData(cid, data.x_train[idx], y, torch.bincount(y, minlength=10)))
    return clients


def mnist_run(name: str, clients, **params):
    torch.manual_seed(0)
    init = MLP(784, 10).state_dict()

    def build():
        model = MLP(784, 10)
        model.load_state_dict(init)
        return model

    ctx = RunContext(num_classes=10, input_shape=(1, 28, 28), build_model=build, split=None, server_batch=64,
                     local_iters=3, local_epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=5e-4,
                     clip=10.0, sampling_seed=0, device=torch.device("cpu"), num_clients=6)
    algorithm = fedlt.algorithms.create(name, **params)
    algorithm.setup(ctx)
    states = ClientStates()
    for r in range(2):
        train_round(algorithm, ctx, r, clients, states)
    return {k: v.clone() for k, v in algorithm.global_model().state_dict().items()}


@pytest.mark.parametrize("name", NEW)
def test_each_moves_the_model_differently_from_fedavg_and_composes_with_a_loss(name, mnist_clients):
    baseline = mnist_run("fedavg", mnist_clients)
    own = mnist_run(name, mnist_clients)
    assert not same(baseline, own)
    assert all(torch.isfinite(v).all() for v in own.values())
    composed = mnist_run(name, mnist_clients, loss="fedlc(tau=0.5) + 0.1*vacant_kd")
    assert not same(own, composed) and all(torch.isfinite(v).all() for v in composed.values())

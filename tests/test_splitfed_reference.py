"""SplitFed V1, V2, V3 and SFL-LocalLoss: the engine's rounds against float64 references written
from SPEC §3 and docs/algorithms.md ("Split learning").

Each reference is plain loops over rounds, local iterations and clients on dicts of float64
tensors: the MLP's two parts written out as matrix products, its own minibatch draws, B_k, cross-
entropy, total-norm clipping, SGD with momentum and weight decay, and |D_k|-weighted averages.
It shares with fedlt only what a run is given: the data and partition (``fedlt.engine.prepare``),
the round's participants (``fedlt.engine.sample_clients``), the seeds of the minibatch streams
(``client_generator``) and the initial weights (``fedlt.models.build`` under the model seed). The
engine is run as a user runs it (``fedlt.engine.run``, float32) and read back from its checkpoint
after every round.

What the four algorithms do in each local iteration, as the references implement it:

- every participant forwards a minibatch of B_k = max(⌊|D_k|·B/Σ_j|D_j|⌋, 1) samples drawn without
  replacement from a fresh permutation of its data (a new one when too few remain);
- V1, V3: participant k's activations go through its own copy of the round-start server part
  (a fresh optimiser each round); V2, SFL-LocalLoss: through the one server part, participant after
  participant in the order sampled, each batch stepping it (its optimiser persists for the run);
- the server loss is the batch's cross-entropy; its gradient w.r.t. the activations, at the
  pre-step server weights, goes back to the client (SplitFed) — or nothing goes back and the client
  stepped on the cross-entropy of an auxiliary linear head on its activations (SFL-LocalLoss,
  which uploads the activations it computed before that step).

At the end of a round the server copies are averaged by |D_k| (V1, V3); client parts are averaged
by |D_k| (V1, V2, SFL-LocalLoss, the head included) or kept per client (V3, whose evaluated
client part is the participants' |D_k|-weighted average; a client's first round starts from the
initial client part). Client optimisers start fresh every round.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

import fedlt.models
from fedlt.algorithms.base import client_generator
from fedlt.config import RunConfig
from fedlt.engine import prepare, run, sample_clients
from fedlt.io import load_checkpoint

# float32 engine vs float64 reference: over 2 rounds × 3 iterations the largest difference measured
# is ~1e-7 (float32's rounding of weights of size ~0.1–1 and of their gradients); 1e-5 leaves two
# orders of magnitude, and every mutant below is at least 100 times farther away.
TOL = 1e-5
LR, MOMENTUM, WD = 0.05, 0.9, 5e-4
CLIP = 1.8  # triggers on some steps only (gradient norms here: server 1.0–2.5, client 1.2–5.9)
SERVER_BATCH, LOCAL_ITERS, ROUNDS = 40, 3, 2
SETTING = dict(
    dataset="mnist", model="mlp", split="1", clients=4, participation=0.75, rounds=ROUNDS,
    partition={"name": "dirichlet", "beta": 0.3, "min_size": 5}, train_limit=120, test_limit=20, seeds={"sampling": 2},
    server_batch=SERVER_BATCH, local_iters=LOCAL_ITERS, optimiser={"lr": LR, "momentum": MOMENTUM,
                                                                   "weight_decay": WD, "clip": CLIP},
)
CLIENT_KEYS = ("1.weight", "1.bias")  # split "1": Flatten, Linear(784, 200), ReLU on the client
SERVER_KEYS = ("3.weight", "3.bias", "5.weight", "5.bias")  # Linear(200, 200), ReLU, Linear(200, 10)
HEAD_KEYS = ("head.weight", "head.bias")  # SFL-LocalLoss's auxiliary head: Linear(200, 10)


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------


def client_forward(w: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x.flatten(1) @ w["1.weight"].T + w["1.bias"])


def server_forward(w: dict, a: torch.Tensor) -> torch.Tensor:
    return torch.relu(a @ w["3.weight"].T + w["3.bias"]) @ w["5.weight"].T + w["5.bias"]


def head_forward(w: dict, a: torch.Tensor) -> torch.Tensor:
    return a @ w["head.weight"].T + w["head.bias"]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (torch.logsumexp(logits, 1) - logits[torch.arange(len(labels)), labels]).mean()


def minibatches(n: int, batch: int, iters: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``iters`` batches without replacement from a fresh permutation; a new one when fewer than
    ``batch`` indices remain."""
    batch = min(batch, n)
    perm, used, out = torch.randperm(n, generator=generator), 0, []
    for _ in range(iters):
        if used + batch > n:
            perm, used = torch.randperm(n, generator=generator), 0
        out.append(perm[used : used + batch])
        used += batch
    return out


def leaves(weights: dict) -> dict:
    return {n: t.detach().clone().requires_grad_(True) for n, t in weights.items()}


def average(parts: list[dict], weights: list[float]) -> dict:
    total = sum(weights)
    return {n: sum(w * p[n].detach() for w, p in zip(weights, parts)) / total for n in parts[0]}


class SGD:
    """One side's optimiser: clip the total gradient norm (torch's 1e-6 guard), then SGD with weight
    decay and momentum (the first step's buffer is the gradient). ``tally`` counts [clipped, steps]."""

    def __init__(self, tally: list[int]) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.tally = tally

    def step(self, params: dict, grads: list[torch.Tensor]) -> dict:
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        scale = min(1.0, CLIP / (norm + 1e-6))
        self.tally[0] += norm > CLIP
        self.tally[1] += 1
        new = {}
        for (name, p), g in zip(params.items(), grads):
            d = scale * g + WD * p.detach()
            self.buffers[name] = d if name not in self.buffers else MOMENTUM * self.buffers[name] + d
            new[name] = (p.detach() - LR * self.buffers[name]).requires_grad_(True)
        return new


@dataclass(frozen=True)
class Variant:
    """What tells the four algorithms apart, plus the deviations the mutant checks use."""

    server_copies: bool  # V1/V3: a server copy per participant, averaged; else one server in turn
    keep_client_parts: bool  # V3
    local_loss: bool  # SFL-LocalLoss
    weighted: bool = True  # |D_k|-weighted averages (mutant: unweighted)
    server_momentum_persists: bool = True  # the one server's optimiser lives for the run (mutant: per round)
    newcomer_starts_from_initial: bool = True  # V3 (mutant: from the participants' last average)
    upload_before_local_step: bool = True  # SFL-LocalLoss (mutant: activations after the step)
    client_by_client: bool = False  # the one server meets c1, c2, ..., c1, c2, ... (mutant: c1's T batches, then c2's)


VARIANTS = {
    "splitfed_v1": Variant(server_copies=True, keep_client_parts=False, local_loss=False),
    "splitfed_v2": Variant(server_copies=False, keep_client_parts=False, local_loss=False),
    "splitfed_v3": Variant(server_copies=True, keep_client_parts=True, local_loss=False),
    "sfl_localloss": Variant(server_copies=False, keep_client_parts=False, local_loss=True),
}


@dataclass
class Client:
    cid: int
    x: torch.Tensor  # float64
    y: torch.Tensor


class Reference:
    def __init__(self, variant: Variant, initial: dict, sampling_seed: int) -> None:
        self.variant, self.sampling_seed = variant, sampling_seed
        client_keys = CLIENT_KEYS + (HEAD_KEYS if variant.local_loss else ())
        self.initial_client = {n: initial[n] for n in client_keys}
        self.client = dict(self.initial_client)  # the global client part (V3: the evaluated average)
        self.server = {n: initial[n] for n in SERVER_KEYS}
        self.tally = {"client": [0, 0], "server": [0, 0]}  # [clipped, steps] per side
        self.server_optimiser = SGD(self.tally["server"])  # the one server's (V2, SFL-LocalLoss)
        self.kept: dict[int, dict] = {}  # V3: each client's own part
        self.rounds: list[tuple[list[int], list[int]]] = []  # each round's (|D_k|, B_k)

    def round(self, round_index: int, participants: list[Client]) -> float:
        """One round; returns the mean server loss (the engine's train_loss)."""
        v = self.variant
        sizes = [len(c.y) for c in participants]
        batches = [max(n * SERVER_BATCH // sum(sizes), 1) for n in sizes]  # B_k
        self.rounds.append((sizes, batches))
        draws = [minibatches(n, b, LOCAL_ITERS, client_generator(self.sampling_seed, round_index, c.cid))
                 for c, n, b in zip(participants, sizes, batches)]
        starts = []
        for c in participants:
            if not v.keep_client_parts:
                starts.append(self.client)
            elif c.cid in self.kept:
                starts.append(self.kept[c.cid])
            else:
                starts.append(self.initial_client if v.newcomer_starts_from_initial else self.client)
        clients = [leaves(s) for s in starts]
        client_optimisers = [SGD(self.tally["client"]) for _ in participants]
        if v.server_copies:
            servers = [leaves(self.server) for _ in participants]
            server_optimisers = [SGD(self.tally["server"]) for _ in participants]
        else:
            if not v.server_momentum_persists:
                self.server_optimiser = SGD(self.tally["server"])
            servers, server_optimisers = [leaves(self.server)], [self.server_optimiser]
        # one exchange at a time: client k's batch of iteration t, the server's step on it, client
        # k's step. Client k's exchange depends only on its own weights and the server it meets,
        # so this equals the engine's lockstep (all forwards, the server, all backwards) exactly.
        if v.client_by_client:
            exchanges = [(k, t) for k in range(len(participants)) for t in range(LOCAL_ITERS)]
        else:
            exchanges = [(k, t) for t in range(LOCAL_ITERS) for k in range(len(participants))]
        server_losses = []
        for k, t in exchanges:
            x, y = participants[k].x[draws[k][t]], participants[k].y[draws[k][t]]
            activations = client_forward(clients[k], x)
            if v.local_loss:
                loss = cross_entropy(head_forward(clients[k], activations), y)
                clients[k] = client_optimisers[k].step(clients[k], torch.autograd.grad(loss, list(clients[k].values())))
                if not v.upload_before_local_step:
                    activations = client_forward(clients[k], x)
            upload = activations.detach().requires_grad_(True)
            s = k if v.server_copies else 0
            loss = cross_entropy(server_forward(servers[s], upload), y)
            *grads, activation_grad = torch.autograd.grad(loss, [*servers[s].values(), upload])
            servers[s] = server_optimisers[s].step(servers[s], grads)
            server_losses.append(float(loss.detach()))
            if not v.local_loss:
                grads = torch.autograd.grad(activations, list(clients[k].values()), activation_grad)
                clients[k] = client_optimisers[k].step(clients[k], grads)
        weights = [float(n) for n in sizes] if v.weighted else [1.0] * len(sizes)
        self.server = average(servers, weights) if v.server_copies else {n: t.detach() for n, t in servers[0].items()}
        self.client = average(clients, weights)
        if v.keep_client_parts:
            for c, w in zip(participants, clients):
                self.kept[c.cid] = {n: t.detach() for n, t in w.items()}
        return sum(server_losses) / len(server_losses)

    def global_model(self) -> dict:
        return {**{n: self.client[n] for n in CLIENT_KEYS}, **self.server}


# ---------------------------------------------------------------------------------------------
# The engine's run and the reference's, on the same inputs
# ---------------------------------------------------------------------------------------------


def initial_weights(config: RunConfig, in_chans: int, image_size: int, num_classes: int) -> dict:
    """The model as ``fedlt.engine.prepare`` builds it: under the model seed, and (SFL-LocalLoss)
    the auxiliary head made right after it from the same stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seeds.model)
        model = fedlt.models.build(config.model, in_chans=in_chans, num_classes=num_classes, image_size=image_size)
        head = nn.Linear(200, num_classes)
    weights = {n: t.detach().double() for n, t in model.state_dict().items()}
    return {**weights, "head.weight": head.weight.detach().double(), "head.bias": head.bias.detach().double()}


@dataclass
class Snapshot:
    """One round's result: the global model, V3's kept client parts, the train loss."""

    model: dict
    kept: dict[int, dict]
    train_loss: float


def engine_rounds(config: RunConfig) -> list[Snapshot]:
    """Run ``config`` and read every round's checkpoint back: the global model through the
    Algorithm protocol (``load_state_dict``, ``global_model``), V3's parts from the client states."""
    out: list[Snapshot] = []
    reader = prepare(config).algorithm

    def read(rounds_done: int, row: dict) -> None:  # the checkpoint of this round is on disk now
        saved = load_checkpoint(Path(config.out) / "checkpoint.pt")
        assert saved["round"] == rounds_done
        reader.load_state_dict(saved["algorithm"])
        model = {n: t.detach().clone() for n, t in reader.global_model().state_dict().items()}
        kept = {int(cid): dict(s["client_model"]) for cid, s in saved["client_states"].items() if "client_model" in s}
        out.append(Snapshot(model, kept, row["train_loss"]))

    run(config, on_round=read)
    rows = [json.loads(line) for line in (Path(config.out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in rows] == [s.train_loss for s in out]
    return out


def reference_rounds(config: RunConfig, variant: Variant) -> tuple[list[Snapshot], Reference, list[list[int]]]:
    prep = prepare(config)
    data = prep.data
    x, y = data.x_train.double(), data.y_train
    initial = initial_weights(config, x.shape[1], x.shape[-1], data.num_classes)
    reference = Reference(variant, initial, config.seeds.sampling)
    snapshots, chosen = [], []
    for r in range(config.rounds):
        cids = sample_clients(config.clients, config.participation, config.seeds.sampling, r)
        participants = []
        for cid in cids:
            idx = torch.as_tensor(prep.partition.client_indices[cid], dtype=torch.long)
            participants.append(Client(cid, x[idx], y[idx]))
        loss = reference.round(r, participants)
        snapshots.append(Snapshot(reference.global_model(), {c: dict(w) for c, w in reference.kept.items()}, loss))
        chosen.append(cids)
    return snapshots, reference, chosen


def max_difference(engine: Snapshot, reference: Snapshot) -> float:
    """The largest elementwise difference over the global model and the client parts both keep."""
    pairs = [(engine.model[n], t) for n, t in reference.model.items()]
    pairs += [(engine.kept[c][n], t) for c, part in reference.kept.items() if c in engine.kept for n, t in part.items()]
    return max(float((a.double() - b).abs().max()) for a, b in pairs)


# name: the deviations from the algorithm that the comparison must catch
MUTANTS = {
    "splitfed_v1": {"V2's one sequential server": VARIANTS["splitfed_v2"],
                    "unweighted averages": replace(VARIANTS["splitfed_v1"], weighted=False)},
    "splitfed_v2": {"V1's server copies": VARIANTS["splitfed_v1"],
                    "server momentum restarted each round": replace(VARIANTS["splitfed_v2"],
                                                                    server_momentum_persists=False),
                    "the paper's order, one client's T batches at a time": replace(VARIANTS["splitfed_v2"],
                                                                                  client_by_client=True)},
    "splitfed_v3": {"V1's averaged client parts": VARIANTS["splitfed_v1"],
                    "a newcomer starting from the average": replace(VARIANTS["splitfed_v3"],
                                                                    newcomer_starts_from_initial=False),
                    "unweighted averages": replace(VARIANTS["splitfed_v3"], weighted=False)},
    "sfl_localloss": {"V2's gradient from the server": VARIANTS["splitfed_v2"],
                      "activations uploaded after the local step": replace(VARIANTS["sfl_localloss"],
                                                                           upload_before_local_step=False),
                      "unweighted averages": replace(VARIANTS["sfl_localloss"], weighted=False)},
}


@pytest.mark.parametrize("algorithm", list(VARIANTS))
def test_rounds_match_the_float64_reference(algorithm, tmp_path, one_thread):
    """Two rounds of 3 of 4 clients of 33, 35, 36 and 16 samples (round 1: clients 0, 1, 3 with
    B_k = 15, 16, 7 — rounding would give 16, 17, 8 — and every client runs out of data and
    reshuffles within T = 3; round 2: clients 0, 1, 2, so client 2 is new and V3 keeps client 3's
    part untouched), clipping on some steps: the global model, V3's kept parts and the train loss
    after each round equal the reference's, and every mutant of the reference is far from the
    engine."""
    config = RunConfig(algorithm=algorithm, **SETTING, out=tmp_path / "run")
    got = engine_rounds(config)
    want, reference, chosen = reference_rounds(config, VARIANTS[algorithm])
    assert len(got) == len(want) == ROUNDS
    for r, (g, w) in enumerate(zip(got, want)):
        for n, t in w.model.items():
            torch.testing.assert_close(g.model[n].double(), t, atol=TOL, rtol=0,
                                       msg=lambda m, where=f"round {r + 1}, {n}": f"{where}: {m}")
        assert sorted(g.kept) == sorted(w.kept), f"round {r + 1}: clients with a kept part"
        for cid, part in w.kept.items():
            for n, t in part.items():
                torch.testing.assert_close(g.kept[cid][n].double(), t, atol=TOL, rtol=0,
                                           msg=lambda m, where=f"round {r + 1}, client {cid}, {n}": f"{where}: {m}")
        assert g.train_loss == pytest.approx(w.train_loss, abs=TOL), f"round {r + 1}: train_loss"

    # the comparison has power: the setting is the one described above, both sides clipped on
    # some steps but not all, training moved every tensor well beyond TOL
    assert chosen == [[0, 1, 3], [0, 1, 2]], chosen
    assert reference.rounds == [([33, 35, 16], [15, 16, 7]), ([33, 35, 36], [12, 13, 13])], reference.rounds
    clipped = {side: c for side, (c, _) in reference.tally.items()}
    steps = sum(n for _, n in reference.tally.values())
    assert clipped["client"] > 0 and clipped["server"] > 0 and sum(clipped.values()) < steps, reference.tally
    initial = initial_weights(config, 1, 28, 10)
    assert min(float((want[-1].model[n] - initial[n]).abs().max()) for n in want[-1].model) > 100 * TOL
    for deviation, variant in MUTANTS[algorithm].items():
        mutant, _, _ = reference_rounds(config, variant)
        distance = max_difference(got[-1], mutant[-1])
        assert distance > 100 * TOL, f"{algorithm} vs {deviation}: {distance:.2e}"

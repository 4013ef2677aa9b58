"""Ditto's adapter: PFLlib's own client and server code (github.com/TsingZ0/PFLlib, read from a git
snapshot at COMMIT, executed verbatim) beside fedlt's ``ditto``.

Their pieces, as they are: ``clientDitto.ptrain`` and ``clientDitto.train``
(system/flcore/clients/clientditto.py:27-93), called in that order as ``Ditto.train`` does
(system/flcore/servers/serverditto.py:38-40), with a stand-in for ``self`` holding what
``Client.__init__`` builds (clientbase.py:43-51: plain SGD, cross-entropy) and what
``clientDitto.__init__`` builds (clientditto.py:19-21: the personal model, a copy of the initial
model, and ``PerturbedGradientDescent``, system/flcore/optimizers/fedoptimizer.py:64-75, executed
verbatim); ``Server.aggregate_parameters`` / ``add_parameters`` (serverbase.py:138-150) with the
weights ``receive_models`` computes (serverbase.py:131-136: n_k / Σ n over the round's clients).

Each ``load_train_data()`` (a new shuffled ``DataLoader(drop_last=True)``, clientbase.py:59) is
replaced by the minibatches fedlt's schedule draws; fedlt trains v on the same minibatches as w
(the paper's Algorithm 1 leaves the order open), so both of their passes get the same ones.
Ditto's λ is their ``-mu`` (main.py:449, default 0.0, which would make the personal model plain
local training): the replay passes fedlt's λ = 1 (the Ditto authors' run.sh).

Modes: ``matched`` and ``released`` are the same here (nothing is aligned).
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from authors_code import load as load_definitions
from fedlt_side import EpochLoader
from golden_source import definitions, source

REPO = "github.com/TsingZ0/PFLlib"
COMMIT = "d832e76f6a23b833038949ec1e4fdefe63a4d350"
MODES = ("matched", "released")

WHERE = {
    "weights": ("fedlt/algorithms/pfl.py:430 (the FedAvg family's loop on w)",
                "system/flcore/clients/clientditto.py:27-52 (clientDitto.train)"),
    "personal": ("fedlt/algorithms/pfl.py:397-414, 431-433 (ProximalUpdate on v, anchored at the received w)",
                 "system/flcore/clients/clientditto.py:64-89 with fedoptimizer.py:64-75"),
    "global": ("fedlt/algorithms/fedavg_family.py:199 (Strategy.aggregate: weights n_k / Σ n)",
               "system/flcore/servers/serverbase.py:131-150"),
}


def load(git_dir: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"torch": torch, "np": np, "time": time, "copy": copy, "Optimizer": Optimizer}
    load_definitions(git_dir, COMMIT, "system/flcore/optimizers/fedoptimizer.py", ["PerturbedGradientDescent"], ns)
    ns.update(definitions(source(git_dir, COMMIT, "system/flcore/clients/clientditto.py"),
                          ["clientDitto.train", "clientDitto.ptrain"], ns))
    ns["client_train"], ns["client_ptrain"] = ns.pop("train"), ns.pop("ptrain")
    ns.update(definitions(source(git_dir, COMMIT, "system/flcore/servers/serverbase.py"),
                          ["Server.aggregate_parameters", "Server.add_parameters"], ns))
    return ns


class Authors:
    """Their clients (one stand-in each, kept across rounds) and their server's aggregation."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0) -> None:
        if mode not in MODES:
            raise SystemExit(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.ns = load(git_dir)
        self.model, self.initial = copy.deepcopy(initial), copy.deepcopy(initial)
        self.lr, self.epochs = config.optimiser.lr, config.local_epochs
        self.mu = float(config.algorithm_params.get("lam", 1.0))
        self.clients: dict[int, SimpleNamespace] = {}

    def client(self, cid: int) -> SimpleNamespace:
        if cid not in self.clients:  # Client.__init__ and clientDitto.__init__ (before round 1), what the round reads
            me = SimpleNamespace(model=copy.deepcopy(self.initial), device="cpu", train_slow=False,
                                 loss=nn.CrossEntropyLoss(), local_epochs=self.epochs, plocal_epochs=self.epochs,
                                 learning_rate_decay=False, train_time_cost={"num_rounds": 0, "total_cost": 0.0})
            me.optimizer = torch.optim.SGD(me.model.parameters(), lr=self.lr)
            me.model_per = copy.deepcopy(me.model)
            me.optimizer_per = self.ns["PerturbedGradientDescent"](me.model_per.parameters(), lr=self.lr, mu=self.mu)
            self.clients[cid] = me
        return self.clients[cid]

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        me = self.client(cid)
        for p, g in zip(me.model.parameters(), self.model.parameters()):  # Client.set_parameters (send_models)
            p.data = g.data.clone()
        me.load_train_data = lambda: EpochLoader(x, y, batches, self.epochs)
        self.ns["client_ptrain"](me)
        self.ns["client_train"](me)
        clone = lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()}  # noqa: E731
        return {"weights": clone(me.model), "personal": clone(me.model_per), "loss": None}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        total = sum(sizes[c] for c in participants)
        server = SimpleNamespace(uploaded_models=[self.clients[c].model for c in participants],
                                 uploaded_weights=[sizes[c] / total for c in participants])
        server.add_parameters = lambda w, m: self.ns["add_parameters"](server, w, m)
        self.ns["aggregate_parameters"](server)
        self.model = server.global_model

"""FedGELA's adapter: the authors' own client code (github.com/MediaBrain-SJTU/FedGELA, read from a
git snapshot at COMMIT, executed verbatim) beside fedlt's ``fedgela``.

Their pieces, as they are: ``produce_Ew`` (FedGELA.py:15-39: a client's Ew = C·n_c/Σn) and
``train_net`` (FedGELA.py:174-231: SGD with momentum 0.9 and weight decay ``reg``, NLL of
log-softmax of (BN(h)·(Ew ⊙ ETF))/T, gradient clipping at total norm 20), with ``compute_accuracy_l``
(FedGELA.py:98-128), which ``train_net`` calls around each epoch (evaluation only: the model in
eval mode, no update). What the adapter writes itself: ``.cuda()`` made a no-op and a logger that
keeps the messages (offline); sklearn's ``balanced_accuracy_score`` (not compared); their test
loader (the client's own data: only their accuracy printout reads it); the ETF — theirs is
``get_etf`` of a uniform draw (FedGELA.py:130-137; ``tests/test_fedgela_golden.py`` holds fedlt's
ETF to theirs from the same draw) — is fedlt's head's, so both sides use one matrix; their model —
``forward -> (h, x, proxy(x))``, the ``etf`` proxy a BatchNorm1d (model.py:298-327) — is fedlt's
MLP with its ``GELAHead``'s BatchNorm as the proxy (the same module names, so the same state-dict
keys); the loader is the minibatches fedlt's schedule draws (theirs: ``DataLoader(shuffle=True,
drop_last=True)``, load_data.py:173; fedlt's client smaller than a batch trains its one batch,
where theirs would take no step); the server's aggregation restated from their ``__main__``
(FedGELA.py:355-381: Σ weight·w_k per key over the round's clients, loaded into the global model).

Modes: ``matched`` weighs the clients by their number of samples (fedlt's FedAvg); ``released`` by
their number of batches, as their code does (``len(train_dl_local_set[r])``, FedGELA.py:359).
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.optim as optim
from torch import nn

from authors_code import load as load_definitions
from fedlt.models import classifier, heads
from fedlt_side import EpochLoader, cuda_as_cpu, default_dtype

REPO = "github.com/MediaBrain-SJTU/FedGELA"
COMMIT = "b5b20d522c70672b9c374116797c20b0e3c7c806"
MODES = ("matched", "released")

WHERE = {
    "weights": ("fedlt/algorithms/fedgela.py:GELAUpdate.parts (objective of z·Ew/T) in the FedAvg family's loop",
                "FedGELA.py:186-212 (train_net)"),
    "global": ("fedlt/algorithms/fedavg_family.py (Strategy.aggregate: weights n_k / Σ n)",
               "FedGELA.py:355-381 (weights: each client's number of batches)"),
}
REASONS = {"released": {"global": "their aggregation weighs a client by its number of batches "
                                  "(len(train_dl), FedGELA.py:359), fedlt's by its number of samples"}}


class Proxy(nn.Module):
    """Holds their ``etf`` proxy (a BatchNorm1d) under fedlt's head's name ``bn``; passes h on."""

    def __init__(self, bn: nn.BatchNorm1d) -> None:
        super().__init__()
        self.bn = bn

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.flatten(1)


class TheirInterface(nn.Module):
    """Their models' forward ``(h, x, proxy(x))`` over a copy of fedlt's model whose head is
    replaced by its own BatchNorm (the state-dict keys stay fedlt's, under ``net.``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.proxy = Proxy(classifier(model).bn)
        self.net = heads.swap(model, self.proxy)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.net(x)
        return h, h, self.proxy.bn(h)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("net."): v.detach().clone() for k, v in self.state_dict().items()
                if k.startswith("net.")}


class Logger:
    def __init__(self) -> None:
        self.messages: list[str] = []

    def info(self, message: str) -> None:
        self.messages.append(message)


class Authors:
    """Their ``train_net`` per participant from the global weights, and their aggregation."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        cuda_as_cpu()
        dtype = next(initial.parameters()).dtype
        self.ns: dict[str, Any] = {"torch": torch, "nn": nn, "np": np, "optim": optim, "time": time,
                                   "logger": Logger(), "balanced_accuracy_score": lambda true, pred: 0.0,
                                   "ETF": classifier(initial).proto.to(dtype), "EW_set": {}}
        load_definitions(git_dir, COMMIT, "FedGELA.py", ["produce_Ew", "train_net", "compute_accuracy_l"], self.ns)
        self.mode, self.model, self.initial = mode, copy.deepcopy(initial), copy.deepcopy(initial)
        self.num_classes = classifier(initial).proto.shape[1]
        self.lr, self.reg, self.epochs = config.optimiser.lr, config.optimiser.weight_decay, config.local_epochs
        self.temperature = float(config.algorithm_params.get("temperature", 0.2))
        self.batches_per_epoch: dict[int, int] = {}

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        with default_dtype(x.dtype):  # their torch.zeros(num_classes) in the run's dtype
            _, ew = self.ns["produce_Ew"]([SimpleNamespace(targets=y.tolist())], self.num_classes)
        self.ns["EW_set"][cid] = ew[0]
        net = TheirInterface(copy.deepcopy(self.model))  # net.load_state_dict(global_para) (FedGELA.py:394-395)
        loader = EpochLoader(x, y, batches, self.epochs)
        self.batches_per_epoch[cid] = len(batches) // self.epochs
        own_data = [(x, y)]
        self.ns["train_net"](cid, net, loader, own_data, self.epochs, self.lr, "sgd", self.reg, self.temperature)
        return {"weights": net.weights(), "loss": None}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        points = [sizes[c] if self.mode == "matched" else self.batches_per_epoch[c] for c in participants]
        global_para = self.model.state_dict()
        for idx, cid in enumerate(participants):  # FedGELA.py:370-381
            net_para = results[cid]["weights"]
            weight = points[idx] / sum(points)
            if idx == 0:
                for key in net_para:
                    global_para[key] = net_para[key] * weight
            else:
                for key in net_para:
                    global_para[key] += net_para[key] * weight
        self.model.load_state_dict(global_para)

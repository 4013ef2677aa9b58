"""FedProto's adapter: the authors' own client and server code (github.com/yuetan031/FedProto, read
from a git snapshot at COMMIT, executed verbatim) beside fedlt's ``fedproto``.

Their pieces, as they are: ``LocalUpdate.update_weights_het`` (lib/update.py:136-205: their local
loop, NLL of log-softmax + ``ld``·MSE to the global prototypes, the per-class prototypes of the last
local epoch), ``agg_func`` (lib/utils.py:205-219: a client's prototypes, the mean per class) and
``proto_aggregation`` (lib/utils.py:221-240: the server's unweighted mean over the clients that
hold a class). What the adapter writes itself: a stand-in for ``LocalUpdate``'s ``self`` holding
what its ``__init__`` builds (lib/update.py:29-33: the arguments, the loader, ``nn.NLLLoss``), the
loader being the minibatches fedlt's schedule draws (theirs: ``DataLoader(shuffle=True,
drop_last=True)``, lib/update.py:41-42; the preset sets ``drop_last``); their model — a CNN whose
forward returns ``(log_softmax(logits), x1)``, x1 the classifier's input (lib/models/models.py:54-61)
— is fedlt's MLP behind that interface; the round loop restated from ``FedProto_taskheter``
(exps/federated_main.py:44-75: each client trains a copy of its own model, keeps the result, the
server replaces ``global_protos`` by the aggregate of the round's clients) over the clients fedlt
samples (theirs: every client every round). A client's own model starts as the initial global model.

The server's prototypes sit, on fedlt's side, in the model's ``classifier.prototypes`` /
``classifier.present`` buffers; the adapter writes their ``global_protos`` into a copy of the global
model the same way, so the global weights compare as for any method.

Modes: ``matched`` and ``released`` are the same here (nothing is aligned).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from authors_code import load as load_definitions
from fedlt.algorithms.fedproto import bank_keys
from fedlt.algorithms.stateful import features_of
from fedlt.models import classifier
from fedlt_side import EpochLoader

REPO = "github.com/yuetan031/FedProto"
COMMIT = "97e42e2741e1ae2e2fce2465e80f38f6997f8836"
MODES = ("matched", "released")

WHERE = {
    "personal": ("fedlt/algorithms/fedproto.py:98-117 (ProtoUpdate.parts: objective + lam·prototype_distance)",
                 "lib/update.py:136-175 (update_weights_het)"),
    "prototypes": ("fedlt/algorithms/fedproto.py:96-106, 119-126 (the last epoch's sums, class_means)",
                   "lib/update.py:177-181 (agg_protos_label) with lib/utils.py:205-219 (agg_func)"),
    "loss": ("fedlt's train_loss: the mean step loss", "lib/update.py:195-201 (epoch_loss['total'])"),
    "global": ("fedlt/algorithms/fedproto.py:145-158 (ProtoStrategy.aggregate)",
               "lib/utils.py:221-240 (proto_aggregation)"),
}


class TheirInterface(nn.Module):
    """Their models' forward, ``(log_softmax(logits), x1)`` with x1 the classifier's input, over a
    copy of fedlt's model (whose state-dict keys it keeps)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.net = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with features_of(self.net) as seen:
            logits = self.net(x)
        return F.log_softmax(logits, dim=1), seen[0]


class Authors:
    """Their clients' own models (kept across rounds) and their server's prototypes."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        ns: dict[str, Any] = {"torch": torch, "nn": nn, "copy": copy, "np": np}
        load_definitions(git_dir, COMMIT, "lib/update.py", ["LocalUpdate"], ns)
        load_definitions(git_dir, COMMIT, "lib/utils.py", ["agg_func", "proto_aggregation"], ns)
        self.ns = ns
        self.initial, self.model = copy.deepcopy(initial), copy.deepcopy(initial)
        self.args = SimpleNamespace(optimizer="sgd", lr=config.optimiser.lr, train_ep=config.local_epochs,
                                    local_bs=config.batch_size, ld=float(config.algorithm_params.get("lam", 1.0)),
                                    num_classes=classifier(initial).prototypes.shape[0], verbose=0, device="cpu")
        self.own: dict[int, dict[str, torch.Tensor]] = {}  # their local_model_list, as state dicts
        self.global_protos: Any = []  # exps/federated_main.py:39: a list until the first aggregation
        self.round = 0

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        model = TheirInterface(copy.deepcopy(self.initial))
        if cid in self.own:
            model.net.load_state_dict(self.own[cid])
        me = SimpleNamespace(args=self.args, device="cpu", criterion=nn.NLLLoss(),
                             trainloader=EpochLoader(x, y, batches, self.args.train_ep))
        w, loss, _, protos = self.ns["LocalUpdate"].update_weights_het(
            me, self.args, cid, self.global_protos, model=model, global_round=self.round)
        protos = self.ns["agg_func"](protos)
        weights = {k.removeprefix("net."): v.detach().clone() for k, v in w.items()}
        self.own[cid] = weights
        bank = set(bank_keys(self.initial))  # the server's prototypes: not the client's own
        return {"personal": {k: v for k, v in weights.items() if k not in bank},
                "prototypes": {str(c): p.detach().clone() for c, p in sorted(protos.items())},
                "loss": loss["total"], "_protos": protos}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        self.global_protos = self.ns["proto_aggregation"]({c: results[c].pop("_protos") for c in participants})
        bank = classifier(self.model)
        with torch.no_grad():
            bank.prototypes.zero_(), bank.present.zero_()
            for label, (proto,) in self.global_protos.items():
                bank.prototypes[label] = proto
                bank.present[label] = 1.0
        self.round += 1

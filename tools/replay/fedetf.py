"""FedETF's adapter: the authors' client and server code (github.com/ZexiLee/ICCV-2023-FedETF, read from
a git snapshot at COMMIT, executed verbatim) beside fedlt's ``fedetf``.

Their pieces, as they are: ``client_fedetf`` and ``balanced_softmax_loss`` (client_funct.py:236-278),
called once per local epoch as ``Client_update`` does (client_funct.py:50-57); the client's
optimiser from ``init_optimizer`` (utils.py:261-270: SGD, momentum, weight decay over every
parameter); its class counts from ``Node.generate_sample_per_class`` (nodes.py:151-159: an absent
class counted as one); ``fedavg`` (server_funct.py:121-129) with the weights
``receive_client_models`` computes (server_funct.py:33-34: n_k / Σ n over the round's clients).
Each client is a stand-in for their ``Node``: a model kept across rounds that receives the global
weights and the ETF each round (``receive_server_model``, client_funct.py:19-24). The model is
fedlt's (the MLP's body and its ``etf`` head's projection, ETF and β) under their attribute names;
its forward restates the three lines of their ``CNNCifar10.forward`` that make the normalised
feature (models_dict/cnn.py:42-44), the body being fedlt's MLP instead of their CNN.

Two modes:

* ``released``: their code as released. The client's ``node.optimizer`` is built once, in
  ``Node.__init__`` (nodes.py:43), and the model's parameters keep their identity across rounds
  (``load_state_dict``), so SGD's momentum buffers carry over from the client's previous round
  (stale: computed on an older global model). fedlt builds the optimiser each round.
* ``matched``: the same code with the optimiser built again at every round (what fedlt does).

Not handed to them: their 30 % validation split of each client's data (``client_valid_ratio``,
nodes.py:27-35): both sides train on the client's whole partition.
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
from fedlt_side import EpochLoader, cuda_as_cpu
from golden_source import definitions, source

REPO = "github.com/ZexiLee/ICCV-2023-FedETF"
COMMIT = "092ace3471d0489c432fcde811ed7b7081042720"
MODES = ("matched", "released")

WHERE = {
    "weights": ("fedlt/algorithms/fedavg_family.py:135-175 (ClientUpdate.loop: the optimiser built each round)",
                "client_funct.py:253-278 (client_fedetf) with nodes.py:43 (node.optimizer, built once per client)"),
    "loss": ("fedlt/algorithms/fedavg_family.py:254-268 (check_parts: mean over steps)",
             "client_funct.py:52-57 (mean of per-epoch means)"),
    "global": ("fedlt/algorithms/fedavg_family.py:361-365 (Strategy.aggregate: weights n_k / Σ n)",
               "server_funct.py:20-34, 121-129 (receive_client_models, fedavg)"),
}
REASONS = {
    "released": {
        "weights": "a choice of their code, not of the paper (kept out of fedlt): each client's SGD is built once "
                   "(nodes.py:43) and keeps its momentum buffers across rounds — momentum computed on the "
                   "client's previous round's model is applied to the new global model; fedlt, as FedAvg, "
                   "starts each round's optimiser afresh",
    },
}


def load(git_dir: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"torch": torch, "F": F, "np": np, "copy": copy}
    load_definitions(git_dir, COMMIT, "client_funct.py", ["client_fedetf", "balanced_softmax_loss"], ns)
    load_definitions(git_dir, COMMIT, "utils.py", ["init_optimizer"], ns)
    load_definitions(git_dir, COMMIT, "server_funct.py", ["fedavg"], ns)
    ns.update(definitions(source(git_dir, COMMIT, "nodes.py"), ["Node.generate_sample_per_class"], ns))
    return ns


class ETFNet(nn.Module):
    """fedlt's model under their CNNCifar10's names: ``linear_proto``, ``proto_classifier.proto``,
    ``scaling_train``; ``forward`` returns (normalised feature, None, body output) as theirs."""

    def __init__(self, model: nn.Sequential) -> None:
        super().__init__()
        head = model[-1]
        self.body = copy.deepcopy(nn.Sequential(*list(model)[:-1]))
        self.linear_proto = copy.deepcopy(head.linear_proto)
        self.scaling_train = copy.deepcopy(head.scaling_train)
        self.proto_classifier = SimpleNamespace(proto=head.proto.detach().clone())
        self.head_index = len(model) - 1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        out = self.body(x)
        feature = self.linear_proto(out)  # models_dict/cnn.py:42-44
        feature_norm = torch.norm(feature, p=2, dim=1, keepdim=True).clamp(min=1e-12)
        return torch.div(feature, feature_norm), None, out

    def fedlt_state(self) -> dict[str, torch.Tensor]:
        """The weights under fedlt's keys."""
        h = self.head_index
        out = {k[len("body."):]: v for k, v in self.state_dict().items() if k.startswith("body.")}
        out.update({f"{h}.linear_proto.{k}": v for k, v in self.linear_proto.state_dict().items()})
        out[f"{h}.scaling_train"] = self.scaling_train.data
        return {k: v.detach().clone() for k, v in out.items()}


class Authors:
    """Their nodes (one per client, kept across rounds) and their server's aggregation."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        self.ns, self.mode = load(git_dir), mode
        cuda_as_cpu()  # their client_fedetf calls .cuda()
        self.central = ETFNet(initial)
        self.args = SimpleNamespace(client_method="fedetf", optimizer="sgd", lr=config.optimiser.lr,
                                    momentum=config.optimiser.momentum, local_wd_rate=config.optimiser.weight_decay)
        self.epochs, self.num_classes = config.local_epochs, initial[-1].proto.shape[1]
        self.nodes: dict[int, SimpleNamespace] = {}

    @property
    def model(self) -> nn.Module:
        state = self.central.fedlt_state()
        return SimpleNamespace(state_dict=lambda: state)

    def node(self, cid: int, x: torch.Tensor, y: torch.Tensor) -> SimpleNamespace:
        if cid not in self.nodes:  # Node.__init__ (nodes.py:37-43) and main.py:95: the initial global weights
            me = SimpleNamespace(num_classes=self.num_classes, local_data=[(x, y)], model=copy.deepcopy(self.central))
            me.sample_per_class = self.ns["generate_sample_per_class"](me, me.local_data)
            me.optimizer = self.ns["init_optimizer"](cid, me.model, self.args)
            self.nodes[cid] = me
        return self.nodes[cid]

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        me = self.node(cid, x, y)
        me.model.load_state_dict(copy.deepcopy(self.central.state_dict()))  # receive_server_model
        me.model.proto_classifier.proto = copy.deepcopy(self.central.proto_classifier.proto)
        if self.mode == "matched":
            me.optimizer = self.ns["init_optimizer"](cid, me.model, self.args)
        me.local_data = EpochLoader(x, y, batches, self.epochs)
        losses = [self.ns["client_fedetf"](self.args, me) for _ in range(self.epochs)]  # client_funct.py:52-56
        return {"weights": me.model.fedlt_state(), "loss": sum(losses) / len(losses),
                "state": copy.deepcopy(me.model.state_dict())}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        weights = [sizes[c] for c in participants]
        weights = [w / sum(weights) for w in weights]  # receive_client_models
        self.central.load_state_dict(self.ns["fedavg"]([results[c]["state"] for c in participants], weights))

    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Their ``validate`` of the global model: argmax of β·feature·M (utils.py ``validate``'s fedetf branch)."""
        with torch.no_grad():
            feature, _, _ = self.central(x)
            logits = self.central.scaling_train * (feature @ self.central.proto_classifier.proto)
        return float((logits.argmax(1) == y).double().mean())

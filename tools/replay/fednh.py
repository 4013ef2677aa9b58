"""FedNH's adapter: the authors' client and server code (github.com/Yutong-Dai/FedNH, read from a git
snapshot at COMMIT, executed verbatim) beside fedlt's ``fednh``.

Their pieces, as they are: ``FedUHClient.training`` (src/flbase/strategies/FedUH.py:80-113: SGD from
their ``setup_optimizer``, CE, the gradient norm clipped at 10 over the trainable parameters),
``FedNHClient._estimate_prototype`` (FedNH.py:29-58, the upload) and ``FedNHServer.aggregate``
(FedNH.py:108-164: the participants' mean update times the server lr, the semantic infusion with
smoothing 0.9), each called with a stand-in for ``self`` holding what their ``__init__`` builds;
``setup_optimizer`` and ``linear_combination_state_dict`` (src/flbase/utils.py). The round loop
(their ``Server.run``) is restated: every participant gets the server's weights, trains, uploads.

What the adapter writes itself: their ``Conv2CifarNH`` is fedlt's model with the ``prototypes``
head behind their interface (``forward -> logits``, or ``(normalised features, logits)`` when
``return_embedding``; ``.prototype``); their state dicts name the prototypes ``prototype`` (fedlt's
head buffer renamed); their ``trainloader`` yields fedlt's minibatches epoch by epoch (and, for the
prototype estimate, the client's set in order); ``setup_seed`` (global seeds; the loaders are
fedlt's) is a no-op. Their model normalises the prototypes in every forward (CNN.py:64-66); fedlt
uses them as stored (unit rows: the server normalises them), equal up to rounding.

Modes: ``matched`` (their client lr constant: ``lr_decay_per_round`` 1.0) and ``released``
(their CIFAR command's ``--client_lr_scheduler diminishing``, 0.99 a round, src/flbase/utils.py:21).
"""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedic import featured
from fedlt_side import EpochLoader, default_dtype
from golden_source import definitions, source

from fedlt.models import classifier

REPO = "github.com/Yutong-Dai/FedNH"
COMMIT = "60c3161412d576cddc8187af318cdc8a91a8709f"
MODES = ("matched", "released")
CONFIG = {"algorithm_params": {}}

WHERE = {
    "weights": ("fedlt/algorithms/fedavg_family.py (the FedAvg family's client loop, the prototypes head)",
                "src/flbase/strategies/FedUH.py:80-113 (FedUHClient.training)"),
    "prototypes": ("fedlt/server_steps/fednh.py: class_prototypes", "FedNH.py:29-58 (FedNHClient._estimate_prototype)"),
    "global": ("fedlt 'mean' aggregator; fedlt/server_steps/fednh.py: semantic_infusion",
               "FedNH.py:108-164 (FedNHServer.aggregate)"),
}
REASONS = {"released": {"weights": "their client lr decays 0.99 a round (diminishing, src/flbase/utils.py:21); "
                                   "fedlt keeps it constant"}}


class Loader:
    """Their ``trainloader``: each iteration the next epoch of fedlt's minibatches; ``.dataset``'s length."""

    def __init__(self, epochs: list[list[tuple[torch.Tensor, torch.Tensor]]], n: int) -> None:
        self.epochs, self.dataset = epochs, range(n)

    def __iter__(self):
        return iter(self.epochs.pop(0))


class Authors:
    """Their server state (``server_model_state_dict``) and a client stand-in per participant and round."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        from authors_code import load
        self.ns: dict[str, Any] = {"torch": torch, "F": F, "deepcopy": copy.deepcopy, "setup_seed": lambda seed: None}
        load(git_dir, COMMIT, "src/flbase/utils.py", ["setup_optimizer", "linear_combination_state_dict"], self.ns)
        self.fns = definitions(source(git_dir, COMMIT, "src/flbase/strategies/FedNH.py"),
                               ["FedNHClient._estimate_prototype", "FedNHServer.aggregate"], self.ns)
        self.fns.update(definitions(source(git_dir, COMMIT, "src/flbase/strategies/FedUH.py"),
                                    ["FedUHClient.training"], self.ns))
        self.config = config
        self.dtype = next(initial.parameters()).dtype
        self.net = featured(initial)
        self.key = next(k for k in self.net.state_dict() if k.endswith("prototype"))  # the head's buffer
        self.client_config = {"global_seed": 0, "client_lr_scheduler": "diminishing", "client_lr": config.optimiser.lr,
                              "lr_decay_per_round": 1.0 if mode == "matched" else 0.99, "optimizer": "SGD",
                              "sgd_momentum": config.optimiser.momentum,
                              "sgd_weight_decay": config.optimiser.weight_decay, "num_rounds": config.rounds,
                              "num_classes": 10}
        self.server = SimpleNamespace(
            server_config={"learning_rate": 1.0, "lr_decay_per_round": 1.0, "num_classes": 10,
                           "FedNH_server_adv_prototype_agg": False, "FedNH_smoothing": 0.9},
            clients_dict={0: SimpleNamespace(device="cpu")}, exclude_layer_keys=set(),
            server_model_state_dict=self.theirs(self.net.state_dict()))
        self.round = 1  # their rounds count from 1

    def theirs(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {("prototype" if k == self.key else k): v.detach().clone() for k, v in state.items()}

    def fedlt_names(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {(self.key if k == "prototype" else k): v.detach().clone() for k, v in state.items()}

    @property
    def model(self) -> Any:
        state = self.fedlt_names(self.server.server_model_state_dict)
        return SimpleNamespace(state_dict=lambda: state)

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        model = copy.deepcopy(self.net)
        model.load_state_dict(self.fedlt_names(self.server.server_model_state_dict))  # their set_params
        model.return_embedding = False
        base = type(model)

        def forward(x_):
            features, logits = base.forward(model, x_)
            if model.return_embedding:  # their feature_embedding is normalised (CNN.py:60-62)
                return features / torch.norm(features, p=2, dim=1, keepdim=True).clamp(min=1e-12), logits
            return logits

        model.forward = forward
        model.prototype = classifier(model).prototype
        epochs = EpochLoader(x, y, batches, self.config.local_epochs).epochs
        counts = Counter(y.tolist())
        me = SimpleNamespace(model=model, criterion=nn.CrossEntropyLoss(), client_config=self.client_config,
                             trainloader=Loader(epochs, len(y)), num_rounds_particiapted=0, device="cpu",
                             train_loss_dict={}, train_acc_dict={}, count_by_class=counts,
                             count_by_class_full=torch.tensor([counts[c] if c in counts else 1e-12 for c in range(10)]))
        with default_dtype(self.dtype):
            self.fns["FedUHClient.training"](me, self.round, self.config.local_epochs)
            me.trainloader = Loader([[(x[i:i + 256], y[i:i + 256]) for i in range(0, len(y), 256)]], len(y))
            shared = self.fns["FedNHClient._estimate_prototype"](me)
        self.uploads = getattr(self, "uploads", {})
        self.uploads[cid] = (self.theirs(me.new_state_dict), shared)
        return {"weights": self.fedlt_names(me.new_state_dict), "loss": None,
                "prototypes": {"scaled": shared["scaled_prototype"], "counts": shared["count_by_class_full"]}}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        with default_dtype(self.dtype):
            self.fns["FedNHServer.aggregate"](self.server, [self.uploads[c] for c in participants], self.round)
        self.round += 1

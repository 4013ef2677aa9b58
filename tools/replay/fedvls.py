"""FedVLS's adapter: the authors' own client and server (github.com/krumpguo/FedVLS at COMMIT, a
PFLlib fork, read from a git snapshot and executed verbatim) beside fedlt's ``fedvls``.

Their pieces, as they are: the class ``clientVLS`` (system/flcore/clients/clientvls.py:10-116:
``__init__``, ``train`` with its class-count pass on the first round, ``set_parameters`` and its
teacher copy, the three losses) and the class ``FedVLS`` (system/flcore/servers/servervls.py:
``send_models``, ``receive_models``, ``aggregate_parameters``), whose ``__init__`` (it reads their
data) is not run: the attributes those methods read are set. Their code calls ``.cuda()`` on
tensors unconditionally (clientvls.py:51, 56-57, 97-98); the replay runs it on the CPU with
``Tensor.cuda`` answering the tensor itself (``fedlt_side.cuda_as_cpu``; tools/fedvls_repro's
patch_authors.sh deletes the calls from a copy instead). ``clientVLS.train`` is handed a loader
that yields, per iteration, the class-count pass (the client's whole data once, its first round
only) and then each epoch of the minibatches fedlt's schedule drew. The model is fedlt's (their
code calls it as a whole: ``self.model(x)``), so the weights carry fedlt's names on both sides.

Constants: λ = 0.1 (fedlt's ``fedvls(lam=0.1)``; their ``-lam`` defaults to 1.0, main.py:222, and
their README's commands give ``-lam 0.1``). Modes: ``matched`` makes their float32 class counts
and prior (``torch.Tensor(...).float()``) in the model's dtype, ``released`` leaves them float32
(the two differ in float64 only).
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import time
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from authors_code import load as load_definitions
from fedlt_side import EpochLoader, cuda_as_cpu

REPO = "github.com/krumpguo/FedVLS"
COMMIT = "7d8163f4410ecef565a1d4e27703cd4bcab403d5"
MODES = ("matched", "released")

WHERE = {
    "weights": ("fedlt/losses/fedvls.py:164-185 (logit_adjust + lam·vacant_kd + logit_suppression), "
                "fedlt/algorithms/fedavg_family.py:135-175",
                "system/flcore/clients/clientvls.py:40-115"),
    "global": ("fedlt/algorithms/fedavg_family.py:361-365", "system/flcore/servers/servervls.py:146-176"),
}
REASONS = {"released": {
    "weights": "float64 only: their class counts and prior are float32 (clientvls.py:51-52, 97-98: "
               "torch.Tensor(...).float()), so log(prior) carries float32 rounding into the float64 logits; "
               "fedlt's keep the run's dtype (matched mode makes theirs so). In float32 the two agree"}}


@contextlib.contextmanager
def counts_in(dtype: torch.dtype | None) -> Iterator[None]:
    """With ``dtype`` (matched mode), their float32 counts and prior (``torch.Tensor(...).float()``,
    clientvls.py:51, 97-98) made in the model's dtype for the duration; None: as released."""
    to_float, default = torch.Tensor.float, torch.get_default_dtype()
    if dtype is not None:
        torch.Tensor.float = lambda self, *a, **k: self.to(dtype)
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.Tensor.float = to_float
        torch.set_default_dtype(default)


class CountThenEpochs(EpochLoader):
    """Their ``trainloader`` for one round: first (a client's first round only) the pass
    clientvls.py:47-50 counts the classes with, then one epoch per iteration."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], epochs: int,
                 count_pass: bool) -> None:
        super().__init__(x, y, batches, epochs)
        if count_pass:
            self.epochs.insert(0, [(x, y)])


class Authors:
    """Their clients (all built up front, kept across rounds) and their server."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        self.ns: dict[str, Any] = {"torch": torch, "nn": nn, "np": np, "F": F, "copy": copy, "time": time,
                                   "parameters_to_vector": torch.nn.utils.parameters_to_vector}
        load_definitions(git_dir, COMMIT, "system/flcore/clients/clientvls.py", ["clientVLS"], self.ns)
        load_definitions(git_dir, COMMIT, "system/flcore/servers/servervls.py", ["FedVLS"], self.ns)
        self.initial, self.config, self.round, self.mode = copy.deepcopy(initial), config, 0, mode
        self.lam = _lam(config.algorithm_params.get("loss", "fedvls(lam=0.1)"))
        cuda_as_cpu()

    def attach(self, side: Any) -> None:
        c = self.config
        args = SimpleNamespace(model=self.initial, algorithm="FedVLS", dataset="replay", device="cpu",
                               num_classes=10, batch_size=c.batch_size, local_learning_rate=c.optimiser.lr,
                               local_epochs=c.local_epochs, weight_decay=c.optimiser.weight_decay, beta=0.005,
                               lamda=self.lam)
        clients = [self.ns["clientVLS"](args, id=cid, train_samples=len(side.client(cid))) for cid in range(c.clients)]
        self.server = object.__new__(self.ns["FedVLS"])
        self.server.__dict__.update(clients=clients, selected_clients=[], global_model=copy.deepcopy(self.initial),
                                    uploaded_ids=[], uploaded_weights=[], uploaded_models=[])

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        client = self.server.clients[cid]
        self.server.selected_clients = [client]  # send_models sends to the round's selected clients
        self.server.send_models()
        loader = CountThenEpochs(x, y, batches, self.config.local_epochs, client.num_per_class is None)
        dtype = next(client.model.parameters()).dtype if self.mode == "matched" else None
        with counts_in(dtype), contextlib.redirect_stdout(io.StringIO()):  # their per-epoch prints
            client.train(loader, self.round)
        return {"weights": {k: v.detach().clone() for k, v in client.model.state_dict().items()}, "loss": None}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        self.server.selected_clients = [self.server.clients[c] for c in participants]
        self.server.receive_models()
        self.server.aggregate_parameters()
        self.round += 1

    def global_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.server.global_model.state_dict().items()}


def _lam(loss: str) -> float:
    """λ of a ``fedvls(lam=...)`` loss expression (fedlt's preset: 0.1)."""
    found = re.search(r"fedvls\(\s*lam\s*=\s*([0-9.eE+-]+)", loss)
    return float(found.group(1)) if found else 0.1

"""PFLlib's common parts for the personalised methods' adapters (github.com/TsingZ0/PFLlib at
COMMIT, read from a git snapshot and executed verbatim; nothing of theirs is committed).

What runs as they wrote it: the class ``Client`` (system/flcore/clients/clientbase.py) and the
method's client class on top of it (``clientPer``, ``clientRep``, ...: ``__init__``, ``train``,
``set_parameters``, ``test_metrics``, ``fine_tune``), and the class ``Server``
(system/flcore/servers/serverbase.py) with the method's server class on top of it (its own
``receive_models`` where it has one): ``send_models``, ``receive_models``,
``aggregate_parameters``, ``add_parameters``, ``fine_tuning_new_clients``. Their constructors
are called with an ``args`` stand-in holding main.py's defaults and the replay's settings; a
server's ``__init__`` (which reads their data files) is not run: the attributes its methods read
are set instead (serverbase.py:13-64), all clients built up front as ``set_clients`` does
(serverbase.py:66-76).

What the adapter supplies in place of theirs: ``read_client_data`` (a reference to the client's
data) and ``DataLoader`` (clientbase.py:59, 65): a training loader yields, epoch by epoch, the
minibatches fedlt's schedule drew for that call (the round's, FedRep's head phase's, a
fine-tune's); a test loader yields the replay's test set in order; the sample count FedRoD's
``__init__`` takes from a loader (clientrod.py:22-26) sees every sample once in ``matched`` mode,
and a real ``DataLoader(drop_last=True, shuffle=True)`` in ``released`` mode. sklearn's
``label_binarize`` / ``roc_auc_score`` (only ``test_metrics``' AUC) are stand-ins that keep the
scores ``test_metrics`` computed, which the replay compares.

The model: fedlt's, split as PFLlib's main.py does (main.py:187-189: the classifier moved to
``head``, an ``nn.Identity`` in its place, ``BaseHeadSplit(model, head)``,
system/flcore/trainmodel/models.py:9-20, executed verbatim).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import TensorDataset

from authors_code import load as load_definitions
from fedlt_side import EpochLoader
from fedlt.models import classifier

REPO = "github.com/TsingZ0/PFLlib"
COMMIT = "d832e76f6a23b833038949ec1e4fdefe63a4d350"
MODES = ("matched", "released")
CLIENTS, SERVERS = "system/flcore/clients/", "system/flcore/servers/"


@dataclasses.dataclass
class ClientRef:
    """What ``read_client_data`` returns here: which client's data, which split."""

    id: int
    is_train: bool


class Feed:
    """The loaders their ``load_train_data`` / ``load_test_data`` get, queued per client."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.queued: dict[int, list[Any]] = {}
        self.test: tuple[torch.Tensor, torch.Tensor] | None = None

    def put(self, cid: int, loader: Any) -> None:
        self.queued.setdefault(cid, []).append(loader)

    def loader(self, ref: ClientRef, batch_size: int, drop_last: bool = False, shuffle: bool = False) -> Any:
        if not ref.is_train:
            return [self.test]
        if self.queued.get(ref.id):
            return self.queued[ref.id].pop(0)
        x, y = self.data[ref.id]  # not a round's training: FedRoD's sample count (clientrod.py:22-26)
        if self.mode == "released":
            return TorchLoader(TensorDataset(x, y), batch_size, drop_last=drop_last, shuffle=shuffle)
        return [(x, y)]


def their_keys(model: nn.Module) -> dict[str, str]:
    """fedlt's state-dict key -> where PFLlib's client holds it: ``model.base.K`` (the body),
    ``model.head.K`` (the classifier; FedRoD's generic head), ``head.K`` (FedRoD's personal head,
    clientrod.py:15)."""
    head = classifier(model)
    prefix = next(name for name, m in model.named_modules() if m is head) + "."
    out = {}
    for k in model.state_dict():
        rest = k.removeprefix(prefix)
        if rest == k:
            out[k] = f"model.base.{k}"
        elif rest.startswith("personal."):
            out[k] = f"head.{rest.removeprefix('personal.')}"
        else:
            out[k] = f"model.head.{rest.removeprefix('generic.')}"
    return out


def split_model(model: nn.Module, base_head_split: type) -> nn.Module:
    """main.py:187-189 on a copy of fedlt's model: ``head`` its classifier (FedRoD: the generic
    head), an ``nn.Identity`` in the classifier's place, both in ``BaseHeadSplit``."""
    base = copy.deepcopy(model)
    head = classifier(base)
    for module in base.modules():
        for name, child in module.named_children():
            if child is head:
                setattr(module, name, nn.Identity())
    return base_head_split(base, copy.deepcopy(getattr(head, "generic", head)))


def read(owner: Any, path: str) -> torch.Tensor:
    """The tensor at ``path`` (``model.base.1.weight``: the client's ``model``, its state-dict key
    ``base.1.weight``)."""
    attr, key = path.split(".", 1)
    return getattr(owner, attr).state_dict()[key].detach().clone()


class Metrics:
    """sklearn's ``metrics`` and ``label_binarize`` as ``test_metrics`` calls them (clientbase.py:
    107, 118): the scores it collected are kept (``last``), the AUC is not computed."""

    def __init__(self) -> None:
        self.last: Any = None

    def roc_auc_score(self, y_true: Any, y_prob: Any, average: str = "micro") -> float:
        self.last = y_prob
        return float("nan")

    @staticmethod
    def label_binarize(y: Any, classes: Any) -> Any:
        return y


class PFLlib:
    """One PFLlib method's clients and server, kept across rounds. A method's adapter names its
    client and server classes and where they keep what they upload (``UPLOADS``) and the
    client's own part (``KEEPS``: a path prefix of :func:`their_keys`; ``PERSONAL_FROM``
    renames ``model`` for a method with a whole personal model), and may override ``train`` (what
    the server calls per participant), ``params`` (its ``args``), ``round_batches`` (the loader of
    a round) and ``personal`` (how a client's personal model is scored)."""

    CLIENT: tuple[str, str] = ("clientavg.py", "clientAVG")
    SERVER: tuple[str, str] = ("serveravg.py", "FedAvg")
    EXTRA: tuple[tuple[str, list[str]], ...] = ()  # other definitions their classes use (file, names)
    UPLOADS = "model"
    KEEPS: str | None = None
    PERSONAL_FROM = "model"
    SCORES = "logits"  # what the scoring method collects: the outputs, or their softmax (FedRoD, Ditto)
    SCORED_BY = "test_metrics"  # the client's method that scores its personal model
    # a client not trained yet is scored with its initial personal model (Ditto's, APFL's
    # model_per) where fedlt scores the global model: compared in released mode only
    UNTRAINED_DIFFER = False
    WHERE: dict[str, tuple[str, str]] = {}
    REASONS: dict[str, dict[str, str]] = {}

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        self.mode, self.config, self.feed, self.metrics = mode, config, Feed(mode), Metrics()
        self.ns = self.load(git_dir)
        self.names = their_keys(initial)
        self.initial = split_model(initial, self.ns["BaseHeadSplit"])
        self.round = 0
        self.sent = False
        self.trained: set[int] = set()
        self.side = side
        self.server = self.build_server(side)

    def load(self, git_dir: str) -> dict[str, Any]:
        ns: dict[str, Any] = {"torch": torch, "nn": nn, "np": np, "F": F, "copy": copy, "os": os, "time": time,
                              "random": random.Random(0), "Optimizer": Optimizer, "h5py": None, "DLG": None,
                              "read_client_data": lambda dataset, idx, is_train=True, few_shot=0: ClientRef(idx, is_train),
                              "DataLoader": lambda data, batch_size, **kw: self.feed.loader(data, batch_size, **kw)}
        ns["metrics"], ns["label_binarize"] = self.metrics, Metrics.label_binarize
        load_definitions(git_dir, COMMIT, "system/flcore/trainmodel/models.py", ["BaseHeadSplit"], ns)
        for path, names in self.EXTRA:
            load_definitions(git_dir, COMMIT, path, names, ns)
        load_definitions(git_dir, COMMIT, CLIENTS + "clientbase.py", ["Client"], ns)
        load_definitions(git_dir, COMMIT, CLIENTS + self.CLIENT[0], [self.CLIENT[1]], ns)
        load_definitions(git_dir, COMMIT, SERVERS + "serverbase.py", ["Server"], ns)
        if self.SERVER[1] != "Server":
            load_definitions(git_dir, COMMIT, SERVERS + self.SERVER[0], [self.SERVER[1]], ns)
        return ns

    def params(self) -> dict[str, Any]:
        """main.py's arguments the clients read (main.py:395-471 defaults; the replay's settings)."""
        c = self.config
        return dict(model=self.initial, algorithm=self.SERVER[1], dataset="replay", device="cpu",
                    save_folder_name="items", num_classes=10, batch_size=c.batch_size,
                    local_learning_rate=c.optimiser.lr, local_epochs=c.local_epochs, few_shot=0,
                    learning_rate_decay=False, learning_rate_decay_gamma=0.99, plocal_epochs=1,
                    fine_tuning_epochs=10, fine_tuning_epoch_new=0, mu=0.0, alpha=1.0)

    def build_server(self, side: Any) -> Any:
        """Their server and all its clients, built up front as ``Server.__init__`` and ``set_clients``
        do, on the clients' data of fedlt's side."""
        args = SimpleNamespace(**self.params())
        clients = []
        for cid in range(self.config.clients):
            data = side.client(cid)
            self.feed.data[cid] = (data.x, data.y)
            with torch.random.fork_rng(devices=[]):  # Client.__init__ seeds torch's generator (clientbase.py:18)
                clients.append(self.ns[self.CLIENT[1]](args, id=cid, train_samples=len(data), test_samples=0,
                                                       train_slow=False, send_slow=False))
        server = object.__new__(self.ns[self.SERVER[1]])
        server.__dict__.update(args=args, device="cpu", clients=clients, selected_clients=[], uploaded_ids=[],
                               uploaded_weights=[], uploaded_models=[], global_model=self.initial_global(),
                               learning_rate=args.local_learning_rate, client_drop_rate=0.0, time_threthold=10000,
                               current_num_join_clients=0, new_clients=[], fine_tuning_epoch_new=0,
                               num_new_clients=0, eval_new_clients=False)
        return server

    def initial_global(self) -> nn.Module:
        """The server's global model before round 1 (serverbase.py:23: a copy of the model)."""
        return copy.deepcopy(self.initial)

    # -- a round ------------------------------------------------------------------------------------
    def loaders(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor]) -> list[Any]:
        """The loaders the client's round asks for, in order: one over the round's minibatches
        (Ditto's two passes: two; FedRep's: its head phase's epochs, then the round's)."""
        return [EpochLoader(x, y, batches, self.config.local_epochs)]

    def train(self, client: Any) -> None:
        client.train()

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        if not self.sent:  # each round starts by sending the global model to every client
            self.server.send_models()
            self.sent = True
        client = self.server.clients[cid]
        for loader in self.loaders(cid, x, y, batches):
            self.feed.put(cid, loader)
        self.train(client)
        self.trained.add(cid)
        out = {"weights": self.part(client, self.UPLOADS), "loss": None}
        if self.KEEPS is not None:
            out["personal"] = self.part(client, self.KEEPS, self.PERSONAL_FROM)
        return out

    def part(self, client: Any, prefix: str, holder: str = "model") -> dict[str, torch.Tensor]:
        """The tensors of one of the client's parts (``prefix`` of :func:`their_keys`' paths),
        under fedlt's names; ``holder``: the client's attribute that holds it in place of ``model``
        (``model_per``: Ditto's and APFL's personal model)."""
        return {k: read(client, holder + path.removeprefix("model") if path.startswith("model.") else path)
                for k, path in self.names.items() if path.startswith(prefix + ".")}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        server = self.server
        server.selected_clients = [server.clients[c] for c in participants]
        server.current_num_join_clients = len(participants)
        server.receive_models()
        expected = {id(self.module(server.clients[c], self.UPLOADS)) for c in participants}
        if {id(m) for m in server.uploaded_models} != expected:
            raise SystemExit(f"{self.SERVER[1]}.receive_models uploads other modules than {self.UPLOADS!r}")
        server.aggregate_parameters()
        self.round += 1
        self.sent = False

    @staticmethod
    def module(client: Any, path: str) -> nn.Module:
        for part in path.split("."):
            client = getattr(client, part)
        return client

    def global_weights(self) -> dict[str, torch.Tensor]:
        """Their global model (what ``aggregate_parameters`` built: the uploaded part) under fedlt's names."""
        state = self.server.global_model.state_dict()
        return {k: state[path.removeprefix(self.UPLOADS + ".")].detach().clone()
                for k, path in self.names.items() if path.startswith(self.UPLOADS + ".")}

    # -- the personal models, as PFLlib scores them -----------------------------------------------------
    def personal(self, client: Any) -> Any:
        """The client object whose ``test_metrics`` scores its personal model (after ``send_models``)."""
        return client

    def sends_before_scoring(self) -> bool:
        return True

    def personal_scores(self, cid: int, x: torch.Tensor, y: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """Client ``cid``'s personal model on the test set as PFLlib's evaluation at the next round's
        start sees it (serverbase.py:103-112 then 194-210): its correct count and the scores
        ``test_metrics`` collected; None for a client this mode leaves out of the comparison."""
        if self.UNTRAINED_DIFFER and self.mode == "matched" and cid not in self.trained:
            return None
        if self.sends_before_scoring():
            self.server.send_models()
            self.sent = True
        self.feed.test = (x, y)
        correct, total, _ = getattr(self.personal(self.server.clients[cid]), self.SCORED_BY)()
        return int(correct), torch.as_tensor(self.metrics.last)  # (test samples, classes)

"""FedLF's adapter: the authors' client loop (github.com/18sym/FedLF, ``algorithm/our.py``, read from a
git snapshot at COMMIT, executed verbatim) beside fedlt's ``fedlf``.

Their pieces, as they are: ``Local.local_train`` (algorithm/our.py:388-476: FedRS-scaled logits
h·Wᵀ ⊙ a, the epoch's running class means f_k, CE + 0.5·L1(f_k, f_G) once f_G ≠ 0), called with a
stand-in for ``self`` holding what ``Local.__init__`` builds (our.py:298-320: plain SGD over the
model, cross-entropy) and, in their module's namespace, a ``DataLoader`` that yields the next epoch
of fedlt's minibatches, ``transforms`` whose ``Compose`` is the identity (their
``transform_train``, our.py:391-393, crops and flips each batch; the replay trains without
augmentation on both sides) and a silent ``logger``; ``Global.initialize_for_model_fusion``
(our.py:208-222), the size-weighted average. The server loop's class-centre update (our.py:640-654,
inside ``our()``, not importable) is restated below in its lines.

The model is fedlt's ``resnet8`` (their ResNet_cifar, resnet_size 8, scaling 4: the 256-d
representation their code hard-codes at our.py:400 and 547), called as theirs: ``hs, _ =
model(x)`` (the representation and the logits) and ``model.classifier.weight``. The replay sets
``warm_up = 0`` (their ``--warm_up_epoch``, default 10) so that the class centres act within 3
rounds. One mode: nothing is aligned.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import CrossEntropyLoss

from fedlt_side import EpochLoader, default_dtype
from golden_source import definitions, source

from fedlt.algorithms.stateful import features_of
from fedlt.models import classifier

REPO = "github.com/18sym/FedLF"
COMMIT = "99f98b37e787713f5463214a79d36dbafa7dfd16"
MODES = ("matched", "released")
CONFIG = {"model": "resnet8", "algorithm_params": {"warm_up": 0}}

WHERE = {
    "weights": ("fedlt/algorithms/longtail.py:237-251 (FedLFUpdate.terms)", "algorithm/our.py:388-476 (local_train)"),
    "centres": ("fedlt/algorithms/longtail.py:253-256 (the last epoch's running means)",
                "algorithm/our.py:474 (f_k = f_k_mean)"),
    "global": ("fedlt/algorithms/longtail.py:280-286 (FedAvg; update_centres)",
               "algorithm/our.py:208-222, 640-654 (initialize_for_model_fusion; f_G)"),
}


COUNTERS = ("BatchNorm's num_batches_tracked: their initialize_for_model_fusion averages the int64 counters by "
            "size (a float) and load_state_dict truncates it into the int64 buffer (our.py:208-222); fedlt "
            "keeps the largest (fedlt/aggregators.py:55); BatchNorm with momentum 0.1 never reads them")


class _Silent:
    def info(self, *args: Any, **kwargs: Any) -> None:
        pass


class FeatureNet(nn.Module):
    """fedlt's model as their ResNet_cifar is called: ``(representation, logits)``, ``.classifier``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = copy.deepcopy(model)

    @property
    def classifier(self) -> nn.Linear:
        return classifier(self.model)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with features_of(self.model) as seen:
            logits = self.model(x)
        return seen[0].flatten(1), logits


def fedlt_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("model."):]: v.detach().clone() for k, v in state.items()}


def load(git_dir: str) -> dict[str, Any]:
    # their augmentation (our.py:391-393, RandomCrop(32, padding=4) + flip, one draw per batch) as the identity
    identity = SimpleNamespace(Compose=lambda steps: (lambda images: images), RandomCrop=lambda *a, **k: None,
                               RandomHorizontalFlip=lambda *a, **k: None)
    ns: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "np": np, "copy": copy, "logger": _Silent(),
                          "CrossEntropyLoss": CrossEntropyLoss, "transforms": identity}
    ns.update(definitions(source(git_dir, COMMIT, "algorithm/our.py"),
                          ["Local.local_train", "Global.initialize_for_model_fusion"], ns))
    return ns


class Authors:
    """Their server state (the global weights, f_G) and a fresh ``Local`` per participant and round."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        self.ns = load(git_dir)
        self.global_net = FeatureNet(initial)
        params = config.algorithm_params
        self.warm_up, self.round = int(params.get("warm_up", 10)), 0
        dtype = next(initial.parameters()).dtype
        head = classifier(initial)
        self.f_G = torch.zeros(head.out_features, head.in_features, dtype=dtype)  # our.py:547
        self.args = SimpleNamespace(num_epochs_local_training=config.local_epochs, rs_alpha=float(params.get("alpha", 0.25)),
                                    batch_size_local_training=config.batch_size, lr_local_training=config.optimiser.lr)
        self.counts: dict[int, torch.Tensor] = {}

    @property
    def model(self) -> Any:
        state = fedlt_keys(self.global_net.state_dict())
        return SimpleNamespace(state_dict=lambda: state)

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        me = SimpleNamespace(local_model=copy.deepcopy(self.global_net), device="cpu", num_classes=len(self.f_G),
                             criterion=CrossEntropyLoss(), data_client=None)
        me.optimizer = torch.optim.SGD(me.local_model.parameters(), lr=self.args.lr_local_training)  # our.py:320
        loader = EpochLoader(x, y, batches, self.args.num_epochs_local_training)
        self.ns["DataLoader"] = lambda **kwargs: loader  # our.py:408: each call, the next epoch
        cnts = torch.bincount(y, minlength=len(self.f_G))  # original_dict_per_client[client]
        dist = cnts / cnts.sum()  # our.py:598
        with default_dtype(self.f_G.dtype):  # their torch.zeros (f_k, class_count) take the default dtype
            params, f_k = self.ns["local_train"](me, self.args, copy.deepcopy(self.global_net.state_dict()), dist,
                                                 copy.deepcopy(self.f_G), _Silent())
        return {"weights": fedlt_keys(params), "centres": {"centres": f_k.detach().clone()}, "state": params,
                "loss": None}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        fuse = self.ns["initialize_for_model_fusion"]
        self.global_net.load_state_dict(fuse(None, [results[c]["state"] for c in participants],
                                             [sizes[c] for c in participants]))
        self.round += 1
        r, f_locals = self.round, [results[c]["centres"]["centres"] for c in participants]
        if r > self.warm_up:  # our.py:640-654, restated
            if r == self.warm_up + 1:
                sum_f_k = torch.zeros_like(f_locals[0])
                for f_k in f_locals:
                    sum_f_k += f_k
                self.f_G = sum_f_k / len(f_locals)
            else:
                sim = torch.nn.CosineSimilarity(dim=1)
                tmp, w_sum = 0, 0
                for i in f_locals:
                    sim_weight = sim(self.f_G, i).reshape(len(self.f_G), 1)
                    w_sum += sim_weight
                    tmp += sim_weight * i
                self.f_G = torch.div(tmp, w_sum)

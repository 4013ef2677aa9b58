"""Fed-GraB's adapter: the authors' client loop and server aggregation (github.com/ZackZikaiXiao/FedGraB,
read from a git snapshot at COMMIT, executed verbatim) beside fedlt's ``fedgrab``.

Their pieces, as they are: ``PIDLOSS`` (with ``PID``, ``Hook`` and ``random_unit``,
util/losses.py), one per client kept across rounds as fed_grab.py:78-86 builds and configures it;
``LocalUpdate.update_weights_pid`` (util/update_baseline.py:92-127), the local loop, called with
a stand-in for ``self`` whose ``ldr_train`` yields fedlt's minibatches; ``FedAvg_noniid``
(util/fedavg.py:54), the aggregation. The server loop of fed_grab.py:89-110 (a ``__main__`` block,
not importable) is restated below in its ten lines.

Two modes:

* ``released``: their code as released. ``update_weights_pid`` optimises ``net.parameters()``
  only (util/update_baseline.py:98), so the classifier (``GBA_Layer``) is never stepped; SGB's
  gates come from their fixed prior 0.1^(i/(C−1)) over the class index (util/losses.py:162-176),
  drawn with Python's ``random`` (seeded 0 here), not from DPA; the aggregation pairs the clients'
  weights (trained in order 0..K−1, fed_grab.py:92) with the sizes of a random permutation of the
  clients (fed_grab.py:91,100).
* ``classifier``: as released, except that the classifier is stepped (the whole model is ``net``):
  an ablation, to tell which of their choices a run's behaviour comes from.
* ``matched``: the same code with those three choices aligned to fedlt, to show that everything
  else agrees: the whole model is ``net`` (``GBA_Layer`` is the identity, so the classifier is
  stepped as fedlt steps it), ``random_unit`` returns the gates fedlt's SGB drew from its DPA
  prior at that step, and the sizes are paired with their clients.
"""

from __future__ import annotations

import copy
import math
import random
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.loss import _Loss

from authors_code import load as load_definitions
from fedlt_side import EpochLoader, default_dtype
from golden_source import definitions, source

REPO = "github.com/ZackZikaiXiao/FedGraB"
COMMIT = "7394da67dc313ee2dddf82bf19ba100778709100"
MODES = ("matched", "released", "classifier")

# where each quantity is computed, on both sides (what a difference is reported with)
WHERE = {
    "gates": ("fedlt/losses/fedgrab.py:229-236 (r ≤ the DPA prior of the received classifier)",
              "util/losses.py:162-176 (random_unit(0.1^(tail_id/(C−1))), tail_id advancing on each gate)"),
    "sgb": ("fedlt/losses/fedgrab.py:220-247", "util/losses.py:98-203, 297-316, 430-483"),
    "weights": ("fedlt/algorithms/fedavg_family.py:144-145 (SGD over every trainable parameter)",
                "util/update_baseline.py:92-127 (SGD over net.parameters() only, line 98)"),
    "global": ("fedlt/algorithms/fedavg_family.py:361-365 (Strategy.aggregate: weights n_k / Σ n)",
               "util/fedavg.py:54-68 with fed_grab.py:91,100 (sizes of a random permutation)"),
    "loss": ("fedlt/algorithms/fedavg_family.py:254-268 (check_parts: mean over steps)",
             "util/update_baseline.py:123-127 (mean of per-epoch means)"),
}

REASONS = {
    "released": {
        "gates": "code vs paper (kept: fedlt follows the paper's DPA, SPEC §2): their released loop gates with a "
                 "fixed geometric prior over the class index, not the DPA prior of the global classifier",
        "weights": "a bug of theirs (kept out of fedlt): update_weights_pid's optimiser holds the backbone only, so "
                   "the classifier stays at its initial value for the whole run and DPA, were it used, would see "
                   "a constant prior",
        "global": "a bug of theirs: the aggregation weights are the sizes of a permutation of the clients, not "
                  "each client's own size (equal only with equal client sizes)",
    },
}


def load(git_dir: str) -> dict[str, Any]:
    """Their definitions, executed verbatim in one namespace (its ``random_unit`` can be replaced)."""
    ns: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "np": np, "copy": copy, "math": math, "random": random,
                          "partial": partial, "_Loss": _Loss}
    load_definitions(git_dir, COMMIT, "util/losses.py", ["PIDLOSS", "Hook", "PID", "random_unit"], ns)
    load_definitions(git_dir, COMMIT, "util/fedavg.py", ["FedAvg_noniid"], ns)
    ns.update(definitions(source(git_dir, COMMIT, "util/update_baseline.py"), ["LocalUpdate.update_weights_pid"], ns))
    return ns


def new_pid_loss(ns: dict[str, Any], num_classes: int):
    """One client's PIDLOSS, configured as fed_grab.py:78-86 does."""
    loss = ns["PIDLOSS"](device="cpu", pidmask=["head", "middle"], class_activation=False, num_classes=num_classes)
    loss.get_3shotclass(head_class=[], middle_class=[], tail_class=[])
    loss.get_3shotclass(head_class=[], middle_class=[], tail_class=list(range(num_classes)))
    loss.apply_3shot_mask()
    loss.apply_class_activation()
    return loss


def split_model(model: nn.Sequential) -> tuple[nn.Module, nn.Module]:
    """(backbone, classifier) of fedlt's MLP, sharing nothing with ``model``."""
    model = copy.deepcopy(model)
    return nn.Sequential(*list(model)[:-1]), model[-1]


def sgb_state(loss) -> dict[str, torch.Tensor]:
    """Their PIDLOSS state under fedlt's names: pos, neg, u (PID output), e1, e2 (last two errors)."""
    pid = loss.controllers
    t = lambda v: torch.as_tensor(v, dtype=torch.float64).reshape(())  # noqa: E731
    return {"pos": loss.pos_grad.double().clone(), "neg": loss.neg_grad.double().clone(),
            "u": torch.stack([t(p.out) for p in pid]), "e1": torch.stack([t(p.error[0]) for p in pid]),
            "e2": torch.stack([t(p.error[1]) for p in pid])}


class Authors:
    """Their side of the run: a PIDLOSS per client, the global model, their round."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        num_clients, num_classes, epochs = config.clients, initial[-1].out_features, config.local_epochs
        lr, momentum = config.optimiser.lr, config.optimiser.momentum
        self.ns, self.mode = load(git_dir), mode
        self.model = copy.deepcopy(initial)
        with default_dtype(next(initial.parameters()).dtype):  # their buffers (torch.zeros) take it: the model's
            self.losses = [new_pid_loss(self.ns, num_classes) for _ in range(num_clients)]
        self.args = SimpleNamespace(lr=lr, momentum=momentum, device="cpu")
        self.epochs, self.num_classes = epochs, num_classes
        self.released_random = random.Random(seed)
        self.permutation_rng = np.random.default_rng(seed)
        self.original_random_unit = self.ns["random_unit"]

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: list[torch.Tensor] | None) -> dict[str, Any]:
        drawn: list[bool] = []
        if self.mode == "matched":
            decisions = iter([bool(g) for step in gates for g in step])
            self.ns["random_unit"] = lambda p: drawn.append(next(decisions)) or drawn[-1]
        else:
            state = random.getstate()
            random.setstate(self.released_random.getstate())
            unit = self.original_random_unit
            self.ns["random_unit"] = lambda p: drawn.append(bool(unit(p))) or drawn[-1]
        # their GBA_Layer is not in the optimiser: the classifier is stepped only as part of ``net``
        net, layer = split_model(self.model) if self.mode == "released" else (copy.deepcopy(self.model), nn.Identity())
        me = SimpleNamespace(args=self.args, ldr_train=EpochLoader(x, y, batches, self.epochs))
        try:
            net_w, layer_w, loss = self.ns["update_weights_pid"](me, net=net, seed=0, epoch=self.epochs,
                                                                  GBA_Loss=self.losses[cid], GBA_Layer=layer)
        finally:
            if self.mode != "matched":
                self.released_random.setstate(random.getstate())
                random.setstate(state)
        if self.mode != "released":
            weights = {k: v.detach().clone() for k, v in net_w.items()}
        else:  # backbone Sequential(0..n-2) + the classifier as the last layer, under the whole model's keys
            last = len(self.model) - 1
            weights = {**{k: v.detach().clone() for k, v in net_w.items()},
                       **{f"{last}.{k}": v.detach().clone() for k, v in layer_w.items()}}
        steps = len(drawn) // self.num_classes
        gates_drawn = [torch.tensor(drawn[s * self.num_classes:(s + 1) * self.num_classes]) for s in range(steps)]
        return {"weights": weights, "loss": float(loss), "sgb": sgb_state(self.losses[cid]), "gates": gates_drawn}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        """FedAvg_noniid over the participants' weights (fed_grab.py:100-107)."""
        order = list(participants)
        if self.mode != "matched":  # fed_grab.py:91 draws the round's users; :100 takes their sizes in that order
            order = list(self.permutation_rng.permutation(participants))
        avg = self.ns["FedAvg_noniid"]([results[c]["weights"] for c in participants], [sizes[c] for c in order])
        self.model.load_state_dict(avg)


REASONS["classifier"] = REASONS["released"]

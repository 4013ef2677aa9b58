"""FEDIC's adapter: the authors' own client and server code (github.com/shangxinyi/FEDIC, read from a
git snapshot at COMMIT, executed verbatim) beside fedlt's ``fedic``.

Their pieces, as they are: ``Local`` (main.py:265-303: ``__init__``, ``train`` — plain SGD, CE,
``upload_params``), ``Ensemble_highway`` and ``Global`` (main.py:23-262: FedAvg by sample count,
the fine-tuned copy, the calibration, the distillation, with their optimisers kept across rounds).
What the adapter writes itself: their ResNet-8 (``ResNet_cifar_feature``) is fedlt's MLP behind
their interface (``forward -> (features, logits)``, the features the classifier's input), each
built as a copy of fedlt's initial model; their ``DataLoader`` in ``Local.train`` yields the
minibatches fedlt's schedule draws (epoch by epoch) and in ``Global.eval`` the test set unshuffled;
their ``RandomState`` (the server's batches) returns fedlt's draws (``draw_orders`` of the round's
server stream) in their order; their calibration's gate is ``Linear(256, 1)`` (main.py:32,
ResNet-8's width): it is replaced by a ``Linear(200, 1)`` for the MLP's 200 features, with
fedlt's initial gate weights, and their ``highway_optimizer`` re-created over it as main.py:105
creates it; ``tqdm`` a no-op; the round loop restated from ``disalign()`` (main.py:353-378) over
the clients fedlt samples. Their gate averages the features of 8 clients (``avg_weight``, main.py:53):
the replay samples 8 of 10 clients a round.

The data: the replay set at 1 200 images (a class has at least 5) so that 2 images a class can be
the proxy set (``proxy_per_class`` 2: their ``mini_batch_size`` 20 is the whole set, which their
``choice(..., replace=False)`` needs) and its unlabelled batch is 8 (``batch_unlabeled``; the proxy
images are the unlabelled set, theirs CIFAR-100).

Modes: ``matched`` and ``released`` are the same here (nothing is aligned).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import Adam

import fedlt.algorithms.fedic as fedlt_fedic
from authors_code import load as load_definitions
from fedlt.models import classifier
from fedlt.server_steps import classifier_inputs
from fedic_golden.make_golden import Pairs, namespace
from fedlt_side import EpochLoader, default_dtype

REPO = "github.com/shangxinyi/FEDIC"
COMMIT = "76a1d75e33f1b315b0ab99f1e603a206c37c5446"
MODES = ("matched", "released")
DATA = {"n_train": 1200}
SETTINGS = {"clients": 10, "participation": 0.8, "algorithm_params": {"proxy_per_class": 2, "batch_unlabeled": 8}}

WHERE = {
    "weights": ("fedlt/algorithms/fedavg_family.py (the FedAvg family's client loop)", "main.py:287-300 (Local.train)"),
    "global": ("fedlt/algorithms/fedic.py: FedicStrategy.aggregate (FedAvg, fine-tune, calibration, distillation)",
               "main.py:127-223 (Global.update_distillation_highway_feature)"),
}


def featured(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose forward returns ``(features, logits)`` (their models' interface),
    with ``model``'s parameter names."""
    out = copy.deepcopy(model)
    base = type(out)

    class Featured(base):
        def forward(self, x):
            with classifier_inputs(classifier(self)) as seen:
                logits = base.forward(self, x)
            return seen.pop(), logits

    out.__class__ = Featured
    return out


class Draws:
    """Their ``np.random.RandomState``: each ``choice`` returns fedlt's next batch of the round."""

    def __init__(self) -> None:
        self.queue: list[np.ndarray] = []

    def load(self, orders: Any) -> None:
        self.queue = [o.numpy() for o in orders.finetune] + [o.numpy() for o in orders.calibrate]
        for u, lab in orders.distill:
            self.queue += [u.numpy(), lab.numpy()]

    def choice(self, population, size, replace=False):
        out = self.queue.pop(0)
        assert len(out) == size and not replace, (len(out), size)
        return out


class Authors:
    """Their ``Global`` (one, across rounds) and a ``Local`` per participant and round."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        self.config, self.side, self.loader = config, side, None
        self.ns = namespace(lambda **kwargs: featured(initial), self.data_loader)
        load_definitions(git_dir, COMMIT, "main.py", ["Ensemble_highway", "Global", "Local"], self.ns)
        strategy = side.prep.algorithm.strategy
        proxy, _ = strategy.server_sets()
        p = config.algorithm_params
        with default_dtype(next(initial.parameters()).dtype):
            self.server = self.ns["Global"](
                dataset_global_teaching=Pairs(proxy.x, proxy.y), num_classes=10, total_steps=100,
                mini_batch_size=p.get("batch_labeled", 20), mini_batch_size_unlabled=p["batch_unlabeled"],
                lr_global_teaching=0.001, temperature=2.0, device="cpu", seed=0, server_steps=100,
                num_online_clients=8, ld=0.5, ensemble_ld=0.0, unlabeled_data=Pairs(proxy.x, proxy.y))
            highway = self.server.highway_model
            highway.classifier2 = copy.deepcopy(strategy.calibration.gate)  # fedlt's initial gate (main.py:32's width)
            self.server.highway_optimizer = Adam(highway.parameters(), lr=0.001)  # main.py:105, over the new gate
        self.draws = Draws()
        self.server.random_state = self.draws
        self.epochs = config.local_epochs
        self.round = 0

    def data_loader(self, dataset=None, batch_size=None, shuffle=False, **kwargs):
        """Their DataLoader: a client's next epoch of fedlt's minibatches; the test set in order."""
        if shuffle:
            return self.loader
        return [(dataset.x[i:i + batch_size], dataset.y[i:i + batch_size]) for i in range(0, len(dataset), batch_size)]

    @property
    def model(self) -> nn.Module:
        return self.server.model

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        self.loader = EpochLoader(x, y, batches, self.epochs)
        local = self.ns["Local"](global_params=self.server.download_params(), data_client=Pairs(x, y), num_classes=10,
                                 num_epochs_local_training=self.epochs, batch_size_local_training=self.config.batch_size,
                                 lr_local_training=self.config.optimiser.lr, device="cpu")
        local.train(round=0)
        return {"weights": {k: v.detach().clone() for k, v in local.upload_params().items()}, "loss": None}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        p = self.config.algorithm_params
        proxy, unlabeled = self.side.prep.algorithm.strategy.server_sets()
        r = self.round
        self.draws.load(fedlt_fedic.draw_orders(
            fedlt_fedic.server_generator(self.config.seeds.sampling, r), len(proxy), len(unlabeled),
            finetune_steps=100, calibration_steps=100, distill_steps=100, batch_labeled=p.get("batch_labeled", 20),
            batch_unlabeled=p["batch_unlabeled"]))
        test = Pairs(self.side.prep.data.x_test, self.side.prep.data.y_test)
        self.server.update_distillation_highway_feature(r + 1, [copy.deepcopy(results[c]["weights"]) for c in participants],
                                                        [sizes[c] for c in participants], test, 50)
        assert not self.draws.queue  # their server took every batch fedlt drew
        self.round += 1

    def begin_round(self, participants: list[int], data: Any) -> None:
        pass

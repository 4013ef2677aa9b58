"""CReFF's adapter: the authors' client and server code (github.com/shangxinyi/CReFF-FL, read from a
git snapshot at COMMIT, executed verbatim) beside fedlt's ``creff``.

Their pieces, as they are: ``Local`` (main.py:156-253: ``__init__``, ``compute_gradient`` — the
per-class classifier gradients on the received model with the last re-trained classifier, 10 draws
of ``batch_real`` features a class — and ``local_train``, plain SGD), ``Global`` (main.py:23-153:
``update_feature_syn``, the gradient matching; ``feature_re_train``, the classifier re-trained from
scratch; ``initialize_for_model_fusion``, FedAvg by size), ``match_loss`` / ``distance_wb``
(Dataset/Gradient_matching_loss.py) and ``get_class_num`` (Dataset/dataset.py). The round loop of
``CReFF()`` (main.py:295-329) is restated in ``train_client`` / ``aggregate`` below, its lines named.

What the adapter writes itself: their ``ResNet_cifar`` is fedlt's ``resnet8`` (the 256-d
representation their code hard-codes at main.py:40, 49, 86, 101) behind their interface
(``forward -> (features, logits)``, ``.classifier``), each built as a copy of fedlt's initial
model; ``args_parser`` returns the replay's options; their ``DataLoader`` yields, in
``local_train``, the next epoch of fedlt's minibatches and, in ``feature_re_train``, the
permutations fedlt's re-training drew; ``transforms.Compose`` is the identity (their per-batch
RandomCrop(32, padding 4) + flip, main.py:234-236, is left out on both sides); ``TensorDataset`` is
torch's (theirs casts to float32, which would leave float64). The server's random draws are
fedlt's, handed over: the initial federated features (their ``torch.randn``, main.py:40) and the
first classifier the gradients are taken under (their ``temp_model``, main.py:293) are fedlt's
``step.setup`` draws; each client's ``np.random.permutation`` of a class's indices
(main.py:191) is the ``randperm`` fedlt's client drew from its collect stream
(fedlt/algorithms/recalibrate.py ``_collect_generator``); the fresh ``nn.Linear(256, 10)`` of
``feature_re_train`` (main.py:101) starts at fedlt's ``linear_init`` draw.

Sizes: the server step's sizes are reduced (``SETTINGS``): 4 federated features a class (theirs
100), 5 matching steps (100), 3 re-training epochs (300); ``batch_real`` 32, 10 repeats, lr_feature
0.1, lr_net 0.01 and the re-training batch 32 are theirs. One mode: nothing is aligned.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from torch.optim import SGD
from torch.utils.data import TensorDataset

import fedlt.server_steps.creff as fedlt_creff
from fedlt.algorithms.base import client_generator
from fedic import featured
from fedic_golden.make_golden import Pairs
from fedlt_side import EpochLoader, default_dtype
from golden_source import definitions, source

REPO = "github.com/shangxinyi/CReFF-FL"
COMMIT = "fbec98f1a49dfb8d9f346d98bf3f9568d9004687"
MODES = ("matched", "released")
STEP = {"name": "creff", "features_per_class": 4, "match_epochs": 5, "retrain_epochs": 3}
SETTINGS = {"model": "resnet8", "algorithm_params": {"step": STEP}}

WHERE = {
    "gradients": ("fedlt/server_steps/creff.py: CReFFStep.collect, class_gradients",
                  "main.py:175-231 (Local.compute_gradient)"),
    "weights": ("fedlt/algorithms/fedavg_family.py (the FedAvg family's client loop)",
                "main.py:233-253 (Local.local_train)"),
    "global": ("fedlt/server_steps/creff.py: CReFFStep.apply (update_features, retrain_classifier) on FedAvg",
               "main.py:51-135 (Global.update_feature_syn, feature_re_train, initialize_for_model_fusion)"),
}
COUNTERS = ("BatchNorm's num_batches_tracked: their initialize_for_model_fusion averages the int64 counters by "
            "size and load_state_dict truncates it (main.py:126-135); fedlt keeps the largest; never read with "
            "BatchNorm's momentum 0.1")


class Numpy:
    """Their ``np``: numpy, except ``np.random.permutation`` (main.py:191), which answers with the
    permutations fedlt's client drew, in the order it drew them."""

    def __init__(self) -> None:
        self.perms: list[torch.Tensor] = []
        self.random = SimpleNamespace(permutation=self.permutation)

    def permutation(self, indices):
        perm = self.perms.pop(0)
        assert len(perm) == len(indices), (len(perm), len(indices))
        return np.asarray(indices)[perm.numpy()]

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


class Server:
    """fedlt's server draws of the round (the re-training's initial classifier and permutations),
    recorded as fedlt's ``CReFFStep.apply`` makes them, for their ``nn.Linear`` and ``DataLoader``."""

    def __init__(self) -> None:
        self.inits: list[dict[str, torch.Tensor]] = []
        self.orders: list[list[torch.Tensor]] = []
        original = fedlt_creff.retrain_classifier

        def retrain(init, x, y, *, epochs, batch_size, lr, generator=None, orders=None):
            assert orders is None
            orders = [torch.randperm(len(y), generator=generator) for _ in range(epochs)]  # the draws it would make
            self.inits.append({k: v.clone() for k, v in init.items()})
            self.orders.append(orders)
            return original(init, x, y, epochs=epochs, batch_size=batch_size, lr=lr, orders=orders)

        fedlt_creff.retrain_classifier = retrain  # this process's (the harness's own)


class Authors:
    """Their ``Global`` (one, across rounds, with the last re-trained classifier ``syn_params``) and a
    ``Local`` per participant and round."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        self.config, self.side, self.loader = config, side, None
        self.dtype = next(initial.parameters()).dtype
        step = side.prep.algorithm.strategy.step
        self.args = SimpleNamespace(num_classes=10, device="cpu", dis_metric="ours", lr_feature=step.lr_feature,
                                    lr_net=step.lr_net, match_epoch=step.match_epochs, crt_epoch=step.retrain_epochs,
                                    batch_real=step.batch_real, dsa=False, lr_local_training=config.optimiser.lr,
                                    num_epochs_local_training=config.local_epochs,
                                    batch_size_local_training=config.batch_size, num_of_feature=step.per_class)
        assert step.batch_size == config.batch_size and step.repeats == 10  # theirs: the same batch; 10 hard-coded
        self.np, self.server_draws = Numpy(), Server()
        identity = SimpleNamespace(Compose=lambda steps: (lambda images: images), RandomCrop=lambda *a, **k: None,
                                   RandomHorizontalFlip=lambda *a, **k: None)
        self.ns: dict[str, Any] = {
            "torch": torch, "np": self.np, "copy": copy, "SGD": SGD, "CrossEntropyLoss": CrossEntropyLoss,
            "nn": SimpleNamespace(Linear=self.linear), "TensorDataset": TensorDataset, "DataLoader": self.data_loader,
            "unsqueeze": torch.unsqueeze, "max": torch.max, "eq": torch.eq, "no_grad": torch.no_grad,
            "transforms": identity, "DiffAugment": None, "time": None, "args": self.args,
            "args_parser": lambda: self.args, "ResNet_cifar": lambda **kwargs: featured(initial)}
        definitions(source(git_dir, COMMIT, "Dataset/Gradient_matching_loss.py"), ["match_loss", "distance_wb"],
                    self.ns)
        definitions(source(git_dir, COMMIT, "Dataset/dataset.py"), ["get_class_num"], self.ns)
        exec_classes(git_dir, self.ns)
        with default_dtype(self.dtype):
            self.server = self.ns["Global"](num_classes=10, device="cpu", args=self.args, num_of_feature=step.per_class)
            # fedlt's initial federated features and first classifier (their torch.randn, main.py:40; temp_model, :293)
            self.server.feature_syn = step.features.clone().requires_grad_(True)
            self.server.optimizer_feature = SGD([self.server.feature_syn, ], lr=self.args.lr_feature)  # main.py:44
        self.syn_params = {k: v.clone() for k, v in step.head.items()}
        self.step = step
        self.round, self.ft_params, self.uploads = 0, None, {}

    def linear(self, d_in: int, d_out: int) -> nn.Linear:
        """Their ``nn.Linear(256, 10)``: feature_re_train's fresh classifier starts at fedlt's draw."""
        layer = nn.Linear(d_in, d_out)
        if self.server_draws.inits:
            init = self.server_draws.inits.pop(0)
            with torch.no_grad():
                layer.weight.copy_(init["weight"]), layer.bias.copy_(init["bias"])
        return layer

    def data_loader(self, dataset=None, batch_size=None, shuffle=False, **kwargs):
        """Their DataLoader: a client's next epoch of fedlt's minibatches; the re-training's next epoch
        of fedlt's permutation."""
        if isinstance(dataset, TensorDataset):
            perm = self.orders.pop(0)
            return [dataset[idx] for idx in perm.split(batch_size)]
        return self.loader

    def syn_feature_params(self) -> dict[str, torch.Tensor]:
        """main.py:296-303: the global weights with the last re-trained classifier."""
        out = copy.deepcopy(self.server.download_params())
        out["classifier.weight"], out["classifier.bias"] = self.syn_params["weight"], self.syn_params["bias"]
        return out

    def collect_draws(self, cid: int, y: torch.Tensor) -> None:
        """fedlt's client draws for its gradients (CReFFStep.collect over its collect stream), queued
        for their np.random.permutation in the order both draw them (10 repeats × classes ascending)."""
        seed = client_generator(self.config.seeds.sampling, self.round, cid).initial_seed() ^ 0x5EED
        generator = torch.Generator().manual_seed(seed)
        sizes = [int((y == c).sum()) for c in torch.unique(y).tolist()]
        self.np.perms = [torch.randperm(n, generator=generator) for _ in range(self.step.repeats) for n in sizes]

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        self.loader = EpochLoader(x, y, batches, self.config.local_epochs)
        counts = torch.bincount(y, minlength=10).tolist()  # original_dict_per_client[client]
        with default_dtype(self.dtype):
            local = self.ns["Local"](data_client=Pairs(x, y), class_list=counts)  # main.py:313
            self.collect_draws(cid, y)
            gradient = local.compute_gradient(copy.deepcopy(self.syn_feature_params()), self.args)  # main.py:316
            assert not self.np.perms
            params = local.local_train(self.args, copy.deepcopy(self.server.download_params()))  # main.py:319
        grads = {f"{c}.{name}": g[i].detach().clone() for c, g in gradient.items()
                 for i, name in enumerate(("weight", "bias"))}
        self.uploads[cid] = gradient  # as their server receives it (class -> [weight, bias])
        return {"weights": {k: v.detach().clone() for k, v in params.items()}, "gradients": grads, "loss": None}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        self.orders = [o for orders in self.server_draws.orders for o in orders]
        self.server_draws.orders.clear()
        with default_dtype(self.dtype):
            fedavg = self.server.initialize_for_model_fusion(  # main.py:322
                [copy.deepcopy(results[c]["weights"]) for c in participants], [sizes[c] for c in participants])
            self.server.update_feature_syn(self.args, copy.deepcopy(self.syn_feature_params()),
                                           [copy.deepcopy(self.uploads[c]) for c in participants])  # :323
            self.syn_params, self.ft_params = self.server.feature_re_train(copy.deepcopy(fedavg),
                                                                           self.args.batch_size_local_training)  # :325
            self.server.syn_model.load_state_dict(copy.deepcopy(fedavg))  # main.py:329
        assert not self.orders and not self.server_draws.inits  # their server took every draw fedlt made
        self.round += 1

    def global_weights(self) -> dict[str, torch.Tensor]:
        """FedAvg's weights with the re-trained classifier (ft_params, what their global_eval scores;
        fedlt's global_model())."""
        return {k: v.detach().clone() for k, v in self.ft_params.items()}


def exec_classes(git_dir: str, ns: dict[str, Any]) -> None:
    from authors_code import load
    load(git_dir, COMMIT, "main.py", ["Global", "Local"], ns)

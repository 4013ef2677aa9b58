"""CCVR's adapter: FL-bench's implementation (github.com/KarhouTam/FL-bench; CCVR's authors published no
code), read from a git snapshot at COMMIT and executed verbatim, beside fedlt's ``ccvr``.

Their pieces, as they are: ``FedAvgClient.fit`` (src/client/fedavg.py:205-223, plain SGD, batches of
one skipped), ``CCVRClient.get_classwise_feature_means_and_covs`` (src/client/ccvr.py),
``FedAvgServer.aggregate_client_updates`` (src/server/fedavg.py:660-, weights by sample count) and
``CCVRServer.compute_classes_mean_cov`` / ``generate_virtual_representation`` /
``calibrate_classifier`` (src/server/ccvr.py), each called with a stand-in for ``self``. Their round
(train, aggregate; at evaluation, ``test_client_models``: calibrate a copy, restore) is restated.

What the adapter writes itself: their model is fedlt's MLP behind their interface (``.classifier``,
``get_last_features``); their ``trainloader`` yields fedlt's minibatches epoch by epoch (for the
statistics, the client's set in order); the server's draws are fedlt's, handed over: their
``np.random.multivariate_normal`` returns the virtual features fedlt's ``sample_virtual`` drew for
the class, their calibration's ``DataLoader`` the permutation fedlt's re-training drew.

One mode, ``matched``: their server pools the round's participants (their ``train_clients`` are
0..K−1 of the round, each the k-th participant: ``compute_classes_mean_cov`` indexes its list of
uploads by client id, so it pools every training client as released) and their ``dtype=torch.float``
(``generate_virtual_representation``) is read as the run's dtype: in float32 that is their code; in
float64 their code as released stops (float32 features into a float64 classifier). Their pooled
means and covariances are compared with fedlt's and printed, not judged (the draws are fedlt's):
their clients send the biased covariance (``cov(correction=0)``), which the server pools as unbiased.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import fedlt.server_steps.ccvr as fedlt_ccvr
from fedic import featured
from fedlt_side import EpochLoader, default_dtype, relative_difference
from golden_source import definitions, source

from fedlt.models import classifier

REPO = "github.com/KarhouTam/FL-bench"
COMMIT = "06e658bca5af6ce732e25bb7c0f8be321e14a85e"
MODES = ("matched",)

WHERE = {
    "weights": ("fedlt/algorithms/fedavg_family.py (the FedAvg family's client loop)",
                "src/client/fedavg.py:205-223 (fit)"),
    "stats": ("fedlt/server_steps/ccvr.py: class_stats", "src/client/ccvr.py (get_classwise_feature_means_and_covs)"),
    "global": ("fedlt/server_steps/ccvr.py: CCVRStep.apply on FedAvg",
               "src/server/ccvr.py (compute_classes_mean_cov, generate_virtual_representation, calibrate_classifier)"),
}


def their_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (fedlt's parameter names) with FL-bench's ``.classifier`` and ``get_last_features``."""
    out = featured(model)
    base = type(out)

    class Net(base):
        classifier = property(lambda self: self.get_classifier())

        def get_last_features(self, x, detach=True):  # src/utils/models.py:69-74: detached by default
            return base.forward(self, x)[0].detach().clone()

        def forward(self, x):
            return base.forward(self, x)[1]

    out.__class__ = Net
    return out


class ServerDraws:
    """fedlt's virtual features (per class, in its order) and re-training permutations, recorded as
    its ``CCVRStep.apply`` draws them."""

    def __init__(self) -> None:
        self.samples: list[torch.Tensor] = []
        self.orders: list[torch.Tensor] = []
        self.pooled: list[tuple[torch.Tensor, torch.Tensor]] = []  # fedlt's pooled (mean, cov) of each class
        sample, retrain = fedlt_ccvr.sample_virtual, fedlt_ccvr.retrain_classifier

        def sample_virtual(mean, cov, n, generator=None):
            out = sample(mean, cov, n, generator)
            self.samples.append(out.clone())
            self.pooled.append((mean.clone(), cov.clone()))
            return out

        def retrain_classifier(init, x, y, *, epochs, batch_size, lr, generator=None, orders=None):
            orders = [torch.randperm(len(y), generator=generator) for _ in range(epochs)]
            self.orders += orders
            return retrain(init, x, y, epochs=epochs, batch_size=batch_size, lr=lr, orders=orders)

        fedlt_ccvr.sample_virtual, fedlt_ccvr.retrain_classifier = sample_virtual, retrain_classifier


class Authors:
    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        self.mode, self.config = mode, config
        self.dtype = next(initial.parameters()).dtype
        self.draws = ServerDraws()
        # their torch, with ``torch.float`` the run's dtype (the virtual features' cast)
        torch_ns = SimpleNamespace(**({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")}
                                      | {"float": self.dtype}))
        self.ns: dict[str, Any] = {"torch": torch_ns, "np": SimpleNamespace(random=SimpleNamespace(
            multivariate_normal=self.multivariate_normal)), "deepcopy": copy.deepcopy, "Dataset": Dataset,
            "DataLoader": self.data_loader, "NUM_CLASSES": {"replay": 10}, "Any": Any}
        self.fns = definitions(source(git_dir, COMMIT, "src/client/fedavg.py"), ["FedAvgClient.fit"], self.ns)
        self.fns.update(definitions(source(git_dir, COMMIT, "src/client/ccvr.py"),
                                    ["CCVRClient.get_classwise_feature_means_and_covs"], self.ns))
        self.fns.update(definitions(source(git_dir, COMMIT, "src/server/fedavg.py"),
                                    ["FedAvgServer.aggregate_client_updates"], self.ns))
        self.fns.update(definitions(source(git_dir, COMMIT, "src/server/ccvr.py"),
                                    ["CCVRServer.compute_classes_mean_cov",
                                     "CCVRServer.generate_virtual_representation",
                                     "CCVRServer.calibrate_classifier"], self.ns))
        self.net = their_model(initial)
        self.public = {k: v.detach().clone() for k, v in self.net.named_parameters()}
        self.sizes: dict[int, int] = {}
        self.data: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.calibrated: dict[str, torch.Tensor] = {}

    def multivariate_normal(self, mean, cov, n):
        """fedlt's draws for the class; their pooled mean and covariance compared with fedlt's on the way."""
        ours_mean, ours_cov = self.draws.pooled.pop(0)
        self.pooled["mean"] = max(self.pooled["mean"], relative_difference(ours_mean, torch.from_numpy(mean)))
        self.pooled["cov"] = max(self.pooled["cov"], relative_difference(ours_cov, torch.from_numpy(cov)))
        out = self.draws.samples.pop(0)
        assert out.shape == (n, len(mean))
        return out.numpy()

    def data_loader(self, dataset=None, batch_size=None, shuffle=False, **kwargs):
        perm = self.draws.orders.pop(0)
        return [dataset[idx] for idx in perm.split(batch_size)]

    def client(self, x, y, loader=None) -> SimpleNamespace:
        model = copy.deepcopy(self.net)
        model.load_state_dict(self.public, strict=False)
        me = SimpleNamespace(model=model, dataset=SimpleNamespace(train=lambda: None, classes=range(10)),
                             local_epoch=self.config.local_epochs, trainloader=loader, device="cpu",
                             criterion=nn.CrossEntropyLoss(), lr_scheduler=None,
                             set_parameters=lambda package: model.load_state_dict(self.public, strict=False))
        # fedavg.py:45, its state reset each round (set_parameters)
        me.optimizer = torch.optim.SGD(model.parameters(), lr=self.config.optimiser.lr)
        return me

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        me = self.client(x, y, EpochLoader(x, y, batches, self.config.local_epochs))
        with default_dtype(self.dtype):
            self.fns["FedAvgClient.fit"](me)
        self.data[cid] = (x, y)
        return {"weights": {k: v.detach().clone() for k, v in me.model.state_dict().items()}, "loss": None}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        server = SimpleNamespace(return_diff=False, public_model_params=self.public, model=copy.deepcopy(self.net))
        packages = OrderedDict((c, {"weight": sizes[c], "regular_model_params": results[c]["weights"]})
                               for c in participants)
        self.pooled = {"mean": 0.0, "cov": 0.0}
        with default_dtype(self.dtype):
            self.fns["FedAvgServer.aggregate_client_updates"](server, packages)
            self.calibrate(participants)
        # not judged (their draws are fedlt's): the pooled statistics the virtual features would be drawn from
        print(f"pooled class statistics, max relative difference: means {self.pooled['mean']:.2e}, "
              f"covariances {self.pooled['cov']:.2e}")

    def calibrate(self, participants: list[int]) -> None:
        """Their test_client_models: calibrate_classifier on a copy of the public weights, then restored."""
        frozen = copy.deepcopy(self.public)

        def statistics(name, clients):  # their client k is the round's k-th participant
            return {k: self.fns["CCVRClient.get_classwise_feature_means_and_covs"](
                self.client(*self.data[c], [(self.data[c][0][i:i + 256], self.data[c][1][i:i + 256])
                                            for i in range(0, len(self.data[c][1]), 256)]), {})
                for k, c in zip(clients, participants)}

        model = copy.deepcopy(self.net)
        server = SimpleNamespace(
            trainer=SimpleNamespace(exec=statistics), train_clients=list(range(len(participants))), device="cpu",
            model=model,
            args=SimpleNamespace(dataset=SimpleNamespace(name="replay"), ccvr=SimpleNamespace(sample_per_class=200),
                                 common=SimpleNamespace(batch_size=32), optimizer=SimpleNamespace(lr=0.01)),
            public_model_params=self.public, public_model_param_names=list(self.public))
        server.compute_classes_mean_cov = lambda: self.fns["CCVRServer.compute_classes_mean_cov"](server)
        server.generate_virtual_representation = lambda m, c: self.fns["CCVRServer.generate_virtual_representation"](
            server, m, c)
        self.fns["CCVRServer.calibrate_classifier"](server)
        assert not self.draws.samples and not self.draws.orders
        self.calibrated = {**model.state_dict(), **server.public_model_params}
        self.public = frozen

    def global_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.calibrated.items()}

"""FedYoYo's adapter: the authors' own client and server code (github.com/shanss132/FedYoYo, read from
a git snapshot at COMMIT, executed verbatim) beside fedlt's ``fedyoyo``.

Their pieces, as they are: ``Local.get_feature_mean`` and ``Local.calculate_eff_weight``
(main_fedyoyo.py:198-264: a participant's effective numbers on the received model),
``Local.local_train`` (main_fedyoyo.py:156-195: the prior pulled to the client's label distribution
at every step, CE on both views' adjusted logits, the KL self-distillation where the weak view is
right), ``Global.cal_prior`` and ``Global.initialize_for_model_fusion`` (main_fedyoyo.py:85-95,
133-135) and ``apply_change_threshold`` (data_loader/tools.py:7-18). What the adapter writes
itself: ``.cuda()`` a no-op and ``torch.tensor(..., device='cuda')`` made on the CPU (offline); a
stand-in for ``Local``'s ``self`` holding what its ``__init__`` builds (main_fedyoyo.py:138-154:
plain SGD at the lr, ``CrossEntropyLoss``) with fedlt's MLP behind their model's interface
(``forward -> (features, logits)``, ``.classifier.in_features``); their ``DataLoader`` (shuffled)
replaced by the minibatches fedlt draws — for the measurement the partition fedlt's
``YoYoUpdate.measure`` draws, for training the schedule's, each sample as their dataset's
``(img0, img1, img2, label)``: the test view, the weak view (both the image itself: the replay has
no augmentation, theirs crops, flips and rotates) and the strong view fedlt's ``cutout`` drew at
that step (recorded; theirs also applies AutoAugment); the round loop restated from ``FedYoYo()``
(main_fedyoyo.py:389-432: first every participant's effective numbers on the received model, the
server's sum, smoothing and prior, then every participant's training and FedAvg by sample count)
over the clients fedlt samples.

Their code computes in float32 where it says so (``torch.zeros(C).float()``, main_fedyoyo.py:227,
393; ``dtype=torch.float`` for the label distribution, main_fedyoyo.py:159), and fedlt's prior is
float32 by design (``YoYoStrategy.measure``): the replay is a float32 one (``--dtype float32``). In
float64 their code does not run: ``calculate_eff_weight`` multiplies float32 constants
(``torch.ones(1, num).float()``, main_fedyoyo.py:255-257) with the model's float64 features.

Modes: ``matched`` and ``released`` are the same here (nothing is aligned).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import CrossEntropyLoss
from torch.optim import SGD

import fedlt.algorithms.fedyoyo as fedlt_fedyoyo
from authors_code import load as load_definitions
from fedlt.algorithms.base import client_generator
from fedlt.algorithms.stateful import features_of
from fedlt.models import classifier
from fedlt_side import cuda_as_cpu

REPO = "github.com/shanss132/FedYoYo"
COMMIT = "342686e95f616e0b9bec9478dd324b73941f0895"
MODES = ("matched", "released")

WHERE = {
    "weights": ("fedlt/algorithms/fedyoyo.py: YoYoUpdate.begin / parts (prior, adjusted logits, KL)",
                "main_fedyoyo.py:156-195 (Local.local_train)"),
    "global": ("fedlt/algorithms/fedyoyo.py: YoYoStrategy.measure, then FedAvg",
               "main_fedyoyo.py:389-432 with calculate_eff_weight (222-264) and initialize_for_model_fusion"),
}
REASONS: dict[str, dict[str, str]] = {}


class CpuTorch:
    """``torch`` for their code on a machine without CUDA: ``torch.tensor(..., device='cuda')`` is
    made on the CPU; everything else is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(data: Any, dtype: Any = None, device: Any = None, **kw: Any) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, **kw)


class TheirInterface(nn.Module):
    """Their ResNet's interface over fedlt's model: ``forward -> (features, logits)``; its state
    dict and ``classifier`` are the model's own."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.net = model

    @property
    def classifier(self) -> nn.Module:
        return classifier(self.net)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with features_of(self.net) as seen:
            logits = self.net(x)
        return seen[0], logits

    def state_dict(self, *args: Any, **kw: Any) -> dict[str, torch.Tensor]:
        return self.net.state_dict(*args, **kw)

    def load_state_dict(self, state: Any, strict: bool = True, **kw: Any) -> Any:
        return self.net.load_state_dict(state, strict)


class Epochs:
    """Their dataset as their shuffled ``DataLoader`` would serve it: each ``DataLoader(...)`` call
    (one per epoch, or one per measurement) gets the next list of ``(img0, img1, img2, label)``
    batches."""

    def __init__(self, epochs: list[list[tuple[torch.Tensor, ...]]]) -> None:
        self.epochs = epochs

    def __len__(self) -> int:
        return sum(len(b[-1]) for b in self.epochs[0])

    def next(self) -> list[tuple[torch.Tensor, ...]]:
        return self.epochs.pop(0)


class StrongViews:
    """Records every strong view fedlt's ``cutout`` draws, in order (the participants train one
    after another, so a round's views are consumed in the same order)."""

    def __init__(self) -> None:
        self.views: list[torch.Tensor] = []
        original = fedlt_fedyoyo.cutout

        def recorded(x: torch.Tensor, length: int) -> torch.Tensor:
            out = original(x, length)
            self.views.append(out.detach().clone())
            return out

        fedlt_fedyoyo.cutout = recorded  # module attribute: YoYoUpdate.parts looks it up at each step

    def take(self, n: int) -> list[torch.Tensor]:
        out, self.views = self.views[:n], self.views[n:]
        return out


class Authors:
    """Their ``Local`` per participant and phase, their server's prior and FedAvg."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        cuda_as_cpu()
        self.ns: dict[str, Any] = {"torch": CpuTorch(), "F": F, "EPS": 1e-6, "SGD": SGD,
                                   "CrossEntropyLoss": CrossEntropyLoss, "DataLoader": lambda dataset, **kw: dataset.next()}
        load_definitions(git_dir, COMMIT, "main_fedyoyo.py", ["Local", "Global"], self.ns)
        load_definitions(git_dir, COMMIT, "data_loader/tools.py", ["apply_change_threshold"], self.ns)
        p = config.algorithm_params
        self.args = SimpleNamespace(device="cpu", lr_local_training=config.optimiser.lr,
                                    num_epochs_local_training=config.local_epochs,
                                    batch_size_local_training=config.batch_size, gamma=p.get("gamma", 0.1),
                                    tau=p.get("tau", 1.5), T=p.get("temperature", 1.5), lamda=p.get("lam", 4.0),
                                    warmup=p.get("warmup", 50))
        self.sampling_seed = config.seeds.sampling
        self.model, self.round = copy.deepcopy(initial), 0
        self.num_classes = classifier(initial).weight.shape[0]
        self.eff_global_pre: torch.Tensor | None = None
        self.prior: torch.Tensor | None = None
        self.strong = StrongViews()

    def local(self, data: Epochs) -> Any:
        """Their ``Local(data_client, args)`` (main_fedyoyo.py:138-154) with fedlt's model."""
        me = SimpleNamespace(args=self.args, data_client=data, criterion=CrossEntropyLoss(),
                             local_model=TheirInterface(copy.deepcopy(self.model)))
        me.optimizer = SGD(me.local_model.parameters(), lr=self.args.lr_local_training)
        for name in ("local_train", "get_feature_mean", "calculate_eff_weight"):
            setattr(me, name, getattr(self.ns["Local"], name).__get__(me))
        return me

    def begin_round(self, participants: list[int], data: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Their measurement over the round's participants, the server's smoothing and prior
        (main_fedyoyo.py:394-416)."""
        r = self.round + 1
        global_params = self.model.state_dict()
        eff_global_cur = torch.ones(self.num_classes).float().cuda()
        for cid in participants:
            x, y = data[cid]
            order = self.measurement_order(cid, len(y))
            batch = [(x[i], x[i], x[i], y[i]) for i in order]
            counts = torch.bincount(y, minlength=self.num_classes).tolist()
            me = self.local(Epochs([batch, batch]))  # get_feature_mean's pass, then calculate_eff_weight's
            feature_mean = me.get_feature_mean(global_params, counts).detach()
            eff_global_cur = eff_global_cur + me.calculate_eff_weight(feature_mean, counts)
        if r > 1:
            eff_global_cur = self.eff_global_pre * 0.9 + eff_global_cur * 0.1
            eff_global_cur = self.ns["apply_change_threshold"](eff_global_cur, self.eff_global_pre, 100)
        else:
            abnomal = eff_global_cur > 1e+4
            mean = eff_global_cur[~abnomal].mean()
            eff_global_cur[abnomal] = mean
        self.eff_global_pre = eff_global_cur.clone()
        self.prior = self.ns["Global"].cal_prior(SimpleNamespace(args=self.args), eff_global_cur)

    def measurement_order(self, cid: int, n: int) -> list[torch.Tensor]:
        """The one-epoch partition fedlt's ``YoYoUpdate.measure`` draws (its own stream)."""
        seed = client_generator(self.sampling_seed, self.round, cid).initial_seed() ^ 0x7070
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        return list(order.split(self.args.batch_size_local_training))

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        strong = self.strong.take(len(batches))
        steps = [(x[b], x[b], s, y[b]) for b, s in zip(batches, strong)]
        per = len(steps) // self.args.num_epochs_local_training
        epochs = [steps[e * per:(e + 1) * per] for e in range(self.args.num_epochs_local_training)]
        counts = torch.bincount(y, minlength=self.num_classes).tolist()
        me = self.local(Epochs(epochs))
        params = me.local_train(self.args, copy.deepcopy(self.model.state_dict()), self.round + 1, None, counts,
                                prior=self.prior)
        return {"weights": {k: v.detach().clone() for k, v in params.items()}, "loss": None, "_n": len(y)}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        fused = self.ns["Global"].initialize_for_model_fusion(
            SimpleNamespace(args=self.args), [results[c]["weights"] for c in participants],
            [results[c].pop("_n") for c in participants])
        self.model.load_state_dict(fused)
        self.round += 1

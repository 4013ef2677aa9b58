"""FEDIC (Shang et al., ICME 2022, "Federated Learning on Non-IID and Long-Tailed Data via
Calibrated Distillation"; shangxinyi/FEDIC), as the authors' ``main.py``: FedAvg clients, and a
server that holds a small balanced labelled proxy set and, after averaging, distils a calibrated
ensemble of the round's client models into the global model.

Each round, after the |D_k|-weighted average w̄ (their ``_initialize_for_model_fusion``), the
server (their ``Global.update_distillation_highway_feature``):

1. fine-tunes a copy of w̄ on the proxy set (``finetune_steps`` Adam steps of CE) — the model
   whose logits ``f`` the calibration falls back to;
2. trains the calibration (:class:`CalibratedEnsemble`, their ``Ensemble_highway``) on the proxy
   set (``calibration_steps`` Adam steps of CE) over the client models' logits z_k and features
   h_k (the classifier's input) on each batch: client weights a_k = σ(z_k·s + b) normalised over
   the clients (client-wise), the ensemble Σ_k a_k z_k scaled and shifted per class (class-wise
   logit calibration), and a gate g = σ(Linear(mean_k h_k)) mixing it with f:
   t = g·(scale ⊙ Σ_k a_k z_k + shift) + (1 − g)·f;
3. distils t into w̄ (``distill_steps`` Adam steps): per step a batch of unlabelled images (the
   teacher's, KL(softmax(t/T) ‖ softmax(s/T)) averaged over the batch, no T²) and a labelled
   proxy batch (CE), mixed ``distill_weight``·KL + (1 − ``distill_weight``)·CE. The result is the
   new global model.

The calibration's parameters and the three Adam optimisers (student, fine-tuned copy,
calibration) persist from round to round, as their ``Global`` creates them once; they are the
strategy's checkpointed state. The proxy set is a held-out slice of the training set
(``proxy_per_class`` images of each class, fedlt.run.parts.hold_out) that no client sees; the
unlabelled images are the proxy set's own (their CIFAR-100, a second dataset, is not assumed) or,
with ``unlabeled_per_class``, a second held-out slice whose labels the server never reads.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

import fedlt.augment
from fedlt.algorithms import register
from fedlt.algorithms.base import ClientData, RunContext, build_aggregator, place_model, raise_first_non_finite
from fedlt.algorithms.fedavg_family import FedAvgFamily, Strategy
from fedlt.algorithms.protocol import ClientResult, State
from fedlt.context import RoundContext
from fedlt.datasets.source import to_device  # pinned, non-blocking: a step's host-drawn rows wait for no kernel
from fedlt.errors import FedltError
from fedlt.models import classifier, eval_mode
from fedlt.server_steps import classifier_inputs


class CalibratedEnsemble(nn.Module):
    """Their ``Ensemble_highway`` for C classes on d features: ``client_scale`` (C×1) and
    ``client_bias`` weigh each client's logits per sample, ``class_scale`` / ``class_bias`` (C)
    calibrate the weighted ensemble per class, ``gate`` (Linear(d, 1)) reads the clients' mean
    feature and mixes the calibrated ensemble with the fallback logits."""

    def __init__(self, num_classes: int, feature_dim: int) -> None:
        super().__init__()
        self.client_scale = nn.Parameter(torch.ones(num_classes, 1))
        self.client_bias = nn.Parameter(torch.zeros(1))
        self.class_scale = nn.Parameter(torch.ones(num_classes))
        self.class_bias = nn.Parameter(torch.zeros(num_classes))
        self.gate = nn.Linear(feature_dim, 1)

    def forward(self, features: torch.Tensor, logits: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        """``features`` K×B×d and ``logits`` K×B×C of the K client models, ``fallback`` B×C."""
        # σ(v_k) / Σ_j σ(v_j) as a softmax over the clients of log σ(v): theirs divides the sigmoids,
        # which is 0/0 once every client's σ underflows (v < −88 in float32: an MLP's logits on MNIST)
        weights = torch.softmax(F.logsigmoid(logits @ self.client_scale + self.client_bias), dim=0)  # K×B×1
        ensemble = (weights * logits).sum(0)
        calibrated = ensemble * self.class_scale + self.class_bias
        gate = torch.sigmoid(self.gate(features.mean(0)))  # theirs: Σ_k h_k / 8, their 8 clients a round
        return gate * calibrated + (1 - gate) * fallback


def client_models(work: nn.Module, clients: Sequence[State]) -> list[nn.Module]:
    """A module per client model of the round, in eval mode, holding that client's uploaded
    tensors themselves (``assign``: nothing copied); built once a round, so a server step runs
    K forwards and loads nothing (their ``model1.load_state_dict`` per client and batch)."""
    models = []
    for weights in clients:
        model = copy.deepcopy(work)
        model.load_state_dict(weights, assign=True)
        models.append(model.eval())
    return models


@torch.no_grad()
def client_views(models: Sequence[nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features K×B×d, logits K×B×C) of each client model on ``x`` (their ``features_logits``:
    eval mode, BatchNorm's running statistics, nothing updated)."""
    feats, logits = [], []
    for model in models:
        with classifier_inputs(classifier(model)) as seen:
            logits.append(model(x))
        feats.append(seen.pop())
    return torch.stack(feats), torch.stack(logits)


@dataclass(frozen=True)
class ServerOrders:
    """The proxy-set rows of every server step of one round: the fine-tune's batches, the
    calibration's, and the distillation's (unlabelled rows, labelled rows) pairs."""

    finetune: list[torch.Tensor]
    calibrate: list[torch.Tensor]
    distill: list[tuple[torch.Tensor, torch.Tensor]]


def draw_orders(generator: torch.Generator, labeled: int, unlabeled: int, *, finetune_steps: int,
                calibration_steps: int, distill_steps: int, batch_labeled: int, batch_unlabeled: int) -> ServerOrders:
    """Their draws, in their order: each batch ``batch`` distinct rows of its set, drawn afresh at
    every step (``RandomState.choice(..., replace=False)``; a set smaller than a batch gives all of it)."""

    def pick(n: int, batch: int) -> torch.Tensor:
        return torch.randperm(n, generator=generator)[:batch]

    finetune = [pick(labeled, batch_labeled) for _ in range(finetune_steps)]
    calibrate = [pick(labeled, batch_labeled) for _ in range(calibration_steps)]
    distill = []
    for _ in range(distill_steps):
        u = pick(unlabeled, batch_unlabeled)
        distill.append((u, pick(labeled, batch_labeled)))
    return ServerOrders(finetune, calibrate, distill)


def server_generator(sampling_seed: int, round_index: int) -> torch.Generator:
    """The server's draws of round ``round_index``: derived, so a resumed round draws the same."""
    words = np.random.SeedSequence([sampling_seed, round_index, 0xF1C]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed((int(words[0]) << 31) ^ int(words[1]))


def finetune(model: nn.Module, optimiser: torch.optim.Optimizer, proxy: ClientData,
             batches: Iterable[torch.Tensor], augment: Any = None) -> torch.Tensor:
    """Adam steps of CE on the proxy batches, the model in train mode (their ``model2``); the
    per-step losses (on the device)."""
    model.train()
    losses = []
    for idx in batches:
        x, y = proxy.take(to_device(idx, proxy.index_device))
        loss = F.cross_entropy(model(augment(x) if augment else x), y)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.detach())
    model.eval()
    return torch.stack(losses) if losses else torch.zeros(0)


def train_calibration(calibration: CalibratedEnsemble, optimiser: torch.optim.Optimizer,
                      clients: Sequence[nn.Module], fallback: nn.Module, proxy: ClientData,
                      batches: Iterable[torch.Tensor], augment: Any = None) -> torch.Tensor:
    """Adam steps of CE of the calibrated ensemble on the proxy batches (their ``highway_model``);
    the client models and the fallback (the fine-tuned model) fixed, in eval mode."""
    losses = []
    for idx in batches:
        x, y = proxy.take(to_device(idx, proxy.index_device))
        x = augment(x) if augment else x
        feats, logits = client_views(clients, x)
        with torch.no_grad(), eval_mode(fallback):
            base = fallback(x)
        loss = F.cross_entropy(calibration(feats, logits, base), y)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.detach())
    return torch.stack(losses) if losses else torch.zeros(0)


def distill(student: nn.Module, optimiser: torch.optim.Optimizer, calibration: CalibratedEnsemble,
            clients: Sequence[nn.Module], fallback: nn.Module, proxy: ClientData, unlabeled: ClientData,
            batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, temperature: float, weight: float,
            augment: Any = None) -> torch.Tensor:
    """Adam steps of ``weight``·KL(teacher ‖ student) at temperature T on an unlabelled batch plus
    (1 − ``weight``)·CE on a labelled one, the student in train mode (its BatchNorm sees the
    unlabelled batch, then the labelled one, as theirs), and in eval mode after."""
    student.train()
    losses = []
    for u_idx, l_idx in batches:
        u = unlabeled.take(to_device(u_idx, unlabeled.index_device))[0]
        u = augment(u) if augment else u
        x, y = proxy.take(to_device(l_idx, proxy.index_device))
        x = augment(x) if augment else x
        feats, logits = client_views(clients, u)
        with torch.no_grad(), eval_mode(fallback):
            teacher = calibration(feats, logits, fallback(u))
        soft = F.kl_div(F.log_softmax(student(u) / temperature, 1), F.softmax(teacher / temperature, 1),
                        reduction="batchmean")
        hard = F.cross_entropy(student(x), y)
        loss = weight * soft + (1 - weight) * hard
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.detach())
    student.eval()  # as finetune leaves its model: the global model is next read for evaluation
    return torch.stack(losses) if losses else torch.zeros(0)


@dataclass(frozen=True)
class ServerSettings:
    """FEDIC's server-side sizes (see :class:`FEDIC`)."""

    finetune_steps: int
    calibration_steps: int
    distill_steps: int
    batch_labeled: int
    batch_unlabeled: int
    server_lr: float
    server_weight_decay: float
    temperature: float
    distill_weight: float
    proxy_per_class: int


class FedicStrategy(Strategy):
    """FedAvg's server, then the calibrated distillation on the server's data (``ctx.server_data``:
    the first ``proxy_per_class`` images of each class are the labelled proxy set, the rest the
    unlabelled set; none left: the proxy set's images). Its state: the global model, the
    fine-tuned copy, the calibration and the three optimisers' moments."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str, settings: ServerSettings) -> None:
        super().__init__(model, aggregator, ctx, objective)
        self.settings = settings
        head = classifier(model)
        self.finetuned = place_model(ctx.build_model(), ctx.device)
        self.work = place_model(ctx.build_model(), ctx.device)  # the template of the client models
        self.calibration = CalibratedEnsemble(head.weight.shape[0], head.weight.shape[1]).to(
            device=head.weight.device, dtype=head.weight.dtype)
        adam = dict(lr=settings.server_lr, weight_decay=settings.server_weight_decay)
        self.optimisers = {"student": torch.optim.Adam(model.parameters(), **adam),
                           "finetuned": torch.optim.Adam(self.finetuned.parameters(), **adam),
                           "calibration": torch.optim.Adam(self.calibration.parameters(), lr=settings.server_lr)}

    def server_sets(self) -> tuple[ClientData, ClientData]:
        """(the labelled proxy set, the unlabelled set) from the run's server data."""
        data = self.ctx.server_data
        if data is None:
            raise FedltError("fedic needs data at the server: run it through fedlt's engines, which hold "
                             "proxy_per_class images of each class out of the training set for it")
        per_class = self.settings.proxy_per_class
        rank = _rank_in_class(data.y)
        labeled = (rank < per_class).nonzero().squeeze(1)
        unlabeled = (rank >= per_class).nonzero().squeeze(1)
        proxy = _rows(data, labeled)
        return proxy, (_rows(data, unlabeled) if len(unlabeled) else proxy)

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        metrics = super().aggregate(round, results)
        device = next(self.model.parameters()).device
        clients = [{k: v.to(device) for k, v in r.weights.items()}
                   for r in sorted(results, key=lambda r: r.cid) if isinstance(r, ClientResult)]
        if clients:
            proxy, unlabeled = self.server_sets()
            s = self.settings
            orders = draw_orders(server_generator(self.ctx.sampling_seed, round.round_index), len(proxy),
                                 len(unlabeled), finetune_steps=s.finetune_steps,
                                 calibration_steps=s.calibration_steps, distill_steps=s.distill_steps,
                                 batch_labeled=s.batch_labeled, batch_unlabeled=s.batch_unlabeled)
            losses = self.calibrate_and_distill(clients, proxy, unlabeled, orders,
                                                fedlt.augment.build(self.ctx.augment))
            raise_first_non_finite(losses, f"fedic's server, round {round.round_index + 1}", "server step")
        return metrics

    def calibrate_and_distill(self, clients: Sequence[State], proxy: ClientData, unlabeled: ClientData,
                              orders: ServerOrders, augment: Any = None) -> torch.Tensor:
        """Steps 1–3 of the module's docstring from the averaged model ``self.model``, which ends
        distilled; the losses of every server step, in order."""
        s = self.settings
        self.finetuned.load_state_dict(self.model.state_dict())
        tuned = finetune(self.finetuned, self.optimisers["finetuned"], proxy, orders.finetune, augment)
        models = client_models(self.work, clients)
        calibrated = train_calibration(self.calibration, self.optimisers["calibration"], models, self.finetuned,
                                       proxy, orders.calibrate, augment)
        distilled = distill(self.model, self.optimisers["student"], self.calibration, models, self.finetuned, proxy, unlabeled, orders.distill, temperature=s.temperature,
                            weight=s.distill_weight, augment=augment)
        return torch.cat([t.to(tuned.device) for t in (tuned, calibrated, distilled)])

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"finetuned": self.finetuned.state_dict(),
                                       "calibration": self.calibration.state_dict(),
                                       "optimisers": {k: o.state_dict() for k, o in self.optimisers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.finetuned.load_state_dict(state["finetuned"])
        self.calibration.load_state_dict(state["calibration"])
        for k, o in self.optimisers.items():
            o.load_state_dict(state["optimisers"][k])


def _rank_in_class(y: torch.Tensor) -> torch.Tensor:
    """Each sample's position among the samples of its class, in row order."""
    onehot = F.one_hot(y, int(y.max()) + 1 if len(y) else 1)
    return ((onehot.cumsum(0) - 1) * onehot).sum(1)


def _rows(data: ClientData, rows: torch.Tensor) -> ClientData:
    x, y = data.take(rows.to(data.index_device))
    return ClientData(data.cid, x, y, torch.bincount(y, minlength=len(data.class_counts)))


class FEDIC(FedAvgFamily):
    """FEDIC: FedAvg clients; the server fine-tunes the average on a held-out proxy set, trains a
    client-wise and class-wise logit calibration with a gate over the round's client models, and
    distils the calibrated ensemble into the global model. Defaults: the authors' options.py and
    main.py (docs/algorithms.md)."""

    proxy_per_class: int = Field(100, ge=1, le=10**6, description="labelled images of each class held out of the "
                                 "training set for the server (their 49 000 of CIFAR-10's 50 000: 100 a class)")
    unlabeled_per_class: int = Field(0, ge=0, le=10**6, description="images of each class held out besides, whose "
                                     "labels the server never reads, to distil on (0: the proxy set's images)")
    finetune_steps: int = Field(100, ge=0, le=10**6, description="Adam steps fine-tuning the average on the proxy set")
    calibration_steps: int = Field(100, ge=0, le=10**6, description="Adam steps training the calibration")
    distill_steps: int = Field(100, ge=0, le=10**6, description="Adam steps distilling into the global model")
    batch_labeled: int = Field(20, ge=1, le=10**6, description="proxy images a server step (their mini_batch_size)")
    batch_unlabeled: int = Field(128, ge=1, le=10**6, description="unlabelled images a distillation step")
    server_lr: float = Field(0.001, gt=0, allow_inf_nan=False, description="the server's Adam learning rate "
                             "(their lr_global_teaching)")
    server_weight_decay: float = Field(2e-4, ge=0, allow_inf_nan=False, description="the L2 weight decay of the "
                                       "student's and the fine-tuned model's Adam (the calibration's has none)")
    temperature: float = Field(2.0, gt=0, allow_inf_nan=False, description="the distillation temperature")
    distill_weight: float = Field(0.5, ge=0, le=1, allow_inf_nan=False, description="the KL term's weight λ; the "
                                  "proxy CE gets 1 − λ (their ld)")

    def server_data_per_class(self) -> tuple[int, str]:
        return self.proxy_per_class + self.unlabeled_per_class, "proxy_per_class + unlabeled_per_class"

    def reads_each_update(self) -> str | None:
        return "its calibrated ensemble weighs and distils each client's own model"

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        settings = ServerSettings(self.finetune_steps, self.calibration_steps, self.distill_steps, self.batch_labeled,
                                  self.batch_unlabeled, self.server_lr, self.server_weight_decay, self.temperature,
                                  self.distill_weight, self.proxy_per_class)
        return FedicStrategy(model, build_aggregator(self.aggregator), ctx, self.loss, settings)


register("fedic")(FEDIC)

__all__ = ["FEDIC", "FedicStrategy", "CalibratedEnsemble", "ServerOrders", "client_views", "distill", "draw_orders",
           "finetune", "train_calibration"]

"""FedReLa (guangzhengh/FedReLa, "FedReLa: Imbalanced Federated Learning via Re-Labeling", as its
README cites it; issue 45), as the authors' code (``util/FedReLa.py`` and
``util/update_baseline.py::LocalUpdate.update_weights_gaux``): a plug-in on FedLoGe — from round
``relabel_start`` on, each client trains on its own data with some labels of head classes moved to
rarer classes, chosen once from the received global model's predictions, and with the learning
rate scaled by ``lr_scale``.

The relabelling of one client (``relabel``): P its samples' softmax predictions of the global
model, y their labels, n its class counts. Priors π_c = 1 − (n_c − min n)/(max n − min n) (all 1
when the counts are equal); per class c the mean μ_c and standard deviation σ_c (population,
clipped at 1e-6) of P over the samples labelled c; z = (P − μ_y)/σ_y; per class column j the
threshold t_j, the (n − 1 − m)-th smallest z of the column, m = ⌊thre/100·n⌋ (the top ``thre`` %);
flip rate f = tanh(z − t) · max(π − π_y, 0); with u uniform draws, a sample is relabelled to the
class of highest f among those with f > u (its label kept where none).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field
from torch import nn

from fedlt.algorithms import register
from fedlt.algorithms.base import ClientData, place_model
from fedlt.algorithms.fedavg_family import AroundUpdate
from fedlt.algorithms.longtail import FedLoGe, WithHead
from fedlt.algorithms.personal import stream_seed
from fedlt.algorithms.protocol import ClientResult, ClientTask
from fedlt.bounds import MAX_ROUNDS
from fedlt.models import eval_mode

STATE = "fedrela"  # the client's relabelled targets in its state


def relabel_priors(class_counts: torch.Tensor) -> torch.Tensor:
    """The authors' ``compute_normalized_priors``: 1 − min-max normalised class counts (float64)."""
    n = class_counts.double()
    low, high = n.min(), n.max()
    return torch.where(high > low, 1 - (n - low) / (high - low).clamp(min=1e-300), torch.ones_like(n))


def relabel(predictions: torch.Tensor, targets: torch.Tensor, uniform: torch.Tensor, thre: float) -> torch.Tensor:
    """FedReLa's new labels (the authors' ``compute_classwise_statistics``, ``zscore``,
    ``compute_adaptive_threshold`` and ``get_rho_with_tanh_norm``): ``predictions`` n×C softmax
    outputs, ``targets`` the n labels, ``uniform`` n×C draws on [0, 1); float64 throughout."""
    p = predictions.double()
    n, c = p.shape
    onehot = torch.nn.functional.one_hot(targets, c).double()  # n×C
    counts = onehot.sum(0)
    mean = (onehot.t() @ p) / counts.clamp(min=1)[:, None]  # C×C: row c the mean prediction of class c
    var = (onehot.t() @ (p - mean[targets]).pow(2)) / counts.clamp(min=1)[:, None]  # two passes, as numpy's std
    std = var.sqrt().clamp(min=1e-6)
    z = (p - mean[targets]) / std[targets]
    m = min(max(int(thre / 100 * n), 0), n - 1)
    k = min(max(n - 1 - m, 0), n - 1)
    threshold = z.sort(0).values[k]  # per column, the k-th smallest
    priors = relabel_priors(counts)
    flip = torch.tanh(z - threshold) * (priors[None] - priors[targets][:, None]).clamp(min=0)
    candidate = flip > uniform.to(flip)
    best = torch.where(candidate, flip, torch.full_like(flip, -torch.inf)).argmax(1)
    return torch.where(candidate.any(1), best, targets)


@torch.no_grad()
def predictions_of(model: nn.Module, data: ClientData, batch: int = 2048) -> torch.Tensor:
    """The softmax outputs of ``model`` (in eval mode) on every sample of ``data``, in order, in the
    model's dtype (at least float32: a float64 run's z-scores are not rounded to float32's)."""
    index = torch.arange(len(data), device=data.index_device).split(batch)
    with eval_mode(model):
        logits = [model(x) for x, _ in data.batches(index)]
        return torch.cat([torch.softmax(z.to(torch.promote_types(z.dtype, torch.float32)), 1) for z in logits])


@dataclass(frozen=True)
class Relabelled(AroundUpdate):
    """A client update (``update``) run, from round index ``start`` on, on the client's data with
    its FedReLa labels — computed from the received model when the client has none yet (or every
    ``period`` rounds after ``start``, when ``period`` > 0), kept in its state — and with the
    learning rate times ``lr_scale``."""

    update: Any
    start: float
    period: int
    thre: float
    lr_scale: float

    def first_round(self, rounds: int) -> int:
        """``start`` as a round index: a fraction of the run's rounds when below 1, else the index itself."""
        return math.floor(self.start * rounds + 1e-9) if self.start < 1 else int(self.start)  # 0.29·100 is 29

    def before(self, task: ClientTask, model: nn.Module | None) -> ClientTask:
        """The task on the client's FedReLa labels (also put in its state, for ``after``) at the
        scaled rate; the received task before round ``start``."""
        start = self.first_round(task.context.rounds)
        if task.round_index < start:
            return task
        own = task.state.get(STATE)
        refresh = self.period > 0 and (task.round_index - start) % self.period == 0
        if own is None or refresh or task.round_index == start:
            own = self.new_labels(task, model)
        data = dataclasses.replace(task.data, y=own.to(task.data.y.device))
        schedule = dataclasses.replace(task.schedule, lr=task.schedule.lr * self.lr_scale)
        return dataclasses.replace(task, data=data, schedule=schedule, state=task.state | {STATE: own})

    def after(self, task: ClientTask, result: ClientResult) -> ClientResult:
        if STATE not in task.state:
            return result
        return dataclasses.replace(result, state=result.state | {STATE: task.state[STATE]})

    def new_labels(self, task: ClientTask, model: nn.Module | None) -> torch.Tensor:
        if model is None:
            model = place_model(task.context.model.build(), task.data.x.device)
        model.load_state_dict(task.weights)
        predictions = predictions_of(model, task.data)
        seed = stream_seed(task.context.sampling_seed, task.round_index, task.cid, "fedrela")
        uniform = torch.rand(predictions.shape, generator=torch.Generator().manual_seed(seed % (2**63)),
                             dtype=torch.float64).to(predictions.device)
        return relabel(predictions, task.data.y, uniform, self.thre).to(task.data.y.dtype)


class FedReLa(FedLoGe):
    """FedReLa on FedLoGe (the authors' ``fedloge.py`` with ``--relabel_start``): FedLoGe's training,
    and from round ``relabel_start`` on each client's labels relabelled once (``relabel``; every
    ``relabel_period`` rounds when > 0) from the received global model's predictions, the local
    learning rate times ``lr_scale`` (their 0.1). ``relabel_start``: a fraction of the run's rounds
    when below 1 (default 0.9: their README's T450 of 500 rounds), else a round index (from 0, as
    their ``rnd``); ``thre`` = 5 (% of the samples above each class column's threshold, their --thre)."""

    relabel_start: float = Field(0.9, ge=0, allow_inf_nan=False, description="first relabelled round: a fraction "
                                 "of the run's rounds when < 1, else a round index from 0")
    relabel_period: int = Field(0, ge=0, le=MAX_ROUNDS, description="rounds between refreshed relabellings (0: once, their default)")
    thre: float = Field(5.0, ge=0, le=100, allow_inf_nan=False, description="the top percentage of each class "
                        "column's z-scores above its threshold (their --thre)")
    lr_scale: float = Field(0.1, gt=0, allow_inf_nan=False, description="the local learning rate's factor from "
                            "relabel_start on (their 0.1)")

    def client_fn(self):
        relabelled = Relabelled(self.client_update(), self.relabel_start, self.relabel_period, self.thre,
                                self.lr_scale)
        return WithHead(relabelled, self.head_spec(), aux=True)


register("fedrela")(FedReLa)

__all__ = ["FedReLa", "Relabelled", "relabel", "relabel_priors", "predictions_of"]

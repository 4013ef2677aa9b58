"""FedGELA (Fan et al., NeurIPS 2023; issue 45), as the authors' code (MediaBrain-SJTU/FedGELA,
``FedGELA.py``: ``get_etf``, ``produce_Ew``, ``train_net``, ``compute_accuracy_g`` and
``compute_accuracy_l``; ``model.py``'s ``proxies(type='etf')``): a global simplex ETF shared by all
clients, locally adapted to each client's label distribution.

The model's classifier becomes ``GELAHead``: the representation through a BatchNorm1d (their
``etf`` proxy) and then the fixed d×C simplex ETF M, z = BN(h) M. A client trains on the objective
of its locally adapted logits z ⊙ E / T, E_c = C·n_c/Σn (their ``Ew``: M's columns scaled by the
client's class shares times C; 0 for a class it lacks) and T the temperature; the server averages
the models (FedAvg). The global model answers with z; a client's personal model with z ⊙ E.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedlt.algorithms import register
from fedlt.algorithms.base import RunContext, place_model, upcast
from fedlt.algorithms.fedavg_family import OBJECTIVE, ClientUpdate, FedAvgFamily, StepForward
from fedlt.algorithms.personal import EvalTask
from fedlt.algorithms.pfl import eval_device
from fedlt.algorithms.protocol import ClientTask
from fedlt.bounds import MAX_SEED
from fedlt.models import classifier, heads
from fedlt.models.heads import simplex_etf


class GELAHead(nn.Module):
    """FedGELA's classifier: z = BN(h) M, BN a BatchNorm1d over the d features (trained and
    averaged with the model) and M the fixed d×C simplex ETF drawn from ``seed`` (the authors'
    ``get_etf``: the Q factor of a uniform d×C draw; a non-persistent buffer, rebuilt on every
    node). ``weight`` is Mᵀ (C×d). A training batch of one sample (where BatchNorm has no batch
    statistics and their code fails) is normalised with the running statistics, which it leaves
    as they are."""

    def __init__(self, in_features: int, num_classes: int, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the same ETF on every node
            torch.manual_seed(seed)
            a = torch.rand(in_features, num_classes, dtype=torch.float64)
        self.bn = nn.BatchNorm1d(in_features)
        self.register_buffer("proto", simplex_etf(a).float(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.proto.t()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h.flatten(1)
        if self.training and h.shape[0] == 1:  # one sample has no batch statistics: the running ones, unmoved
            bn = self.bn
            return F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps) @ \
                self.proto.to(h.dtype)
        return self.bn(h) @ self.proto.to(h.dtype)


def with_gela_head(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` with its d→C linear classifier replaced by a ``GELAHead``, in place."""
    old = classifier(model)
    return heads.swap(model, GELAHead(old.in_features, old.out_features, seed).to(old.weight.device))


def local_adaptation(class_counts: torch.Tensor) -> torch.Tensor:
    """The authors' ``Ew``: C·n_c/Σn per class (0 for a class the client lacks), float64."""
    n = class_counts.double()
    return n.numel() * n / n.sum()


class Adapted(nn.Module):
    """The personal classifier: the global head's logits scaled by the client's ``Ew``."""

    def __init__(self, head: nn.Module, scale: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("scale", scale.detach().clone())

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight * self.scale[:, None].to(self.head.weight.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h) * self.scale.to(h.dtype)


@dataclass(frozen=True)
class GELAUpdate(ClientUpdate):
    """FedGELA's local step (the authors' ``train_net``): the objective (their NLL of log-softmax:
    ``ce``) on z ⊙ Ew / ``temperature``; the client's class counts kept for its personal model.
    A model the client builds for itself gets the head attached (``seed``)."""

    temperature: float = 0.2
    seed: int = 0
    # measured (fedlt.testing.cohort.sensitivity, the contract's settings, by epochs): the sequential
    # path from weights perturbed by 1e-7 ends 53 % apart after two rounds (float32), by 1e-16 4e-5
    # (float64); with the cohorts_bn helper's per-client BatchNorm statistics the cohort equals it to
    # 2e-16 by iterations in float64, 1.2e-5 by epochs
    cohort_refusal = ("FedGELA's local training amplifies rounding itself (its BatchNorm head standardises h over "
                      "a batch, its logits scaled by C·n_c/Σn / T): one client after another, weights perturbed by "
                      "1e-7 end 53 % apart after two rounds (1e-16 in float64: 4e-5), so no batched order of float "
                      "sums can be checked equal to the sequential run")

    def build(self, task: ClientTask) -> nn.Module:
        return with_gela_head(super().build(task), self.seed)

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        scale = local_adaptation(task.data.class_counts) / self.temperature
        like = next(model.parameters()).dtype  # the model's: a float64 run's Ew / T is not rounded to float32
        return {"scale": scale.to(task.data.x.device, like)}

    def terms(self, local: Any, forward: StepForward, objective, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {OBJECTIVE: objective(upcast(forward.logits) * local["scale"], y, **extra)}

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"class_counts": task.data.class_counts.detach().clone()}, {}


class FedGELA(FedAvgFamily):
    """FedGELA (Fan et al., NeurIPS 2023), as the authors' code: the classifier is ``GELAHead``
    (BatchNorm1d + a fixed simplex ETF, ``seed``); each client trains on its logits scaled by
    Ew = C·(its class shares) and divided by ``temperature`` (0.2, their ``--temperature``
    default); FedAvg aggregation. Global model: BN(h) M; personal model: the global model's
    logits ⊙ Ew (their ``compute_accuracy_l``)."""

    temperature: float = Field(0.2, gt=0, allow_inf_nan=False, description="temperature T of the local logits "
                                                                          "z ⊙ Ew / T (their --temperature)")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the fixed simplex ETF (the same on every node)")

    def client_fn(self) -> GELAUpdate:
        return GELAUpdate(self.temperature, self.seed)

    def setup(self, ctx: RunContext) -> None:
        build, seed = ctx.build_model, self.seed
        super().setup(dataclasses.replace(ctx, build_model=lambda: with_gela_head(build(), seed)))

    def personal_model(self, task: EvalTask) -> nn.Module:
        """The global model (``task.weights``) with its logits scaled by the client's Ew (from the
        class counts in its state); the global model for a client that has never trained."""
        with torch.random.fork_rng(devices=[]):
            model = place_model(self._ctx.build_model(), eval_device(task))
        model.load_state_dict(task.weights)
        counts = task.state.get("class_counts")
        if counts is None:
            return model.eval()
        return heads.swap(model, Adapted(classifier(model), local_adaptation(counts).float())).eval()


register("fedgela")(FedGELA)

__all__ = ["FedGELA", "GELAHead", "GELAUpdate", "Adapted", "local_adaptation", "with_gela_head"]

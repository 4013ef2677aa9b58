"""The long-tail methods after Fed-GraB that fix or re-shape the classifier (issue 33), each a
composition of the FedAvg family's loop, a classifier head (fedlt.models.heads) and/or one more
piece of server state:

| name | model | client (``ClientUpdate`` hook) | server (``Strategy``) |
|---|---|---|---|
| ``fedetf`` | classifier → ``etf`` head (projection, fixed simplex ETF, learnable β) | objective ``balanced_softmax(absent='one')`` | — |
| ``fedlf`` | unchanged | ``parts``: the objective on FedRS-scaled logits h·Wᵀ ⊙ a, + λ·L1 to the class centres | class centres f_G, similarity-weighted |
| ``fednh`` | classifier → ``prototypes`` head | ``end``: the client's class prototypes | the ``fednh`` server step: semantic infusion |
| ``fedloge`` | classifier → ``sse_c`` head (fixed) | — | — (g_aux, local heads, realignment: not built) |

A head is attached to every model the algorithm builds (the server's, each process's work
module, and a model a client builds for itself), so every engine runs the same architecture.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from pydantic import AfterValidator, Field
from torch import nn

from fedlt.algorithms import register
from fedlt.algorithms.base import AggregatorSpec, LossExpression, RunContext, as_spec, build_aggregator
from fedlt.algorithms.fedavg_family import OBJECTIVE, ClientUpdate, FedAvgFamily, Strategy, client_update
from fedlt.algorithms.protocol import ClientResult, ClientTask
from fedlt.algorithms.recalibrate import Recalibrated, StepSpec
from fedlt.algorithms.stateful import decorrelation_loss, features_of
from fedlt.context import RoundContext
from fedlt.errors import FedltError
from fedlt.models import classifier, heads


def _valid_head(spec: str | dict[str, Any]) -> str | dict[str, Any]:
    """A head spec whose name is registered and whose parameters its factory takes (the values
    are checked when the head is built, against the model's dimensions)."""
    parsed = as_spec(spec)
    name = parsed.pop("name", None)
    try:
        factory = heads.REGISTRY.get(name)
        inspect.signature(factory).bind(in_features=1, num_classes=2, **parsed)
    except TypeError as exc:
        raise ValueError(f"head {name!r}: {exc}") from None
    except FedltError as exc:
        raise ValueError(str(exc)) from None
    return spec


HeadSpec = Annotated[str | dict[str, Any], AfterValidator(_valid_head)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


@dataclass(frozen=True)
class WithHead:
    """A client update whose model carries the head: the given work module already does; a
    model the client builds for itself (no module given) gets it attached."""

    update: Any
    head: dict[str, Any]

    def __call__(self, task: ClientTask, model: nn.Module | None = None) -> ClientResult:
        if model is None:
            model = heads.attach(task.context.model.build(), self.head).to(task.data.x.device)
        return self.update(task, model)


class HeadFamily(FedAvgFamily):
    """A FedAvg-family algorithm whose models carry a classifier head (``head``, a spec of
    fedlt.models.heads) in place of their linear classifier."""

    head: HeadSpec = Field("etf", description="the classifier head that replaces the model's classifier")

    def head_spec(self) -> dict[str, Any]:
        return as_spec(self.head)

    def client_update(self) -> Any:
        """The client's loop, before the head is attached to a model it builds itself."""
        return client_update

    def client_fn(self):
        return WithHead(self.client_update(), self.head_spec())

    def setup(self, ctx: RunContext) -> None:
        build, spec = ctx.build_model, self.head_spec()
        super().setup(_replace_build(ctx, lambda: heads.attach(build(), spec)))


def _replace_build(ctx: RunContext, build) -> RunContext:
    return dataclasses.replace(ctx, build_model=build)


class FedETF(HeadFamily):
    """FedETF (Li et al., ICCV 2023), its generic (global-model) half: the model's classifier is
    the ``etf`` head — projection layer, L2-normalised features, a fixed simplex-ETF classifier
    and a learnable temperature β — trained with the balanced softmax loss on the client's counts,
    an absent class counted as one sample (the authors' ``client_fedetf``); FedAvg aggregation."""

    loss: LossExpression = Field("balanced_softmax(absent='one')", description="the local objective, a loss expression")
    head: HeadSpec = Field("etf", description="the classifier head: FedETF's projection + fixed simplex ETF")


register("fedetf")(FedETF)


# -- FedLF ------------------------------------------------------------------------------------
def fedrs_scale(class_counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """FedLF's adaptive logit adjustment factor (the authors' ``our.py``, FedRS's restricted
    softmax): a_c = (1 − α)·p_c / max_c p_c + α, p = n / Σ n."""
    p = class_counts.double() / class_counts.double().sum()
    return (p / p.max()) * (1.0 - alpha) + alpha


def running_centres(features: torch.Tensor, labels: torch.Tensor, sums: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    """Adds the batch to the epoch's per-class feature sums (detached, as the authors' code) and
    returns the per-class means so far (0 for a class not seen yet)."""
    sums.index_add_(0, labels, features.detach().to(sums.dtype))
    counts.index_add_(0, labels, torch.ones_like(labels, dtype=counts.dtype))
    seen = counts > 0
    means = torch.zeros_like(sums)
    means[seen] = sums[seen] / counts[seen, None]
    return means


def epoch_size(task: ClientTask) -> int:
    """Samples in one local epoch: the client's data (by epochs), or the samples drawn before the
    iteration schedule reshuffles (⌊n/B⌋·B)."""
    n = len(task.data)
    if task.schedule.epochs is not None:
        return n
    batch = min(task.schedule.batch, n)
    return (n // batch) * batch


@dataclass(frozen=True)
class FedLFUpdate(ClientUpdate):
    """FedLF's local step (the authors' ``Local.local_train``): the objective on the logits
    z = (h Wᵀ) ⊙ a (h the classifier's input, W its weight, no bias; a from ``fedrs_scale``)
    plus ``lam``·L1(f_k, f_G) between the local epoch's running class means f_k (restarted each
    epoch) and the server's centres f_G, once the server has any (f_G ≠ 0). The running means
    are detached in the authors' code, so the centre term adds to the loss's value, not to its
    gradient. The client uploads the last epoch's class means."""

    alpha: float
    lam: float
    beta: float = 0.0

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        centres = task.payload["centres"].to(task.data.y.device)
        return {"scale": fedrs_scale(task.data.class_counts, self.alpha).float().to(centres.device),
                "centres": centres, "active": bool((centres != 0).any()),
                "sums": torch.zeros_like(centres, dtype=torch.float64),
                "counts": torch.zeros(len(centres), dtype=torch.float64, device=centres.device),
                "size": epoch_size(task), "seen": 0, "means": None}

    def parts(self, local: Any, model: nn.Module, objective, x: torch.Tensor, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        with features_of(model) as seen:
            model(x)
        h, w = seen[0], classifier(model).weight
        parts = {OBJECTIVE: objective((h @ w.t()) * local["scale"], y, **extra)}
        if local["seen"] >= local["size"]:  # a new local epoch: the authors restart f_k
            local["sums"].zero_(), local["counts"].zero_()
            local["seen"] = 0
        local["seen"] += len(y)
        local["means"] = running_centres(h, y, local["sums"], local["counts"])
        if local["active"]:
            centre = F.l1_loss(local["means"], local["centres"].double()).to(h.dtype)
            parts[f"FedLF's class-centre term (lam={self.lam:g})"] = self.lam * centre
        if self.beta:
            parts[f"FedLF's feature decorrelation (beta={self.beta:g})"] = self.beta * decorrelation_loss(h)
        return parts

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        means = local["means"] if local["means"] is not None else local["sums"]
        return {}, {"centres": means.float()}


def update_centres(centres: torch.Tensor, local: Sequence[torch.Tensor], first: bool) -> torch.Tensor:
    """The server's class centres f_G (the authors' ``our()``): the plain mean of the clients'
    centres in the first round after the warm-up; afterwards, per class c,
    f_G[c] = Σ_k s_kc·f_k[c] / Σ_k s_kc with s_kc = cos(f_G[c], f_k[c]) (torch's cosine
    similarity, eps 1e-8). A class whose weights sum to 0 (no client has seen it) keeps its
    centre, where the authors' code divides 0 by 0."""
    stacked = torch.stack([c.double() for c in local])  # K×C×d
    if first:
        return stacked.mean(0)
    sims = F.cosine_similarity(centres.double()[None], stacked, dim=2)  # K×C
    total = sims.sum(0)
    weighted = (sims[..., None] * stacked).sum(0)
    keep = total == 0
    out = weighted / torch.where(keep, torch.ones_like(total), total)[:, None]
    return torch.where(keep[:, None], centres.double(), out)


class FedLFStrategy(Strategy):
    """FedAvg of the models, and the class centres f_G (C×d, zero until the round after
    ``warm_up``) sent to every client and updated from the clients' uploads."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str, warm_up: int) -> None:
        super().__init__(model, aggregator, ctx, objective)
        self.warm_up = warm_up
        self.centres = torch.zeros(ctx.num_classes, classifier(model).in_features)

    def payload(self, round: RoundContext) -> dict[str, Any]:
        return {"centres": self.centres}

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        metrics = super().aggregate(round, results)
        r = round.round_index + 1  # the authors count rounds from 1
        if r > self.warm_up and results:
            local = [res.extras["centres"] for res in sorted(results, key=lambda res: res.cid)]
            self.centres = update_centres(self.centres, local, first=r == self.warm_up + 1).float()
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"centres": self.centres.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.centres = state["centres"].clone()


class FedLF(FedAvgFamily):
    """FedLF (Lu, Li, Jiang, ACML 2024), as the authors' code (18sym/FedLF ``algorithm/our.py``):
    the objective on FedRS-scaled logits (adaptive logit adjustment, ``alpha``), plus ``lam``·L1
    between the local class centres and the server's (continuous class-centred optimisation),
    the server's centres updated by similarity-weighted averaging after ``warm_up`` rounds.
    Defaults: the authors' options (rs_alpha 0.25, warm_up_epoch 10, weight 0.5)."""

    alpha: NonNegative = Field(0.25, le=1, description="α of the adaptive scale a_c = (1 − α)·p_c/max p + α")
    lam: NonNegative = Field(0.5, description="weight λ of the class-centre L1 term")
    warm_up: int = Field(10, ge=0, description="rounds before the server's class centres are first formed")
    beta: NonNegative = Field(0.0, description="weight β of a feature-decorrelation term (FedDecorr's) on h; "
                                               "0 as the authors' code, which has none")

    def client_fn(self):
        return FedLFUpdate(self.alpha, self.lam, self.beta)

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return FedLFStrategy(model, build_aggregator(self.aggregator), ctx, self.loss, self.warm_up)


register("fedlf")(FedLF)

# -- FedNH ------------------------------------------------------------------------------------
class FedNH(HeadFamily, Recalibrated):
    """FedNH (Dai et al., AAAI 2023), as the authors' code (Yutong-Dai/FedNH, ``FedNH.py``): the
    classifier is the ``prototypes`` head (orthogonal class prototypes, normalised features, a
    learnable scale), fixed on the clients; after local training the clients upload their class
    prototypes and the server infuses them into the global ones with smoothing ``rho`` — the
    ``fednh`` server step (fedlt.server_steps.fednh), run after the aggregator. Defaults: their
    Conv2Cifar setting (ρ = 0.9, CE, the unweighted mean of the client models: server learning
    rate 1)."""

    head: HeadSpec = Field("prototypes", description="the classifier head: FedNH's class prototypes")
    aggregator: AggregatorSpec = Field("mean", description="the server's aggregator spec (the authors' server: "
                                                           "the unweighted mean)")
    step: StepSpec = Field("fednh", description="the server-side step that moves the prototypes")
    rho: float = Field(0.9, ge=0, le=1, allow_inf_nan=False, description="smoothing ρ of the prototype update "
                                                                         "(the 'fednh' step's rho)")

    def step_spec(self) -> dict[str, Any]:
        spec = as_spec(self.step)
        if spec["name"] == "fednh":
            spec.setdefault("rho", self.rho)
        return spec

    def client_update(self) -> Any:
        return Recalibrated.client_fn(self)

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        if not isinstance(classifier(model), heads.PrototypeHead):
            raise FedltError(f"fednh: head {self.head!r} has no class prototypes; use the 'prototypes' head")
        return super().make_strategy(model, ctx)


register("fednh")(FedNH)

# -- FedLoGe ----------------------------------------------------------------------------------
class FedLoGe(HeadFamily):
    """FedLoGe (Xiao et al., ICLR 2024), its global model as the authors' default evaluates it
    (fedloge.py: ``cls_switch = "SSE-C"``, ``global_test_head = 'g_head'``): the backbone trained
    with CE through the fixed static sparse equiangular classifier (the ``sse_c`` head), FedAvg.
    Not built yet: the auxiliary global head g_aux and the clients' local heads (trained on
    detached features) and their global/local feature realignment."""

    head: HeadSpec = Field("sse_c", description="the classifier head: FedLoGe's fixed SSE-C")


register("fedloge")(FedLoGe)

__all__ = ["HeadFamily", "FedETF", "FedLF", "WithHead", "fedrs_scale", "running_centres", "update_centres", "FedNH", "FedLoGe"]

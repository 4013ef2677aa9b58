"""FedProto (Tan et al., AAAI 2022; issue 45), as the authors' code (yuetan031/FedProto,
``lib/update.py::LocalUpdate.update_weights_het``, ``lib/utils.py::agg_func`` and
``proto_aggregation``, ``lib/update.py::test_inference_new_het_lt``): clients exchange class
prototypes instead of weights.

Each client keeps its whole model (as ``local``) and trains it on the objective plus
``lam``·MSE(h, P̄_y), h the classifier's input and P̄_y the global prototype of the sample's class
(the sample's own h, i.e. no pull, where the server has none for it). After training it uploads
its class prototypes: the per-class mean of h over its last local epoch. The server's prototypes
are, per class, the unweighted mean of the prototypes of the participants that hold the class.

The global prototypes travel inside the model: its classifier is wrapped by ``WithPrototypes``,
whose buffers (``prototypes``, C×d; ``present``, C) the server writes after each round; every
participant reads them from the weights it receives, every evaluation from the global weights,
and they are checkpointed with the model. A client keeps everything else of its model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedlt.algorithms import register
from fedlt.algorithms.base import RunContext, build_aggregator, place_model, upcast
from fedlt.algorithms.fedavg_family import OBJECTIVE, StepForward, Strategy
from fedlt.algorithms.longtail import epoch_size
from fedlt.algorithms.personal import EvalTask
from fedlt.algorithms.pfl import PERSONAL, PartsUpdate, Personalised, _keys_under
from fedlt.algorithms.protocol import ClientResult, ClientTask
from fedlt.context import RoundContext
from fedlt.models import classifier, heads

UNREACHABLE = 100.0  # the authors' distance to a class the client lacks or the server has no prototype of


class WithPrototypes(nn.Module):
    """The model's classifier (``linear``, unchanged in the forward) carrying the server's class
    prototypes: ``prototypes`` (C×d) and ``present`` (C; 1 where the server has the class's)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear
        c, d = linear.weight.shape
        like = {"dtype": linear.weight.dtype, "device": linear.weight.device}
        self.register_buffer("prototypes", torch.zeros(c, d, **like))
        self.register_buffer("present", torch.zeros(c, **like))

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def in_features(self) -> int:
        return self.linear.weight.shape[1]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h)


def with_prototypes(model: nn.Module) -> nn.Module:
    """``model`` with its classifier wrapped by ``WithPrototypes``, in place."""
    return heads.swap(model, WithPrototypes(classifier(model)))


def bank_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of the server's prototypes (never kept by a client)."""
    bank = classifier(model)
    return sorted(set(_keys_under(model, bank)) - set(_keys_under(model, bank.linear)))


def prototype_distance(h: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor,
                       y: torch.Tensor) -> torch.Tensor:
    """The authors' ``loss_mse(proto_new, protos)``: the mean over the batch and the d features of
    (h − P̄_y)², a sample whose class has no global prototype counted with distance 0."""
    target = torch.where(present[y].bool()[:, None], prototypes[y].to(h.dtype), h.detach())
    return F.mse_loss(h, target)


def class_means(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return sums / counts.clamp(min=1)[:, None]


@dataclass(frozen=True)
class ProtoUpdate(PartsUpdate):
    """FedProto's local round: the client's own model (``keep``: all but the server's prototypes),
    the objective + ``lam``·``prototype_distance``; the per-class means of h over the last local
    epoch (restarted each epoch, as the authors' ``agg_protos_label``) go to the server."""

    lam: float = 1.0

    def build(self, task: ClientTask) -> nn.Module:
        return with_prototypes(place_model(task.context.model.build(), task.data.x.device))

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        bank = classifier(model)
        c, d = bank.prototypes.shape
        device = bank.prototypes.device
        return {"prototypes": bank.prototypes.detach().clone(), "present": bank.present.detach().clone(),
                "sums": torch.zeros(c, d, dtype=torch.float64, device=device),
                "counts": torch.zeros(c, dtype=torch.float64, device=device), "size": epoch_size(task), "seen": 0}

    features = True

    def terms(self, local: Any, forward: StepForward, objective, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        logits, h = forward.logits, upcast(forward.features)
        if local["seen"] >= local["size"]:  # a new local epoch: the authors restart their prototypes
            local["sums"].zero_(), local["counts"].zero_()
            local["seen"] = 0
        local["seen"] += len(y)
        local["sums"].index_add_(0, y, h.detach().double())
        local["counts"].index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
        distance = prototype_distance(h, local["prototypes"], local["present"], y)
        return {OBJECTIVE: objective(upcast(logits), y, **extra),
                f"FedProto's prototype distance (lam={self.lam:g})": self.lam * distance}

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        own = set(bank_keys(model))
        kept = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in own}
        like = local["prototypes"].dtype  # the model's: a float64 run's prototypes are not rounded to float32
        extras = {"prototypes": class_means(local["sums"], local["counts"]).to(like),
                  "present": (local["counts"] > 0).to(like)}
        return {PERSONAL: kept, "class_counts": task.data.class_counts.detach().clone()}, extras


def aggregate_prototypes(prototypes: Sequence[torch.Tensor], present: Sequence[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' ``proto_aggregation``: per class, the unweighted mean of the prototypes of
    the clients that hold it; (C×d prototypes, C presence) — a class none holds: 0, absent."""
    stacked = torch.stack([p.double() for p in prototypes])  # K×C×d
    held = torch.stack([m.double() for m in present])  # K×C
    total = held.sum(0)
    mean = (held[..., None] * stacked).sum(0) / total.clamp(min=1)[:, None]
    return mean, (total > 0).double()


class ProtoStrategy(Strategy):
    """No weights aggregated; the model's prototype buffers replaced each round by the aggregate of
    the participants' prototypes (the authors' ``global_protos = proto_aggregation(local_protos)``:
    a class no participant of the round holds has none until one does again)."""

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        metrics = {"train_loss": sum(r.train_loss for r in results) / len(results)}
        ordered = sorted(results, key=lambda r: r.cid)
        mean, present = aggregate_prototypes([r.extras["prototypes"] for r in ordered],
                                             [r.extras["present"] for r in ordered])
        bank = classifier(self.model)
        with torch.no_grad():
            bank.prototypes.copy_(mean), bank.present.copy_(present)
        return metrics


class NearestPrototype(nn.Module):
    """The authors' inference "with protos": the logit of class j is −MSE(h, P̄_j) (mean over the
    d features) for a class the server has a prototype of and the client holds, −100 otherwise,
    so the prediction is the nearest of those prototypes."""

    def __init__(self, prototypes: torch.Tensor, allowed: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("prototypes", prototypes.detach().clone())
        self.register_buffer("allowed", allowed.detach().clone().bool())

    @property
    def weight(self) -> torch.Tensor:
        return self.prototypes

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h.flatten(1)
        distance = (h[:, None, :] - self.prototypes.to(h.dtype)[None]).pow(2).mean(-1)
        return -torch.where(self.allowed[None], distance, torch.full_like(distance, UNREACHABLE))


class FedProto(Personalised):
    """FedProto (Tan et al., AAAI 2022), as the authors' code: the client's whole model kept,
    trained on the objective (their NLL of log-softmax: ``ce``) + ``lam``·MSE to the global
    prototypes (``lam`` = 1, their ``--ld``); the server averages the clients' class prototypes
    (``ProtoStrategy``); no weights are sent. The personal model answers with the nearest global
    prototype among the client's classes (``inference='prototypes'``, their "with protos") or with
    its own classifier (``'model'``, their "w/o protos"). The global model is never trained."""

    keep: ClassVar[str] = "all"
    shared: ClassVar[str] = "none"
    lam: float = Field(1.0, ge=0, allow_inf_nan=False, description="weight λ of the prototype distance (their --ld)")
    inference: Literal["prototypes", "model"] = Field("prototypes", description="the personal model's answer: the "
                                                      "nearest global prototype, or the client's own classifier")

    def client_fn(self) -> ProtoUpdate:
        return ProtoUpdate(self.keep, self.freeze, self.shared, lam=self.lam)

    def setup(self, ctx: RunContext) -> None:
        build = ctx.build_model
        super().setup(dataclasses.replace(ctx, build_model=lambda: with_prototypes(build())))

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return ProtoStrategy(model, build_aggregator(self.aggregator), ctx, self.loss)

    def personal_model(self, task: EvalTask) -> nn.Module:
        model = super().personal_model(task)  # the global weights (the server's prototypes) + the client's own
        counts = task.state.get("class_counts")
        if self.inference == "model" or counts is None:
            return model
        bank = classifier(model)
        allowed = bank.present.bool() & (counts.to(bank.present.device) > 0)
        return heads.swap(model, NearestPrototype(bank.prototypes, allowed)).eval()


register("fedproto")(FedProto)

__all__ = ["FedProto", "ProtoUpdate", "ProtoStrategy", "WithPrototypes", "NearestPrototype", "aggregate_prototypes",
           "prototype_distance", "with_prototypes", "bank_keys"]

"""The long-tail methods after Fed-GraB that fix or re-shape the classifier (issue 33), each a
composition of the FedAvg family's loop, a classifier head (fedlt.models.heads) and/or one more
piece of server state:

| name | model | client (``ClientUpdate`` hook) | server (``Strategy``) |
|---|---|---|---|
| ``fedetf`` | classifier → ``etf`` head (projection, fixed simplex ETF, learnable β) | objective ``balanced_softmax(absent='one')`` | —; ``personal_model``: local training + fine-tuning |
| ``fedlf`` | unchanged | ``parts``: the objective on FedRS-scaled logits h·Wᵀ ⊙ a, + λ·L1 to the class centres | class centres f_G, similarity-weighted |
| ``fednh`` | classifier → ``prototypes`` head | ``end``: the client's class prototypes | the ``fednh`` server step: semantic infusion |
| ``fedloge`` | classifier → ``sse_c`` head (fixed) + ``g_aux`` | ``parts``: CE of g_aux and of the client's l_head on detached features; ``end``: l_head kept | FedAvg; GA-FR (option); ``personal_model``: LA-FR |

A head is attached to every model the algorithm builds (the server's, each process's work
module, and a model a client builds for itself), so every engine runs the same architecture.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import AfterValidator, Field
from torch import nn

from fedlt.algorithms import register
from fedlt.bounds import MAX_EPOCHS, MAX_ROUNDS
from fedlt.algorithms.base import (AggregatorSpec, ClientData, LocalSchedule, LossExpression, RunContext, as_spec,
                                   build_aggregator, client_generator, upcast)
from fedlt.algorithms.fedavg_family import (OBJECTIVE, ClientUpdate, FedAvgFamily, Federated, StepForward, Strategy,
                                            client_update)
from fedlt.algorithms.personal import EvalTask
from fedlt.algorithms.protocol import ClientResult, ClientTask
from fedlt.algorithms.recalibrate import Recalibrated, StepSpec
from fedlt.algorithms.stateful import decorrelation_loss, features_of
from fedlt.context import RoundContext
from fedlt.errors import FedltError
from fedlt.models import classifier, heads


def _valid_head(spec: str | dict[str, Any]) -> str | dict[str, Any]:
    """A head spec whose name is registered and whose parameters its factory takes (the values
    are checked when the head is built, against the model's dimensions)."""
    try:
        heads.check_params(as_spec(spec))
    except FedltError as exc:
        raise ValueError(str(exc)) from None
    return spec


HeadSpec = Annotated[str | dict[str, Any], AfterValidator(_valid_head)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


@dataclass(frozen=True)
class WithHead:
    """A client update whose model carries the head: the given work module already does; a
    model the client builds for itself (no module given) gets it attached (and FedLoGe's g_aux
    beside it, ``aux``)."""

    update: Any
    head: dict[str, Any]
    aux: bool = False

    @property
    def given_module(self) -> Any:
        """What runs when the work module is given (a cohort's case): the wrapped update."""
        return self.update

    def __call__(self, task: ClientTask, model: nn.Module | None = None) -> ClientResult:
        if model is None:
            model = heads.attach(task.context.model.build(), self.head)
            model = (with_aux(model) if self.aux else model).to(task.data.x.device)
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


def _train_epochs(model: nn.Module, params: list[torch.Tensor], optimiser: torch.optim.Optimizer, data: ClientData,
                  schedule: LocalSchedule, generator: torch.Generator) -> None:
    """``schedule``'s passes of plain CE over ``data``, only ``params`` trainable (the rest frozen,
    as the authors' ``requires_grad = False``), the model in train mode."""
    trainable = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    model.train()
    for x, y in data.batches(schedule.batches(len(data), generator, data.index_device)):
        optimiser.zero_grad(set_to_none=True)
        F.cross_entropy(upcast(model(x)), y).backward()
        optimiser.step()


def etf_finetune(model: nn.Module, data: ClientData, schedule: LocalSchedule, generator: torch.Generator, *,
                 alternations: int = 20, epochs: int = 3, lr_proto: float = 0.1, lr_proj: float = 0.05) -> nn.Module:
    """FedETF's personalisation after local training (the authors' ``Client_personalization``):
    ``alternations`` times, ``epochs`` passes of CE on the ETF M alone (plain SGD, lr ``lr_proto``),
    then ``epochs`` on the projection layer alone (SGD lr ``lr_proj`` with the schedule's momentum
    and weight decay, a fresh optimiser each time); β stays. M becomes a parameter of the head
    (a buffer of the global model). ``model`` (an ``etf`` head) is changed in place and returned."""
    head = classifier(model)
    proto = nn.Parameter(head.proto.detach().clone())
    del head._buffers["proto"]
    head.proto = proto  # the client's own M from now on
    passes = dataclasses.replace(schedule, epochs=epochs, iters=None)
    for _ in range(alternations):
        _train_epochs(model, [proto], torch.optim.SGD([proto], lr=lr_proto), data, passes, generator)
        proj = list(head.linear_proto.parameters())
        optimiser = torch.optim.SGD(proj, lr=lr_proj, momentum=schedule.momentum, weight_decay=schedule.weight_decay)
        _train_epochs(model, proj, optimiser, data, passes, generator)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


class FedETF(HeadFamily):
    """FedETF (Li et al., ICCV 2023): the model's classifier is the ``etf`` head — projection
    layer, L2-normalised features, a fixed simplex-ETF classifier and a learnable temperature β —
    trained with the balanced softmax loss on the client's counts, an absent class counted as
    one sample (the authors' ``client_fedetf``); FedAvg aggregation. A client's personal model
    (``personal_model``) is the global model after the authors' personalisation: one more local
    training (the round's objective and schedule), then ``etf_finetune``."""

    loss: LossExpression = Field("balanced_softmax(absent='one')", description="the local objective, a loss expression")
    head: HeadSpec = Field("etf", description="the classifier head: FedETF's projection + fixed simplex ETF")
    alternations: int = Field(20, ge=0, le=MAX_EPOCHS, description="personalisation: alternations of fine-tuning M "
                                                                   "and the projection")
    finetune_epochs: int = Field(3, ge=1, le=MAX_EPOCHS, description="personalisation: epochs of each fine-tuning "
                                                                     "phase")
    # its personal model fine-tunes the ETF head's own M and projection (``etf_finetune``)
    personal_requires: ClassVar[frozenset[str]] = frozenset({"etf"})
    lr_proto: float = Field(0.1, gt=0, allow_inf_nan=False, description="personalisation: learning rate of M")
    lr_proj: float = Field(0.05, gt=0, allow_inf_nan=False, description="personalisation: learning rate of the "
                                                                       "projection layer")

    def personal_model(self, task: EvalTask) -> nn.Module:
        """The global model (``task.weights``) trained on the client's data (``task.data``) as a
        round would (``task.schedule``, else the run's), then fine-tuned by ``etf_finetune``; its
        draws from a stream of its own (the round after the last, never a training round's)."""
        if task.data is None:
            raise FedltError("fedetf: the personal model fine-tunes on the client's training data; "
                             "the evaluation task carries none (EvalTask.data)")
        schedule = task.schedule or self._ctx.schedule(self._ctx.batch_size or self._ctx.server_batch)
        model = self._ctx.build_model().to(task.data.x.device)
        context = dataclasses.replace(task.context, round_index=task.context.rounds)
        local = ClientTask(task.cid, context, task.weights, task.data, dict(task.state), schedule, self.loss, {})
        self.client_fn()(local, model)  # trains ``model`` in place
        generator = client_generator(task.context.sampling_seed, task.context.rounds + 1, task.cid)
        return etf_finetune(model, task.data, schedule, generator, alternations=self.alternations,
                            epochs=self.finetune_epochs, lr_proto=self.lr_proto, lr_proj=self.lr_proj)


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
        # the model's dtype, not float32: a float64 run (the replay's) keeps float64 throughout
        dtype = params[0].dtype if params else torch.float32
        return {"scale": fedrs_scale(task.data.class_counts, self.alpha).to(centres.device, dtype),
                "centres": centres, "active": bool((centres != 0).any()),
                "sums": torch.zeros_like(centres, dtype=torch.float64),
                "counts": torch.zeros(len(centres), dtype=torch.float64, device=centres.device),
                "size": epoch_size(task), "seen": 0, "means": None}

    features = True

    def terms(self, local: Any, forward: StepForward, objective, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        h, w = forward.features, forward.param(classifier(forward.model), "weight")
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
        return {}, {"centres": means.to(params[0].dtype if params else torch.float32)}


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
            self.centres = update_centres(self.centres, local, first=r == self.warm_up + 1).to(self.centres.dtype)
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
    warm_up: int = Field(10, ge=0, le=MAX_ROUNDS, description="rounds before the server's class centres are first "
                                                              "formed")
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
    head_requires: ClassVar[frozenset[str]] = frozenset({"prototypes"})  # its clients train against them
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
ABSENT = -1e10  # the authors' mask: the weight rows of a class the client lacks (localtest, p_mode 1)


class WithAux(nn.Module):
    """The model's classifier for FedLoGe: the fixed SSE-C ``g_head`` (the forward: the global
    logits) and beside it the auxiliary global head ``g_aux`` (a d→C linear layer, trained on
    detached features and averaged with the rest, outside the forward). ``weight`` is g_head's."""

    def __init__(self, g_head: nn.Module) -> None:
        super().__init__()
        # g_aux reads the representation h, whose width the head declares (``in_features``): a
        # head's class vectors may live in another space (the ETF's projection)
        c, d = g_head.weight.shape[0], g_head.in_features
        self.g_head = g_head
        self.g_aux = nn.Linear(d, c).to(g_head.weight.device)
        # GA-FR's evaluated model: g_aux re-aligned to this row norm instead of g_head (None: g_head).
        # The same modules and state-dict keys either way, so a personal model loads its weights.
        self.realign_scale: float | None = None

    @property
    def weight(self) -> torch.Tensor:
        if self.realign_scale is not None:
            return global_realignment(self.g_aux.weight, self.realign_scale)
        return self.g_head.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.realign_scale is not None:
            return F.linear(h.flatten(1), self.weight, self.g_aux.bias)
        return self.g_head(h)


def with_aux(model: nn.Module) -> nn.Module:
    """``model`` with its classifier (the head) wrapped with FedLoGe's g_aux (``WithAux``), in place."""
    return heads.swap(model, WithAux(classifier(model)))


def g_aux(model: nn.Module) -> nn.Linear:
    return classifier(model).g_aux


def local_realignment(g_aux_weight: torch.Tensor, l_head_weight: torch.Tensor) -> torch.Tensor:
    """FedLoGe's local adaptive feature realignment (LA-FR; the authors' ``update_weights_norm_init``
    as realignment.py runs it, epoch 0): g_aux's row c scaled by ‖l_head row c‖₂."""
    return g_aux_weight * torch.linalg.vector_norm(l_head_weight, dim=1, keepdim=True)


def global_realignment(g_aux_weight: torch.Tensor, scale: float = 1.7) -> torch.Tensor:
    """FedLoGe's global adaptive feature realignment (GA-FR; the authors' ``globaltest_calibra``):
    g_aux's row c scaled to norm ``scale`` (their 1.7): W_c · scale/‖W_c‖₂."""
    return g_aux_weight * (scale / torch.linalg.vector_norm(g_aux_weight, dim=1)).view(-1, 1)


def mask_absent(weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``weight`` with the rows of the classes of zero ``counts`` set to −1e10 (the authors' mask)."""
    return torch.where((counts == 0).view(-1, 1).to(weight.device), torch.full_like(weight, ABSENT), weight)


class PersonalHead(nn.Module):
    """A FedLoGe client's classifier (the authors' ``localtest`` after realignment.py's LA-FR):
    z = l_head(h) + g_aux'(h), g_aux' = g_aux with its rows scaled by the local head's row norms,
    both heads' rows of the classes the client lacks set to −1e10."""

    def __init__(self, g_aux: nn.Linear, l_head: dict[str, torch.Tensor], counts: torch.Tensor) -> None:
        super().__init__()
        dev = g_aux.weight.device
        l_w, l_b = l_head["weight"].to(dev), l_head["bias"].to(dev)
        self.register_buffer("g_weight", mask_absent(local_realignment(g_aux.weight.detach(), l_w), counts))
        self.register_buffer("g_bias", g_aux.bias.detach().clone())
        self.register_buffer("l_weight", mask_absent(l_w, counts))
        self.register_buffer("l_bias", l_b.clone())

    @property
    def weight(self) -> torch.Tensor:
        return self.l_weight + self.g_weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h.flatten(1)
        return F.linear(h, self.l_weight, self.l_bias) + F.linear(h, self.g_weight, self.g_bias)


def linear_head(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        out.weight.copy_(weight), out.bias.copy_(bias)
    return out


@dataclass(frozen=True)
class FedLoGeUpdate(ClientUpdate):
    """FedLoGe's local step (the authors' ``LocalUpdate.update_weights_gaux``): the backbone by the
    objective through the fixed SSE-C; g_aux (in the model: the run's optimiser) and the client's
    own local head l_head (its own optimiser, the schedule's settings, fresh each round as theirs)
    each by CE on the detached features of the same forward. l_head and the client's class
    counts are kept in the client's state (``end``); a client without one starts from a linear
    layer's default initialisation drawn from (seed, client id)."""

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        aux = g_aux(model)
        own = task.state.get("fedloge")
        start = own["l_head"] if own else initial_local_head(aux, task.context.sampling_seed, task.cid)
        l_head = linear_head(start["weight"].to(aux.weight), start["bias"].to(aux.weight)).requires_grad_(True)
        return {"l_head": l_head, "optimiser": task.schedule.optimiser(list(l_head.parameters()))}

    features: ClassVar[bool] = True  # g_aux and l_head read h

    def terms(self, local: Any, forward: StepForward, objective, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        h = forward.features.detach()
        aux = forward.call(g_aux(forward.model), h)  # the client's own g_aux (a cohort's: its slice)
        return {OBJECTIVE: objective(upcast(forward.logits), y, **extra),
                "FedLoGe's g_aux (CE on detached features)": F.cross_entropy(upcast(aux), y),
                "FedLoGe's local head (CE on detached features)": F.cross_entropy(upcast(local["l_head"](h)), y)}

    def correct(self, local: Any, params: list[nn.Parameter]) -> None:
        # l_head's own step, after the step's backward and before the model's clip and step, as
        # theirs (its gradient is its term's alone: detached features)
        local["optimiser"].step()
        local["optimiser"].zero_grad(set_to_none=True)

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        l_head = local["l_head"]
        own = {"l_head": {"weight": l_head.weight.detach().clone(), "bias": l_head.bias.detach().clone()},
               "counts": task.data.class_counts.detach().clone()}
        return {"fedloge": own}, {}


def initial_local_head(aux: nn.Linear, seed: int, cid: int) -> dict[str, torch.Tensor]:
    """nn.Linear's default initialisation U(±1/√d) for a client's first local head, from its own stream."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + cid) * 1_000_003 + 0xF10E) % 2**63)
    bound = 1 / math.sqrt(aux.in_features)
    w = (torch.rand(aux.weight.shape, generator=g, dtype=torch.float64) * 2 - 1) * bound
    b = (torch.rand(aux.bias.shape, generator=g, dtype=torch.float64) * 2 - 1) * bound
    return {"weight": w.to(aux.weight), "bias": b.to(aux.weight)}


class FedLoGeStrategy(Strategy):
    """FedAvg of the backbone and g_aux (the authors' size-weighted ``FedAvg_noniid`` and
    ``FedAvg_noniid_classifier``); the evaluated model: with the SSE-C (``g_head``) or with g_aux
    re-aligned by GA-FR (``g_aux``), built once per aggregate."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str, global_head: str,
                 scale: float) -> None:
        super().__init__(model, aggregator, ctx, objective)
        self.global_head, self.scale = global_head, scale
        self._inference: nn.Module | None = None

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        self._inference = None
        return super().aggregate(round, results)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._inference = None
        super().load_state_dict(state)

    def inference_model(self) -> nn.Module:
        if self.global_head == "g_head":
            return self.model
        if self._inference is None:
            self._inference = copy.deepcopy(self.model)
            classifier(self._inference).realign_scale = self.scale
        return self._inference


class FedLoGe(HeadFamily):
    """FedLoGe (Xiao et al., ICLR 2024), as the authors' code (ZackZikaiXiao/FedLoGe, fedloge.py,
    util/update_baseline.py, realignment.py): the backbone trained with the objective through the
    fixed static sparse equiangular classifier (the ``sse_c`` head, g_head); an auxiliary global
    head g_aux and each client's local head l_head trained by CE on the detached features in the
    same steps; FedAvg of the backbone and g_aux. The global model is evaluated with g_head
    (``global_head='g_head'``: fedloge.py's default) or with g_aux re-aligned (GA-FR: rows to
    norm ``realign_scale``); a client's personal model (``personal_model``) is l_head + g_aux
    re-aligned to l_head's row norms (LA-FR), the classes it lacks masked."""

    head: HeadSpec = Field("sse_c", description="the classifier head: FedLoGe's fixed SSE-C (g_head)")
    head_requires: ClassVar[frozenset[str]] = frozenset({"in_features"})  # g_aux and l_head read h
    global_head: Literal["g_head", "g_aux"] = Field("g_head", description="the evaluated global classifier: the "
                                                    "SSE-C, or g_aux re-aligned by GA-FR")
    realign_scale: float = Field(1.7, gt=0, allow_inf_nan=False, description="GA-FR: the norm g_aux's rows are "
                                                                            "scaled to (the authors' 1.7)")

    def client_update(self) -> Any:
        return FedLoGeUpdate()

    def client_fn(self):
        return WithHead(self.client_update(), self.head_spec(), aux=True)

    def setup(self, ctx: RunContext) -> None:
        build, spec = ctx.build_model, self.head_spec()
        Federated.setup(self, _replace_build(ctx, lambda: with_aux(heads.attach(build(), spec))))

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return FedLoGeStrategy(model, build_aggregator(self.aggregator), ctx, self.loss, self.global_head,
                               self.realign_scale)

    def global_model(self) -> nn.Module:
        return self._strategy.inference_model()

    def personal_model(self, task: EvalTask) -> nn.Module:
        """The client's model: the global backbone (``task.weights``) with its PersonalHead built
        from g_aux, its l_head and its class counts (``task.state``); the global model for a
        client that has never trained."""
        device = task.test.x.device if task.test is not None else torch.device("cpu")
        model = self._ctx.build_model().to(device)
        model.load_state_dict(task.weights)
        own = task.state.get("fedloge")
        if not own:
            return model
        return heads.swap(model, PersonalHead(g_aux(model), own["l_head"], own["counts"]))


register("fedloge")(FedLoGe)

__all__ = ["HeadFamily", "FedETF", "FedLF", "WithHead", "fedrs_scale", "running_centres", "update_centres", "FedNH", "FedLoGe", "FedLoGeUpdate", "etf_finetune", "PersonalHead", "local_realignment",
           "global_realignment", "mask_absent"]

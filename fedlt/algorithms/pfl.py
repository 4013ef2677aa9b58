"""Personalised federated learning (issue 32): each method a composition of the FedAvg family's
loop (``ClientUpdate`` hooks), a ``Strategy`` that aggregates the shared part of the model only,
and the engine's client-state store, where a client's own part lives between rounds (its
``"personal"`` entry, given back as ``task.state`` the next time it is sampled).

The parts are named on the model through its classifier (``fedlt.models.classifier``): ``head``
is the classifier's parameters and buffers, ``body`` everything else.

| name | the client keeps | trained locally | sent and aggregated | personal model |
|---|---|---|---|---|
| ``local`` | all | all | nothing | its own model |
| ``fedavg_ft`` | — | all | all | the global model fine-tuned E epochs |
| ``fedper`` | head | all | body | global body + its head |
| ``fedrep`` | head | head (body frozen), then body (head frozen) | body | global body + its head |
| ``fedbabu`` | — | body (head frozen at its init) | body | the global model fine-tuned E epochs |
| ``lg_fedavg`` | body | all | head | its body + global head |
| ``fedrod`` | personal head | body + generic head (balanced softmax), personal head (CE of g + p) | body + generic head | generic + personal logits |
| ``ditto`` | a whole model v | w (FedAvg) and v (objective + λ/2‖v − w‖²) | w | v |
| ``apfl`` | a whole model v and α | w, then v on the mixed output; α by its gradient | w | α·v(x) + (1 − α)·w(x) |

Each defines ``personal_model(task: EvalTask) -> nn.Module`` (fedlt.algorithms.personal). Where
a paper and its authors' (or the frameworks') code differ, the code is followed; each choice is
in docs/algorithms.md, "Personalised algorithms".
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field, PrivateAttr
from torch import nn

from fedlt.algorithms import register
from fedlt.algorithms.base import LossExpression, PendingLoss, RunContext, build_aggregator, place_model, upcast
from fedlt.algorithms.fedavg_family import (OBJECTIVE, ClientUpdate, FedAvgFamily, PhasedUpdate, StepForward, Strategy,
                                            frozen)
from fedlt.algorithms.personal import EvalTask, FinetuneUpdate, finetune, stream_seed
from fedlt.algorithms.protocol import ClientResult, ClientStates, ClientTask, State
from fedlt.algorithms.stateful import add_to_grad
from fedlt.bounds import MAX_EPOCHS
from fedlt.context import RoundContext
from fedlt.errors import FedltError
from fedlt.models import classifier

NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Epochs = Annotated[int, Field(ge=1, le=MAX_EPOCHS)]
PARTS = ("none", "all", "head", "body", "personal_head", "global")
PERSONAL = "personal"  # the key of a client's own part in its state


# -- the model's parts ----------------------------------------------------------------------------
def _keys_under(model: nn.Module, module: nn.Module) -> list[str]:
    for name, m in model.named_modules():
        if m is module:
            prefix = f"{name}." if name else ""
            return [k for k in model.state_dict() if k.startswith(prefix)]
    raise FedltError(f"{type(model).__name__}.get_classifier() returns a module that is not one of its children")


def part_keys(model: nn.Module, part: str) -> list[str]:
    """The state-dict keys of one part of ``model``: ``all``, ``none``, ``head`` (its classifier,
    ``fedlt.models.classifier``), ``body`` (the rest), ``personal_head`` (FedRoD's personal head)
    and ``global`` (all but the personal head)."""
    keys = list(model.state_dict())
    if part in ("all", "none"):
        return keys if part == "all" else []
    head = classifier(model)
    if part in ("personal_head", "global"):
        if not isinstance(head, DualHead):
            raise FedltError(f"part {part!r} needs FedRoD's two heads; the model's classifier is {type(head).__name__}")
        own = set(_keys_under(model, head.personal))
        return [k for k in keys if (k in own) == (part == "personal_head")]
    if part not in ("head", "body"):
        raise FedltError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    inside = set(_keys_under(model, head))
    return [k for k in keys if (k in inside) == (part == "head")]


def _clone(state: State, keys: Sequence[str] | None = None) -> State:
    return {k: v.detach().clone() for k, v in state.items() if keys is None or k in keys}


def eval_device(task: EvalTask) -> torch.device:
    """Where a personal model is built: the device of the client's test set (the CPU without one)."""
    x = task.test.x if task.test is not None else None
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


# -- the client side ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PartsUpdate(ClientUpdate):
    """The local loop on the received model with the client's own part (``keep``, from its state)
    in place of the received one, ``freeze`` out of training; ``end`` keeps the ``keep`` part,
    ``upload`` sends the ``shared`` part only. ``stream``: a phase's own minibatch stream
    (``""``: the round's)."""

    keep: str = "none"
    freeze: str = "none"
    shared: str = "all"
    stream: str = ""

    def start(self, task: ClientTask) -> ClientTask:
        return dataclasses.replace(task, weights=task.weights | task.state.get(PERSONAL, {}))

    def frozen_keys(self, model: nn.Module) -> Sequence[str]:
        return part_keys(model, self.freeze)

    def generator(self, task: ClientTask) -> torch.Generator:
        if not self.stream:
            return super().generator(task)
        seed = stream_seed(task.context.sampling_seed, task.round_index, task.cid, self.stream)
        return torch.Generator().manual_seed(seed % (2**63))

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        keep = part_keys(model, self.keep)
        return ({PERSONAL: _clone(model.state_dict(), keep)} if keep else {}), {}

    def upload(self, local: Any, task: ClientTask, model: nn.Module, state: dict[str, Any]) -> State:
        return _clone(model.state_dict(), part_keys(model, self.shared))


def _joined(first: ClientResult, second: ClientResult) -> ClientResult:
    """Two phases of one round as one result: the second's weights and state, both phases' steps
    and their step-weighted mean loss."""
    # the step counts, not the results: a pending loss waits for the round's end, the first's model need not
    first_steps, second_steps = first.steps, second.steps
    steps = first_steps + second_steps
    combine = lambda a, b: (a * first_steps + b * second_steps) / steps if steps else 0.0  # noqa: E731
    a, b = first.train_loss, second.train_loss
    if isinstance(a, PendingLoss):  # read with the round's other clients' (fedlt.algorithms.base.deferred_losses)
        loss = a.joined(b, combine)
    elif isinstance(b, PendingLoss):
        loss = b.joined(a, lambda mine, theirs: combine(theirs, mine))
    else:
        loss = combine(a, b)
    return dataclasses.replace(second, steps=steps, train_loss=loss)


@dataclass(frozen=True)
class RepUpdate(PhasedUpdate):
    """FedRep's round: ``head_epochs`` epochs of the head with the body frozen (a stream of its
    own), then the round's schedule on the body with the head frozen; keeps the head, sends the body."""

    keep: str = "head"
    freeze: str = "none"
    shared: str = "body"
    head_epochs: int = 1

    def loops(self) -> tuple[PartsUpdate, PartsUpdate]:
        # the head phase sends nothing: its "upload" is its whole trained model (BatchNorm
        # statistics included), where the body phase starts
        return (PartsUpdate(keep="head", freeze="body", shared="all", stream="fedrep-head"),
                PartsUpdate(keep="head", freeze="head", shared="body"))

    def phase(self, index: int, task: ClientTask,
              done: Sequence[ClientResult]) -> tuple[ClientUpdate, ClientTask] | None:
        head, body = self.loops()
        if index == 0:
            return head, dataclasses.replace(task, schedule=dataclasses.replace(task.schedule, epochs=self.head_epochs,
                                                                                iters=None))
        return (body, dataclasses.replace(task, weights=done[0].weights, state=done[0].state)) if index == 1 else None

    def join(self, task: ClientTask, done: Sequence[ClientResult]) -> ClientResult:
        return _joined(*done)


class SharedStrategy(Strategy):
    """FedAvg's strategy over the ``shared`` keys only: the rest of the global model (a part the
    clients keep) is never aggregated and stays as it was initialised."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str, shared: Sequence[str]) -> None:
        super().__init__(model, aggregator, ctx, objective)
        self.shared = list(shared)

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        metrics = {"train_loss": sum(r.train_loss for r in results) / len(results)}
        if not self.shared:
            return metrics
        x = self.model.state_dict()
        shared = set(self.shared)
        new = self.aggregator({k: x[k] for k in self.shared},
                              [({k: r.weights[k] for k in self.shared}, float(r.num_samples)) for r in results],
                              [n for n in self.trainable if n in shared])
        self.model.load_state_dict(x | new)
        return metrics


class Personalised(FedAvgFamily):
    """A FedAvg-family algorithm whose clients keep a part of the model (``keep``), train all but
    ``freeze`` and send ``shared``; its personal model is the global one with the client's part."""

    keep: ClassVar[str] = "none"
    freeze: ClassVar[str] = "none"
    shared: ClassVar[str] = "all"

    def client_fn(self) -> ClientUpdate:
        return PartsUpdate(self.keep, self.freeze, self.shared)

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return SharedStrategy(model, build_aggregator(self.aggregator), ctx, self.loss, part_keys(model, self.shared))

    def fresh_model(self, task: EvalTask) -> nn.Module:
        """A model of the run's architecture on the task's evaluation device (its weights are
        overwritten); built in a forked stream, so evaluating draws nothing from the caller's."""
        with torch.random.fork_rng(devices=[]):
            ctx = getattr(self, "_ctx", None)
            model = ctx.build_model() if ctx is not None else task.context.model.build()
        return place_model(model, eval_device(task))

    def personal_model(self, task: EvalTask) -> nn.Module:
        """The global model with the client's kept part; a new client (``task.new_client``) of a
        method that keeps the head gets the global body with a head trained on its data, the body
        frozen — FedRep's protocol for new clients (Collins et al. 2021, §5: the learned
        representation, a new local head)."""
        model = self.fresh_model(task)
        model.load_state_dict(task.weights | task.state.get(PERSONAL, {}))
        if task.new_client and self.keep == "head" and PERSONAL not in task.state:
            if task.data is None:
                raise FedltError(f"{type(self).__name__}'s personal model of new client {task.cid} trains its head: "
                                 "its evaluation task needs its training data")
            schedule = self.new_head_schedule(task)
            with frozen(model, part_keys(model, "body")):
                finetune(model, dataclasses.replace(task, schedule=schedule), FinetuneUpdate())
        return model.eval()

    def new_head_schedule(self, task: EvalTask) -> Any:
        """How a new client's head is trained: one round's local schedule."""
        return task.schedule or self._ctx.schedule(self._ctx.batch_size)


# -- local, FedPer, FedRep, LG-FedAvg ------------------------------------------------------------------
class Local(Personalised):
    """Local training only (no federation): each client trains its own model, starting from the
    initial global model the first time it is sampled, and sends nothing; the server model is
    never changed. Personal model: the client's own."""

    keep: ClassVar[str] = "all"
    shared: ClassVar[str] = "none"


class FedPer(Personalised):
    """FedPer (Arivazhagan et al. 2019): the whole model trained locally, the body shared and
    averaged, the head (the classifier) kept by each client (PFLlib's ``clientper``)."""

    keep: ClassVar[str] = "head"
    shared: ClassVar[str] = "body"


class FedRep(Personalised):
    """FedRep (Collins et al., ICML 2021, Algorithm 1): each round the client's head trained
    ``head_epochs`` epochs with the body frozen, then the body with the run's local schedule and
    the head frozen; only the body is shared; default head_epochs = 1 (PFLlib's ``plocal_epochs``)."""

    keep: ClassVar[str] = "head"
    shared: ClassVar[str] = "body"
    head_epochs: Epochs = Field(1, description="epochs of head training (body frozen) before the body's")

    def client_fn(self) -> ClientUpdate:
        return RepUpdate(self.keep, self.freeze, self.shared, head_epochs=self.head_epochs)

    def new_head_schedule(self, task: EvalTask) -> Any:
        """A new client's head: ``head_epochs`` epochs, as a round's head phase."""
        return dataclasses.replace(super().new_head_schedule(task), epochs=self.head_epochs, iters=None)


class LGFedAvg(Personalised):
    """LG-FedAvg (Liang et al. 2020): local representations, a global head — the whole model
    trained locally, the body kept by each client, the head (the classifier) shared and averaged
    (PFLlib's ``clientlg``; FL-bench's ``num_global_layers=1``)."""

    keep: ClassVar[str] = "body"
    shared: ClassVar[str] = "head"


# -- fine-tuned personal models: fedavg_ft, FedBABU ---------------------------------------------------
class FineTuned(Personalised):
    """Personal model: the global model fine-tuned ``finetune_epochs`` epochs (all of it) on the
    client's training data (``task.data``) with the run's local optimiser (``task.schedule``'s
    settings when given), on its own random stream (fedlt.algorithms.personal.finetune)."""

    finetune_epochs: Epochs = Field(10, description="epochs of local fine-tuning for the personal model")

    def personal_model(self, task: EvalTask) -> nn.Module:
        if task.data is None:
            raise FedltError(f"{type(self).__name__}'s personal model of client {task.cid} is fine-tuned: "
                             "its evaluation task needs its training data")
        model = self.fresh_model(task)
        model.load_state_dict(task.weights)
        base = task.schedule or self._ctx.schedule(self._ctx.batch_size)
        schedule = dataclasses.replace(base, epochs=self.finetune_epochs, iters=None)
        finetune(model, dataclasses.replace(task, schedule=schedule), FinetuneUpdate())
        return model.eval()


class FedAvgFT(FineTuned):
    """FedAvg + local fine-tuning: FedAvg's training; personal model: the global model fine-tuned
    E = 10 epochs on the client's data (PFLlib's ``fine_tuning_epochs`` default)."""

    def client_fn(self):  # FedAvg's own loop and strategy, so it trains in a --cohort as FedAvg does
        return FedAvgFamily.client_fn(self)

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return FedAvgFamily.make_strategy(self, model, ctx)


class FedBABU(FineTuned):
    """FedBABU (Oh, Kim, Yun, ICLR 2022): the head frozen at its random initialisation during
    federated training, the body trained and averaged; personal model: the global model (body
    and head) fine-tuned E = 10 epochs (PFLlib's ``clientbabu.fine_tune`` and ``fine_tuning_epochs``)."""

    freeze: ClassVar[str] = "head"
    shared: ClassVar[str] = "body"


# -- FedRoD ---------------------------------------------------------------------------------------
class DualHead(nn.Module):
    """FedRoD's two heads on one representation h: ``generic`` (the model's classifier) and
    ``personal`` (a copy of it at initialisation, as PFLlib's ``copy.deepcopy(model.head)``).
    ``forward`` gives the generic logits, or generic + personal ones when ``personalised``.
    ``weight``/``bias`` are the generic head's (what readers of the classifier see)."""

    def __init__(self, generic: nn.Linear) -> None:
        super().__init__()
        self.generic, self.personal = generic, copy.deepcopy(generic)
        self.personalised = False

    @property
    def weight(self) -> torch.Tensor:
        return self.generic.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.generic.bias

    @property
    def in_features(self) -> int:
        return self.generic.in_features

    @property
    def out_features(self) -> int:
        return self.generic.out_features

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.generic(h)
        return z + self.personal(h) if self.personalised else z


def with_dual_head(model: nn.Module) -> nn.Module:
    """``model`` with its classifier replaced by a :class:`DualHead` around it, in place."""
    old = classifier(model)
    if not isinstance(old, nn.Linear):
        raise FedltError(f"fedrod needs a linear classifier; {type(model).__name__}'s is {type(old).__name__}")
    for module in model.modules():
        for name, child in module.named_children():
            if child is old:
                setattr(module, name, DualHead(old))
                return model
    raise FedltError(f"{type(model).__name__}.get_classifier() returns a module that is not one of its children")


PERSONAL_HEAD_TERM = "FedRoD's personal head (CE of generic + personal logits)"


@dataclass(frozen=True)
class RoDUpdate(PartsUpdate):
    """One forward: the objective (balanced softmax) on the generic logits z_g trains body and
    generic head; CE(z_g.detach() + p(h.detach()), y) trains the personal head p only (PFLlib's
    ``clientrod``: the representation and the generic logits detached)."""

    def build(self, task: ClientTask) -> nn.Module:
        return place_model(with_dual_head(task.context.model.build()), task.data.x.device)

    features = True

    def terms(self, local: Any, forward: StepForward, objective, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        z = upcast(forward.logits)
        personal = upcast(forward.call(classifier(forward.model).personal, forward.features.detach()))
        return {OBJECTIVE: objective(z, y, **extra),
                PERSONAL_HEAD_TERM: F.cross_entropy(z.detach() + personal, y)}


class FedRoD(Personalised):
    """FedRoD (Chen & Chao, ICLR 2022), without the hypernetwork: a shared body and generic head
    trained with the balanced softmax on the client's class counts (the generic model), and a
    personal head per client on the detached representation; personal prediction = generic +
    personal logits (PFLlib's ``clientrod``; FL-bench's differs, see docs/algorithms.md)."""

    keep: ClassVar[str] = "personal_head"
    shared: ClassVar[str] = "global"
    loss: LossExpression = Field("balanced_softmax", description="the generic head's objective, a loss expression")

    def client_fn(self) -> ClientUpdate:
        return RoDUpdate(self.keep, self.freeze, self.shared)

    def setup(self, ctx: RunContext) -> None:
        build = ctx.build_model
        super().setup(dataclasses.replace(ctx, build_model=lambda: with_dual_head(build())))

    def fresh_model(self, task: EvalTask) -> nn.Module:
        model = super().fresh_model(task)
        return model if isinstance(classifier(model), DualHead) else with_dual_head(model)

    def personal_model(self, task: EvalTask) -> nn.Module:
        model = super().personal_model(task)
        classifier(model).personalised = True
        return model


# -- Ditto ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProximalUpdate(ClientUpdate):
    """The local loop with λ(v − w) added to each gradient — the gradient of (λ/2)‖v − w‖², w the
    round's received global model (``task.payload["anchor"]``); keeps v as the client's own model."""

    lam: float

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        anchor = task.payload["anchor"]
        return [anchor[n] for n, p in model.named_parameters() if p.requires_grad]

    def correct(self, local: Any, params: list[nn.Parameter]) -> None:
        for p, w in zip(params, local):
            add_to_grad(p, self.lam * (p.detach() - w))

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return {PERSONAL: _clone(model.state_dict())}, {}

    def upload(self, local: Any, task: ClientTask, model: nn.Module, state: dict[str, Any]) -> State:
        return {}


@dataclass(frozen=True)
class DittoUpdate(PhasedUpdate):
    """Ditto's round (Li et al., ICML 2021, Algorithm 1): w_k by the local loop from the received
    w (sent for averaging), then the personal v from the client's own (the initial model the first
    time) by the same loop, on the same minibatches, with the gradient of (λ/2)‖v − w‖² added."""

    lam: float

    def loops(self) -> tuple[ClientUpdate, ProximalUpdate]:
        return ClientUpdate(), ProximalUpdate(self.lam)

    def phase(self, index: int, task: ClientTask,
              done: Sequence[ClientResult]) -> tuple[ClientUpdate, ClientTask] | None:
        shared, personal = self.loops()
        if index == 0:
            return shared, task
        own = task.state.get(PERSONAL) or task.payload["init"]
        return (personal, dataclasses.replace(task, weights=own, payload={"anchor": task.weights})) if index == 1 else None

    def join(self, task: ClientTask, done: Sequence[ClientResult]) -> ClientResult:
        return dataclasses.replace(done[0], state=done[0].state | done[1].state)


class InitStrategy(SharedStrategy):
    """Sends the initial global model to each participant that has no model of its own yet (the
    frameworks' initialisation of Ditto's and APFL's personal models); the copy is checkpointed."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str, shared: Sequence[str]) -> None:
        super().__init__(model, aggregator, ctx, objective, shared)
        self.init = _clone(model.state_dict())

    def configure(self, round: RoundContext, participants, states: ClientStates) -> list[ClientTask]:
        tasks = super().configure(round, participants, states)
        return [t if PERSONAL in t.state else dataclasses.replace(t, payload=t.payload | {"init": self.init})
                for t in tasks]

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"init": _clone(self.init)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.init = _clone(state["init"])


class Ditto(Personalised):
    """Ditto (Li, Hu, Beirami, Smith, ICML 2021): the global model by FedAvg, and per client a
    personal model v trained on objective + (λ/2)‖v − w‖² towards the received global w; default
    λ = 1 (the authors' run scripts, ``--lam=1``; FL-bench's and PFLlib's default too)."""

    shared: ClassVar[str] = "all"
    lam: NonNegative = Field(1.0, description="λ of the proximal term (λ/2)·‖v − w‖² of the personal model")

    def client_fn(self) -> ClientUpdate:
        return DittoUpdate(self.lam)

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return InitStrategy(model, build_aggregator(self.aggregator), ctx, self.loss, part_keys(model, self.shared))


# -- APFL -------------------------------------------------------------------------------------------
class Mixed(nn.Module):
    """APFL's personal prediction α·v(x) + (1 − α)·w(x): the client's model v and the global w
    mixed in output space (the authors' ``inference_personal``)."""

    def __init__(self, personal: nn.Module, global_: nn.Module, alpha: float) -> None:
        super().__init__()
        self.personal, self.global_model, self.alpha = personal, global_, float(alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha * self.personal(x) + (1.0 - self.alpha) * self.global_model(x)


@dataclass
class _ApflLocal:
    personal: nn.Module
    optimiser: torch.optim.Optimizer
    alpha: float
    schedule: Any  # the round's LocalSchedule: v's clipping, and η of α's step


@dataclass(frozen=True)
class ApflUpdate(ClientUpdate):
    """APFL's round as the authors' FedTorch code runs it: each step, w's step on the objective,
    then (same minibatch, w after its step) v's step on CE(α·v(x) + (1 − α)·w(x), y); at the
    round's first step α ← clip(α − η·(Σ⟨v − w, α·∇_v + (1 − α)·∇_w⟩ + 0.02·α), 0, 1), the
    gradients those of that mixed loss; w is sent, v and α kept."""

    alpha: float
    adaptive: bool

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        personal = copy.deepcopy(model)  # same architecture, device and layout as the work module
        personal.load_state_dict(task.state.get(PERSONAL) or task.payload["init"])
        personal.train()
        alpha = task.state.get("alpha")
        alpha = self.alpha if alpha is None else float(alpha)
        optimiser = task.schedule.optimiser([p for p in personal.parameters() if p.requires_grad])
        return _ApflLocal(personal, optimiser, alpha, task.schedule)

    def stepped(self, local: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        v, w = local.personal, model
        w_params = [p for p in w.parameters() if p.requires_grad]
        v_params = [p for p in v.parameters() if p.requires_grad]
        local.optimiser.zero_grad(set_to_none=True)
        for p in w_params:
            p.grad = None  # the mixed loss's gradient w.r.t. w, for α's step only (w has stepped)
        mixed = local.alpha * upcast(v(x)) + (1.0 - local.alpha) * upcast(w(x))
        F.cross_entropy(mixed, y).backward()
        local.schedule.clip_(v_params)
        local.optimiser.step()
        if self.adaptive and step == 0:
            grad = 0.0
            with torch.no_grad():
                for pv, pw in zip(v_params, w_params):
                    gv = pv.grad if pv.grad is not None else torch.zeros_like(pv)
                    gw = pw.grad if pw.grad is not None else torch.zeros_like(pw)
                    direction = local.alpha * gv + (1.0 - local.alpha) * gw
                    grad += float(((pv - pw).double() * direction.double()).sum())
            grad += 0.02 * local.alpha
            local.alpha = min(max(local.alpha - local.schedule.lr * grad, 0.0), 1.0)
        for p in w_params:
            p.grad = None

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        alpha = torch.tensor(local.alpha, dtype=torch.float64)
        return {PERSONAL: _clone(local.personal.state_dict()), "alpha": alpha}, {}


class APFL(Personalised):
    """APFL (Deng, Kamani, Mahdavi 2020) as the authors' FedTorch code runs it: the global model w
    by FedAvg; per client a model v and a mixing weight α (default 0.5, ``fed_personal_alpha``),
    learned by its gradient at each round's first step (``adaptive``); personal prediction
    α·v(x) + (1 − α)·w(x)."""

    shared: ClassVar[str] = "all"
    alpha: float = Field(0.5, ge=0, le=1, description="the mixing weight α a client starts with")
    adaptive: bool = Field(True, description="learn α by its gradient (False: α stays fixed)")

    def client_fn(self) -> ClientUpdate:
        return ApflUpdate(self.alpha, self.adaptive)

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return InitStrategy(model, build_aggregator(self.aggregator), ctx, self.loss, part_keys(model, self.shared))

    def personal_model(self, task: EvalTask) -> nn.Module:
        w = self.fresh_model(task)
        w.load_state_dict(task.weights)
        if PERSONAL not in task.state:  # never trained: its personal model is the global one
            return w.eval()
        v = self.fresh_model(task)
        v.load_state_dict(task.state[PERSONAL])
        return Mixed(v, w, float(task.state["alpha"])).eval()


register("local")(Local)
register("fedavg_ft")(FedAvgFT)
register("fedper")(FedPer)
register("fedrep")(FedRep)
register("fedbabu")(FedBABU)
register("lg_fedavg")(LGFedAvg)
register("fedrod")(FedRoD)
register("ditto")(Ditto)
register("apfl")(APFL)

__all__ = ["Local", "FedAvgFT", "FedPer", "FedRep", "FedBABU", "LGFedAvg", "FedRoD", "Ditto", "APFL", "DualHead",
           "Mixed", "ApflUpdate",
           "PartsUpdate", "RepUpdate", "RoDUpdate", "DittoUpdate", "ProximalUpdate", "SharedStrategy",
           "InitStrategy", "part_keys", "frozen", "with_dual_head", "eval_device"]

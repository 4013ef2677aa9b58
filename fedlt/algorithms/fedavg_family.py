"""The FedAvg family: one client function × one strategy (SPEC §2, §4).

FedAvg, FedProx, FedLogit, FedLC, FedVLS and Fed-GraB differ only in their local objective, so
each is ``FedAvgFamily`` with a different default ``loss`` — no subclass per algorithm. The
client's work is the function ``client_update(task) -> ClientResult``; the server side is a
``Strategy`` (the global model and its aggregator, with the aggregator's state); the round itself
is ``Federated.train_round``, shared by every one-call-per-round algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
from torch import nn
from torch.func import functional_call

import fedlt.losses
from fedlt.algorithms import preset
from fedlt.algorithms.base import (AggregatorSpec, ClientData, LossExpression, NonFiniteLoss, RunContext,
                                   build_aggregator, client_generator, objective_seed, proportional_batches,
                                   raise_first_non_finite)
from fedlt.algorithms.protocol import ClientResult, ClientStates, ClientTask, State
from fedlt.errors import FedltError
from fedlt.models import classifier, eval_mode


def build_objective(task: ClientTask, model: nn.Module):
    """The client's local objective for this round, built once, its persistent state restored.

    ``global_params`` / ``classifier_weight`` are views of the received weights (no copy)."""
    names = {id(p): name for name, p in model.named_parameters()}
    try:
        classifier_weight = task.weights[names[id(classifier(model).weight)]]
    except FedltError:  # models without the classifier hook still run objectives that don't read it
        classifier_weight = None
    objective = fedlt.losses.build(
        task.objective, class_counts=task.data.class_counts, num_classes=task.num_classes,
        classifier_weight=classifier_weight, global_counts=task.payload.get("global_counts"),
        global_params=[task.weights[name] for name, p in model.named_parameters() if p.requires_grad],
        seed=objective_seed(task.seed, task.cid), fused=task.fused,
    )
    if task.state.get("loss"):
        objective.load_state_dict(task.state["loss"])
    return objective


class ClientUpdate:
    """The client's work for one round — local SGD on the objective — as an object whose steps
    a stateful algorithm overrides (SCAFFOLD's gradient correction, SAM's two-pass step, MOON's
    extra term), so every variant shares this one loop.

    Calling it is ``client_update(task, model)``. The hooks, in the order the loop calls them:
    ``begin`` (once: what this round's variant needs, returned as ``local``), per step
    ``backward`` (the loss and its gradients; by default ``loss`` then ``.backward()``) and
    ``correct`` (edits the gradients before clipping), then ``end`` (once: the client's new
    persistent state and the extras the strategy reads). Subclasses are plain, picklable
    dataclasses holding their hyper-parameters only: nothing is carried between calls.
    """

    def __call__(self, task: ClientTask, model: nn.Module | None = None) -> ClientResult:
        if model is None:
            model = task.model.build().to(task.data.x.device)
        model.load_state_dict(task.weights)
        model.train()
        objective = build_objective(task, model)
        params = [p for p in model.parameters() if p.requires_grad]
        optimiser = task.schedule.optimiser(params)
        generator = client_generator(task.seed, task.round_index, task.cid)
        local = self.begin(task, model, params)
        losses: list[torch.Tensor] = []  # kept on the device: one host synchronisation per round, not per step
        for idx in task.schedule.batches(len(task.data), generator):
            x, y = task.data.x[idx], task.data.y[idx]
            extra: dict[str, Any] = {}
            if objective.needs_teacher:
                extra["teacher_logits"] = teacher_logits(model, task.weights, x)
            if objective.needs_params:
                extra["params"] = params
            optimiser.zero_grad(set_to_none=True)
            loss = self.backward(local, model, params, objective, x, y, extra)
            self.correct(local, params)
            task.schedule.clip_(params)
            optimiser.step()
            losses.append(loss.detach())
        per_step = torch.stack(losses) if losses else torch.zeros(0)
        raise_first_non_finite(per_step, f"client {task.cid}, loss {task.objective!r}")
        own, extras = self.end(local, task, model, params, len(losses))
        state = ({"loss": objective.state_dict()} if objective.state_dict() else {}) | own
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return ClientResult(task.cid, weights, len(task.data), state,
                            {"train_loss": float(per_step.double().mean()) if len(losses) else 0.0,
                             "steps": len(losses)}, extras)

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        return None

    def loss(self, local: Any, model: nn.Module, objective, x: torch.Tensor, y: torch.Tensor,
             extra: dict[str, Any]) -> torch.Tensor:
        return objective(model(x), y, **extra)

    def backward(self, local: Any, model: nn.Module, params: list[nn.Parameter], objective, x: torch.Tensor,
                 y: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
        loss = self.loss(local, model, objective, x, y, extra)
        loss.backward()
        return loss

    def correct(self, local: Any, params: list[nn.Parameter]) -> None:
        pass

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the client's own persistent state, beside its loss terms'; extras for the strategy)."""
        return {}, {}


_PLAIN = ClientUpdate()


def client_update(task: ClientTask, model: nn.Module | None = None) -> ClientResult:
    """Train the received weights on the client's data for one round (SPEC §2's local objective).

    ``model`` is a reusable work module of the right architecture (its weights are overwritten
    with ``task.weights``; it keeps nothing between calls); without it one is built from
    ``task.model``. The teacher of terms such as FedVLS's vacant-class distillation is the
    received global model itself, run through the same module with ``task.weights`` in eval mode.
    Returns the trained weights, the client's new persistent state (its loss terms' state, e.g.
    SGB's collector and PID; ``{}`` when it has none) and its metrics.
    """
    return _PLAIN(task, model)


@torch.no_grad()
def teacher_logits(model: nn.Module, weights: State, x: torch.Tensor) -> torch.Tensor:
    with eval_mode(model):  # the global model as evaluated: no BatchNorm statistics move
        return functional_call(model, weights, (x,))


class Strategy:
    """The server side of a one-call-per-round algorithm: the global model and an aggregator.

    ``configure`` turns the round's participants into tasks (SCALA-style B_k from all
    participants' sizes when training by iterations); ``aggregate`` folds the results into the
    new global model. Its ``state_dict`` (global model and aggregator state — server momentum,
    Adam moments) is what the engine checkpoints for the server side.
    """

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str) -> None:
        self.model, self.aggregator, self.ctx, self.objective = model, aggregator, ctx, objective
        self.trainable = [name for name, p in model.named_parameters() if p.requires_grad]

    def configure(self, round_index: int, participants: Sequence[ClientData], states: ClientStates) -> list[ClientTask]:
        ctx = self.ctx
        weights = self.model.state_dict()  # unchanged until aggregation: shared by every task, no copy
        batches = proportional_batches([len(c) for c in participants], ctx.server_batch)
        payload = {"global_counts": ctx.global_counts} | self.payload(round_index)
        return [ClientTask(c.cid, round_index, weights, c, states.get(c.cid), ctx.schedule(b), self.objective,
                           ctx.sampling_seed, ctx.num_classes, ctx.model, ctx.fused, payload)
                for c, b in zip(participants, batches)]

    def payload(self, round_index: int) -> dict[str, Any]:
        """What every participant receives besides the weights (SCAFFOLD's server control variate)."""
        return {}

    def aggregate(self, round_index: int, results: Sequence[ClientResult]) -> dict[str, float]:
        new = self.aggregator(self.model.state_dict(), [(r.weights, float(r.num_samples)) for r in results],
                              self.trainable)
        self.model.load_state_dict(new)
        return {"train_loss": sum(r.metrics["train_loss"] for r in results) / len(results)}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "aggregator": self.aggregator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.aggregator.load_state_dict(state.get("aggregator", {}))


ClientFn = Callable[[ClientTask, "nn.Module | None"], ClientResult]


def run_locally(client: ClientFn, work: nn.Module) -> Callable[[list[ClientTask]], list[ClientResult]]:
    """The local engine's executor: each task in turn, in this process, on one reusable work module."""
    return lambda tasks: [client(task, work) for task in tasks]


class Federated(BaseModel):
    """A one-call-per-round algorithm: ``client`` (a function of its task) × ``make_strategy``.

    ``train_round`` is the whole round: configure → run every task (locally, or through any
    executor with the same signature, e.g. Flower's) → store the clients' states → aggregate.
    """

    model_config = ConfigDict(extra="forbid")
    _ctx: RunContext = PrivateAttr()
    _strategy: Strategy = PrivateAttr()
    _work: nn.Module = PrivateAttr()

    def client_fn(self) -> ClientFn:
        """The client's work; algorithms with another local update (SCAFFOLD, ...) return theirs."""
        return client_update

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        raise NotImplementedError

    def setup(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self._strategy = self.make_strategy(ctx.build_model().to(ctx.device), ctx)
        self._work = ctx.build_model().to(ctx.device)

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def train_round(self, round_index: int, participants: list[ClientData], states: ClientStates,
                    execute: Callable[[list[ClientTask]], list[ClientResult]] | None = None) -> dict[str, float]:
        execute = execute or run_locally(self.client_fn(), self._work)
        results = execute(self._strategy.configure(round_index, participants, states))
        for r in results:
            states.put(r.cid, r.state)
        return self._strategy.aggregate(round_index, results)

    def global_model(self) -> nn.Module:
        return self._strategy.model

    def state_dict(self) -> dict[str, Any]:
        return self._strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._strategy.load_state_dict(state)


class FedAvgFamily(Federated):
    """Local objective ``loss`` (a loss expression, SPEC §2) aggregated by ``aggregator`` (SPEC §4)."""

    loss: LossExpression = Field("ce", description="the local objective, a loss expression (SPEC §2)")
    aggregator: AggregatorSpec = Field("fedavg", description="the server's aggregator spec (SPEC §4)")

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return Strategy(model, build_aggregator(self.aggregator), ctx, self.loss)


preset("fedavg", FedAvgFamily, "FedAvg: cross-entropy locally, |D_k|-weighted averaging.", loss="ce")
preset("fedprox", FedAvgFamily, "FedProx: CE + (mu/2)·‖w − w_global‖².", loss="ce + fedprox(mu=0.01)")
preset("fedlogit", FedAvgFamily, "FedLogit: logit-adjusted CE with the client's prior.", loss="logit_adjust(tau=1)")
preset("fedlc", FedAvgFamily, "FedLC: CE on logits calibrated by −tau·n_c^(−1/4).", loss="fedlc(tau=0.5)")
preset("fedvls", FedAvgFamily, "FedVLS: logit adjustment + vacant-class distillation + logit suppression.",
       loss="fedvls(lam=0.1)")
preset("fedgrab", FedAvgFamily, "Fed-GraB: SGB re-weighting gated by the DPA prior of the received classifier.",
       loss="fedgrab")

__all__ = ["client_update", "ClientUpdate", "Strategy", "Federated", "FedAvgFamily", "run_locally", "NonFiniteLoss"]

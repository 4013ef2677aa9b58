"""ONE engine for the FedAvg family: a local objective (loss expression) × an aggregator.

FedAvg, FedProx, FedLogit, FedLC, FedVLS and Fed-GraB differ only in their local objective, so
each is this class with a different default ``loss`` (SPEC §2) — no subclass per algorithm.
A client's work is the pure function ``local_update``: (global weights, client data, client
state) -> (new weights, new client state, metrics), which a Flower client can call as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, PrivateAttr
from torch import nn

import fedlt.aggregators
import fedlt.losses
from fedlt.algorithms import preset
from fedlt.algorithms.base import (AggregatorName, ClientData, LocalSchedule, LossExpression, RunContext,
                                   client_generator, objective_seed, objective_value, proportional_batches)
from fedlt.errors import FedltError
from fedlt.models import classifier, eval_mode

State = dict[str, torch.Tensor]


def build_objective(expr: str, model: nn.Module, global_state: State, data: ClientData, num_classes: int,
                    seed: int, client_state: dict[str, Any]):
    """The client's local objective for this round, its persistent state restored.

    ``global_params`` / ``classifier_weight`` are views of the received global state (no copy).
    """
    names = {id(p): name for name, p in model.named_parameters()}
    try:
        classifier_weight = global_state[names[id(classifier(model).weight)]]
    except FedltError:  # models without the classifier hook still run objectives that don't read it
        classifier_weight = None
    objective = fedlt.losses.build(
        expr, class_counts=data.class_counts, num_classes=num_classes, classifier_weight=classifier_weight,
        global_params=[global_state[name] for name, p in model.named_parameters() if p.requires_grad], seed=seed,
    )
    if client_state.get("loss"):
        objective.load_state_dict(client_state["loss"])
    return objective


def local_update(model: nn.Module, global_state: State, data: ClientData, client_state: dict[str, Any],
                 objective_expr: str, schedule: LocalSchedule, generator: torch.Generator, num_classes: int,
                 teacher: Callable[[], nn.Module] | None = None, seed: int = 0) -> tuple[State, dict[str, Any], dict[str, float]]:
    """Train ``model`` (a work buffer: its weights are overwritten with ``global_state``) on one client.

    Returns the trained weights, the client's new persistent state (its loss terms' state, e.g.
    SGB's collector and PID) and metrics. ``teacher()`` gives a module holding ``global_state``
    (run in eval mode), called only when the objective needs the global model's logits (FedVLS).
    """
    model.load_state_dict(global_state)
    model.train()
    objective = build_objective(objective_expr, model, global_state, data, num_classes, seed, client_state)
    if objective.needs_teacher:
        if teacher is None:
            raise ValueError(f"the objective {objective_expr!r} needs a teacher module")
        teacher_model = teacher()
    params = [p for p in model.parameters() if p.requires_grad]
    optimiser = schedule.optimiser(params)
    total, steps = 0.0, 0
    for idx in schedule.batches(len(data), generator):
        x, y = data.x[idx], data.y[idx]
        loss = objective_value(objective, model(x), y, f"local step {steps + 1}, client {data.cid}, loss "
                               f"{objective_expr!r}", teacher=lambda: _eval(teacher_model, x), params=params)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        schedule.clip_(params)
        optimiser.step()
        total += float(loss.detach())
        steps += 1
    new_state = {"loss": objective.state_dict()} if objective.state_dict() else {}
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, new_state, {"train_loss": total / max(steps, 1), "steps": steps}


def _eval(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with eval_mode(module):
        return module(x)


class FedAvgFamily(BaseModel):
    """Local objective ``loss`` (a loss expression, SPEC §2) aggregated by ``aggregator`` (SPEC §4)."""

    model_config = ConfigDict(extra="forbid")
    loss: LossExpression = "ce"
    aggregator: AggregatorName = "fedavg"

    _ctx: RunContext = PrivateAttr()
    _model: nn.Module = PrivateAttr()  # the global model
    _work: nn.Module = PrivateAttr()  # scratch copy trained by each client in turn
    _client_states: dict[int, dict[str, Any]] = PrivateAttr(default_factory=dict)

    def setup(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self._model = ctx.build_model().to(ctx.device)
        self._work = ctx.build_model().to(ctx.device)

    def train_round(self, round_index: int, clients: list[ClientData]) -> dict[str, float]:
        ctx = self._ctx
        global_state = self._model.state_dict()  # unchanged until aggregation: no copy needed
        batches = proportional_batches([len(c) for c in clients], ctx.server_batch)
        updates, losses = [], []
        for data, batch in zip(clients, batches):
            weights, state, metrics = local_update(
                self._work, global_state, data, self._client_states.get(data.cid, {}), self.loss,
                ctx.schedule(batch), client_generator(ctx.sampling_seed, round_index, data.cid), ctx.num_classes,
                teacher=lambda: self._model,  # holds global_state until aggregation
                seed=objective_seed(ctx.sampling_seed, data.cid),
            )
            if state:
                self._client_states[data.cid] = state
            updates.append((weights, float(len(data))))
            losses.append(metrics["train_loss"])
        self._model.load_state_dict(fedlt.aggregators.get(self.aggregator)(updates))
        return {"train_loss": sum(losses) / len(losses)}

    def global_model(self) -> nn.Module:
        return self._model

    def state_dict(self) -> dict[str, Any]:
        return {"model": self._model.state_dict(), "client_states": self._client_states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._model.load_state_dict(state["model"])
        self._client_states = {int(k): v for k, v in state["client_states"].items()}


preset("fedavg", FedAvgFamily, "FedAvg: cross-entropy locally, |D_k|-weighted averaging.", loss="ce")
preset("fedprox", FedAvgFamily, "FedProx: CE + (mu/2)·‖w − w_global‖².", loss="ce + fedprox(mu=0.01)")
preset("fedlogit", FedAvgFamily, "FedLogit: logit-adjusted CE with the client's prior.", loss="logit_adjust(tau=1)")
preset("fedlc", FedAvgFamily, "FedLC: CE on logits calibrated by −tau·n_c^(−1/4).", loss="fedlc(tau=0.5)")
preset("fedvls", FedAvgFamily, "FedVLS: logit adjustment + vacant-class distillation + logit suppression.",
       loss="fedvls(lam=0.1)")
preset("fedgrab", FedAvgFamily, "Fed-GraB: SGB re-weighting gated by the DPA prior of the received classifier.",
       loss="fedgrab")

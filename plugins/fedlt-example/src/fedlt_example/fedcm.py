"""An algorithm with per-client and server state, added without touching fedlt: FedCM-style
client-level momentum (Xu et al. 2021, "FedCM: Federated Learning with Client-level Momentum").

Server state: the momentum Δ, the participants' mean applied direction of the last round,
Δ ← mean_k (x − y_k) / (a_k·η) (x the global weights sent, y_k client k's trained weights, η the
local learning rate, a_k its effective local steps: K_k without momentum, Σ_{j≤K_k}(1 − ρ^j)/(1 − ρ)
with the optimiser's momentum ρ, as SCAFFOLD's and FedNova's in fedlt — dividing by K_k alone
inflates Δ by ≈ 1/(1 − ρ) each round and the blend feeds it back), zero before the first round; it is sent to every
participant as payload. Client work: FedAvg's local SGD with each gradient blended with it,
g ← a_k·g + (1 − a_k)·Δ. Per-client state (this example's own warm-up, not FedCM's): how many
rounds the client has trained; a_k = max(alpha, 1/(visits + 1)), so a client's first round takes
plain gradients and later ones lean on the federation's momentum.

It is a composition of fedlt's parts — a ``ClientUpdate`` variant (its ``begin`` / ``correct`` /
``end`` hooks), a ``Strategy`` with one more piece of state, a ``FedAvgFamily`` that pairs them —
registered through the entry point ``fedlt.algorithms: example_fedcm``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import Field
from torch import nn

from fedlt.plugin import (ClientResult, ClientTask, ClientUpdate, FedAvgFamily, RoundContext, RunContext, Strategy,
                          build_aggregator, effective_steps, trainable_names)


@dataclass(frozen=True)
class MomentumUpdate(ClientUpdate):
    """Local SGD on a_k·g + (1 − a_k)·Δ; the client's visit count is its persistent state."""

    alpha: float

    # once per round: what the steps need (handed to every other hook as ``local``)
    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        visits = int(task.state.get("visits", torch.tensor(0)))  # {} on the client's first round
        blend = max(self.alpha, 1.0 / (visits + 1))
        momentum = task.payload["momentum"]  # what the strategy sent
        return blend, [momentum[n] for n in trainable_names(model)], visits

    # each step: edit the gradients before clipping
    def correct(self, local: Any, params: list[nn.Parameter]) -> None:
        blend, momentum, _ = local
        if blend == 1.0:
            return
        for p, m in zip(params, momentum):
            if p.grad is None:  # a parameter the loss did not reach still follows the momentum
                p.grad = (1.0 - blend) * m.clone()
            else:
                p.grad.mul_(blend).add_(m, alpha=1.0 - blend)

    # once, after the last step: (the client's new state, extras for the strategy)
    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"visits": torch.tensor(local[2] + 1)}, {}


class MomentumStrategy(Strategy):
    """FedAvg's strategy plus the server momentum Δ (checkpointed under ``"momentum"``)."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str) -> None:
        super().__init__(model, aggregator, ctx, objective)
        self.momentum = {n: torch.zeros_like(model.state_dict()[n]) for n in self.trainable}

    def payload(self, round: RoundContext) -> dict[str, Any]:  # sent to every participant with its task
        return {"momentum": self.momentum}

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        sent = {n: self.model.state_dict()[n].double() for n in self.trainable}  # x, before it changes
        metrics = super().aggregate(round, results)  # the aggregator's new global model
        trained = [r for r in sorted(results, key=lambda r: r.cid) if r.steps > 0]
        for name, x in sent.items():
            total = torch.zeros_like(x)
            for r in trained:  # float64, in client order: the same sum on every engine
                steps = effective_steps(r.steps, self.ctx.momentum)  # K_k, or its momentum equivalent
                total += (x - r.weights[name].double()) / (steps * self.ctx.lr)
            self.momentum[name] = (total / max(len(trained), 1)).to(self.momentum[name].dtype)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"momentum": {n: t.clone() for n, t in self.momentum.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.momentum = {n: t.clone() for n, t in state["momentum"].items()}


class ExampleFedCM(FedAvgFamily):
    """FedCM-style client-level momentum with a per-client warm-up (an example plugin algorithm):
    each local gradient is blended with the server momentum Δ, g ← a_k·g + (1 − a_k)·Δ, where
    a_k = max(alpha, 1/(visits + 1)); default alpha 0.1 (FedCM's)."""

    alpha: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False,
                                  description="weight of the client's own gradient in the blend (FedCM's α)")] = 0.1

    def client_fn(self) -> ClientUpdate:
        return MomentumUpdate(self.alpha)

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return MomentumStrategy(model, build_aggregator(self.aggregator), ctx, self.loss)

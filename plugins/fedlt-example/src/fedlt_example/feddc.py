"""An algorithm that chooses what its clients send back, added without touching fedlt: FedDC-style
local drift decoupling (Gao et al. 2022, "FedDC: Federated Learning with Non-IID Data via Local
Drift Decoupling and Correction", eq. 5-7), without FedDC's gradient correction term.

Client k keeps a local drift h_k (zero at first). Each round it minimises
L_k(θ) + (α/2)·‖θ + h_k − w‖² from the received global weights w, then h_k ← h_k + (θ_k − w), and
it uploads θ_k + h_k — not θ_k — through ``ClientUpdate``'s ``upload`` hook; the server aggregates
the uploads with the run's aggregator (FedAvg's |D_k|-weighted mean by default). Buffers (BatchNorm
statistics) are uploaded as trained. Registered through the entry point
``fedlt.algorithms: example_feddc``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import Field
from torch import nn

from fedlt.plugin import ClientTask, ClientUpdate, FedAvgFamily, State, trainable_names


@dataclass(frozen=True)
class DriftUpdate(ClientUpdate):
    """Local SGD on L + (α/2)·‖θ + h − w‖²; the drift h is the client's state; uploads θ + h."""

    alpha: float

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        names = trainable_names(model)
        drift = task.state.get("drift") or {n: torch.zeros_like(task.weights[n]) for n in names}
        return names, drift, task.weights

    def correct(self, local: Any, params: list[nn.Parameter]) -> None:
        names, drift, received = local
        for name, p in zip(names, params):  # the penalty's gradient α·(θ + h − w), added to the loss's
            penalty = self.alpha * (p.detach() + drift[name] - received[name])
            p.grad = penalty if p.grad is None else p.grad.add_(penalty)

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        names, drift, received = local
        return {"drift": {n: drift[n] + (p.detach() - received[n]) for n, p in zip(names, params)}}, {}

    def upload(self, local: Any, task: ClientTask, model: nn.Module, state: dict[str, Any]) -> State:
        weights = super().upload(local, task, model, state)  # the trained weights θ (copies)
        return weights | {n: weights[n] + h for n, h in state["drift"].items()}  # θ + h


class ExampleFedDC(FedAvgFamily):
    """FedDC-style drift decoupling (an example plugin algorithm): each client keeps a drift h,
    trains on L + (alpha/2)·‖θ + h − w‖², sets h ← h + (θ − w) and uploads θ + h; default alpha
    0.01 (the FedDC authors' alpha_coef)."""

    alpha: Annotated[float, Field(ge=0, allow_inf_nan=False,
                                  description="weight α of the drift penalty (α/2)·‖θ + h − w‖²")] = 0.01

    def client_fn(self) -> ClientUpdate:
        return DriftUpdate(self.alpha)

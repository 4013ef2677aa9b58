"""The papers' stateful baselines as compositions of a client variant and/or a strategy (issue 16).

Each algorithm is the FedAvg family's loop (``ClientUpdate``) with one of its steps replaced,
and/or the FedAvg ``Strategy`` with one more piece of server state; all of them take any loss
expression as their local objective (``--algo scaffold --loss fedlc``) and any partitioner.

| name | client (``ClientUpdate`` hook) | server (``Strategy``) |
|---|---|---|
| ``scaffold`` | ``correct``: g + c − c_i; ``end``: c_i⁺, Δc_i | c ← c + (1/N)·Σ Δc_i, sent as payload |
| ``feddyn`` | ``correct``: g − g_k + α(θ − θ^{t−1}); ``end``: g_k⁺ | h, θ = avg − h/α |
| ``moon`` | ``parts``: + μ·ℓ_con; ``end``: keep the local model | — |
| ``fednova`` | — | average the updates normalised by effective local steps |
| ``fedexp`` | — | the ``fedexp`` aggregator (extrapolated server step) |
| ``fedsam`` | ``ascent``: SAM's two-pass gradient (ε = ρ·g/‖g‖) | — |
| ``feddecorr`` | ``parts``: + β·decorrelation of the representation | — |

Per-client state lives in the engine's ``ClientStates`` (checkpointed); per-server state in the
strategy's ``state_dict``. The representation of MOON and FedDecorr is the input of the model's
classifier (``fedlt.models.classifier``), read by a forward pre-hook: see ``features_of``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedlt.algorithms import preset, register
from fedlt.algorithms.base import AggregatorSpec, NonFiniteLoss, RunContext, build_aggregator, loss_of, upcast
# features_of is re-exported: its users import it from here
from fedlt.algorithms.fedavg_family import (ClientUpdate, FedAvgFamily, StepForward, Strategy,  # noqa: F401
                                            client_norms, features_of, trainable_names)
from fedlt.algorithms.protocol import ClientResult, ClientTask, State
from fedlt.context import RoundContext

NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _zeros(weights: State, names: Sequence[str]) -> State:
    return {n: torch.zeros_like(weights[n]) for n in names}


def add_to_grad(p: nn.Parameter, delta: torch.Tensor) -> None:
    """``p.grad += delta`` (a correction or proximal term added to the loss's gradient)."""
    if p.grad is None:  # a parameter the loss did not reach still moves by the correction
        p.grad = delta.clone()
    else:
        p.grad.add_(delta)


class ControlStrategy(Strategy):
    """A strategy with one per-parameter server tensor ``self.server[name]`` (SCAFFOLD's c,
    FedDyn's h), zero at the start, checkpointed under ``"server"``."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str) -> None:
        super().__init__(model, aggregator, ctx, objective)
        self.server: State = _zeros(model.state_dict(), self.trainable)

    def num_clients(self, round: RoundContext) -> int:
        return round.num_clients

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"server": {n: t.clone() for n, t in self.server.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.server = {n: t.clone() for n, t in state["server"].items()}


# -- SCAFFOLD ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScaffoldUpdate(ClientUpdate):
    """Local steps on g(y) − c_i + c; then option II: c_i⁺ = c_i − c + (x − y)/(K·η_l), K the
    client's effective step count (``effective_steps``: its steps without momentum)."""

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        names = trainable_names(model)
        c = task.payload["c"]
        c_i = task.state.get("c") or _zeros(task.weights, names)
        return names, c, c_i, [c[n] - c_i[n] for n in names]

    def correct(self, local: Any, params: list[nn.Parameter]) -> None:
        for p, delta in zip(params, local[3]):
            add_to_grad(p, delta)

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        names, c, c_i, _ = local
        if steps == 0:
            return {"c": c_i}, {"delta_c": _zeros(c_i, names)}
        # K·η_l with K the effective step count under momentum (K itself without): with momentum
        # the model moves ~1/(1 − ρ) times further, and dividing by K alone would inflate c_i
        # by that factor, which the corrected steps then feed back (diverges at ρ = 0.9)
        scale = 1.0 / (effective_steps(steps, task.schedule.momentum) * task.schedule.lr)
        new = {n: c_i[n] - c[n] + (task.weights[n] - p.detach()) * scale for n, p in zip(names, params)}
        _check_finite(new, task.cid, task.schedule.lr, steps)
        return {"c": new}, {"delta_c": {n: new[n] - c_i[n] for n in names}}


def _check_finite(c_i: State, cid: int, lr: float, steps: int) -> None:
    """c_i finite, else NonFiniteLoss: one flag for every tensor, read with the client's loss check
    (``loss_of``: at once, or by the local runner after the round's last client, which makes it this
    client's failure or the round's error as if read here) — not one host synchronisation a tensor."""
    def read(numbers: list[float]) -> float:
        if not numbers[0]:
            raise NonFiniteLoss(f"SCAFFOLD's control variate of client {cid} is not finite (its step "
                                f"(x - y)/(K·lr) overflows at lr={lr:g}, K={steps})")
        return 0.0

    loss_of([torch.stack([torch.isfinite(t).all() for t in c_i.values()]).all()], read)


class ScaffoldStrategy(ControlStrategy):
    """Sends the server control variate c to every participant; x ← aggregate(y_i) (η_g = 1);
    c ← c + (1/N)·Σ_{i∈S} Δc_i with N all clients."""

    def payload(self, round: RoundContext) -> dict[str, Any]:
        return {"c": self.server}

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        metrics = super().aggregate(round, results)
        n = self.num_clients(round)
        for name, c in self.server.items():
            total = torch.zeros_like(c, dtype=torch.float64)
            for r in sorted(results, key=lambda r: r.cid):
                total.add_(r.extras["delta_c"][name].double())
            self.server[name] = (c.double() + total / n).to(c.dtype)
        return metrics


class Scaffold(FedAvgFamily):
    """SCAFFOLD (Karimireddy et al. 2020, Algorithm 1, option II): control variates c (server) and
    c_i (client state) correct each local gradient by c − c_i; defaults: η_g = 1, the unweighted
    ``mean`` of the client models as in the paper."""

    aggregator: AggregatorSpec = "mean"

    def client_fn(self) -> ClientUpdate:
        return ScaffoldUpdate()

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return ScaffoldStrategy(model, build_aggregator(self.aggregator), ctx, self.loss)


# -- FedDyn -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FedDynUpdate(ClientUpdate):
    """Minimise L_k(θ) − ⟨g_k, θ⟩ + (α/2)‖θ − θ^{t−1}‖² (its gradient added to the loss's);
    then g_k ← g_k − α(θ_k − θ^{t−1})."""

    alpha: float

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        names = trainable_names(model)
        grad = task.state.get("grad") or _zeros(task.weights, names)
        return names, [task.weights[n] for n in names], [grad[n] for n in names]

    def correct(self, local: Any, params: list[nn.Parameter]) -> None:
        for p, anchor, g in zip(params, local[1], local[2]):
            add_to_grad(p, self.alpha * (p.detach() - anchor) - g)

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        names, anchors, grads = local
        return {"grad": {n: g - self.alpha * (p.detach() - a)
                         for n, p, a, g in zip(names, params, anchors, grads)}}, {}


class FedDynStrategy(ControlStrategy):
    """h ← h − α·(1/N)·Σ_{k∈P}(θ_k − θ^{t−1}); θ^t = aggregate(θ_k) − h/α (h is ``self.server``)."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str, alpha: float) -> None:
        super().__init__(model, aggregator, ctx, objective)
        self.alpha = alpha

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        previous = {n: self.model.state_dict()[n].clone() for n in self.trainable}
        metrics = super().aggregate(round, results)
        if self.alpha == 0:  # h stays 0: the average itself
            return metrics
        n = self.num_clients(round)
        new = self.model.state_dict()
        for name, h in self.server.items():
            x = previous[name].double()
            drift = torch.zeros_like(x)
            for r in sorted(results, key=lambda r: r.cid):
                drift.add_(r.weights[name].double() - x)
            h64 = h.double() - (self.alpha / n) * drift
            self.server[name] = h64.to(h.dtype)
            new[name] = (new[name].double() - h64 / self.alpha).to(new[name].dtype)
        self.model.load_state_dict(new)
        return metrics


class FedDyn(FedAvgFamily):
    """FedDyn (Acar et al. 2021, Algorithm 1): dynamic regulariser with a per-client dual state
    g_k and a server state h; default α = 0.01 (the authors' CIFAR setting) and the paper's
    unweighted ``mean`` of the client models."""

    alpha: NonNegative = Field(0.01, description="weight α of the dynamic regulariser")
    aggregator: AggregatorSpec = "mean"

    def client_fn(self) -> ClientUpdate:
        return FedDynUpdate(self.alpha)

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return FedDynStrategy(model, build_aggregator(self.aggregator), ctx, self.loss, self.alpha)


# -- representation hook (MOON, FedDecorr) ----------------------------------------------------
# -- MOON -------------------------------------------------------------------------------------
def contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """MOON's eq. 3: −log(e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ})), batch mean."""
    logits = torch.stack([F.cosine_similarity(z, z_global, dim=1), F.cosine_similarity(z, z_previous, dim=1)], 1)
    return F.cross_entropy(logits / temperature, torch.zeros(len(z), dtype=torch.long, device=z.device))


@dataclass(frozen=True)
class MoonUpdate(ClientUpdate):
    """Objective + μ·ℓ_con on the representation; the trained local model becomes the client's
    "previous" model (its first round uses the received global model, as the authors' code)."""

    mu: float
    temperature: float

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        return task.weights, task.state.get("previous") or task.weights

    features = True

    def terms(self, local: Any, forward: StepForward, objective, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        received, previous = local
        parts = super().terms(local, forward, objective, y, extra)
        # the two reference models as evaluated; bf16 under autocast: the term in float32
        z, z_global, z_previous = (upcast(t) for t in (forward.features, forward.reference(received),
                                                        forward.reference(previous)))
        contrastive = contrastive_loss(z, z_global, z_previous, self.temperature)
        return parts | {f"MOON's contrastive term (mu={self.mu:g}, temperature={self.temperature:g})": self.mu * contrastive}

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"previous": {k: v.detach().clone() for k, v in model.state_dict().items()}}, {}


class Moon(FedAvgFamily):
    """MOON (Li, He, Song 2021, eq. 3-4): objective + μ·ℓ_con between the representation of the
    local, the received global and the client's previous local model; defaults μ = 1, τ = 0.5
    (the authors' code). The representation is the classifier's input (see ``features_of``)."""

    mu: NonNegative = Field(1.0, description="weight μ of the contrastive term ℓ_con")
    temperature: Positive = Field(0.5, description="temperature τ of ℓ_con's cosine similarities")

    def client_fn(self) -> ClientUpdate:
        return MoonUpdate(self.mu, self.temperature)


# -- FedDecorr --------------------------------------------------------------------------------
def decorrelation_loss(z: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """FedDecorr's term as the authors' code computes it: z standardised per dimension over the
    batch (unbiased variance, + eps), K = zᵀz, the mean of K's squared off-diagonal entries / B
    (the paper writes ‖K/B‖_F²/d²); 0 for a batch of one sample."""
    b, d = z.shape
    if b < 2:
        return z.sum() * 0.0
    z = z - z.mean(0, keepdim=True)
    z = z / torch.sqrt(eps + z.var(0, keepdim=True))
    k = z.t() @ z
    off = k - torch.diag_embed(torch.diagonal(k))
    return off.pow(2).sum() / (d * (d - 1)) / b if d > 1 else z.sum() * 0.0


@dataclass(frozen=True)
class DecorrUpdate(ClientUpdate):
    beta: float
    features = True
    # measured (fedlt.testing.cohort.sensitivity, the contract's settings): the sequential path from
    # weights perturbed by 1e-7 ends 3.9 % apart after two rounds (FedAvg's 3e-8); the cohort 2.2 %.
    # In float64 too: perturbed by 1e-16 the sequential path ends 1.4e-4 apart (the cohort 7.6e-5)
    cohort_refusal = ("FedDecorr's local training amplifies float32 rounding itself (its z/√(var + 1e-8) on a "
                      "feature nearly constant over a batch): one client after another, weights perturbed by 1e-7 "
                      "end 3.9 % apart after two rounds, so no batched order of float sums can be checked equal "
                      "to the sequential run")

    def terms(self, local: Any, forward: StepForward, objective, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        parts = super().terms(local, forward, objective, y, extra)
        return parts | {f"FedDecorr's decorrelation term (beta={self.beta:g})":
                        self.beta * decorrelation_loss(upcast(forward.features))}


class FedDecorr(FedAvgFamily):
    """FedDecorr (Shi et al. 2023, eq. 5): objective + β·decorrelation of the representation
    before the classifier; default β = 0.1 (the authors' code)."""

    beta: NonNegative = Field(0.1, description="weight β of the decorrelation term")

    def client_fn(self) -> ClientUpdate:
        return DecorrUpdate(self.beta)


# -- FedSAM -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamUpdate(ClientUpdate):
    """Each step: ε = ρ·g/(‖g‖ + 1e-12) (g the batch gradient, ‖·‖ over all of a client's
    parameters), the gradient at w + ε, then the optimiser steps from w with it (Foret et al.
    2021's SAM); the two passes are ``ClientUpdate.backward``'s, which a cohort runs batched."""

    rho: float

    def ascent(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        scale = self.rho / (client_norms(grads) + 1e-12)  # one per client (row)
        return [g * scale.view(-1, *([1] * (g.dim() - 1))) for g in grads]


class FedSAM(FedAvgFamily):
    """FedSAM (Qu et al. 2022, "Generalized Federated Learning via Sharpness Aware Minimization"):
    SAM as the local optimiser's gradient; default ρ = 0.05 (SAM's default, as in the paper's
    CIFAR runs)."""

    rho: NonNegative = Field(0.05, description="radius ρ of SAM's ascent step")

    def client_fn(self) -> ClientUpdate:
        return SamUpdate(self.rho)


# -- FedNova ----------------------------------------------------------------------------------
def effective_steps(steps: int, momentum: float) -> float:
    """‖a_i‖₁ of FedNova's local SGD with momentum ρ: Σ_{k=1}^{τ} (1 − ρ^k)/(1 − ρ); τ without momentum."""
    total, counter = 0.0, 0.0
    for _ in range(steps):
        counter = momentum * counter + 1.0
        total += counter
    return total


class NovaStrategy(Strategy):
    """x ← x + τ_eff·Σ_i p_i·(y_i − x)/a_i with p_i = |D_i|/Σ|D_j| and τ_eff = Σ_i p_i·a_i: each
    update is rescaled to τ_eff/a_i of itself, then aggregated (``fedavg``'s p_i by default)."""

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        steps = [effective_steps(r.steps, self.ctx.momentum) for r in results]
        sizes = [float(r.num_samples) for r in results]
        tau_eff = sum(n * a for n, a in zip(sizes, steps)) / sum(sizes)
        x = self.model.state_dict()
        rescaled = []
        for r, a in zip(results, steps):
            ratio = tau_eff / a if a > 0 else 0.0
            weights = r.weights if ratio == 1.0 else r.weights | {
                n: (x[n].double() + ratio * (r.weights[n].double() - x[n].double())).to(x[n].dtype)
                for n in self.trainable}
            rescaled.append(dataclasses.replace(r, weights=weights))
        metrics = super().aggregate(round, rescaled)
        return metrics | {"tau_eff": tau_eff}


class FedNova(FedAvgFamily):
    """FedNova (Wang et al. 2020, eq. 6-7): normalised averaging by each client's effective local
    steps a_i (its step count, or Σ_k (1 − ρ^k)/(1 − ρ) with momentum ρ); τ_eff = Σ p_i a_i."""

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return NovaStrategy(model, build_aggregator(self.aggregator), ctx, self.loss)

    def reads_each_update(self) -> str | None:
        return "it normalises each client's update by that client's own effective step count"


register("scaffold")(Scaffold)
register("feddyn")(FedDyn)
register("moon")(Moon)
register("feddecorr")(FedDecorr)
register("fedsam")(FedSAM)
register("fednova")(FedNova)
preset("fedexp", FedAvgFamily, "FedExP (Jhunjhunwala et al. 2023): the extrapolated server step of the "
       "fedexp aggregator, eps=1e-3.", aggregator="fedexp")

__all__ = ["Scaffold", "FedDyn", "Moon", "FedDecorr", "FedSAM", "FedNova", "features_of", "contrastive_loss",
           "decorrelation_loss", "effective_steps"]

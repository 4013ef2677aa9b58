"""Aggregators (SPEC §4): server-side objects that turn the clients' results into the new global model.

An aggregator is called once per round as ``aggregator(global_state, results, trainable)``:
``results`` are the participants' ``(state_dict, |D_k|)`` pairs and ``trainable`` names the
trainable floating-point parameters. ``fedavg`` and ``mean`` are stateless; the server optimisers
(``fedavgm``, ``fedadagrad``, ``fedadam``, ``fedyogi``) treat the averaged update
Δ = Σ_k (|D_k| / Σ_j |D_j|)·x_k − x as a pseudo-gradient on the trainable parameters and keep
their moments in ``state_dict()``; every other entry (float buffers, integer buffers) is
aggregated as ``fedavg``. Parameters are pydantic fields: a bad value names the field.

The building block is the pure function ``weighted_average``: aggregating identical states
returns them exactly, and the result does not depend on the order of the clients.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field, PrivateAttr

from fedlt.errors import FedltError
from fedlt.registry import Registry
from fedlt.spec import SpecModel

State = dict[str, torch.Tensor]

REGISTRY: Registry[type[Aggregator]] = Registry("aggregator")
# ``list`` shadows the builtin inside this module: use ``sorted`` here.
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list


def weighted_average(states: Sequence[tuple[State, float]]) -> State:
    """w = Σ_k (w_k / Σ_j w_j) · x_k on floating-point tensors (in float64, cast back); integer
    tensors take the maximum."""
    if not states:
        raise FedltError("cannot aggregate zero client states")
    total = float(sum(w for _, w in states))
    if total <= 0:
        raise FedltError("aggregation weights must sum to a positive number")
    # A canonical, content-derived client order makes the float64 sum independent of the order
    # the clients arrived in, without sorting every element.
    states = sorted(states, key=lambda sw: (sw[1], _fingerprint(sw[0])))
    out: State = {}
    for name, ref in states[0][0].items():
        if ref.is_floating_point():
            if all(torch.equal(ref, s[name]) for s, _ in states[1:]):
                out[name] = ref.clone()
                continue
            acc = torch.zeros_like(ref, dtype=torch.float64)
            for s, w in states:
                acc.add_(s[name].double(), alpha=w / total)
            out[name] = acc.to(ref.dtype)
        else:
            out[name] = torch.stack([s[name] for s, _ in states]).amax(0)
    return out


def _fingerprint(state: State) -> tuple[float, ...]:
    return tuple(float(t.double().sum()) for t in state.values() if t.is_floating_point())


# -- the interface --------------------------------------------------------------------------------
Eta = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
Tau = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class Aggregator(SpecModel):
    """The new global state from the current one and the clients' ``(state, |D_k|)`` pairs.

    Subclasses set ``name`` and implement ``__call__``; a stateful one keeps its state in private
    attributes and round-trips it through ``state_dict`` / ``load_state_dict`` (tensors only, so a
    checkpoint loads with ``torch.load(..., weights_only=True)``).
    """

    name: ClassVar[str] = "aggregator"
    # Why it needs each participant's own state, not only their weighted mean (None: the mean is
    # enough). Secure aggregation and central DP hand the server the mean alone, so a run that
    # combines them with such an aggregator is refused (RunConfig._parts_fit).
    reads_each_update: ClassVar[str | None] = None

    def __call__(self, global_state: State, results: Sequence[tuple[State, float]],
                 trainable: Collection[str]) -> State:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__()")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise FedltError(f"aggregator {self.name!r} keeps no state, got keys {sorted(state)}")


@register("fedavg")
class FedAvg(Aggregator):
    """x ← Σ_k (|D_k| / Σ_j |D_j|) · x_k (integer buffers: max); no parameters; McMahan et al. 2017."""

    name = "fedavg"

    def __call__(self, global_state: State, results: Sequence[tuple[State, float]],
                 trainable: Collection[str]) -> State:
        return weighted_average(results)


@register("mean")
class Mean(Aggregator):
    """x ← (1/K) · Σ_k x_k over the K participants, unweighted (integer buffers: max); no parameters."""

    name = "mean"

    def __call__(self, global_state: State, results: Sequence[tuple[State, float]],
                 trainable: Collection[str]) -> State:
        return weighted_average([(s, 1.0) for s, _ in results])


class ServerOptimizer(Aggregator):
    """A server optimiser on the pseudo-gradient Δ = fedavg(results) − x of each trainable parameter.

    ``step(name, x, avg, delta)`` (all float64) returns the new parameter in float64 and updates
    the optimiser's state; the result is cast to the parameter's dtype. Buffers are ``fedavg``.
    The moments are kept in float64 on the parameter's device: Adagrad's v only grows, and
    float32 (let alone a bf16 parameter's dtype) would drop the small late increments.
    """

    def __call__(self, global_state: State, results: Sequence[tuple[State, float]],
                 trainable: Collection[str]) -> State:
        out = weighted_average(results)
        for name in sorted(trainable):  # sorted: the state's insertion order is fixed too
            if name not in global_state or name not in out:
                raise FedltError(f"{self.name}: trainable parameter {name!r} is not in the "
                                 f"{'global' if name not in global_state else 'clients'} state")
            x = global_state[name]
            if not x.is_floating_point():
                raise FedltError(f"{self.name}: trainable parameter {name!r} is not floating-point ({x.dtype})")
            x64, avg64 = x.double(), out[name].double()
            out[name] = self.step(name, x64, avg64, avg64 - x64).to(x.dtype)
        return out

    def step(self, name: str, x: torch.Tensor, avg: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def _moment(self, store: dict[str, torch.Tensor], name: str, like: torch.Tensor, start: float) -> torch.Tensor:
        """The moment of ``name`` (float64, shaped like the parameter), ``start`` before the first round."""
        if name not in store:
            store[name] = torch.full_like(like, start, dtype=torch.float64)
        elif store[name].shape != like.shape:
            raise FedltError(f"{self.name}: saved state for {name!r} has shape {tuple(store[name].shape)}, "
                             f"the parameter {tuple(like.shape)}")
        elif store[name].device != like.device:  # a checkpoint loaded on the CPU, a model elsewhere
            store[name] = store[name].to(like.device)
        return store[name]


def _load_moments(agg: Aggregator, state: dict[str, Any], keys: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    if state and set(state) != set(keys):
        raise FedltError(f"{agg.name}: state must have keys {sorted(keys)}, got {sorted(state)}")
    return {k: {n: t.detach().to(torch.float64, copy=True) for n, t in state.get(k, {}).items()} for k in keys}


@register("fedavgm")
class FedAvgM(ServerOptimizer):
    """v ← β·v + Δ; x ← x + η·v (v starts at 0); defaults β = 0.9, η = 1.0; Hsu et al. 2019 (FedAvgM)."""

    name = "fedavgm"
    beta: Beta = Field(0.9, description="momentum β of the server velocity v")
    eta: Eta = Field(1.0, description="server learning rate η (--server-lr)")

    _v: dict[str, torch.Tensor] = PrivateAttr(default_factory=dict)  # momentum, float64

    def step(self, name: str, x: torch.Tensor, avg: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        v = self._moment(self._v, name, x, 0.0)
        # x + η·(β·v + Δ), written as avg − ((1 − η)·Δ − η·β·v): exactly fedavg's average when
        # β = 0 and η = 1. The + 0.0 turns a -0.0 correction into +0.0, so avg − 0 keeps avg's sign.
        correction = ((1.0 - self.eta) * delta - (self.eta * self.beta) * v) + 0.0
        self._v[name] = self.beta * v + delta
        return avg - correction

    def state_dict(self) -> dict[str, Any]:
        return {"v": {n: t.clone() for n, t in self._v.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._v = _load_moments(self, state, ("v",))["v"]


class Adaptive(ServerOptimizer):
    """Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2 (no bias correction):
    m ← β1·m + (1 − β1)·Δ; v ← ``second_moment(v, Δ²)``; x ← x + η·m / (√v + τ); m starts at 0,
    v at τ²."""

    eta: Eta = Field(0.01, description="server learning rate η (--server-lr)")
    beta1: Beta = Field(0.9, description="first-moment decay β1")
    beta2: Beta = Field(0.99, description="second-moment decay β2 (unused by fedadagrad)")
    tau: Tau = Field(1e-3, description="adaptivity τ: added to √v in the step, and v starts at τ²")

    _m: dict[str, torch.Tensor] = PrivateAttr(default_factory=dict)  # first moment, float64
    _v: dict[str, torch.Tensor] = PrivateAttr(default_factory=dict)  # second moment, float64

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement second_moment()")

    def step(self, name: str, x: torch.Tensor, avg: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        m = self.beta1 * self._moment(self._m, name, x, 0.0) + (1.0 - self.beta1) * delta
        v = self.second_moment(self._moment(self._v, name, x, self.tau**2), delta * delta)
        self._m[name], self._v[name] = m, v
        return x + self.eta * m / (v.sqrt() + self.tau)

    def state_dict(self) -> dict[str, Any]:
        return {"m": {n: t.clone() for n, t in self._m.items()}, "v": {n: t.clone() for n, t in self._v.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        moments = _load_moments(self, state, ("m", "v"))
        self._m, self._v = moments["m"], moments["v"]


@register("fedadagrad")
class FedAdagrad(Adaptive):
    """Adaptive with v ← v + Δ²; defaults η = 0.01, β1 = 0.9, τ = 1e-3 (β2 unused); Reddi et al. 2021, Alg. 2."""

    name = "fedadagrad"

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v + delta_sq


@register("fedadam")
class FedAdam(Adaptive):
    """Adaptive with v ← β2·v + (1 − β2)·Δ²; defaults η = 0.01, β1 = 0.9, β2 = 0.99, τ = 1e-3; Reddi et al. 2021, Alg. 2."""

    name = "fedadam"

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return self.beta2 * v + (1.0 - self.beta2) * delta_sq


@register("fedyogi")
class FedYogi(Adaptive):
    """Adaptive with v ← v − (1 − β2)·Δ²·sign(v − Δ²); defaults η = 0.01, β1 = 0.9, β2 = 0.99, τ = 1e-3; Reddi et al. 2021, Alg. 2."""

    name = "fedyogi"

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v - (1.0 - self.beta2) * delta_sq * torch.sign(v - delta_sq)


@register("fedexp")
class FedExP(Aggregator):
    """x ← x + η_g·Δ̄ with Δ_k = x_k − x, Δ̄ = (1/M)·Σ_k Δ_k over the M participants and the
    extrapolated step η_g = max(1, Σ_k ‖Δ_k‖² / (2M·(‖Δ̄‖² + ε))) (norms over all trainable
    parameters together); default ε = 1e-3; Jhunjhunwala et al. 2023 (FedExP), Algorithm 1.

    Unweighted, as the paper (η_g = 1 is ``mean`` exactly); buffers are ``mean``. The paper also
    evaluates the average of the last two iterates; fedlt evaluates the iterate itself.
    """

    name = "fedexp"
    reads_each_update = "its step size η_g is computed from each client's own update norm ‖Δ_k‖²"
    eps: Annotated[float, Field(ge=0, allow_inf_nan=False,
                                description="ε added to ‖Δ̄‖² in the step size's denominator")] = 1e-3

    def __call__(self, global_state: State, results: Sequence[tuple[State, float]],
                 trainable: Collection[str]) -> State:
        out = weighted_average([(s, 1.0) for s, _ in results])
        eta = self.step_size(global_state, [s for s, _ in results], out, trainable)
        if eta == 1.0:
            return out
        for name in sorted(trainable):
            x = global_state[name].double()
            out[name] = (x + eta * (out[name].double() - x)).to(global_state[name].dtype)
        return out

    def step_size(self, global_state: State, states: Sequence[State], mean: State, trainable: Collection[str]) -> float:
        """η_g of the round (float64 sums)."""
        names = sorted(trainable)
        per_client = [sum(float((s[n].double() - global_state[n].double()).pow(2).sum()) for n in names) for s in states]
        spread = sum(sorted(per_client))  # sorted: the sum does not depend on the clients' order
        drift = sum(float((mean[n].double() - global_state[n].double()).pow(2).sum()) for n in names)
        return max(1.0, spread / (2 * len(states) * (drift + self.eps)))

"""Update transforms (docs/transforms.md, SPEC §9): what a client does to its update before it
uploads it — clip, compress, add noise — as registered components composed with ``+``:
``--upload "clip(norm=1.0) + topk(fraction=0.01, error_feedback=true)"``.

A transform is optax's ``GradientTransformation`` for one federated upload: ``apply(update,
state) -> (update, state)`` maps the client's update Δ_k = θ_k − w (a dict of floating-point
tensors, by parameter name) and its own persistent state (``{}`` on the client's first round; an
error-feedback residual) to the transformed update and the new state. The engine keeps the state
in the client-state store under ``"upload"``, so it is checkpointed, resumed and carried to worker
processes and Flower nodes with the client's other state. Randomness (QSGD's rounding, noise)
comes from torch's global generator, which inside a client's work is the client's own stream
(``fedlt.algorithms.protocol.client_rng``): the same draws on every engine.

``encode`` is ``apply`` with each tensor in the transform's wire form (top-k: int32 indices and
values; QSGD: a scale and int8 levels; sign: packed bits and a scale), what crosses to the
server; :func:`unpack` reads any of them back. A chain sends its last transform's form.

Third-party transforms register through the entry-point group ``fedlt.transforms``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field

from fedlt.augment import parse_plus
from fedlt.errors import FedltError
from fedlt.registry import Registry
from fedlt.spec import SpecModel, format_spec

State = dict[str, torch.Tensor]


def _is_transform(obj: Any) -> str | None:
    return None if callable(getattr(obj, "apply", None)) else f"{type(obj).__name__} lacks apply(update, state)"


REGISTRY: Registry = Registry("transform", product=_is_transform)
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list
SEQUENCE = type([])  # ``list`` is this module's registry lookup (fedlt.transforms.list)


class UpdateTransform(SpecModel):
    """The base: the identity. Subclasses set ``name`` and override ``apply``; a compressor
    overrides ``encode`` too (its wire form). Parameters are pydantic fields (a bad value names
    the field)."""

    name: ClassVar[str] = "identity"

    def apply(self, update: State, state: State) -> tuple[State, State]:
        return update, state

    def encode(self, update: State, state: State) -> tuple[dict[str, Any], State]:
        """``apply`` with each tensor in its wire form (what :func:`unpack` reads back): used
        when the transform is the last of the chain. Default: the dense tensors."""
        return self.apply(update, state)

    def __add__(self, other: Any) -> "Chain":
        return Chain([*_links(self), *_links(other)])


def _links(t: Any) -> list[Any]:
    return SEQUENCE(t.links) if isinstance(t, Chain) else [t]


class Chain:
    """Transforms applied left to right; each keeps its own state under its position."""

    def __init__(self, links: Sequence[Any]) -> None:
        self.links = SEQUENCE(links)

    def _run(self, update: State, state: dict[str, Any], pack: bool) -> tuple[Any, dict[str, Any]]:
        new: dict[str, Any] = {}
        for i, link in enumerate(self.links):
            last = pack and i == len(self.links) - 1
            update, own = (link.encode if last else link.apply)(update, dict(state.get(str(i), {})))
            if own:
                new[str(i)] = own
        return update, new

    def apply(self, update: State, state: dict[str, Any]) -> tuple[State, dict[str, Any]]:
        """(the transformed update, dense; the chain's new state)."""
        return self._run(update, state, pack=False)

    def encode(self, update: State, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the transformed update in the last transform's wire form; the chain's new state)."""
        return self._run(update, state, pack=True)

    def __add__(self, other: Any) -> "Chain":
        return Chain([*self.links, *_links(other)])

    def __bool__(self) -> bool:
        return bool(self.links)

    def describe(self) -> str:
        return " + ".join(format_spec({"name": type(t).name, **t.params()}) if hasattr(t, "params") else repr(t)
                          for t in self.links) or "none"


def parse_chain(text: str, what: str = "--upload") -> list[dict[str, Any]]:
    """``"clip(norm=1) + topk(fraction=0.01)"`` -> ``[{"name": "clip", "norm": 1}, {...}]``;
    ``""`` / ``"none"`` -> ``[]``."""
    return parse_plus(text, what, "clip(norm=1.0) + topk(fraction=0.01)")


def build(specs: Sequence[dict[str, Any]]) -> Chain:
    """A fresh chain from ``[{"name": ..., **params}, ...]``."""
    links = []
    for spec in specs:
        spec = dict(spec)
        links.append(create(spec.pop("name"), **spec))
    return Chain(links)


def global_norm(update: State) -> torch.Tensor:
    """‖Δ‖₂ over every tensor together, in float64 (a 0-d tensor on the update's device)."""
    squares = [t.double().pow(2).sum() for t in update.values()]
    return torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)


# -- built-ins ----------------------------------------------------------------------------------------
@register("clip")
class Clip(UpdateTransform):
    """Δ · min(1, C / ‖Δ‖₂), the norm taken over all tensors together (DP-FedAvg's clipping,
    McMahan et al. 2018; SPEC §9)."""

    name: ClassVar[str] = "clip"
    norm: float = Field(1.0, gt=0, allow_inf_nan=False, description="C: the largest L2 norm an update keeps")

    def apply(self, update: State, state: State) -> tuple[State, State]:
        factor = torch.clamp(self.norm / global_norm(update).clamp_min(1e-300), max=1.0)
        return {k: (v.double() * factor).to(v.dtype) for k, v in update.items()}, state


@register("noise")
class Noise(UpdateTransform):
    """Δ + N(0, std²) on every coordinate (local DP's Gaussian mechanism: std = σ·C after clip(C))."""

    name: ClassVar[str] = "noise"
    std: float = Field(..., ge=0, allow_inf_nan=False, description="the noise's standard deviation")

    def apply(self, update: State, state: State) -> tuple[State, State]:
        return {k: v + self.std * torch.randn(v.shape, dtype=v.dtype, device=v.device) for k, v in update.items()}, state


class Compressor(UpdateTransform):
    """A per-tensor compressor Q given by its wire form (``quantise``), with optional error
    feedback (Seide et al. 2014; Karimireddy et al. 2019): e ← e + Δ; send Q(e); e ← e − Q(e),
    the residual e kept in the client's state."""

    error_feedback: bool = Field(False, description="carry what was not sent into the next round's update")

    def quantise(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def encode(self, update: State, state: State) -> tuple[dict[str, Any], State]:
        forms, residual = {}, {}
        for k, v in update.items():
            full = v + state[k].to(v) if self.error_feedback and k in state else v
            forms[k] = self.quantise(full)
            if self.error_feedback:
                residual[k] = full - unpack(forms[k], full)
        return forms, residual

    def apply(self, update: State, state: State) -> tuple[State, State]:
        forms, residual = self.encode(update, state)
        return {k: unpack(f, update[k]) for k, f in forms.items()}, residual


@register("topk")
class TopK(Compressor):
    """Keeps the ⌈fraction·d⌉ largest-magnitude coordinates of each tensor (d its size), zeroes the
    rest; sent as int32 indices + values (Aji & Heafield 2017; Stich et al. 2018 with error feedback)."""

    name: ClassVar[str] = "topk"
    fraction: float = Field(0.01, gt=0, le=1, allow_inf_nan=False, description="share of each tensor's coordinates kept")

    def quantise(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = tensor.reshape(-1)
        k = max(1, math.ceil(self.fraction * flat.numel()))
        idx = flat.abs().topk(k, sorted=False).indices.sort().values
        return {"sparse": idx.to(torch.int32), "values": flat[idx]}


@register("qsgd")
class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017, eq. 1): Q(v)_i = ‖v‖₂ · sign(v_i) · ξ_i / s, with ξ_i = l + 1
    with probability |v_i|·s/‖v‖₂ − l (l = ⌊|v_i|·s/‖v‖₂⌋), else l — unbiased, E[Q(v)] = v; per
    tensor; sent as its scale ‖v‖₂/s (float32) and int8 signed levels (s ≤ 127)."""

    name: ClassVar[str] = "qsgd"
    levels: int = Field(16, ge=1, le=127, description="s: quantisation levels per sign")

    def quantise(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        norm = tensor.double().norm()
        scaled = tensor.double().abs() * self.levels / norm.clamp_min(1e-300)
        low = scaled.floor()
        up = torch.rand(tensor.shape, dtype=torch.float64, device=tensor.device) < (scaled - low)
        level = (low + up.double()).clamp_max(self.levels) * tensor.sign()
        return {"levels": level.to(torch.int8), "scale": (norm / self.levels).float()}


@register("sign")
class Sign(Compressor):
    """Scaled sign compression (EF-signSGD, Karimireddy et al. 2019): (‖v‖₁/d)·sign(v) per
    tensor (sign 0 read as +), sent as one bit a coordinate (packed) and its float32 scale."""

    name: ClassVar[str] = "sign"

    def quantise(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        bits = (tensor.reshape(-1) >= 0).to(torch.uint8)
        bits = torch.cat([bits, bits.new_zeros((-bits.numel()) % 8)]).view(-1, 8)
        return {"bits": (bits * _BIT_VALUES.to(bits.device)).sum(1, dtype=torch.uint8),
                "scale": tensor.abs().mean().float()}


_BIT_VALUES = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def unpack(form: Any, like: torch.Tensor) -> torch.Tensor:
    """The dense tensor (``like``'s shape, dtype and device) a wire form carries."""
    if isinstance(form, torch.Tensor):
        return form.to(like.device, like.dtype).view(like.shape)
    if not isinstance(form, dict):
        raise FedltError(f"upload: a packed tensor is a tensor or a dict, got {type(form).__name__}")
    if "sparse" in form:
        out = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
        out[form["sparse"].to(like.device).long()] = form["values"].to(like.device, like.dtype)
        return out.view(like.shape)
    if "levels" in form:
        scale = form["scale"].to(like.device).double()
        return (form["levels"].to(like.device).double() * scale).to(like.dtype).view(like.shape)
    if "bits" in form:
        bits = (form["bits"].to(like.device)[:, None] & _BIT_VALUES.to(like.device)).ne(0).reshape(-1)[:like.numel()]
        scale = form["scale"].to(like.device, like.dtype)
        return torch.where(bits, scale, -scale).view(like.shape)
    raise FedltError(f"upload: unknown packed form with keys {sorted(form)}")


__all__ = ["REGISTRY", "register", "get", "create", "list", "UpdateTransform", "Chain", "build", "parse_chain",
           "unpack", "global_norm", "State", "Compressor"]

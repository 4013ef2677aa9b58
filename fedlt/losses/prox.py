"""FedProx's proximal term ``fedprox`` (SPEC §2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedlt.losses import register
from fedlt.losses.base import LossTerm, check_number, fail


def prox_loss(params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor],
              mu: float) -> torch.Tensor:
    """(mu/2)·Σ_k ‖w_k − w_global,k‖²."""
    total = sum((w - a).pow(2).sum() for w, a in zip(params, anchors))
    return (mu / 2) * total  # type: ignore[return-value]


@register("fedprox")
class FedProx(LossTerm):
    """FedProx (Li et al. 2020): adds (mu/2)·‖w − w_global‖² to the local objective; default
    mu=0.01. A term on the weights, not the logits (``needs_params``).

    ``global_params`` are the received global model's tensors, copied at construction (so
    training a model that shares their storage cannot move the anchor); the call's ``params=``
    must be the same tensors of the local model, in the same order.

    Args:
        mu: weight μ of the proximal term (μ/2)·‖w − w_global‖²
    """

    name = "fedprox"
    needs_params = True
    self_contained = True  # a weight-space term: runs beside a fused composite unchanged

    def __init__(self, *, global_params: Sequence[torch.Tensor] | None, mu: float = 0.01) -> None:
        self.mu = check_number(self.name, "mu", mu, low=0.0)
        if global_params is None:
            raise fail(self.name, "needs global_params (the received global model's tensors)")
        anchors = list(global_params)
        if not anchors or not all(isinstance(t, torch.Tensor) for t in anchors):
            raise fail(self.name, "global_params must be a non-empty sequence of tensors")
        self.anchors = [t.detach().clone() for t in anchors]

    def __call__(self, logits: Any, targets: Any, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        if params is None:
            raise fail(self.name, "needs params= (the local model's trainable tensors)")
        params = list(params)
        if len(params) != len(self.anchors):
            raise fail(self.name, f"got {len(params)} params but {len(self.anchors)} global_params")
        for i, (w, a) in enumerate(zip(params, self.anchors)):
            if w.shape != a.shape:
                raise fail(self.name, f"params[{i}] has shape {tuple(w.shape)}, "
                                      f"global_params[{i}] {tuple(a.shape)}")
            if a.device != w.device or a.dtype != w.dtype:
                self.anchors[i] = a.to(device=w.device, dtype=w.dtype)
        return prox_loss(params, self.anchors, self.mu)

    def __repr__(self) -> str:
        return f"fedprox(mu={self.mu:g})"

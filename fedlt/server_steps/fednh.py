"""FedNH's semantic infusion (Dai et al., AAAI 2023) as a server-side step: after local training
every participant estimates its class prototypes with its trained model (``after_training``);
the server infuses them into the global prototypes, which the model trains with from the next
round on (``moves_model``). Held to the authors' code, github.com/Yutong-Dai/FedNH
(``src/flbase/strategies/FedNH.py``), by tests/golden/fednh.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedlt.errors import FedltError
from fedlt.server_steps import Batches, Head, features, register


def class_prototypes(h: torch.Tensor, labels: torch.Tensor, class_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's FedNH upload (the authors' ``FedNHClient._estimate_prototype``): for each class c
    it holds, n_c·μ_c/‖μ_c‖ with μ_c the mean of its samples' normalised representations h/‖h‖
    (norms clamped at 1e-12), 0 for the others; and its counts with an absent class as 1e-12."""
    counts = class_counts.to(torch.float64)
    z = h.double() / torch.linalg.vector_norm(h.double(), dim=1, keepdim=True).clamp(min=1e-12)
    sums = torch.zeros(len(counts), h.shape[1], dtype=torch.float64, device=h.device).index_add_(0, labels, z)
    present = counts > 0
    mean = torch.zeros_like(sums)
    mean[present] = sums[present] / counts[present, None]
    unit = mean / torch.linalg.vector_norm(mean, dim=1, keepdim=True).clamp(min=1e-12)
    return unit * counts[:, None], torch.where(present, counts, torch.full_like(counts, 1e-12))


def semantic_infusion(prototype: torch.Tensor, scaled: Sequence[torch.Tensor], counts: Sequence[torch.Tensor],
                      rho: float) -> torch.Tensor:
    """FedNH's server update of the prototypes (the authors' ``FedNHServer.aggregate``):
    P̄ = normalise(Σ_k scaled_k / Σ_k counts_k), P ← normalise(ρ·P + (1 − ρ)·P̄), rows
    normalised (F.normalize, eps 1e-12); a class no participant holds keeps its direction."""
    total = torch.stack([c.double() for c in counts]).sum(0)
    average = torch.zeros_like(prototype, dtype=torch.float64)
    for s in scaled:
        average += s.double() / total[:, None]
    average = F.normalize(average, dim=1)
    return F.normalize(rho * prototype.double() + (1 - rho) * average, dim=1)


@register("fednh")
class FedNHStep:
    """FedNH's prototype update, every round: each participant's class prototypes from its trained
    model (eval mode, its whole local set: ``class_prototypes``), infused into the global ones
    with smoothing ``rho`` (``semantic_infusion``). The prototypes are the classifier's class
    vectors (``head.weight``: the ``prototypes`` head's buffer); the step keeps its own copy from
    ``setup`` on (the aggregator never moves them) and writes the infused ones into the model.

    Args:
        rho: smoothing ρ of the update: the weight of the old prototypes (the authors' 0.9).
    """

    fresh = False
    after_training = True  # the prototypes of the locally trained model (the authors' client)
    moves_model = True  # the infused prototypes are the model's, trained with next round
    requires = frozenset({"prototypes"})  # infuses class prototypes, not a linear layer's rows

    def __init__(self, *, rho: float = 0.9) -> None:
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0 <= rho <= 1:
            raise FedltError(f"fednh: rho must be a number in [0, 1], got {rho!r}")
        self.rho = float(rho)
        self.prototype: torch.Tensor | None = None

    def setup(self, head: nn.Module, generator: torch.Generator | None = None) -> None:
        self.prototype = head.weight.detach().clone().cpu()

    def due(self, round_index: int, rounds: int) -> bool:
        return True

    def payload(self) -> dict[str, Any]:
        return {}

    def collect(self, model: nn.Module, batches: Batches, payload: dict[str, Any], num_classes: int,
                generator: torch.Generator | None = None) -> dict[str, Any]:
        x, y = features(model, batches)
        scaled, counts = class_prototypes(x, y, torch.bincount(y, minlength=num_classes))
        return {"scaled_prototype": scaled, "counts": counts}

    def apply(self, head: nn.Module, uploads: Sequence[dict[str, Any]],
              generator: torch.Generator | None = None) -> Head:
        new = semantic_infusion(self.prototype, [u["scaled_prototype"] for u in uploads],
                                [u["counts"] for u in uploads], self.rho)
        self.prototype = new.to(self.prototype.dtype)
        bias = getattr(head, "bias", None)
        bias = bias.detach().clone() if bias is not None else head.weight.new_zeros(len(new))
        return {"weight": self.prototype.clone(), "bias": bias}

    def state_dict(self) -> dict[str, Any]:
        return {"prototype": self.prototype}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prototype = state["prototype"]

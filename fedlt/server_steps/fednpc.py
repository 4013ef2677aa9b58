"""FedNPC (Gao, Zhao, Yang, Guo; CVPR Findings 2026): after federated training, the global
classifier is re-trained on pure noise — standard-normal "features" with uniformly drawn labels —
while the backbone stays fixed. Held to the authors' code, github.com/JintongGao/FedNPC
(``FedAvg-FedNPC.py``: ``generate_noisy_batch``, ``re_train_classifier``), by
tests/golden/fednpc.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedlt import bounds
from fedlt.errors import FedltError
from fedlt.server_steps import Batches, Head, _positive, _positive_int, head_state, register


def noisy_batch(classes: int, dim: int, size: int, generator: torch.Generator | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' ``generate_noisy_batch``: ``size`` labels uniform over the classes, then
    ``size`` standard-normal d-dimensional features (drawn in this order)."""
    labels = torch.randint(0, classes, (size,), generator=generator)
    return torch.randn((size, dim), generator=generator, dtype=dtype), labels


def noise_retrain(init: Head, *, steps: int, size: int, lr: float, momentum: float,
                  generator: torch.Generator | None = None) -> Head:
    """The authors' ``re_train_classifier`` without its model selection: from the trained
    classifier, ``steps`` SGD steps (lr, momentum; no weight decay) of CE on a fresh noisy batch
    each (``noisy_batch``, in the classifier's dtype)."""
    w = init["weight"].detach().clone().requires_grad_(True)
    b = init["bias"].detach().clone().requires_grad_(True)
    optimiser = torch.optim.SGD([w, b], lr=lr, momentum=momentum)
    for _ in range(steps):
        x, y = noisy_batch(w.shape[0], w.shape[1], size, generator, w.dtype)
        loss = F.cross_entropy(F.linear(x, w, b), y)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return {"weight": w.detach(), "bias": b.detach()}


@register("fednpc")
class FedNPCStep:
    """FedNPC's post-hoc calibration with the authors' defaults: on the last round (and every
    ``every`` rounds if set), the aggregated classifier re-trained for ``steps`` = 27 SGD steps
    (their ``range(1, E)``, E = 28; ``lr`` = 0.1, ``momentum`` = 0.9) on ``size`` = 10 000 noise
    features each; the training model keeps its classifier, the re-trained one is evaluated. The
    clients upload nothing. Their choice of the best step by test accuracy is not built.

    Args:
        steps: SGD steps of the re-training, one fresh noisy batch each.
        size: noise features (and labels) per step (their M).
        lr: learning rate of the re-training.
        momentum: SGD momentum of the re-training.
        every: also re-train every this many rounds (0: only after the last round, as the authors).
    """

    fresh = False
    requires = frozenset({"linear"})  # re-trains h·Wᵀ + b (its weight and bias)

    def __init__(self, *, steps: int = 27, size: int = 10_000, lr: float = 0.1, momentum: float = 0.9,
                 every: int = 0) -> None:
        self.steps = _positive_int("fednpc", "steps", steps)
        self.size = _positive_int("fednpc", "size", size, bounds.MAX_SAMPLES)
        self.lr = _positive("fednpc", "lr", lr)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise FedltError(f"fednpc: momentum must be a number in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.every = bounds.integer("fednpc", "every", every, 0, bounds.MAX_ROUNDS)

    def setup(self, head: nn.Module, generator: torch.Generator | None = None) -> None:
        # checked before the run, not after its last round: one step's noise batch
        d = head.weight.shape[1]
        bounds.tensor_bytes("fednpc", (self.size, d), head.weight.element_size(), f"size={self.size} on {d} features")

    def due(self, round_index: int, rounds: int) -> bool:
        return round_index == rounds - 1 or bool(self.every and (round_index + 1) % self.every == 0)

    def payload(self) -> dict[str, Any]:
        return {}

    def collect(self, model: nn.Module, batches: Batches, payload: dict[str, Any], num_classes: int,
                generator: torch.Generator | None = None) -> dict[str, Any]:
        return {}  # noise needs no statistics

    def apply(self, head: nn.Module, uploads: Sequence[dict[str, Any]],
              generator: torch.Generator | None = None) -> Head:
        return noise_retrain(head_state(head), steps=self.steps, size=self.size, lr=self.lr, momentum=self.momentum,
                             generator=generator)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

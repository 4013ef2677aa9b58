"""Poly-1 loss (Leng et al., "PolyLoss", ICLR 2022, eq. 3) as a fedlt loss term.

    L = CE(z, y) + ε·(1 − p_y),   p = softmax(z),   ε = 1 by default (ε = 0 is CE).
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from fedlt.plugin import FedltError, LossTerm


def poly1_loss(logits: torch.Tensor, targets: torch.Tensor, epsilon: float) -> torch.Tensor:
    log_p = F.log_softmax(logits, dim=1).gather(1, targets[:, None]).squeeze(1)
    return (-log_p + epsilon * (1 - log_p.exp())).mean()


class Poly1(LossTerm):
    """Poly-1: CE + ε·(1 − p_y) (PolyLoss eq. 3); ε = 1 by default, ε = 0 is CE.

    Args:
        epsilon: weight ε of the polynomial term (at least −1); 0 is CE
    """

    name = "poly1"

    def __init__(self, epsilon: float = 1.0) -> None:
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon) \
                or epsilon < -1:
            raise FedltError(f"loss 'poly1': epsilon must be a finite number >= -1, got {epsilon!r}")
        self.epsilon = float(epsilon)

    def __call__(self, logits, targets, *, teacher_logits=None, params=None) -> torch.Tensor:
        return poly1_loss(logits, targets, self.epsilon)

"""The focal loss (Lin et al., 2017) as a fedlt loss term, shipped as a third-party plugin.

    FL(z, y) = −(1 − p_y)^γ · log p_y,   p = softmax(z),   γ = 2 by default (γ = 0 is CE).

Installed, it is found by ``fedlt.losses.get("focal")``, ``fedlt list losses`` and
``fedlt run --loss "focal(gamma=1)"`` with no change to fedlt.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from fedlt.errors import FedltError
from fedlt.losses import LossTerm


def focal_loss(logits: torch.Tensor, targets: torch.Tensor, gamma: float) -> torch.Tensor:
    log_p = F.log_softmax(logits, dim=1).gather(1, targets[:, None]).squeeze(1)
    return (-(1 - log_p.exp()).pow(gamma) * log_p).mean()


class Focal(LossTerm):
    name = "focal"

    def __init__(self, gamma: float = 2.0) -> None:
        if not gamma >= 0:
            raise FedltError(f"loss 'focal': gamma must be >= 0, got {gamma}")
        self.gamma = float(gamma)

    def __call__(self, logits, targets, *, teacher_logits=None, params=None) -> torch.Tensor:
        return focal_loss(logits, targets, self.gamma)

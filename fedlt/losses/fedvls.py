"""FedVLS's terms: ``vacant_kd``, ``logit_suppression`` and the ``fedvls`` preset (SPEC §2)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fedlt.losses import register
from fedlt.losses.adjust import LogitAdjust
from fedlt.losses.base import (
    one_hot,
    DeviceCache,
    LossTerm,
    as_counts,
    check_batch,
    check_choice,
    check_number,
    fail,
    zero_like_loss,
)
from fedlt.losses.compose import Composite
from fedlt.losses.fused.parts import Suppression
from fedlt.losses.fused.parts import VacantKD as VacantKDPart


# -- logit-space math -------------------------------------------------------------------------
def vacant_kd_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, vacant: torch.Tensor,
                   T: float) -> torch.Tensor:
    """(1/B)·Σ_i KL(softmax(t_i[O]/T) ‖ softmax(z_i[O]/T))·T², O = ``vacant`` (|O| ≥ 2)."""
    log_p = F.log_softmax(logits.index_select(1, vacant) / T, dim=1)
    log_q = F.log_softmax(teacher_logits.detach().index_select(1, vacant) / T, dim=1)
    # q·(log q − log p) with q = exp(log q): a finite log q underflowing to q = 0 gives 0, not NaN.
    kl = (log_q.exp() * (log_q - log_p)).sum()
    return kl * (T * T) / logits.shape[0]


def logit_suppression_reference(logits: torch.Tensor, targets: torch.Tensor,
                                p: torch.Tensor) -> torch.Tensor:
    """FedVLS's published code: 0.005·Σ_c p_c·s_c, s_c = logsumexp_i A[c,i] − log B, with
    A[c,i] = z_ic − log(p_c + 1e-9) + log(1/C + 1e-9) if y_i ≠ c else 0 (an entry of 0, not −inf)."""
    B, C = logits.shape
    A = logits - torch.log(p + 1e-9) + math.log(1.0 / C + 1e-9)  # their log(balanced_prior + 1e-9)
    A = A.masked_fill(one_hot(targets, C), 0.0)
    s = torch.logsumexp(A, dim=0) - math.log(B)
    return 0.005 * (p * s).sum()


def logit_suppression_paper(logits: torch.Tensor, targets: torch.Tensor,
                            p: torch.Tensor) -> torch.Tensor:
    """FedVLS eqs. 4–5: Σ_c p_c·log((1/B)·Σ_i 1[y_i ≠ c]·e^{z_ic}); a class with no sample of
    another label in the batch contributes 0."""
    B, C = logits.shape
    own = one_hot(targets, C)
    has_other = (~own).any(dim=0)
    masked = logits.masked_fill(own, float("-inf"))
    # Classes with no other-label sample are computed on zeros and discarded, so neither their
    # value (−inf) nor a NaN gradient through torch.where leaks out.
    masked = torch.where(has_other.unsqueeze(0), masked, torch.zeros_like(masked))
    s = torch.logsumexp(masked, dim=0) - math.log(B)
    return (p * torch.where(has_other, s, torch.zeros_like(s))).sum()


# -- terms ------------------------------------------------------------------------------------
@register("vacant_kd")
class VacantKD(LossTerm):
    """Vacant-class distillation (FedVLS eq. 3, sign corrected; SPEC §2 ``vacant_kd``).

    O = {c : n_c = 0}. If |O| ≤ 1 the term is 0 (and ``needs_teacher`` is False, so the engine
    skips the teacher's forward pass); otherwise
    (1/B)·Σ_i KL(softmax(t_i[O]/T) ‖ softmax(z_i[O]/T))·T², t = logits of the global model
    received this round, passed as ``teacher_logits`` and never differentiated. Default T=1.

    Args:
        T: distillation temperature T
    """

    name = "vacant_kd"
    fused_family = "composite"

    def __init__(self, *, class_counts: Any, T: float = 1.0) -> None:
        self.T = check_number(self.name, "T", T, low=0.0, strict=True)
        n = as_counts(class_counts, self.name)
        self.num_classes = n.numel()
        self.vacant = (n == 0).nonzero().flatten()
        self.needs_teacher = self.vacant.numel() >= 2
        self._vacant = DeviceCache(self.vacant)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        fused = self.fused_value(logits, targets, teacher_logits)
        if fused is not None:
            return fused
        if not self._check(logits, targets, teacher_logits):
            return zero_like_loss(logits)
        vacant = self._vacant.get(logits.device, torch.long)
        return vacant_kd_loss(logits, teacher_logits, vacant, self.T)

    def _check(self, logits, targets, teacher_logits) -> bool:
        """Input checks; False when the term is 0 (|O| ≤ 1)."""
        check_batch(self.name, logits, targets, self.num_classes)
        if not self.needs_teacher:
            return False
        if teacher_logits is None:
            raise fail(self.name, "needs teacher_logits= (the received global model's logits)")
        if teacher_logits.shape != logits.shape:
            raise fail(self.name, f"teacher_logits have shape {tuple(teacher_logits.shape)}, "
                                  f"logits {tuple(logits.shape)}")
        return True

    def fused_parts(self, logits, targets, teacher_logits, weight):
        if not self._check(logits, targets, teacher_logits):
            return ()
        return (VacantKDPart(weight, self._vacant, self.T),)

    def __repr__(self) -> str:
        return f"vacant_kd(T={self.T:g})"


@register("logit_suppression")
class LogitSuppression(LossTerm):
    """FedVLS's logit suppression L_logit (SPEC §2 ``logit_suppression``), p = n / Σn.

    ``variant="reference"`` (default; what produced the paper's numbers):
    0.005·Σ_c p_c·s_c with s_c = logsumexp_i A[c,i] − log B,
    A[c,i] = z_ic − log(p_c + 1e-9) + log(1/C + 1e-9) when y_i ≠ c and 0 when y_i = c.
    ``variant="paper"`` (eqs. 4–5): Σ_c p_c·log((1/B)·Σ_i 1[y_i ≠ c]·e^{z_ic}); unbounded below
    (all logits can drop together), for fidelity studies.

    Args:
        variant: ``reference`` (the authors' code, which produced the paper's numbers) or ``paper`` (eqs. 4–5)
    """

    name = "logit_suppression"
    fused_family = "composite"

    def __init__(self, *, class_counts: Any, variant: str = "reference") -> None:
        self.variant = check_choice(self.name, "variant", variant, ("reference", "paper"))
        n = as_counts(class_counts, self.name)
        self.num_classes = n.numel()
        self.p = DeviceCache(n / n.sum())
        self._fn = logit_suppression_reference if variant == "reference" else logit_suppression_paper

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        fused = self.fused_value(logits, targets)
        if fused is not None:
            return fused
        check_batch(self.name, logits, targets, self.num_classes)
        return self._fn(logits, targets, self.p.like(logits))

    def fused_parts(self, logits, targets, teacher_logits, weight):
        check_batch(self.name, logits, targets, self.num_classes)
        return (Suppression(weight, self.p, self.variant),)

    def __repr__(self) -> str:
        return f"logit_suppression(variant={self.variant!r})"


@register("fedvls")
class FedVLS(Composite):
    """FedVLS's local objective (SPEC §2 ``fedvls``):
    logit_adjust(tau=1, eps=1e-9) + lam·vacant_kd(T=1) + logit_suppression("reference").
    Default lam=0.1 (the authors' code).

    Args:
        lam: weight λ of the vacant-class distillation ``vacant_kd``
    """

    name = "fedvls"

    def __init__(self, *, class_counts: Any, lam: float = 0.1) -> None:
        self.lam = check_number(self.name, "lam", lam, low=0.0)
        super().__init__([
            (1.0, LogitAdjust(class_counts=class_counts, tau=1.0, eps=1e-9)),
            (self.lam, VacantKD(class_counts=class_counts)),
            (1.0, LogitSuppression(class_counts=class_counts, variant="reference")),
        ])

    def __repr__(self) -> str:
        return f"fedvls(lam={self.lam:g})"

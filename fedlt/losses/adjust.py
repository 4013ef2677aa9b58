"""Cross-entropy and its logit-adjusted variants: ``ce``, ``logit_adjust``, ``fedlc`` (SPEC §2).

Each term adds a fixed per-class offset to the logits, computed once from the client's class
counts n over its whole local set; ``adjusted_logits`` exposes the logits the softmax sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fedlt.losses import register
from fedlt.losses.fused.parts import OffsetCE
from fedlt.losses.base import (
    one_hot,
    DeviceCache,
    LossTerm,
    as_counts,
    check_batch,
    check_choice,
    check_number,
    fail,
)


# -- logit-space math (one function per term; a fused kernel replaces these) ---------------------
def ce_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(1/B)·Σ_i [logsumexp(z_i) − z_{i,y_i}]."""
    return F.cross_entropy(logits, targets)


def offset_ce_loss(logits: torch.Tensor, targets: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """CE(z + offset, y); entries of ``offset`` equal to −inf drop that class from the softmax."""
    return F.cross_entropy(logits + offset, targets)


def offset_ce_loss_excluding_target(
    logits: torch.Tensor, targets: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """(1/B)·Σ_i [−(z_iy + o_y) + log Σ_{c≠y_i} e^{z_ic + o_c}] (FedLC's printed eq. 7).

    A sample whose denominator is empty (no other class present) contributes 0.
    """
    adjusted = logits + offset
    is_target = one_hot(targets, logits.shape[1])
    others = adjusted.masked_fill(is_target, float("-inf"))
    empty = ~torch.isfinite(others).any(dim=1)
    # Rows with nothing left would give logsumexp(−inf…) = −inf and NaN gradients through
    # torch.where, so they are computed on zeros and then discarded.
    others = torch.where(empty.unsqueeze(1), torch.zeros_like(others), others)
    per_sample = torch.logsumexp(others, dim=1) - adjusted.gather(1, targets.unsqueeze(1)).squeeze(1)
    return torch.where(empty, torch.zeros_like(per_sample), per_sample).mean()


# -- terms ------------------------------------------------------------------------------------
@register("ce")
class CE(LossTerm):
    """Cross-entropy, mean over the batch (SPEC §2 ``ce``)."""

    name = "ce"
    fused_family = "ce"

    def __init__(self) -> None:
        """No parameters; defined so a stray one is reported as a FedltError."""

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        fused = self.fused_value(logits, targets)
        if fused is not None:
            return fused
        check_batch(self.name, logits, targets)
        return ce_loss(logits, targets)

    def fused_parts(self, logits, targets, teacher_logits, weight):
        check_batch(self.name, logits, targets)
        return (OffsetCE(weight, None),)

    def ce_offset(self, num_classes: int) -> torch.Tensor | None:
        """The per-class offset o of CE(z + o, y) (float64; here 0), for SCALA's fused pair."""
        return torch.zeros(num_classes, dtype=torch.float64)

    def adjusted_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


@register("logit_adjust")
class LogitAdjust(LossTerm):
    """CE(z + tau·log(p + eps), y), p = n / Σn (SPEC §2 ``logit_adjust``).

    SCALA's client loss (eq. 15), FedLogit and FedVLS's L_cal. ``eps`` keeps a class with
    n_c = 0 at a finite offset (tau·log 1e-12 ≈ −27.6·tau), never −inf. Defaults tau=1,
    eps=1e-12 (SCALA's code); the ``fedvls`` preset uses eps=1e-9 (FedVLS's code).

    Args:
        tau: strength τ of the offset τ·log(p + eps)
        eps: added to p, so that an absent class's offset stays finite
    """

    name = "logit_adjust"
    fused_family = "ce"

    def __init__(self, *, class_counts: Any, tau: float = 1.0, eps: float = 1e-12) -> None:
        self.tau = check_number(self.name, "tau", tau, low=0.0)
        self.eps = check_number(self.name, "eps", eps, low=0.0, strict=True)
        n = as_counts(class_counts, self.name)
        self.num_classes = n.numel()
        self.offset = DeviceCache(self.tau * torch.log(n / n.sum() + self.eps))

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        fused = self.fused_value(logits, targets)
        if fused is not None:
            return fused
        check_batch(self.name, logits, targets, self.num_classes)
        return offset_ce_loss(logits, targets, self.offset.like(logits))

    def fused_parts(self, logits, targets, teacher_logits, weight):
        check_batch(self.name, logits, targets, self.num_classes)
        return (OffsetCE(weight, self.offset),)

    def ce_offset(self, num_classes: int) -> torch.Tensor | None:
        """tau·log(p + eps) (float64), for SCALA's fused pair."""
        return self.offset.vec if num_classes == self.num_classes else None

    def adjusted_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.offset.like(logits)

    def __repr__(self) -> str:
        return f"logit_adjust(tau={self.tau:g}, eps={self.eps:g})"


@register("fedlc")
class FedLC(LossTerm):
    """FedLC's calibrated CE: CE(z − tau·n^(−1/4), y) (SPEC §2 ``fedlc``).

    ``form="code"`` (default): the softmax runs over all classes, as in every public
    implementation; a class with n_c = 0 takes no part in it (offset −inf, probability exactly
    0, gradient exactly 0). A target whose class has n_c = 0 is an error: the counts must cover
    the client's whole local set. ``form="paper"``: the printed eq. 7, with the target left out
    of the denominator, −(z_y − Δ_y) + log Σ_{c≠y} e^{z_c − Δ_c}; it is unbounded below and exists
    for fidelity studies (a sample with no other present class contributes 0).

    Args:
        tau: calibration strength τ of the offset τ·n_c^(−1/4)
        form: ``code`` (softmax over all present classes) or ``paper`` (eq. 7: the target left out of the
            denominator)
    """

    name = "fedlc"
    fused_family = "ce"

    def __init__(self, *, class_counts: Any, tau: float = 0.5, form: str = "code") -> None:
        self.tau = check_number(self.name, "tau", tau, low=0.0)
        self.form = check_choice(self.name, "form", form, ("code", "paper"))
        n = as_counts(class_counts, self.name)
        self.num_classes = n.numel()
        present = n > 0
        offset = torch.full_like(n, float("-inf"))
        # Written out per class so tau = 0 with n_c = 0 stays −inf rather than 0·inf = NaN.
        offset[present] = -self.tau * n[present].pow(-0.25)
        self.offset = DeviceCache(offset)
        self.absent = DeviceCache((~present).to(torch.float64))

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        fused = self.fused_value(logits, targets)
        if fused is not None:
            return fused
        self._check(logits, targets)
        offset = self.offset.like(logits)
        if self.form == "code":
            return offset_ce_loss(logits, targets, offset)
        return offset_ce_loss_excluding_target(logits, targets, offset)

    def _check(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        check_batch(self.name, logits, targets, self.num_classes)
        # on the host only: on a device this read would stall every step; there the target's
        # −inf offset makes the loss non-finite, which the step loop's one check per client names
        if logits.device.type == "cpu" and bool(self.absent.like(logits).index_select(0, targets).any()):
            raise fail(
                self.name,
                "a target's class has class_counts 0; class_counts must be the client's counts "
                "over its whole local set",
            )

    def fused_parts(self, logits, targets, teacher_logits, weight):
        """The code form only: the paper form's target-free denominator has no fused kernel."""
        if self.form != "code":
            return None
        self._check(logits, targets)
        return (OffsetCE(weight, self.offset),)

    def ce_offset(self, num_classes: int) -> torch.Tensor | None:
        """−tau·n^(−1/4) (−inf where n_c = 0) for the code form; None (no pair form) for the paper's."""
        return self.offset.vec if self.form == "code" and num_classes == self.num_classes else None

    def adjusted_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """z − tau·n^(−1/4), −inf for classes with n_c = 0 (their softmax probability is 0)."""
        return logits + self.offset.like(logits)

    def __repr__(self) -> str:
        return f"fedlc(tau={self.tau:g}, form={self.form!r})"

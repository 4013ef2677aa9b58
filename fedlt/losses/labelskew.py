"""Label-skew baselines as loss terms: ``fedrs``, ``fedntd``, ``fedlmd`` and ``fedir`` (the
FedLC, FedVLS and Fed-GraB tables' baselines; docs/losses.md states each formula and source)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fedlt.losses import register
from fedlt.losses.adjust import ce_loss
from fedlt.losses.base import (
    one_hot,
    DeviceCache,
    LossTerm,
    as_counts,
    as_vector,
    check_batch,
    check_choice,
    check_number,
    fail,
)


# -- logit-space math -------------------------------------------------------------------------
def scaled_ce_loss(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """CE(s ⊙ z, y) with a per-class scale s (FedRS's restricted softmax)."""
    return F.cross_entropy(logits * scale, targets)


def masked_kd_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, student_pool: torch.Tensor,
                   teacher_pool: torch.Tensor, T: float) -> torch.Tensor:
    """(1/B)·Σ_i Σ_{c ∈ Q_i} q_ic·(log q_ic − log p_ic)·T², where p_i = softmax over the B×C mask
    ``student_pool`` of z_i/T and q_i = softmax over ``teacher_pool`` (⊆ student_pool) of t_i/T.

    A row whose teacher pool is empty contributes 0 (its entries are computed on zeros and
    discarded, so neither −inf nor a NaN gradient leaks out).
    """
    B = logits.shape[0]
    t = teacher_logits.detach() / T
    has_teacher = teacher_pool.any(dim=1, keepdim=True)
    t = torch.where(has_teacher, t.masked_fill(~teacher_pool, float("-inf")), torch.zeros_like(t))
    log_q = F.log_softmax(t, dim=1)
    log_p = F.log_softmax((logits / T).masked_fill(~student_pool, float("-inf")), dim=1)
    keep = teacher_pool & has_teacher
    zero = torch.zeros_like(log_p)
    # Only pool entries enter the product: outside it log p or log q is −inf.
    log_q, log_p = torch.where(keep, log_q, zero), torch.where(keep, log_p, zero)
    kl = (torch.where(keep, log_q.exp(), zero) * (log_q - log_p)).sum()
    return kl * (T * T) / B


def weighted_ce_loss(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                     normalise: bool) -> torch.Tensor:
    """Σ_i w_{y_i}·CE_i divided by Σ_i w_{y_i} (``normalise``, torch's weighted mean) or by B.

    A batch whose targets all weigh 0 gives 0, not 0/0.
    """
    w = weight.index_select(0, targets)
    total = (w * F.cross_entropy(logits, targets, reduction="none")).sum()
    if not normalise:
        return total / logits.shape[0]
    return total / w.sum().clamp_min(torch.finfo(w.dtype).tiny)


# -- terms ------------------------------------------------------------------------------------
@register("fedrs")
class FedRS(LossTerm):
    """FedRS's restricted softmax (Li & Zhan, KDD'21): CE(s ⊙ z, y), a per-class scale s.

    ``form="code"`` (default; the authors' FedRepo ``algorithms/fedrs.py``):
    s_c = alpha + (1 − alpha)·n_c / max_k n_k, so a class absent locally is scaled by alpha and the
    client's largest class by 1. ``form="paper"``: s_c = 1 if n_c > 0 else alpha (what FedVLS's
    baseline code runs). The authors scale h·w_c (the classifier without its bias); a loss term
    sees the logits, so s scales z_c = h·w_c + b_c (the same for a bias-free classifier).
    Default alpha=0.5; 0 ≤ alpha ≤ 1 (alpha = 1 is CE).

    Args:
        alpha: scale α of a class absent locally, in [0, 1] (1 is CE)
        form: ``code`` (s_c = α + (1 − α)·n_c / max_k n_k) or ``paper`` (s_c = 1 if n_c > 0 else α)
    """

    name = "fedrs"

    def __init__(self, *, class_counts: Any, alpha: float = 0.5, form: str = "code") -> None:
        self.alpha = check_number(self.name, "alpha", alpha, low=0.0)
        if self.alpha > 1:
            raise fail(self.name, f"alpha must be <= 1, got {alpha!r}")
        self.form = check_choice(self.name, "form", form, ("code", "paper"))
        n = as_counts(class_counts, self.name)
        self.num_classes = n.numel()
        present = (n > 0).to(torch.float64)
        share = n / n.max() if form == "code" else present
        self.scale = DeviceCache(self.alpha + (1.0 - self.alpha) * share)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        check_batch(self.name, logits, targets, self.num_classes)
        return scaled_ce_loss(logits, targets, self.scale.like(logits))

    def adjusted_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits * self.scale.like(logits)

    def __repr__(self) -> str:
        return f"fedrs(alpha={self.alpha:g}, form={self.form!r})"


def _check_teacher(term: str, logits: torch.Tensor, teacher_logits: torch.Tensor | None) -> torch.Tensor:
    if teacher_logits is None:
        raise fail(term, "needs teacher_logits= (the received global model's logits)")
    if teacher_logits.shape != logits.shape:
        raise fail(term, f"teacher_logits have shape {tuple(teacher_logits.shape)}, "
                         f"logits {tuple(logits.shape)}")
    if logits.shape[1] < 2:
        raise fail(term, "needs at least 2 classes")
    return teacher_logits


@register("fedntd")
class FedNTD(LossTerm):
    """FedNTD (Lee et al., NeurIPS'22): CE(z, y) + beta·tau²·(1/B)·Σ_i KL(q̃_i ‖ p̃_i), with
    p̃_i = softmax(z_i[c ≠ y_i]/tau) and q̃_i = softmax(t_i[c ≠ y_i]/tau) the not-true
    distributions of the local and the global model (t = ``teacher_logits``, never
    differentiated). Defaults tau=1, beta=1 (the authors' code); FedVLS's baselines use beta=0.1.

    Args:
        tau: distillation temperature τ
        beta: weight β of the not-true distillation term
    """

    name = "fedntd"
    needs_teacher = True

    def __init__(self, *, tau: float = 1.0, beta: float = 1.0) -> None:
        self.tau = check_number(self.name, "tau", tau, low=0.0, strict=True)
        self.beta = check_number(self.name, "beta", beta, low=0.0)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        check_batch(self.name, logits, targets)
        teacher_logits = _check_teacher(self.name, logits, teacher_logits)
        not_true = ~one_hot(targets, logits.shape[1])
        kd = masked_kd_loss(logits, teacher_logits, not_true, not_true, self.tau)
        return ce_loss(logits, targets) + self.beta * kd

    def __repr__(self) -> str:
        return f"fedntd(tau={self.tau:g}, beta={self.beta:g})"


@register("fedlmd")
class FedLMD(LossTerm):
    """FedLMD's label-masking distillation (Lu et al., ACM MM'23), as the authors' code
    (wnma3mz/FedLMD ``criterion.py``): CE(z, y) + beta·tau²·(1/B)·Σ_i KL(q_i ‖ p_i), with

    - M = {c : n_c > mean_k n_k}, the client's major labels (``Server.py``: counts above the
      mean over all C classes);
    - q_i = softmax of t_i/tau over c ∉ M ∪ {y_i} (the global model, label-masked);
    - p_i = softmax of z_i/tau over c ≠ y_i (the local model; major classes stay in its softmax,
      so mass on them is pushed to the others in the teacher's proportions).

    The code masks by subtracting 1000 from the logits; here masked classes are excluded
    exactly. A sample whose teacher pool is empty (every other class is major) contributes 0.
    Defaults tau=1, beta=1 (the authors' config); FedVLS's baselines use beta=0.1. With equal
    counts (M empty) it is ``fedntd``.

    Args:
        tau: distillation temperature τ
        beta: weight β of the distillation term
    """

    name = "fedlmd"
    needs_teacher = True

    def __init__(self, *, class_counts: Any, tau: float = 1.0, beta: float = 1.0) -> None:
        self.tau = check_number(self.name, "tau", tau, low=0.0, strict=True)
        self.beta = check_number(self.name, "beta", beta, low=0.0)
        n = as_counts(class_counts, self.name)
        self.num_classes = n.numel()
        self.major = n > n.mean()
        self._major = DeviceCache(self.major)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        check_batch(self.name, logits, targets, self.num_classes)
        teacher_logits = _check_teacher(self.name, logits, teacher_logits)
        not_true = ~one_hot(targets, logits.shape[1])
        minor = ~self._major.get(logits.device, torch.bool)
        kd = masked_kd_loss(logits, teacher_logits, not_true, not_true & minor, self.tau)
        return ce_loss(logits, targets) + self.beta * kd

    def __repr__(self) -> str:
        return f"fedlmd(tau={self.tau:g}, beta={self.beta:g})"


@register("fedir")
class FedIR(LossTerm):
    """FedIR's importance re-weighting (Hsu et al., ECCV'20): sample i weighs
    w_{y_i} = P_{y_i} / p_{y_i}, P = G / ΣG the global class frequency (``global_counts``, the
    whole federation's training counts), p the client's.

    ``form="code"`` (default; Fed-GraB's ``FedIR.py``, which produced their table):
    Σ_i w_{y_i}·CE_i / Σ_i w_{y_i} (torch's weighted mean). ``form="paper"``:
    (1/B)·Σ_i w_{y_i}·CE_i, the importance-weighted empirical risk. As in that code, a class
    absent locally takes the smallest non-zero local count for p (so every weight is finite).

    Args:
        form: ``code`` (weighted mean Σ w·CE / Σ w, Fed-GraB's code) or ``paper`` ((1/B)·Σ w·CE)
    """

    name = "fedir"

    def __init__(self, *, class_counts: Any, global_counts: Any = None, form: str = "code") -> None:
        self.form = check_choice(self.name, "form", form, ("code", "paper"))
        if global_counts is None:
            raise fail(self.name, "needs global_counts (the class counts of the whole federation's "
                                  "training set); pass global_counts= to build(...)")
        n = as_counts(class_counts, self.name)
        G = as_vector(global_counts, self.name, "global_counts", n.numel())
        if bool((G < 0).any()) or float(G.sum()) <= 0:
            raise fail(self.name, "global_counts must be >= 0 and not all 0")
        self.num_classes = n.numel()
        filled = torch.where(n > 0, n, n[n > 0].min())
        self.weight = (G / G.sum()) / (filled / n.sum())
        self._weight = DeviceCache(self.weight)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        check_batch(self.name, logits, targets, self.num_classes)
        return weighted_ce_loss(logits, targets, self._weight.like(logits), self.form == "code")

    def __repr__(self) -> str:
        return f"fedir(form={self.form!r})"

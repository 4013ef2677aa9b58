"""Long-tail baselines as loss terms: ``ldam``, ``balanced_softmax``, ``focal`` and the stateful
``eqlv2`` and ``gcl`` (Fed-GraB's Table 1 rows; docs/losses.md states each formula and source)."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import torch
import torch.nn.functional as F

from fedlt.losses import register
from fedlt.losses.adjust import offset_ce_loss
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
from fedlt.losses.fused.parts import OffsetCE
from fedlt.losses.labelskew import weighted_ce_loss

_EQL_KEYS = ("pos", "neg", "pos_neg")


# -- logit-space math -------------------------------------------------------------------------
def margin_ce_loss(logits: torch.Tensor, targets: torch.Tensor, margin: torch.Tensor, s: float,
                   weight: torch.Tensor | None) -> torch.Tensor:
    """CE(s·(z − m_y·onehot(y)), y), weighted mean by ``weight`` when given (LDAM)."""
    shifted = logits - one_hot(targets, logits.shape[1]).to(logits.dtype) * margin.index_select(
        0, targets).unsqueeze(1)
    if weight is None:
        return F.cross_entropy(s * shifted, targets)
    return weighted_ce_loss(s * shifted, targets, weight, normalise=True)


def focal_loss(logits: torch.Tensor, targets: torch.Tensor, gamma: float) -> torch.Tensor:
    """(1/B)·Σ_i −(1 − p_{i,y_i})^gamma·log p_{i,y_i}, p = softmax(z).

    1 − p = −expm1(−CE) keeps precision near p = 1; it is floored at the dtype's smallest normal
    number so (1 − p)^gamma has a finite gradient for any gamma ≥ 0.
    """
    ce = F.cross_entropy(logits, targets, reduction="none")
    one_minus_p = (-torch.expm1(-ce)).clamp_min(torch.finfo(ce.dtype).tiny)
    return (one_minus_p.pow(gamma) * ce).mean()


def eqlv2_weights(pos_neg: torch.Tensor, gamma: float, mu: float,
                  alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """EQLv2's (w_pos, w_neg): w_neg = σ(gamma·(pos/neg − mu)), w_pos = 1 + alpha·(1 − w_neg)."""
    w_neg = torch.sigmoid(gamma * (pos_neg - mu))
    return 1.0 + alpha * (1.0 - w_neg), w_neg


def gcl_loss(logits: torch.Tensor, targets: torch.Tensor, cloud: torch.Tensor, noise: torch.Tensor,
             m: float, s: float) -> torch.Tensor:
    """CE(s·(z − noise ⊙ cloud − m·onehot(y)), y), ``noise`` B×C ≥ 0, ``cloud`` per class (GCL)."""
    shifted = logits - noise * cloud - m * one_hot(targets, logits.shape[1]).to(logits.dtype)
    return F.cross_entropy(s * shifted, targets)


# -- terms ------------------------------------------------------------------------------------
@register("ldam")
class LDAM(LossTerm):
    """LDAM (Cao et al., NeurIPS'19; the authors' ``LDAMLoss``): CE(s·(z − m_y·onehot(y)), y) with
    m_c ∝ n_c^(−1/4) scaled so the largest margin is ``max_margin``.

    ``reweight=True`` is the DRW stage: class-balanced weights (Cui et al.)
    w_c = (1 − beta)/(1 − beta^{n_c}), normalised to Σ_c w_c = C over the classes the client holds,
    and the batch loss is the weighted mean Σ_i w_{y_i}·ℓ_i / Σ_i w_{y_i} (torch's
    ``cross_entropy(weight=)``). The paper defers it (uniform weights until epoch 160 of 200): a
    term has no epochs, so build ``ldam`` before the switch round and ``ldam(reweight=True)``
    after. Margins and weights come from the present classes (n_c > 0); a class absent locally
    gets the largest margin and weight (finite; it is never a target). Defaults max_margin=0.5,
    s=30, reweight=False, beta=0.9999. The authors pair it with a cosine classifier (normalised
    features and weights); with a plain linear head s=30 sharpens the logits 30-fold.

    Args:
        max_margin: the largest class margin (margins ∝ n_c^(−1/4))
        s: logit scale s
        reweight: the DRW stage: class-balanced weights on the samples
        beta: β of the class-balanced weights (1 − β)/(1 − β^{n_c})
    """

    name = "ldam"

    def __init__(self, *, class_counts: Any, max_margin: float = 0.5, s: float = 30.0,
                 reweight: bool = False, beta: float = 0.9999) -> None:
        self.max_margin = check_number(self.name, "max_margin", max_margin, low=0.0)
        self.s = check_number(self.name, "s", s, low=0.0, strict=True)
        if not isinstance(reweight, bool):
            raise fail(self.name, f"reweight must be True or False, got {reweight!r}")
        self.reweight = reweight
        self.beta = check_number(self.name, "beta", beta, low=0.0)
        if self.beta >= 1:
            raise fail(self.name, f"beta must be < 1, got {beta!r}")
        n = as_counts(class_counts, self.name)
        self.num_classes = n.numel()
        present = n > 0
        m = torch.full_like(n, self.max_margin)
        raw = n[present].pow(-0.25)
        m[present] = raw * (self.max_margin / raw.max())
        self.margin = DeviceCache(m)
        self.weight = None
        if reweight:
            # 1 − beta^n as −expm1(n·log beta): exact for beta near 1 and n small.
            effective = -torch.expm1(n[present] * torch.log(torch.tensor(self.beta, dtype=n.dtype))) \
                if self.beta > 0 else torch.ones_like(n[present])
            w_present = (1.0 - self.beta) / effective
            w_present = w_present / w_present.sum() * int(present.sum())
            w = torch.full_like(n, float(w_present.max()))
            w[present] = w_present
            self.weight = DeviceCache(w)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        check_batch(self.name, logits, targets, self.num_classes)
        weight = None if self.weight is None else self.weight.like(logits)
        return margin_ce_loss(logits, targets, self.margin.like(logits), self.s, weight)

    def __repr__(self) -> str:
        return (f"ldam(max_margin={self.max_margin:g}, s={self.s:g}, reweight={self.reweight}, "
                f"beta={self.beta:g})")


@register("balanced_softmax")
class BalancedSoftmax(LossTerm):
    """Balanced Softmax (Ren et al., NeurIPS'20; the authors' ``balanced_softmax_loss``):
    CE(z + log n, y). With ``absent="exclude"`` (default) a class with n_c = 0 takes no part in the
    softmax (offset −inf: probability exactly 0, gradient exactly 0, no NaN), as log 0 does in the
    authors' code; a target of such a class is an error (the counts must cover the client's whole
    local set). Equal to ``logit_adjust(tau=1)`` on the present classes, up to that term's eps.
    ``absent="one"`` counts an absent class as one sample (offset log 1 = 0), as FedETF's code
    does (``nodes.py``: ``torch.where(sample_per_class > 0, sample_per_class, 1)``).

    Args:
        absent: ``exclude`` a class with no sample from the softmax, or count it as ``one`` sample (FedETF)
    """

    name = "balanced_softmax"
    fused_family = "ce"  # an offset cross-entropy: the fused path's OffsetCE part (docs/fused.md)

    def __init__(self, *, class_counts: Any, absent: str = "exclude") -> None:
        self.absent_rule = check_choice(self.name, "absent", absent, ("exclude", "one"))
        n = as_counts(class_counts, self.name)
        self.num_classes = n.numel()
        present = n > 0
        offset = torch.full_like(n, float("-inf") if absent == "exclude" else 0.0)
        offset[present] = torch.log(n[present])
        self.offset = DeviceCache(offset)
        self.absent = DeviceCache((~present if absent == "exclude" else torch.zeros_like(present)).to(torch.float64))

    def _check(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        check_batch(self.name, logits, targets, self.num_classes)
        # on the host only (as FedLC's check): on a device this read would stall every step; there the
        # target's −inf offset makes the loss non-finite, which the step loop's one check per client names
        if (self.absent_rule == "exclude" and logits.device.type == "cpu"
                and bool(self.absent.like(logits).index_select(0, targets).any())):
            raise fail(self.name, "a target's class has class_counts 0; class_counts must be the "
                                  "client's counts over its whole local set")

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        fused = self.fused_value(logits, targets, teacher_logits)
        if fused is not None:
            return fused
        self._check(logits, targets)
        return offset_ce_loss(logits, targets, self.offset.like(logits))

    def fused_parts(self, logits, targets, teacher_logits, weight):
        self._check(logits, targets)
        return (OffsetCE(weight, self.offset),)

    def ce_offset(self, num_classes: int) -> torch.Tensor | None:
        """log n (−inf or 0 for an absent class, by ``absent``), float64, for SCALA's fused pair."""
        return self.offset.vec if num_classes == self.num_classes else None

    def adjusted_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.offset.like(logits)

    def __repr__(self) -> str:
        return self.name if self.absent_rule == "exclude" else f"balanced_softmax(absent={self.absent_rule!r})"


@register("focal")
class Focal(LossTerm):
    """Focal loss (Lin et al., ICCV'17), softmax form as in the long-tail baselines:
    (1/B)·Σ_i −(1 − p_{i,y_i})^gamma·log p_{i,y_i}. Default gamma=2 (the paper's); gamma=0 is CE.

    Args:
        gamma: focusing exponent γ (0 is CE)
    """

    name = "focal"

    def __init__(self, *, gamma: float = 2.0) -> None:
        self.gamma = check_number(self.name, "gamma", gamma, low=0.0)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        check_batch(self.name, logits, targets)
        return focal_loss(logits, targets, self.gamma)

    def __repr__(self) -> str:
        return f"focal(gamma={self.gamma:g})"


@register("eqlv2")
class EQLv2(LossTerm):
    """Equalization Loss v2 (Tan et al., CVPR'21; the authors' ``EQLv2``, sigmoid base, without
    detection's background class). State: cumulative ``pos``, ``neg`` (length C) and
    ``pos_neg`` = pos/(neg + 1e-10) (100 at the start, so the first step weighs 1). Each call is
    one step:

    1. w_neg_c = σ(gamma·(pos_neg_c − mu)), w_pos_c = 1 + alpha·(1 − w_neg_c);
       w_ic = w_pos_c if y_i = c else w_neg_c (constants for autograd).
    2. Value: (1/B)·Σ_i Σ_c w_ic·BCE-with-logits(z_ic, onehot_ic).
    3. Collector: g_ic = |σ(z_ic) − onehot_ic|; pos_c += Σ_i g_ic·w_ic·1[y_i = c],
       neg_c += Σ_i g_ic·w_ic·1[y_i ≠ c]; pos_neg = pos/(neg + 1e-10).

    Defaults gamma=12, mu=0.8, alpha=4 (the paper's). Do not call it outside training: every
    call advances the state.

    Args:
        gamma: steepness γ of the negative weight w_neg = σ(γ·(pos_neg − μ))
        mu: centre μ of that sigmoid
        alpha: boost α of the positive weight, w_pos = 1 + α·(1 − w_neg)
    """

    name = "eqlv2"

    def __init__(self, *, gamma: float = 12.0, mu: float = 0.8, alpha: float = 4.0,
                 num_classes: int | None = None) -> None:
        self.gamma = check_number(self.name, "gamma", gamma, low=0.0)
        self.mu = check_number(self.name, "mu", mu)
        self.alpha = check_number(self.name, "alpha", alpha, low=0.0)
        if num_classes is not None and (isinstance(num_classes, bool)
                                        or not isinstance(num_classes, Integral) or num_classes < 1):
            raise fail(self.name, f"num_classes must be a positive int, got {num_classes!r}")
        self.num_classes = None if num_classes is None else int(num_classes)
        self.steps = 0
        self._s: dict[str, torch.Tensor] | None = None
        if self.num_classes is not None:
            self._init_state(self.num_classes, torch.device("cpu"))

    def _init_state(self, C: int, device: torch.device) -> None:
        zeros = torch.zeros(C, dtype=torch.float64, device=device)
        self._s = {"pos": zeros, "neg": zeros.clone(), "pos_neg": torch.full_like(zeros, 100.0)}

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        check_batch(self.name, logits, targets, self.num_classes)
        B, C = logits.shape
        if self._s is None:
            self.num_classes = C
            self._init_state(C, logits.device)
        assert self._s is not None
        if self._s["pos"].device != logits.device:
            self._s = {k: v.to(logits.device) for k, v in self._s.items()}
        s = self._s
        w_pos, w_neg = eqlv2_weights(s["pos_neg"], self.gamma, self.mu, self.alpha)
        is_target = one_hot(targets, C)
        weight = torch.where(is_target, w_pos.unsqueeze(0), w_neg.unsqueeze(0))
        onehot = is_target.to(logits.dtype)
        value = (weight.to(logits.dtype)
                 * F.binary_cross_entropy_with_logits(logits, onehot, reduction="none")).sum() / B
        with torch.no_grad():
            g = (torch.sigmoid(logits.detach().to(torch.float64)) - onehot.to(torch.float64)).abs()
            g = g * weight
            s["pos"] += g.masked_fill(~is_target, 0.0).sum(dim=0)
            s["neg"] += g.masked_fill(is_target, 0.0).sum(dim=0)
            s["pos_neg"] = s["pos"] / (s["neg"] + 1e-10)
        self.steps += 1
        return value

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Snapshot (copies): pos, neg, pos_neg (float64, length C; absent before C is known) and
        steps (int64)."""
        out = {k: v.detach().clone() for k, v in (self._s or {}).items()}
        out["steps"] = torch.tensor(self.steps, dtype=torch.int64)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        keys = set(state)
        full = {"steps", *_EQL_KEYS}
        if keys not in (full, {"steps"}):
            raise fail(self.name, f"state must have keys {sorted(full)}, got {sorted(keys)}")
        if keys == full:
            C = state["pos"].numel()
            if self.num_classes is not None and C != self.num_classes:
                raise fail(self.name, f"state is for {C} classes, this term has {self.num_classes}")
            for k in _EQL_KEYS:
                if state[k].shape != (C,):
                    raise fail(self.name, f"state {k!r} must have shape ({C},)")
            self.num_classes = C
            self._s = {k: state[k].detach().to(torch.float64).clone() for k in _EQL_KEYS}
        self.steps = int(state["steps"])

    def __repr__(self) -> str:
        return f"eqlv2(gamma={self.gamma:g}, mu={self.mu:g}, alpha={self.alpha:g})"


@register("gcl")
class GCL(LossTerm):
    """Gaussian Clouded Logit (Li et al., CVPR'22; the authors' ``GCLLoss``, first stage):
    CE(s·(z − noise_mul·|ε| ⊙ r − m·onehot(y)), y), ε_ic ~ N(0, 1/3²) clamped to [−1, 1], drawn
    fresh every call, and the cloud size r_c = δ_c / max_k δ_k with δ_c = log n_max − log n_c
    (0 for the largest class, 1 for the smallest).

    Defaults m=0, s=30, noise_mul=0.5 (the authors' CIFAR training script; their class defaults
    are m=0.5, noise_mul=1). δ comes from the present classes (n_c > 0); an absent class gets the
    largest cloud, r_c = 1 (finite; it is never a target); with all present counts equal there
    is no cloud. The draw is ``torch.randn(B, C, generator, dtype=float64) / 3`` from a CPU
    generator seeded by ``seed``, whose state is this term's state, so a resumed run draws the
    same noise. Like LDAM it is meant for a cosine classifier; the authors' second stage
    (classifier re-balancing) is not part of the term.

    Args:
        m: margin m subtracted from the target logit
        s: logit scale s
        noise_mul: size of the Gaussian cloud (the factor on |ε| ⊙ r)
    """

    name = "gcl"

    def __init__(self, *, class_counts: Any, m: float = 0.0, s: float = 30.0,
                 noise_mul: float = 0.5, seed: int | None = 0) -> None:
        self.m = check_number(self.name, "m", m, low=0.0)
        self.s = check_number(self.name, "s", s, low=0.0, strict=True)
        self.noise_mul = check_number(self.name, "noise_mul", noise_mul, low=0.0)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)):
            raise fail(self.name, f"seed must be an int, got {seed!r}")
        n = as_counts(class_counts, self.name)
        self.num_classes = n.numel()
        present = n > 0
        log_n = torch.log(n[present])
        delta = log_n.max() - log_n
        r = torch.ones_like(n)
        r[present] = delta / delta.max() if float(delta.max()) > 0 else torch.zeros_like(delta)
        self.cloud = DeviceCache(r)
        self.generator = torch.Generator()
        self.generator.manual_seed(0 if seed is None else int(seed))
        self.steps = 0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        check_batch(self.name, logits, targets, self.num_classes)
        eps = torch.randn(logits.shape, generator=self.generator, dtype=torch.float64) / 3.0
        noise = (self.noise_mul * eps.clamp(-1.0, 1.0).abs()).to(device=logits.device, dtype=logits.dtype)
        self.steps += 1
        return gcl_loss(logits, targets, self.cloud.like(logits), noise, self.m, self.s)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """steps (int64) and rng (the noise generator's state, uint8)."""
        return {"steps": torch.tensor(self.steps, dtype=torch.int64), "rng": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != {"steps", "rng"}:
            raise fail(self.name, f"state must have keys ['rng', 'steps'], got {sorted(state)}")
        self.steps = int(state["steps"])
        self.generator.set_state(state["rng"].detach().to(device="cpu", dtype=torch.uint8).clone())

    def __repr__(self) -> str:
        return f"gcl(m={self.m:g}, s={self.s:g}, noise_mul={self.noise_mul:g})"

"""Fed-GraB: the Self-adjusting Gradient Balancer ``sgb``, the Direct Prior Analyzer ``dpa`` and
the ``fedgrab`` preset (SPEC §2)."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fedlt.errors import FedltError
from fedlt.losses import register
from fedlt.losses.fused import dispatch
from fedlt.datasets.source import to_device
from fedlt.losses.base import one_hot, DeviceCache, LossTerm, as_vector, check_batch, check_choice, check_number, fail

_PER_CLASS_KEYS = ("pos", "neg", "u", "e1", "e2")


# -- math -------------------------------------------------------------------------------------
def phi(x: torch.Tensor, gamma: float = 10.0, delta: float = 9.0, zeta: float = 0.5) -> torch.Tensor:
    """φ(x) = γ / (1 + δ·e^(−ζx)); φ(0) = 1 with the defaults (Fed-GraB §3.3).

    Written literally so φ(0) is exactly γ/(1+δ); e^(−ζx) overflowing to inf gives 0, not NaN.
    """
    return gamma / (1.0 + delta * torch.exp(-zeta * x))


def sgb_base_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, base: str,
                           is_target: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The base loss L and g = ∂L/∂z in closed form (no autograd), both in the logits' dtype.

    ``sigmoid``: L = (1/B)·Σ_i Σ_c BCE-with-logits(z_ic, onehot_ic), g = (σ(z) − onehot)/B.
    ``softmax``: L = CE(z, y), g = (softmax(z) − onehot)/B.
    ``is_target`` is the B×C one-hot of ``targets`` when the caller already has it.
    """
    with torch.no_grad():
        z = logits.detach()
        B, C = z.shape
        onehot = (one_hot(targets, C) if is_target is None else is_target).to(z.dtype)
        if base == "sigmoid":
            value = F.binary_cross_entropy_with_logits(z, onehot, reduction="sum") / B
            grad = (torch.sigmoid(z) - onehot) / B
        else:
            value = F.cross_entropy(z, targets)
            grad = (torch.softmax(z, dim=1) - onehot) / B
    return value, grad


def sgb_reference(logits: torch.Tensor, targets: torch.Tensor, w_pos: torch.Tensor, w_neg: torch.Tensor,
                  base: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGB's steps 4–6 (the ground truth): the unweighted base loss, g' = g·(w_pos at the target,
    w_neg elsewhere) and the collector's sums Σ_{y_i=c}|g'_ic|, Σ_{y_i≠c}|g'_ic| (float64, before
    gating)."""
    is_target = one_hot(targets, logits.shape[1])
    value, grad = sgb_base_loss_and_grad(logits, targets, base, is_target)
    weights = torch.where(is_target, w_pos.unsqueeze(0), w_neg.unsqueeze(0))
    grad = grad * weights.to(grad.dtype)
    mag = grad.abs().to(torch.float64)
    return value, grad, mag.masked_fill(~is_target, 0.0).sum(dim=0), mag.masked_fill(is_target, 0.0).sum(dim=0)


class _ValueWithGradient(torch.autograd.Function):
    """Returns ``value`` and sends ``grad`` (times the upstream scalar) back to the logits."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, value: torch.Tensor,
                grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        ctx.dtype = logits.dtype
        return value.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, upstream: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return (upstream.to(grad.dtype) * grad).to(ctx.dtype), None, None


def dpa(classifier_weight: Any) -> torch.Tensor:
    """Direct Prior Analyzer (Fed-GraB §3.2; SPEC §2 ``dpa``): the prior P_c from the C×d weight
    of the received global classifier, m_j = ‖W_j‖₂, P_c[j] = (m_j − min m) / Σ_k (m_k − min m).

    Returns float64 on W's device, summing to 1; uniform 1/C when all norms are equal (to within
    a relative 1e-12, so rounding in the norms of equal rows cannot produce a spiky prior).
    """
    if isinstance(classifier_weight, torch.Tensor):
        W = classifier_weight.detach().to(torch.float64)
    else:
        try:
            W = torch.as_tensor(np.asarray(classifier_weight, dtype=np.float64))
        except (TypeError, ValueError) as exc:
            raise FedltError(f"dpa: classifier_weight must be a C×d tensor ({exc})") from None
    if W.ndim != 2 or W.numel() == 0:
        raise FedltError(f"dpa: classifier_weight must be a non-empty C×d matrix, "
                         f"got shape {tuple(W.shape)}")
    if not bool(torch.isfinite(W).all()):
        raise FedltError("dpa: classifier_weight must be finite")
    m = torch.linalg.vector_norm(W, dim=1)
    spread = m - m.min()
    if float(spread.max()) <= 1e-12 * float(m.max()):
        return torch.full_like(m, 1.0 / m.numel())
    return spread / spread.sum()


dpa.loss_term = False  # type: ignore[attr-defined]  # registered for lookup; build() refuses it
register("dpa")(dpa)


# -- terms ------------------------------------------------------------------------------------
@register("sgb")
class SGB(LossTerm):
    """Fed-GraB's Self-adjusting Gradient Balancer (SPEC §2 ``sgb``).

    State (per client, kept across steps, epochs and rounds): cumulative ``pos``, ``neg``
    (length C) and a per-class incremental PID controller (``u``, ``e1``, ``e2``), plus the
    gating RNG. Every call is one training step:

    1. Δ = pos − neg, e = −Δ (negative feedback; the paper prints the opposite sign);
       u += kp·(e − e₁) + ki·e + kd·(e − 2e₁ + e₂); e₂ ← e₁; e₁ ← e.
    2. w_pos = φ(u), w_neg = φ(−u), φ(x) = gamma / (1 + delta·e^(−zeta·x)).
    3. With a ``prior`` P (length C, e.g. from :func:`dpa`): r = ``torch.rand(C, generator,
       dtype=float64)``; a class with r_j ≤ P[j] is gated this step: weights (1, 1). No prior:
       no gating and no draw.
    4. Base loss: ``sigmoid`` (default, the authors' code) (1/B)·Σ_i Σ_c BCE(z_ic, onehot_ic),
       or ``softmax`` (the paper's text) CE.
    5. The returned VALUE is the unweighted base loss; its gradient w.r.t. the logits is
       g'_ic = g_ic·(w_pos_c if y_i = c else w_neg_c), g = ∂(base loss)/∂z.
    6. Collector, classes not gated this step: pos_c += Σ_i |g'_ic|·1[y_i = c],
       neg_c += Σ_i |g'_ic|·1[y_i ≠ c].

    g' is the term's own gradient: a weight on the term in a composition scales what reaches
    the model but not what is collected. Defaults kp=10, ki=0.01, kd=0.1, gamma=10, delta=9,
    zeta=0.5 (the authors' code). ``seed`` seeds the gating generator, whose state is part of
    ``state_dict`` so a resumed run draws the same gates. Do not call it outside training: every
    call advances the state.

    Args:
        base: base loss: ``sigmoid`` (per-class BCE, the authors' code) or ``softmax`` (CE, the paper's text)
        kp: proportional gain of the per-class PID controller
        ki: its integral gain
        kd: its derivative gain
        gamma: ceiling γ of the weight map φ(x) = γ / (1 + δ·e^(−ζ·x))
        delta: δ of φ (φ(0) = γ / (1 + δ))
        zeta: slope ζ of φ
        prior: gating prior P (length C, e.g. from ``dpa``); None: no gating
    """

    name = "sgb"
    self_contained = True  # fuses itself (steps 4–6), beside a fused composite

    def __init__(self, *, base: str = "sigmoid", kp: float = 10.0, ki: float = 0.01,
                 kd: float = 0.1, gamma: float = 10.0, delta: float = 9.0, zeta: float = 0.5,
                 prior: Any = None, num_classes: int | None = None, seed: int | None = 0) -> None:
        self.base = check_choice(self.name, "base", base, ("sigmoid", "softmax"))
        self.kp = check_number(self.name, "kp", kp)
        self.ki = check_number(self.name, "ki", ki)
        self.kd = check_number(self.name, "kd", kd)
        self.gamma = check_number(self.name, "gamma", gamma, low=0.0, strict=True)
        self.delta = check_number(self.name, "delta", delta, low=0.0)
        self.zeta = check_number(self.name, "zeta", zeta)
        if num_classes is not None and (isinstance(num_classes, bool)
                                        or not isinstance(num_classes, Integral) or num_classes < 1):
            raise fail(self.name, f"num_classes must be a positive int, got {num_classes!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)):
            raise fail(self.name, f"seed must be an int, got {seed!r}")
        self.num_classes = None if num_classes is None else int(num_classes)
        self.prior = None
        if prior is not None:
            self.set_prior(prior)
        self.generator = torch.Generator()
        self.generator.manual_seed(0 if seed is None else int(seed))
        self.steps = 0
        self._s: dict[str, torch.Tensor] | None = None
        if self.num_classes is not None:
            self._init_state(self.num_classes, torch.device("cpu"))

    @property
    def prior(self) -> torch.Tensor | None:
        """The gating probabilities P_c (float64, CPU), or None: no gating."""
        return None if self._prior is None else self._prior.vec

    @prior.setter
    def prior(self, p: torch.Tensor | None) -> None:
        self._prior = None if p is None else DeviceCache(p)  # its copy on the logits' device

    def set_prior(self, prior: Any) -> None:
        """Set the gating probabilities P_c (length C, each in [0, 1]); None turns gating off."""
        if prior is None:
            self.prior = None
            return
        p = as_vector(prior, self.name, "prior", self.num_classes)
        if bool(((p < 0) | (p > 1)).any()):
            raise fail(self.name, "prior entries must lie in [0, 1]")
        self.num_classes = p.numel()
        self.prior = p

    def _init_state(self, C: int, device: torch.device) -> None:
        self._s = {k: torch.zeros(C, dtype=torch.float64, device=device) for k in _PER_CLASS_KEYS}

    def _state_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        assert self._s is not None
        if self._s["pos"].device != device:
            self._s = {k: v.to(device) for k, v in self._s.items()}
        return self._s

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        check_batch(self.name, logits, targets, self.num_classes)
        C = logits.shape[1]
        if self._s is None:
            self.num_classes = C
            self._init_state(C, logits.device)
        s = self._state_on(logits.device)

        # 1. PID on the cumulative imbalance, updated for every class every step.
        e = -(s["pos"] - s["neg"])
        s["u"] += self.kp * (e - s["e1"]) + self.ki * e + self.kd * (e - 2 * s["e1"] + s["e2"])
        s["e2"] = s["e1"]
        s["e1"] = e
        # 2–3. weights, then gating by the prior.
        w_pos = phi(s["u"], self.gamma, self.delta, self.zeta)
        w_neg = phi(-s["u"], self.gamma, self.delta, self.zeta)
        keep = None  # no prior: every class is collected
        if self._prior is not None:
            # drawn on the host (the same gating on every device), crossing pinned and non-blocking
            r = to_device(torch.rand(C, generator=self.generator, dtype=torch.float64), logits.device)
            gated = r <= self._prior.get(logits.device, self._prior.vec.dtype)
            w_pos = w_pos.masked_fill(gated, 1.0)
            w_neg = w_neg.masked_fill(gated, 1.0)
            keep = (~gated).to(torch.float64)
        # 4–6. unweighted value, re-weighted gradient, the collector's sums (fused or reference)
        impl = dispatch.backend(self.fused, logits, "sgb")
        if impl is not None:
            value, grad, pos, neg = impl.sgb(logits, targets, w_pos, w_neg, self.base)
        else:
            value, grad, pos, neg = sgb_reference(logits, targets, w_pos, w_neg, self.base)
        # only the classes that were re-weighted this step are collected
        if keep is not None:
            pos, neg = keep * pos, keep * neg
        s["pos"] += pos
        s["neg"] += neg
        self.steps += 1

        value = value.to(logits.dtype)
        if not (logits.requires_grad and torch.is_grad_enabled()):
            return value
        return _ValueWithGradient.apply(logits, value, grad)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Snapshot (copies): pos, neg, u, e1, e2 (float64, length C; absent before C is known),
        steps (int64) and rng (the gating generator's state, uint8)."""
        out = {k: v.detach().clone() for k, v in (self._s or {}).items()}
        out["steps"] = torch.tensor(self.steps, dtype=torch.int64)
        out["rng"] = self.generator.get_state()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        keys = set(state)
        full = {"steps", "rng", *_PER_CLASS_KEYS}
        if keys not in (full, {"steps", "rng"}):
            raise fail(self.name, f"state must have keys {sorted(full)}, got {sorted(keys)}")
        if keys == full:
            C = state["pos"].numel()
            if self.num_classes is not None and C != self.num_classes:
                raise fail(self.name, f"state is for {C} classes, this term has {self.num_classes}")
            for k in _PER_CLASS_KEYS:
                if state[k].shape != (C,):
                    raise fail(self.name, f"state {k!r} must have shape ({C},)")
            self.num_classes = C
            self._s = {k: state[k].detach().to(torch.float64).clone() for k in _PER_CLASS_KEYS}
        self.steps = int(state["steps"])
        self.generator.set_state(state["rng"].detach().to(device="cpu", dtype=torch.uint8).clone())

    def __repr__(self) -> str:
        return (f"{self.name}(base={self.base!r}, kp={self.kp:g}, ki={self.ki:g}, kd={self.kd:g}, "
                f"gamma={self.gamma:g}, delta={self.delta:g}, zeta={self.zeta:g}, "
                f"prior={'dpa' if self.prior is not None else None})")


@register("fedgrab")
class FedGraB(SGB):
    """Fed-GraB's local objective (SPEC §2 ``fedgrab``): ``sgb(base="sigmoid")`` gated by
    ``dpa(classifier_weight)``, the classifier of the global model received this round.

    Build it at the start of each round's local training with that round's classifier and load
    the client's saved state; the SGB parameters keep their defaults unless given.

    Args:
        kp: proportional gain of the per-class PID controller
        ki: its integral gain
        kd: its derivative gain
        gamma: ceiling γ of the weight map φ(x) = γ / (1 + δ·e^(−ζ·x))
        delta: δ of φ (φ(0) = γ / (1 + δ))
        zeta: slope ζ of φ
    """

    name = "fedgrab"

    def __init__(self, *, classifier_weight: Any, kp: float = 10.0, ki: float = 0.01,
                 kd: float = 0.1, gamma: float = 10.0, delta: float = 9.0, zeta: float = 0.5,
                 num_classes: int | None = None, seed: int | None = 0) -> None:
        if classifier_weight is None:
            raise fail(self.name, "needs classifier_weight (the C×d weight of the received global "
                                  "classifier, for dpa); use 'sgb' for balancing without a prior")
        super().__init__(base="sigmoid", kp=kp, ki=ki, kd=kd, gamma=gamma, delta=delta,
                         zeta=zeta, prior=dpa(classifier_weight), num_classes=num_classes,
                         seed=seed)

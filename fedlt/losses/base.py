"""The loss-term protocol shared by every local objective (SPEC §2).

A term is a plain object with one call, ``term(logits, targets, *, teacher_logits=None,
params=None) -> scalar tensor`` (mean over the batch), two flags telling the engine what to
supply (``needs_teacher``, ``needs_params``) and torchmetrics-style ``state_dict()`` /
``load_state_dict()`` (``{}`` for stateless terms). The per-class setup a term needs (class
counts, prior, ...) is fixed when it is constructed, once per round; the logit-space math lives
in one module-level function per term so a fused kernel can replace it without touching the
object.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedlt.context import ROUND_FIELDS
from fedlt.errors import FedltError
from fedlt.losses.cache import DeviceCache  # noqa: F401  (re-exported: term modules import it from here)
from fedlt.losses.fused import dispatch
from fedlt.losses.fused.parts import kinds

# What ``build`` may hand to a constructor; each term receives only those its signature names:
# the client's own values, and every field of the round context (fedlt.context.RoundContext).
CLIENT_KEYS = ("class_counts", "global_params", "seed")
SETUP_KEYS = CLIENT_KEYS + tuple(k for k in ROUND_FIELDS if k not in CLIENT_KEYS)


def one_hot(targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The (…, C) boolean mask of ``targets``: ``F.one_hot(targets, C).bool()`` without its range
    check, whose host synchronisation ``vmap`` cannot take (DP-SGD's per-sample gradients)."""
    return targets.unsqueeze(-1) == torch.arange(num_classes, device=targets.device)


class LossTerm:
    """Base class of every loss term: the calling convention, state and arithmetic.

    Subclasses set ``name`` and implement ``__call__``. Constructor arguments are checked
    against the signature before the body runs, so an unknown or missing parameter becomes a
    one-line :class:`FedltError` naming the term and its parameters. ``a + 0.1 * b`` builds a
    :class:`~fedlt.losses.compose.Composite`.
    """

    name: str = "term"
    needs_teacher: bool = False
    needs_params: bool = False
    # True for a term that is not a logit-space part but may run beside a fused composite as it
    # is: weight-space terms (fedprox) and terms that fuse themselves (sgb)
    self_contained: bool = False
    # which measured CPU rule decides ``fused="auto"`` for this term (fused/dispatch.py): "ce" for
    # the offset cross-entropies, "composite" for the FedVLS terms; None: no fused form
    fused_family: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _checked_init(init)  # type: ignore[method-assign]

    def __call__(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        *,
        teacher_logits: torch.Tensor | None = None,
        params: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    # -- the fused path (docs/fused.md) --------------------------------------------------------
    @property
    def fused(self) -> str:
        """``"auto"`` (default), ``"on"`` or ``"off"``: which implementation runs (docs/fused.md)."""
        return getattr(self, "_fused", "auto")

    @fused.setter
    def fused(self, mode: str) -> None:
        self._fused = dispatch.check_mode(mode)

    def fused_value(self, logits: torch.Tensor, targets: torch.Tensor,
                    teacher_logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """This term's value through the fused path chosen by ``fused``, or None: run the reference.

        The choice comes first (from the mode and the logits' shape), so a reference run pays
        only that; then the parts (with the term's input checks) and one fused function."""
        impl = dispatch.backend(self.fused, logits, self.fused_family or "composite")
        if impl is None:
            return None
        parts = self.fused_parts(logits, targets, teacher_logits, 1.0)
        if parts is None:
            dispatch.warn_uncovered(repr(self))
            return None
        return dispatch.objective_value(parts, logits, targets, teacher_logits, impl)

    def fused_parts(self, logits: torch.Tensor, targets: torch.Tensor,
                    teacher_logits: torch.Tensor | None, weight: float) -> tuple | None:
        """This term times ``weight`` as fused parts (:mod:`fedlt.losses.fused.parts`), after
        the term's own input checks; ``()`` when it contributes 0, None when it has no fused form."""
        return None

    # -- state (torchmetrics-style) -----------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that must survive steps, rounds and checkpoints; ``{}`` when stateless."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise FedltError(
                f"loss {self.name!r} is stateless but got state keys {sorted(state)}"
            )

    # -- arithmetic: terms compose into weighted sums ------------------------------------------
    def __add__(self, other: Any) -> Any:
        if not isinstance(other, LossTerm):
            return NotImplemented
        return compose(self, other)

    def __sub__(self, other: Any) -> Any:
        if not isinstance(other, LossTerm):
            return NotImplemented
        return compose(self, (-1.0, other))

    def __mul__(self, weight: Any) -> Any:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            return NotImplemented
        return compose((float(weight), self))

    __rmul__ = __mul__

    def __truediv__(self, divisor: Any) -> Any:
        if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or divisor == 0:
            return NotImplemented
        return self * (1.0 / divisor)

    def __neg__(self) -> Any:
        return self * -1.0

    def __repr__(self) -> str:
        return self.name


def _checked_init(init: Any) -> Any:
    """Wrap ``__init__`` so bad arguments raise a one-line FedltError, not a TypeError."""
    sig = inspect.signature(init)

    @functools.wraps(init)  # keeps __wrapped__, so inspect.signature(cls) still sees the params
    def wrapper(self: LossTerm, *args: Any, **kwargs: Any) -> None:
        try:
            sig.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise FedltError(
                f"loss {type(self).name!r}: {exc} (parameters: {describe_params(init)})"
            ) from None
        init(self, *args, **kwargs)

    return wrapper


def describe_params(fn: Any) -> str:
    """``"tau=0.5, form='code'"``: a constructor's user parameters (setup keys left out)."""
    parts = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.name in SETUP_KEYS or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(parts) or "none"


# -- helpers shared by the term modules ---------------------------------------------------------
def fail(term: str, message: str) -> FedltError:
    return FedltError(f"loss {term!r}: {message}")


def as_vector(value: Any, term: str, what: str, length: int | None = None) -> torch.Tensor:
    """A finite 1-D float64 CPU tensor from a tensor, array or sequence (a per-class vector)."""
    if value is None:
        raise fail(term, f"needs {what}")
    try:
        if isinstance(value, torch.Tensor):
            vec = value.detach().to(device="cpu", dtype=torch.float64)
        else:
            vec = torch.as_tensor(np.asarray(value, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise fail(term, f"{what} must be a numeric vector ({exc})") from None
    if vec.ndim != 1 or vec.numel() == 0:
        raise fail(term, f"{what} must be a non-empty 1-D vector, got shape {tuple(vec.shape)}")
    if length is not None and vec.numel() != length:
        raise fail(term, f"{what} has length {vec.numel()} but there are {length} classes")
    if not bool(torch.isfinite(vec).all()):
        raise fail(term, f"{what} must be finite")
    return vec


def as_counts(class_counts: Any, term: str) -> torch.Tensor:
    """The client's class counts n (length C, float64, ≥ 0, not all 0)."""
    n = as_vector(class_counts, term, "class_counts (the client's per-class sample counts)")
    if bool((n < 0).any()):
        raise fail(term, "class_counts must be >= 0")
    if float(n.sum()) <= 0:
        raise fail(term, "class_counts are all 0 (the client holds no data)")
    return n


def check_number(term: str, name: str, value: Any, *, low: float | None = None,
                 strict: bool = False) -> float:
    """A finite real parameter, optionally bounded below (``strict``: value > low)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise fail(term, f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if strict else value < low):
        raise fail(term, f"{name} must be {'>' if strict else '>='} {low:g}, got {value!r}")
    return float(value)


def check_choice(term: str, name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise fail(term, f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def check_batch(term: str, logits: torch.Tensor, targets: torch.Tensor,
                num_classes: int | None = None) -> None:
    """Shape checks only (no device sync): logits B×C with B ≥ 1, targets of length B."""
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[0] == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise fail(term, f"logits must be a non-empty B×C tensor, got {shape}")
    if not isinstance(targets, torch.Tensor) or targets.shape != logits.shape[:1]:
        shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise fail(term, f"targets must have shape ({logits.shape[0]},), got {shape}")
    if num_classes is not None and logits.shape[1] != num_classes:
        raise fail(
            term, f"logits have {logits.shape[1]} classes but class_counts has {num_classes}"
        )


def zero_like_loss(logits: torch.Tensor) -> torch.Tensor:
    """A 0 that stays in the autograd graph (backward works, every gradient is 0, never NaN)."""
    return logits[:, :0].sum()


# -- weighted sums of terms -----------------------------------------------------------------------
class Composite(LossTerm):
    """Σ_k w_k · term_k(logits, targets, ...): a local objective made of terms.

    Every term receives the same call (logits, targets, teacher_logits, params) and uses what it
    needs; ``needs_teacher`` / ``needs_params`` are true when any term with a non-zero weight
    needs them, and terms with weight 0 are not called at all. State is namespaced per term as
    ``"<term name>.<key>"`` (``"<name>#k.<key>"`` for the k-th repeat of a name), so a
    composition's state round-trips through ``state_dict`` / ``load_state_dict``.

    Fused path (docs/fused.md): when every term is a logit-space part (``ce``, ``logit_adjust``,
    ``fedlc``, ``vacant_kd``, ``logit_suppression``, presets of them) or self-contained
    (``fedprox``, ``sgb``), the parts run as ONE fused function (``fedvls`` is one pass, not three)
    and the self-contained terms beside it; ``fused`` set on a composite sets it on its terms.
    """

    name = "sum"

    def __init__(self, terms: Sequence[tuple[float, LossTerm]]) -> None:
        self.terms: list[tuple[float, LossTerm]] = [(float(w), t) for w, t in terms]
        if not self.terms:
            raise FedltError("a composite loss needs at least one term")
        for w, t in self.terms:
            if not isinstance(t, LossTerm):
                raise FedltError(f"composite loss: {t!r} is not a LossTerm")
            if not math.isfinite(w):
                raise FedltError(f"composite loss: weight of {t.name!r} must be finite, got {w}")
        self.labels = _labels([t.name for _, t in self.terms])

    @property
    def needs_teacher(self) -> bool:  # type: ignore[override]
        return any(t.needs_teacher for w, t in self.terms if w != 0)

    @property
    def needs_params(self) -> bool:  # type: ignore[override]
        return any(t.needs_params for w, t in self.terms if w != 0)

    def _set_fused(self, mode: str) -> None:
        LossTerm.fused.fset(self, mode)  # type: ignore[attr-defined]
        for _, term in self.terms:
            term.fused = mode

    fused = property(LossTerm.fused.fget, _set_fused, doc=LossTerm.fused.__doc__)

    def flat_terms(self) -> list[tuple[float, LossTerm]]:
        """The non-zero-weighted leaf terms, nested composites (presets) expanded, weights multiplied."""
        out: list[tuple[float, LossTerm]] = []
        for w, t in self.terms:
            if w == 0:
                continue
            out.extend([(w * w2, t2) for w2, t2 in t.flat_terms()] if isinstance(t, Composite) else [(w, t)])
        return out

    def fused_parts(self, logits, targets, teacher_logits, weight):
        parts: list = []
        for w, t in self.flat_terms():
            p = t.fused_parts(logits, targets, teacher_logits, weight * w)
            if p is None:
                return None
            parts.extend(p)
        return tuple(parts)

    def _fused_call(self, logits, targets, teacher_logits, params) -> torch.Tensor | None:
        """The fused value, or None: run the terms one by one (reference)."""
        flat = self.flat_terms()
        if len(flat) == 1 and flat[0][0] == 1.0:  # one term: it dispatches itself in the plain loop
            return None
        families = {t.fused_family for _, t in flat if not t.self_contained}
        if not families or dispatch.backend(self.fused, logits, "ce" if families == {"ce"} else "composite") is None:
            return None
        parts: list = []
        beside: list[tuple[float, LossTerm]] = []
        uncovered: list[LossTerm] = []
        for w, t in flat:
            p = t.fused_parts(logits, targets, teacher_logits, w)
            if p is not None:
                parts.extend(p)
            elif t.self_contained:
                beside.append((w, t))
            else:
                uncovered.append(t)
        if uncovered:
            dispatch.warn_uncovered(f"{' + '.join(map(repr, uncovered))} (in {self!r})")
            return None
        impl = dispatch.backend(self.fused, logits, kinds(tuple(parts))) if parts else None
        if impl is None:
            return None
        value = dispatch.objective_value(tuple(parts), logits, targets, teacher_logits, impl)
        for w, t in beside:
            v = t(logits, targets, teacher_logits=teacher_logits, params=params)
            value = value + (v if w == 1 else w * v)
        return value

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, *,
                 teacher_logits: torch.Tensor | None = None,
                 params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        fused = self._fused_call(logits, targets, teacher_logits, params)
        if fused is not None:
            return fused
        total: torch.Tensor | None = None
        for w, term in self.terms:
            if w == 0:
                continue
            value = term(logits, targets, teacher_logits=teacher_logits, params=params)
            value = value if w == 1 else w * value
            total = value if total is None else total + value
        return zero_like_loss(logits) if total is None else total

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for label, (_, term) in zip(self.labels, self.terms):
            out.update({f"{label}.{k}": v for k, v in term.state_dict().items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        by_label: dict[str, dict[str, torch.Tensor]] = {label: {} for label in self.labels}
        for key, value in state.items():
            label, _, sub = key.partition(".")
            if label not in by_label or not sub:
                raise FedltError(
                    f"loss state key {key!r} matches no term of {self!r} "
                    f"(terms: {', '.join(self.labels)})"
                )
            by_label[label][sub] = value
        for label, (_, term) in zip(self.labels, self.terms):
            if by_label[label] or term.state_dict():
                term.load_state_dict(by_label[label])

    def __repr__(self) -> str:
        parts = []
        for i, (w, t) in enumerate(self.terms):
            body = f"({t!r})" if type(t) is Composite else repr(t)
            if abs(w) != 1:
                body = f"{abs(w):g}*{body}"
            sign = "-" if w < 0 else "+"
            parts.append((f"-{body}" if w < 0 else body) if i == 0 else f"{sign} {body}")
        return " ".join(parts)


def _labels(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        k = seen.get(name, 0)
        labels.append(name if k == 0 else f"{name}#{k}")
        seen[name] = k + 1
    return labels


def compose(*items: LossTerm | tuple[float, LossTerm]) -> Composite:
    """A weighted sum from terms and ``(weight, term)`` pairs; plain sums are flattened.

    ``compose(la, (0.1, kd), ls)`` == ``la + 0.1 * kd + ls``.
    """
    terms: list[tuple[float, LossTerm]] = []
    for item in items:
        w, term = item if isinstance(item, tuple) else (1.0, item)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not isinstance(term, LossTerm):
            raise FedltError(
                f"compose: expected a LossTerm or a (weight, LossTerm) pair, got {item!r}"
            )
        if type(term) is Composite:  # presets (Composite subclasses) stay one named unit
            terms.extend((w * w2, t2) for w2, t2 in term.terms)
        else:
            terms.append((float(w), term))
    return Composite(terms)

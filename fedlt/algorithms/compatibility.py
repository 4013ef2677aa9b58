"""What the parts of a run need of each other, declared and checked before the run (issue 46).

A part that reads the classifier declares what it needs of it, in the words of
``fedlt.models.heads.CAPABILITIES`` (``linear``, ``prototypes``, ``etf``, ``in_features``):

| who | declares | where |
|---|---|---|
| a head | ``provides`` | on its registered factory (and module class); a plain nn.Linear classifier provides ``heads.LINEAR`` |
| a server step | ``requires`` | a class attribute (``ccvr``, ``creff``, ``fednpc``: linear; ``fednh``: prototypes) |
| an algorithm's training | ``head_requires`` | a class attribute (``fednh``: prototypes; ``fedloge``: in_features) |
| an algorithm's personal model | ``personal_requires`` | a class attribute, checked when ``client_eval`` asks for ``personal`` (``fedetf``: etf) |

``check`` compares them with what the run's classifier provides — the algorithm's head
(``head_spec()``) or the model's own linear layer — and refuses a composition that lacks
something in one FedltError line naming both parts and what is missing, from RunConfig's
validation (before anything is read or written). A part that declares nothing needs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import fedlt.server_steps
from fedlt.errors import FedltError
from fedlt.models import heads

# each capability as a message names it
WHAT = {"linear": "a linear layer's weight and bias ('linear')", "prototypes": "class prototypes ('prototypes')",
        "etf": "FedETF's projection and fixed ETF ('etf')", "in_features": "its input width ('in_features')"}


@dataclass(frozen=True)
class Need:
    """``part`` needs ``wants`` of the run's classifier; ``mode``: only when client_eval asks for it."""

    part: str
    wants: frozenset[str]
    mode: str | None = None


def classifier_of(algorithm: Any) -> tuple[str, frozenset[str]]:
    """The run's classifier, named, and what it provides: the algorithm's head, or the model's linear layer."""
    head_spec = getattr(algorithm, "head_spec", None)
    if callable(head_spec):
        name = head_spec()["name"]
        return f"head {name!r}", heads.provided(name)
    return "the model's linear classifier", heads.LINEAR


def needs(name: str, algorithm: Any) -> list[Need]:
    """What algorithm ``name``'s parts declare they need of the classifier."""
    out = [Need(f"algorithm {name!r}", frozenset(getattr(algorithm, "head_requires", ())))]
    step_spec = getattr(algorithm, "step_spec", None)
    if callable(step_spec):
        step = step_spec()["name"]
        out.append(Need(f"server step {step!r}", fedlt.server_steps.requires(fedlt.server_steps.get(step))))
    out.append(Need(f"{name}'s personal model", frozenset(getattr(algorithm, "personal_requires", ())), "personal"))
    return [n for n in out if n.wants]


def check(name: str, algorithm: Any, modes: Iterable[str] = ()) -> None:
    """A FedltError line when a part of algorithm ``name`` (built with its parameters) needs
    something the run's classifier does not provide; ``modes``: the run's client_eval modes."""
    modes = set(modes)
    part, offered = classifier_of(algorithm)
    for need in needs(name, algorithm):
        missing = sorted(need.wants - offered)
        if not missing or (need.mode is not None and need.mode not in modes):
            continue
        via = f" (client_eval {need.mode})" if need.mode else ""
        has = ", ".join(sorted(offered)) or "nothing declared"
        raise FedltError(f"{need.part}{via} needs {' and '.join(WHAT.get(m, repr(m)) for m in missing)} of the "
                         f"classifier, which {part} does not provide (it provides: {has})")


def check_built(part: str, wants: frozenset[str], classifier: Any) -> None:
    """The same check on a built classifier (an algorithm set up without a RunConfig)."""
    offered = heads.classifier_provides(classifier)
    missing = sorted(wants - offered)
    if missing:
        raise FedltError(f"{part} needs {' and '.join(WHAT.get(m, repr(m)) for m in missing)} of the classifier, "
                         f"which {type(classifier).__name__} does not provide (it provides: "
                         f"{', '.join(sorted(offered)) or 'nothing declared'})")


__all__ = ["Need", "WHAT", "classifier_of", "needs", "check", "check_built"]

"""Which runs can take DP-SGD (``--privacy "sample_level(...)"``, fedlt.privacy.dpsgd): the check made
before the first round, so that a composition whose local update cannot take per-sample gradients
is refused in one line instead of training without the guarantee it asked for."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedlt.algorithms.cohort import client_variant
from fedlt.algorithms.fedavg_family import ClientUpdate, Federated
from fedlt.errors import FedltError

# hooks whose override changes what a step computes from the data (a term beside the objective, a
# second forward, a two-pass step, work around the loop, a second model trained on the same batch):
# DP-SGD's per-sample loss is the objective alone, so such a variant would silently train without
# its own term; the others (``correct``, ``begin``, ``end``, ``upload``, ``generator``) act on the
# privatised gradient or the trained weights: post-processing
DATA_HOOKS = ("__call__", "parts", "terms", "backward", "stepped")


def sample_level_reason(algorithm: Any, model: nn.Module) -> str | None:
    """Why ``algorithm``'s clients cannot run DP-SGD on ``model`` (None: they can)."""
    name = type(algorithm).__name__
    if not isinstance(algorithm, Federated) or client_variant(algorithm) is None:
        return f"{name}'s local update is not fedlt's standard step on a model's loss (ClientUpdate)"
    update = client_variant(algorithm)
    for hook in DATA_HOOKS:
        if hook == "__call__" and getattr(update, "trains_in_the_loop", False):
            continue  # work beside the loop (CCVR's statistics), its training the loop's own
        if getattr(type(update), hook) is not getattr(ClientUpdate, hook):
            return f"{type(update).__name__} overrides ClientUpdate.{hook}, a step DP-SGD's per-sample gradients do not cover"
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return (f"the model has {type(m).__name__}: per-sample gradients are undefined with batch statistics "
                    "(use a model without BatchNorm, e.g. with GroupNorm)")
    return None


def check_sample_level(config: Any, algorithm: Any) -> None:
    """A FedltError line when the run asks for sample-level DP and cannot have it."""
    if config.privacy is None or config.privacy.get("name") != "sample_level":
        return
    reason = sample_level_reason(algorithm, algorithm.global_model())
    if reason is not None:
        raise FedltError(f"privacy: sample_level (DP-SGD) is not available for algorithm {config.algorithm!r}: {reason}")


__all__ = ["check_sample_level", "sample_level_reason"]

"""Which runs can take DP-SGD (``--privacy "sample_level(...)"``, fedlt.privacy.dpsgd): the check made
before the first round, so that a composition whose local update cannot take per-sample gradients
is refused in one line instead of training without the guarantee it asked for."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedlt.algorithms.cohort import around, client_variant
from fedlt.algorithms.fedavg_family import ClientUpdate, Federated
from fedlt.context import RoundContext
from fedlt.errors import FedltError
from fedlt.losses.compose import create_term, parse
from fedlt.privacy.dpsgd import stateful_terms

# hooks whose override changes what a step computes from the data (a term beside the objective:
# MOON's, FedLF's, FedRoD's, read from the batch's forward; a two-pass step; work around the loop;
# a second model trained on the same batch); the others (``correct``, ``begin``, ``end``,
# ``upload``, ``start``, ``frozen_keys``, ``generator``) act on the privatised gradient, the trained
# weights or which of them train: post-processing
DATA_HOOKS = ("__call__", "loop", "step_input", "parts", "terms", "backward", "ascent", "stepped")


def sample_level_reason(algorithm: Any, model: nn.Module) -> str | None:
    """Why ``algorithm``'s clients cannot run DP-SGD on ``model`` (None: they can)."""
    name = type(algorithm).__name__
    if not isinstance(algorithm, Federated) or client_variant(algorithm) is None:
        return f"{name}'s local update is not fedlt's standard step on a model's loss (ClientUpdate)"
    update = client_variant(algorithm)
    if around(algorithm):  # work on the client's data before or after the loop (FedReLa's relabelling)
        return (f"{type(around(algorithm)[0]).__name__} runs work around the local loop on the client's data, "
                "which DP-SGD's per-sample gradients do not cover")
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
    expr = getattr(getattr(algorithm, "strategy", None), "objective", None)
    stateful = stateful_loss_terms(expr) if isinstance(expr, str) else []
    if reason is None and stateful:
        reason = (f"its loss {expr!r} has term(s) {', '.join(stateful)} keeping state across steps, which "
                  "per-sample gradients would move once per sample")
    if reason is not None:
        raise FedltError(f"privacy: sample_level (DP-SGD) is not available for algorithm {config.algorithm!r}: {reason}")


def stateful_loss_terms(expr: str) -> list[str]:
    """The terms of loss expression ``expr`` that keep state across steps, from its terms built
    with the stand-in setup values the config check uses (fedlt.losses.compose.validate)."""
    setup = (RoundContext.placeholder().values()
             | {"class_counts": [1.0, 1.0], "seed": 0, "global_params": [torch.zeros(1)], "num_classes": None})
    return [n for _, name, params in parse(expr) for n in stateful_terms(create_term(name, params, setup))]


__all__ = ["check_sample_level", "sample_level_reason"]

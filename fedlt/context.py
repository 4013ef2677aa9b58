"""What a round knows: one object the engine builds and every objective, client update and
strategy reads (STYLE.md "one round context").

A need that is new to fedlt — a warm-up over the total number of rounds, a prior over the round's
participants — is a field read here, not a new argument threaded through the engine: a loss term
names the field in its constructor (``def __init__(self, *, rounds, round_index)``) and
``fedlt.losses.build`` hands it over; a client update or a strategy reads ``task.context``.

This module imports nothing of fedlt's so that losses, algorithms and engines can all use it (the
bottom layer): a ModelSpec is built by the builder fedlt.models installs when it is imported
(``use_model_builder``), as every process that builds a model imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


_MODEL_BUILDER: list[Callable[..., nn.Module]] = []  # fedlt.models.build, once fedlt.models is imported


def use_model_builder(build: Callable[..., nn.Module]) -> None:
    """What ``ModelSpec.build`` calls: ``build(name, *, in_chans, num_classes, image_size)``."""
    _MODEL_BUILDER[:] = [build]


@dataclass(frozen=True)
class ModelSpec:
    """How to build the model on any node: a plain, picklable description, not a closure."""

    name: str
    in_chans: int
    num_classes: int
    image_size: int

    def build(self) -> nn.Module:
        if not _MODEL_BUILDER:
            raise RuntimeError("a ModelSpec is built by fedlt.models: import it first")
        return _MODEL_BUILDER[0](self.name, in_chans=self.in_chans, num_classes=self.num_classes,
                                 image_size=self.image_size)


@dataclass(frozen=True)
class RoundContext:
    """One round as the engine sees it (every field crosses the wire with a task).

    ``round_index`` counts from 0; ``rounds`` is the run's total; ``participants`` the round's
    client ids in the order their tasks go out, ``participant_counts`` their per-class training
    counts (m×C, same order); ``global_counts`` the whole federation's (C,); ``classifier_weight``
    the global model's classifier at the start of the round (C×d; None for models without a
    ``get_classifier``); ``sampling_seed`` the seed every draw of the round derives from (SPEC §6);
    ``fused`` the loss objects' implementation setting (docs/fused.md).
    """

    round_index: int
    rounds: int
    num_clients: int
    participants: tuple[int, ...]
    num_classes: int
    global_counts: torch.Tensor
    participant_counts: torch.Tensor
    classifier_weight: torch.Tensor | None
    sampling_seed: int
    fused: str = "off"
    model: ModelSpec | None = None

    @classmethod
    def placeholder(cls, num_classes: int = 2) -> "RoundContext":
        """A stand-in for checks made before any data exists (a loss expression at config time):
        one client holding one sample of each class, a one-feature classifier."""
        ones = torch.ones(num_classes, dtype=torch.int64)
        return cls(round_index=0, rounds=1, num_clients=1, participants=(0,), num_classes=num_classes,
                   global_counts=ones, participant_counts=ones[None], classifier_weight=torch.ones(num_classes, 1),
                   sampling_seed=0)

    def values(self) -> dict[str, Any]:
        """The fields by name (what a loss term's constructor may ask for)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


ROUND_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RoundContext))

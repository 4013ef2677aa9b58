"""Per-client evaluation orders and what they return (issue 32): the interface shared by the
engines' evaluators and the personalised algorithms.

    evaluator ──EvalTask──► client side (where the client's state lives) ──ClientScores──► evaluator

An ``EvalTask`` asks one client to test one model on its own test set:

- ``global_local``: the global model (``weights``) as it is;
- ``personal``: the client's personal model — whatever its algorithm keeps. An algorithm that
  keeps one defines ``personal_model(task: EvalTask) -> nn.Module`` (built from ``task.weights``
  and ``task.state``, the client's entry in the engine's ClientStates, on ``task.test``'s device;
  it may be another architecture than the global model, e.g. FedRoD's body + two heads). An
  algorithm without one is scored with the global model (its personal model *is* the global one);
- ``finetune``: the global model fine-tuned on the client's training data (``task.data``) with
  ``task.schedule`` (``epochs`` = E) on ``task.objective``, then tested; nothing is stored.

The client answers with ``ClientScores``: per-class tallies of its test predictions, from which the
evaluator computes every per-client number (fedlt.metrics.per_client_summary). Evaluating changes
no state: the task's tensors are the client's own copies, and a fine-tune draws from a random
stream of its own (never the training round's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fedlt import wire
from fedlt.algorithms.base import ClientData, LocalSchedule
from fedlt.context import RoundContext

State = dict[str, torch.Tensor]
EvalMode = Literal["global_local", "personal", "finetune"]
EVAL_MODES: tuple[str, ...] = ("global_local", "personal", "finetune")


@dataclass(frozen=True)
class EvalTask:
    """One client's evaluation order for the round just trained (``context``).

    ``weights``: the global model's weights (the whole model; split learning: client and server
    parts joined); ``state``: the client's persistent state from the store (``{}`` if none), read
    only; ``data``: its training data (``finetune``); ``test``: its test set. ``data`` and ``test``
    do not travel: a node or worker holds its own.
    """

    cid: int
    context: RoundContext
    weights: State
    state: dict[str, Any]
    mode: str
    data: ClientData | None = None
    test: ClientData | None = None
    schedule: LocalSchedule | None = None  # finetune: the local schedule (epochs = E)
    objective: str = "ce"  # finetune: the local objective

    @property
    def round_index(self) -> int:
        return self.context.round_index


@dataclass
class ClientScores:
    """A client's answer: per-class (C,) int64 counts of correct and of all test predictions, and
    the summed cross-entropy of its test samples."""

    cid: int
    correct: torch.Tensor
    total: torch.Tensor
    loss_sum: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)


for _cls in (EvalTask, ClientScores):
    wire.register(_cls)

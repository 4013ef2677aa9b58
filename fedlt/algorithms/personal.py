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

import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from fedlt import wire
from fedlt.algorithms.base import ClientData, LocalSchedule
from fedlt.algorithms.fedavg_family import ClientUpdate
from fedlt.algorithms.protocol import ClientTask
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


# -- fine-tuning (SPEC §7): fedavg_ft's and FedBABU's personal model, the evaluators' finetune mode --
def stream_seed(sampling_seed: int, round_index: int, cid: int, purpose: str) -> int:
    """The seed of client ``cid``'s stream for ``purpose`` in round ``round_index``: (seed, round,
    cid, purpose) mixed by numpy's SeedSequence, so it shares nothing with the training round's."""
    words = np.random.SeedSequence([sampling_seed, round_index, cid, zlib.crc32(purpose.encode())]).generate_state(2)
    return (int(words[0]) << 31) ^ int(words[1])


@dataclass(frozen=True)
class FinetuneUpdate(ClientUpdate):
    """The FedAvg family's local loop with its minibatches drawn from the (seed, round, cid,
    "finetune") stream instead of the round's."""

    def generator(self, task: ClientTask) -> torch.Generator:
        return torch.Generator().manual_seed(
            stream_seed(task.context.sampling_seed, task.round_index, task.cid, "finetune") % (2**63))


def finetune(model: nn.Module, task: EvalTask, update: ClientUpdate | None = None) -> nn.Module:
    """``model`` (holding the weights to start from) trained in place on ``task.data`` with
    ``task.schedule`` on ``task.objective`` — the run's local loop (``update``: the FedAvg family's
    by default; its optimiser, clipping, augmentation, precision) — and returned (in training
    mode: the caller sets eval). Its minibatches
    and torch's global generators draw from the client's ("finetune") stream; the caller's streams
    are restored after, and nothing is stored."""
    if task.data is None or task.schedule is None:
        raise ValueError(f"finetune of client {task.cid} needs its training data and a schedule")
    work = ClientTask(task.cid, task.context, {k: v.detach().clone() for k, v in model.state_dict().items()},
                      task.data, {}, task.schedule, task.objective)
    device = task.data.x.device if isinstance(task.data.x, torch.Tensor) else torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(stream_seed(task.context.sampling_seed, task.round_index, task.cid, "finetune-rng"))
        (update or FinetuneUpdate())(work, model)
    return model

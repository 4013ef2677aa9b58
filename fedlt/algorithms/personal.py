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

import copy
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedlt import wire
from fedlt.algorithms.base import ClientData, LocalSchedule, LossExpression, upcast
from fedlt.algorithms.fedavg_family import ClientUpdate
from fedlt.algorithms.protocol import CLIENT_CALLS, ClientTask
from fedlt.context import RoundContext
from fedlt.errors import FedltError
from fedlt.metrics import forward_rows
from fedlt.models import eval_mode
from fedlt.spec import SpecModel

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
    eval_batch: int = 2048  # test samples per no-grad forward
    new_client: bool = False  # a client held out of training (new_clients): it never had a state

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


# -- the modes, as a run configures them (``client_eval``) ----------------------------------------
class EvalModeSpec(SpecModel):
    """A per-client evaluation mode; its parameters are the model's fields, validated at the config
    boundary. ``name``: the mode's name in an EvalTask (the prefix of its row fields)."""

    name: ClassVar[str] = "mode"


class GlobalLocal(EvalModeSpec):
    """The global model on each client's test set."""

    name: ClassVar[str] = "global_local"


class Personal(EvalModeSpec):
    """Each client's personal model (``algorithm.personal_model(task)``; the global model for an
    algorithm that keeps none) on its test set."""

    name: ClassVar[str] = "personal"


class Finetune(EvalModeSpec):
    """The global model fine-tuned ``epochs`` local epochs on the client's training data with the
    run's local optimiser settings and ``loss`` (a fresh objective), then tested; nothing is kept."""

    name: ClassVar[str] = "finetune"
    epochs: int = Field(1, ge=1, le=1000, description="local epochs of fine-tuning")
    loss: LossExpression = Field("ce", description="the fine-tuning objective, a loss expression (SPEC §2)")


MODES: dict[str, type[EvalModeSpec]] = {m.name: m for m in (GlobalLocal, Personal, Finetune)}  # EVAL_MODES' order


def eval_mode_of(spec: dict[str, Any]) -> EvalModeSpec:
    """The mode a ``{"name": ..., **params}`` spec names, validated; a FedltError naming the
    valid modes or the bad parameter otherwise."""
    params = dict(spec)
    name = params.pop("name", None)
    if name not in MODES:
        raise FedltError(f"unknown per-client evaluation mode {name!r} (valid: {', '.join(MODES)})")
    try:
        return MODES[name](**params)
    except Exception as exc:  # pydantic's ValidationError: its first error, one line
        errors = getattr(exc, "errors", None)
        detail = errors()[0] if callable(errors) else None
        where = ".".join(str(p) for p in detail["loc"]) if detail and detail.get("loc") else ""
        text = detail["msg"].removeprefix("Value error, ") if detail else str(exc).splitlines()[0]
        raise FedltError(f"{name}: {where + ': ' if where else ''}{text}") from None


# -- the client side: one client's scores --------------------------------------------------------
def _global(algorithm: Any, task: EvalTask) -> Callable[[torch.Tensor], torch.Tensor]:
    module = algorithm.global_model()  # its structure only: the task's weights are passed in, never loaded
    return lambda x: functional_call(module, task.weights, (x,))


def _personal(algorithm: Any, task: EvalTask) -> Callable[[torch.Tensor], torch.Tensor] | nn.Module:
    build = getattr(algorithm, "personal_model", None)
    return _global(algorithm, task) if build is None else build(task)


def _finetuned(algorithm: Any, task: EvalTask) -> nn.Module:
    """A copy of the global model (split learning: the joined model; a head family: with its head)
    holding the task's weights, fine-tuned by :func:`finetune` (the client's "finetune" stream)."""
    if task.data is None or task.schedule is None:
        raise FedltError(f"client {task.cid}: a finetune evaluation needs the client's training data and schedule")
    model = copy.deepcopy(algorithm.global_model())
    model.load_state_dict(task.weights)
    return finetune(model, task)


MODEL_OF: dict[str, Callable[[Any, EvalTask], Any]] = {"global_local": _global, "personal": _personal,
                                                         "finetune": _finetuned}


@torch.no_grad()
def score(model: Callable[[torch.Tensor], torch.Tensor], test: ClientData, num_classes: int, cid: int,
          batch: int) -> ClientScores:
    """Per-class correct and total counts and the summed cross-entropy of ``model`` on ``test``,
    in no-grad batches of ``batch`` on the test data's device, with one host synchronisation."""
    device = test.y.device
    correct = torch.zeros(num_classes, dtype=torch.int64, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for idx in torch.arange(len(test), device=test.index_device).split(forward_rows(batch, device)):
        x, y = test.take(idx)
        logits = upcast(model(x.to(device)))
        hit = logits.argmax(1) == y
        correct += torch.bincount(y[hit], minlength=num_classes)
        loss += F.cross_entropy(logits.double(), y, reduction="sum")
    total = torch.bincount(test.y, minlength=num_classes)
    packed = torch.cat([correct.double(), total.double(), loss.view(1)]).cpu()  # exact: counts < 2**53
    counts = packed[:-1].to(torch.int64)
    return ClientScores(cid, counts[:num_classes], counts[num_classes:], float(packed[-1]))


@torch.no_grad()
def score_clients(model: Callable[[torch.Tensor], torch.Tensor], rows: ClientData, positions: list[torch.Tensor],
                  cids: list[int], num_classes: int, batch: int) -> list[ClientScores]:
    """:func:`score` of one model for many clients whose test sets are rows of one set: client
    ``cids[k]`` tests on ``rows``' rows ``positions[k]``. One no-grad pass over ``rows`` (each
    row once, however many clients share it), then every client's counts and summed
    cross-entropy gathered at once, with one host synchronisation."""
    device = rows.y.device
    hits, losses = [], []
    for idx in torch.arange(len(rows), device=rows.index_device).split(forward_rows(batch, device)):
        x, y = rows.take(idx)
        logits = upcast(model(x.to(device)))
        hits.append(logits.argmax(1) == y)
        losses.append(F.cross_entropy(logits.double(), y, reduction="none"))
    hit = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool, device=device)
    loss = torch.cat(losses) if losses else torch.zeros(0, dtype=torch.float64, device=device)
    at = torch.cat(positions).to(device) if positions else torch.zeros(0, dtype=torch.long, device=device)
    owner = torch.repeat_interleave(torch.arange(len(positions), device=device),
                                    torch.tensor([len(p) for p in positions], device=device))
    cells, size = owner * num_classes + rows.y[at], len(positions) * num_classes
    correct = torch.bincount(cells[hit[at]], minlength=size)
    total = torch.bincount(cells, minlength=size)
    summed = torch.zeros(len(positions), dtype=torch.float64, device=device).index_add_(0, owner, loss[at])
    packed = torch.cat([correct.double(), total.double(), summed]).cpu()  # exact: counts < 2**53
    counts = packed[:2 * size].to(torch.int64).view(2, len(positions), num_classes)
    return [ClientScores(cid, counts[0, k], counts[1, k], float(packed[2 * size + k])) for k, cid in enumerate(cids)]


def evaluate_client(algorithm: Any, task: EvalTask) -> ClientScores:
    """Client ``task.cid``'s scores for ``task.mode`` on its own test set (``task.test``):
    ``global_local`` (the global weights), ``personal`` (``algorithm.personal_model(task)`` if the
    algorithm defines it, else the global weights) or ``finetune`` (see ``_finetuned``). Runs in
    a random stream of its own (never a training round's) and changes no state: the global model
    is only read (its weights are the task's), a fine-tune trains a copy."""
    if task.mode not in MODEL_OF:
        raise FedltError(f"unknown per-client evaluation mode {task.mode!r} (valid: {', '.join(MODEL_OF)})")
    if task.test is None:
        raise FedltError(f"client {task.cid} has no test set here (client_test)")
    seed = stream_seed(task.context.sampling_seed, task.round_index, task.cid, "evaluate")
    devices = [task.test.y.device] if task.test.y.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = MODEL_OF[task.mode](algorithm, task)
        modules = [m for m in (model, algorithm.global_model()) if isinstance(m, nn.Module)]
        with eval_mode(*modules):
            return score(model, task.test, task.context.num_classes, task.cid, task.eval_batch)


CLIENT_CALLS["evaluate"] = evaluate_client  # what every runner's ``evaluate`` runs per task

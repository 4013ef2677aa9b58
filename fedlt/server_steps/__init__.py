"""Server-side steps: what the server computes after aggregation from statistics the clients
upload, producing the classifier the global model is evaluated with (issue 33).

A step is an object with seven calls (:class:`ServerStep`); the algorithm that carries one
(``fedlt.algorithms.recalibrate``) asks every participant for ``collect(...)`` — on the received
weights during its round (``fresh = False``: CReFF's gradients) or in a second call on the
aggregated weights (``fresh = True``: CCVR's feature statistics) — or, for a step whose optional
``after_training`` is true, on the weights the participant has just trained (FedNH's prototypes)
— and hands the uploads to ``apply``, which returns the re-calibrated classifier (``{"weight",
"bias"}`` of the model's classifier; ``weight`` is a head's class vectors, ``head.weight``). By
default the training model keeps its aggregated classifier and the re-calibrated one is only
evaluated (as CReFF's and FL-bench's CCVR code do); a step whose optional ``moves_model`` is true
writes its classifier into the model, which trains on with it (FedNH's semantic infusion).
Built-ins: ``ccvr``, ``creff``, ``fednh``, ``fednpc``; a plugin adds one under the entry-point group
``fedlt.server_steps``, and ``fedlt.testing.check_server_step`` is its contract.

The numerical pieces are module functions, each held to its authors' code by a golden fixture
(tests/golden/): ``pooled_class_stats`` and ``sample_virtual`` (CCVR), ``match_distance`` and
``update_features`` (CReFF), ``class_prototypes`` and ``semantic_infusion`` (FedNH),
``retrain_classifier`` (CCVR, CReFF).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

import fedlt.models
from fedlt import bounds
from fedlt.registry import Registry

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]
Head = dict[str, torch.Tensor]  # a linear classifier's {"weight": C×d, "bias": C}
STEP_METHODS = ("setup", "due", "payload", "collect", "apply", "state_dict", "load_state_dict")


def _step_check(obj: Any) -> str | None:
    missing = [m for m in STEP_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        return f"{type(obj).__name__} lacks {', '.join(missing)} (see fedlt.server_steps.ServerStep)"
    for flag, default in (("fresh", None), ("after_training", False), ("moves_model", False)):
        if not isinstance(getattr(obj, flag, default), bool):
            return f"{type(obj).__name__}.{flag} is not a bool"
    return None


def after_training(step: Any) -> bool:
    """Whether ``step`` collects on the participant's locally trained weights (``fresh`` False)."""
    return not step.fresh and getattr(step, "after_training", False)


def moves_model(step: Any) -> bool:
    """Whether ``step``'s classifier is written into the training model."""
    return getattr(step, "moves_model", False)


REGISTRY: Registry = Registry("server_step", group="fedlt.server_steps", product=_step_check)
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list


class ServerStep(Protocol):
    """The calls an algorithm makes, in this order: ``setup`` once with the initial model's
    classifier; per round ``due`` (does the step run this round?), ``payload`` (what every
    participant receives for ``collect``), ``collect`` on each participant (its uploaded
    statistics; ``fresh`` says on which weights), ``apply`` on the server (the re-calibrated
    classifier); ``state_dict`` / ``load_state_dict`` what it keeps between rounds (checkpointed)."""

    fresh: bool  # True: statistics of the aggregated model (a second call); False: of the received one
    # optional, False when absent: with fresh False, statistics of the locally trained model (end of
    # local training) instead of the received one
    after_training: bool
    # optional, False when absent: apply's classifier replaces the model's (training goes on with it)
    # instead of only the evaluated model's
    moves_model: bool
    # optional, empty when absent: what the step needs of the classifier it reads and writes
    # (fedlt.models.heads.CAPABILITIES), checked against the run's classifier before the run
    requires: frozenset[str]

    def setup(self, head: nn.Module, generator: torch.Generator | None = None) -> None: ...
    def due(self, round_index: int, rounds: int) -> bool: ...
    def payload(self) -> dict[str, Any]: ...
    def collect(self, model: nn.Module, batches: Batches, payload: dict[str, Any], num_classes: int,
                generator: torch.Generator | None = None) -> dict[str, Any]: ...
    def apply(self, head: nn.Module, uploads: Sequence[dict[str, Any]],
              generator: torch.Generator | None = None) -> Head: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def head_state(head: nn.Module) -> Head:
    """A detached copy of a linear classifier's weight and bias (a zero bias when it has none)."""
    bias = head.bias if head.bias is not None else head.weight.new_zeros(head.weight.shape[0])
    return {"weight": head.weight.detach().clone(), "bias": bias.detach().clone()}


@contextmanager
def classifier_inputs(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, each forward through ``head`` appends its input (flattened to B×d) to
    the yielded list: a model's features for whatever runs it (``model(x)``, ``functional_call``)."""
    seen: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda module, args: seen.append(args[0].flatten(1)))
    try:
        yield seen
    finally:
        handle.remove()


@torch.no_grad()
def features(model: nn.Module, batches: Batches) -> tuple[torch.Tensor, torch.Tensor]:
    """(the classifier's inputs, labels) over ``batches``, the model in eval mode (BatchNorm's
    running statistics, as both authors' codes extract features)."""
    head = fedlt.models.classifier(model)
    xs, ys = [], []
    with fedlt.models.eval_mode(model), classifier_inputs(head) as seen:
        for x, y in batches:
            model(x)
            xs.append(seen.pop()), ys.append(y)
    if not xs:
        return head.weight.new_zeros(0, head.weight.shape[1]), torch.zeros(0, dtype=torch.long, device=head.weight.device)
    return torch.cat(xs), torch.cat(ys)


def retrain_classifier(init: Head, x: torch.Tensor, y: torch.Tensor, *, epochs: int, batch_size: int, lr: float,
                       generator: torch.Generator | None = None,
                       orders: Iterable[torch.Tensor] | None = None) -> Head:
    """Plain SGD (no momentum, no weight decay) on CE(x·Wᵀ + b, y) from ``init``, ``epochs``
    passes of minibatches of ``batch_size`` over a fresh permutation each (``orders`` gives them
    explicitly), in ``x``'s dtype. The re-training of CCVR, CReFF and FedNPC."""
    w = init["weight"].detach().clone().to(x.dtype).requires_grad_(True)
    b = init["bias"].detach().clone().to(x.dtype).requires_grad_(True)
    optimiser = torch.optim.SGD([w, b], lr=lr)
    orders = iter(orders) if orders is not None else None
    for _ in range(epochs):
        perm = next(orders) if orders is not None else torch.randperm(len(y), generator=generator)
        for idx in perm.split(batch_size):
            loss = F.cross_entropy(F.linear(x[idx], w, b), y[idx])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return {"weight": w.detach(), "bias": b.detach()}


def _positive_int(step: str, name: str, value: Any, high: int = bounds.MAX_STEPS) -> int:
    """An integer in [1, ``high``]: epochs and steps bounded by MAX_STEPS, samples by MAX_SAMPLES."""
    return bounds.integer(step, name, value, 1, high)


def _positive(step: str, name: str, value: Any) -> float:
    return bounds.finite(step, name, value, low=0, low_open=True)


def requires(step: Any) -> frozenset[str]:
    """What ``step`` (a registered step's class or an instance) needs of the classifier it reads,
    from fedlt.models.heads.CAPABILITIES (``requires``; nothing when it declares nothing)."""
    return frozenset(getattr(step, "requires", ()))


from fedlt.server_steps import ccvr, creff, fednh, fednpc  # noqa: E402,F401  (register the built-in steps)

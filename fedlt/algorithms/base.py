"""What every algorithm receives: the run context (and each round's), a client's data, and the local schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import torch
from pydantic import AfterValidator
from torch import nn

import fedlt.aggregators
import fedlt.losses
from fedlt.context import ModelSpec, RoundContext
from fedlt.datasets.source import Images, images, to_device
from fedlt.errors import FedltError
from fedlt.registry import Registry, create_from_spec
from fedlt.spec import parse_spec


def _valid_loss(expr: str) -> str:
    try:
        fedlt.losses.validate(expr)
    except FedltError as exc:  # a ValueError lets pydantic name the field that holds it
        raise ValueError(str(exc)) from None
    return expr


def as_spec(spec: str | dict[str, Any]) -> dict[str, Any]:
    """A component spec as ``{"name": ..., **params}``: a dict, a bare name, or a spec string
    such as ``grouped(size=2)`` (parsed, never evaluated: fedlt.spec)."""
    if isinstance(spec, str):
        return parse_spec(spec) if "(" in spec else {"name": spec}
    return dict(spec)


def from_spec(registry: Registry, spec: str | dict[str, Any]) -> Any:
    """A fresh component (with empty state) from a name or a ``{"name": ..., **params}`` spec."""
    spec = as_spec(spec)
    return registry.create(spec.pop("name"), **spec)


def spec_of(registry: Registry, what: str) -> Any:
    """The type of an algorithm field holding a spec of ``registry``'s kind, checked (created
    once) when the algorithm's parameters are validated, at the config boundary."""

    def check(spec: str | dict[str, Any]) -> str | dict[str, Any]:
        create_from_spec(registry, as_spec(spec), what)
        return spec

    return Annotated[str | dict[str, Any], AfterValidator(check)]


def build_aggregator(spec: str | dict[str, Any]):
    """A fresh aggregator (with empty state) from a name or a ``{"name": ..., **params}`` spec."""
    return from_spec(fedlt.aggregators.REGISTRY, spec)


# Algorithm fields checked when the algorithm's parameters are validated (at the config boundary).
LossExpression = Annotated[str, AfterValidator(_valid_loss)]
AggregatorSpec = spec_of(fedlt.aggregators.REGISTRY, "aggregator")


@dataclass(frozen=True)
class ClientData:
    """One client's local training set and its class counts over all of it. ``x`` is an
    in-memory tensor or an image source decoded on demand (fedlt.datasets.source); client work
    reads it through ``batches`` and ``take`` only, so it never asks which."""

    cid: int
    x: Images
    y: torch.Tensor
    class_counts: torch.Tensor  # (C,) int64, over the WHOLE local set (SPEC §2's n)

    def __len__(self) -> int:
        return len(self.y)

    @property
    def index_device(self) -> torch.device:
        """Where minibatch indices are used: the device of in-memory images (sliced there), the
        host for images decoded from files."""
        return self.x.device if isinstance(self.x, torch.Tensor) else torch.device("cpu")

    def batches(self, index_batches: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(x[idx], y[idx])`` for each ``idx`` of ``index_batches``, in order (from files: decoded
        ahead by the loader workers, if any)."""
        return images(self.x).batches(self.y, index_batches)

    def take(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x[idx], y[idx])``: one minibatch, at once."""
        return images(self.x).take(idx), self.y[idx]


@dataclass(frozen=True)
class LocalSchedule:
    """Local training budget and optimiser of one client in one round.

    Iteration-based (SCALA): ``iters`` steps of ``batch`` samples drawn without replacement from a
    fresh permutation of the client's data, reshuffled when exhausted. Epoch-based (FedAvg
    family papers): ``epochs`` passes over a fresh permutation each, last batch possibly smaller,
    or left out with ``drop_last`` (PyTorch's ``DataLoader(drop_last=True)``; a client smaller than
    one batch keeps its one batch, so every participant takes at least one step).
    """

    batch: int
    iters: int | None = None
    epochs: int | None = None
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    clip: float | None = 10.0
    augment: tuple[dict[str, Any], ...] = ()  # training-time augmentation specs (fedlt.augment), applied per batch
    precision: str = "fp32"  # "bf16": the forward under autocast (docs/gpu.md)
    drop_last: bool = False  # epochs: leave out each epoch's last partial batch (config drop_last)
    compile: str | None = None  # the step forward's torch.compile backend (fedlt.algorithms.compiled); None: eager
    graphs: str | None = None  # whole-step graphs' backend (fedlt.algorithms.graphs: "cuda", "recorded"); None: eager

    def batches(self, n: int, generator: torch.Generator, device: torch.device | None = None) -> Iterator[torch.Tensor]:
        """The index batches, drawn on the host from ``generator`` (the same on every device);
        with ``device``, each permutation crosses to it once (pinned, asynchronous on CUDA), so
        a step slices device-resident data with a device index and copies nothing."""
        if self.epochs is not None:
            for _ in range(self.epochs):
                perm = to_device(torch.randperm(n, generator=generator), device)
                full = n - n % self.batch if self.drop_last and n >= self.batch else n
                yield from perm[:full].split(self.batch)
            return
        batch = min(self.batch, n)
        perm, pos = to_device(torch.randperm(n, generator=generator), device), 0
        for _ in range(self.iters or 0):
            if pos + batch > n:
                perm, pos = to_device(torch.randperm(n, generator=generator), device), 0
            yield perm[pos : pos + batch]
            pos += batch

    def optimiser(self, params) -> torch.optim.SGD:
        """SGD with this schedule's settings; torch's fused kernel where every parameter allows it
        (one pass over weights, gradients and momentum instead of four: the step was 12 % of the
        PFLlib task's CPU round, docs/benchmarks.md). It rounds like the per-tensor path up to an
        ulp (fused multiply-adds)."""
        params = list(params)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                               fused=fusable(params) or None)

    def clip_(self, params) -> None:
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.clip)


FUSED_SGD_DEVICES = ("cpu", "cuda")
FUSED_SGD_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fusable(params: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused SGD takes these parameters: dense floating-point tensors on the CPU or CUDA."""
    return bool(params) and all(p.device.type in FUSED_SGD_DEVICES and p.dtype in FUSED_SGD_DTYPES
                                and not p.is_sparse for p in params)


def forward_precision(precision: str, device: torch.device) -> AbstractContextManager:
    """The context of a model's forward: bf16 autocast on ``device`` for ``precision="bf16"``
    (matmuls and convolutions in bfloat16, the weights and their gradients stay float32), nothing
    for ``"fp32"`` (the float32 path is untouched, bit for bit)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """A half-precision tensor (bf16 logits out of autocast) as float32; any other as it is (a
    float64 model keeps its float64 logits)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def backward_precision(device: torch.device) -> AbstractContextManager:
    """Autocast off for a backward pass run inside :func:`forward_precision` (autocast is meant
    for the forward and the loss: the backward follows the forward's dtypes by itself)."""
    if device.type not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(device.type):
        return nullcontext()
    return torch.autocast(device.type, enabled=False)


AUTOCAST_DEVICES = ("cpu", "cuda", "mps", "xpu")


def channels_last(model: nn.Module, device: torch.device) -> bool:
    """Whether a model's convolutions should run channels-last: a convolutional model on CUDA
    (cuDNN's fast layout for bf16/TF32 convolutions); never on the CPU, where it was not measured."""
    return device.type == "cuda" and any(isinstance(m, nn.Conv2d) for m in model.modules())


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device``, channels-last where :func:`channels_last` says so."""
    model = model.to(device)
    return model.to(memory_format=torch.channels_last) if channels_last(model, device) else model


def proportional_batches(sizes: list[int], server_batch: int) -> list[int]:
    """SCALA's B_k = max(⌊|D_k|·B / Σ_j |D_j|⌋, 1) over the participants (SPEC §3)."""
    total = sum(sizes)
    return [max(n * server_batch // total, 1) for n in sizes]


def client_generator(sampling_seed: int, round_index: int, cid: int) -> torch.Generator:
    """The minibatch-order stream of one client in one round, derived (not carried) so a resumed
    run, or a client running elsewhere (Flower), draws exactly the same batches."""
    mixed = ((sampling_seed * 1_000_003 + round_index) * 1_000_003 + cid) % (2**63)
    return torch.Generator().manual_seed(mixed)


@dataclass
class RunContext:
    """What an algorithm needs from the run; built by the engine from the RunConfig."""

    num_classes: int
    input_shape: tuple[int, int, int]  # (C, H, W) of one sample
    build_model: Callable[[], nn.Module]  # a fresh, seeded model for this dataset
    split: str | None
    server_batch: int
    local_iters: int
    local_epochs: int | None
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    clip: float | None
    sampling_seed: int
    device: torch.device
    model: ModelSpec | None = None  # the same model as build_model, as a picklable description
    global_counts: torch.Tensor | None = None  # (C,) training samples per class over all clients (FedIR)
    fused: str = "off"  # the loss objects' fused setting (issue 14)
    num_clients: int | None = None  # K, all clients (SCAFFOLD's and FedDyn's 1/K); None: the round's participants
    rounds: int = 1  # the run's total number of rounds
    augment: tuple[dict[str, Any], ...] = ()  # augmentation specs, normalize() statistics filled in (fedlt.augment.fit)
    precision: str = "fp32"  # "fp32" or "bf16" (docs/gpu.md)
    cohort: int = 1  # FedAvg family: participants trained together in one vmapped step (fedlt.algorithms.cohort)
    drop_last: bool = False  # epoch-based training: each epoch's last partial batch left out (issue 41)
    compile: str | None = None  # --compile: the steps' torch.compile backend (fedlt.algorithms.compiled); None: eager
    graphs: str | None = None  # --graphs: whole-step graphs' backend (fedlt.algorithms.graphs); None: eager
    # training images only the server holds, taken out before partitioning (an algorithm's
    # server_data_per_class: FEDIC's proxy set); None when the algorithm asks for none. A process
    # that rebuilds the run for client work (a Flower node) holds it too — it needs the hold-out
    # to cut the same partition from what is left — but only the server's strategy reads it
    server_data: ClientData | None = None

    def round(self, round_index: int, participants: Sequence[ClientData],
              classifier_weight: torch.Tensor | None = None) -> RoundContext:
        """The context of round ``round_index`` with these participants (the engine calls this)."""
        counts = (torch.stack([c.class_counts for c in participants]) if participants
                  else torch.zeros(0, self.num_classes, dtype=torch.int64))
        global_counts = self.global_counts if self.global_counts is not None else counts.sum(0)
        return RoundContext(round_index=round_index, rounds=self.rounds,
                            num_clients=self.num_clients or len(participants),
                            participants=tuple(c.cid for c in participants), num_classes=self.num_classes,
                            global_counts=global_counts, participant_counts=counts,
                            classifier_weight=classifier_weight, sampling_seed=self.sampling_seed,
                            fused=self.fused, model=self.model)

    def schedule(self, batch: int) -> LocalSchedule:
        """Client k's schedule: B_k samples per step, or ``batch_size`` when training by epochs."""
        return LocalSchedule(batch if self.local_epochs is None else self.batch_size, iters=self.local_iters,
                             epochs=self.local_epochs, lr=self.lr, momentum=self.momentum,
                             weight_decay=self.weight_decay, clip=self.clip, augment=self.augment,
                             precision=self.precision, drop_last=self.drop_last, compile=self.compile,
                             graphs=self.graphs)


class Algorithm(Protocol):
    """The engine drives an algorithm through these calls only.

    Each round the engine builds the round's context and hands it, the participants' data, its
    store of the clients' persistent states (fedlt.algorithms.protocol.ClientStates: read a
    participant's state, put the new one back) and its ``runner`` (how client work runs on this
    engine) to ``train_round``, which returns the round's metrics (at least ``train_loss``).
    Client work is declared by defining ``client_work(task)`` (one call per round: the runner's
    ``call``) and/or ``open_session(task)`` (split learning: the runner's ``exchange``); see
    fedlt.algorithms.protocol. ``state_dict`` is the server side's state.
    """

    def setup(self, ctx: RunContext) -> None: ...
    def train_round(self, round: RoundContext, clients: list[ClientData], states: Any,
                    runner: Any) -> dict[str, float]: ...
    def global_model(self) -> nn.Module: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NonFiniteLoss(FedltError):
    """A NaN or inf loss: the run stops and names where it happened."""


class PendingLoss:
    """A client's round loss not yet read back from the device: ``values`` (0-d tensors, e.g. the
    all-finite flag and the mean of its table of per-step losses) and ``read``, which turns their
    numbers into the loss, raising NonFiniteLoss for a non-finite one. Inside
    :func:`deferred_losses` a client's loop hands this on instead of reading the numbers itself, so
    the runner reads every client's in one host synchronisation after the round's last client:
    one client at a time on a GPU, the host sets the next client up while the device still trains
    the one before, instead of waiting for it at each client's end (the H200's profile, docs/gpu.md)."""

    def __init__(self, values: Sequence[torch.Tensor], read: Callable[[list[float]], float]) -> None:
        self.values, self.read = list(values), read

    def __float__(self) -> float:
        """The loss read at once (one host synchronisation), as if at its client's end: for client
        code that needs the number before its runner reads the round's (NonFiniteLoss as there)."""
        return self.read(read_back(self.values))

    def joined(self, other: PendingLoss | float, combine: Callable[[float, float], float]) -> PendingLoss:
        """``combine(self's loss, other's)``, still pending; ``self``'s error is raised first."""
        if not isinstance(other, PendingLoss):
            return PendingLoss(self.values, lambda v: combine(self.read(v), other))
        n = len(self.values)
        return PendingLoss(self.values + other.values, lambda v: combine(self.read(v[:n]), other.read(v[n:])))


_DEFERRED: ContextVar[list[PendingLoss] | None] = ContextVar("fedlt_deferred_losses", default=None)


@contextmanager
def deferred_losses(defer: bool = True) -> Iterator[list[PendingLoss]]:
    """A block in which :func:`loss_of` defers (``defer``; else one in which it reads at once,
    whatever an enclosing block does): the list of every PendingLoss it made (a runner clears it
    per client, to read one client's checks should its work raise)."""
    made: list[PendingLoss] = []
    token = _DEFERRED.set(made if defer else None)
    try:
        yield made
    finally:
        _DEFERRED.reset(token)


def loss_of(values: Sequence[torch.Tensor], read: Callable[[list[float]], float]) -> PendingLoss | float:
    """``read`` of ``values``' numbers: at once (one host synchronisation), or, inside
    :func:`deferred_losses`, a PendingLoss its runner reads with every other client's."""
    made = _DEFERRED.get()
    if made is None:
        return read(read_back(values))
    made.append(pending := PendingLoss(values, read))
    return pending


def read_back(values: Sequence[torch.Tensor]) -> list[float]:
    """0-d tensors' numbers as float64, in one synchronisation per device they are on."""
    out: list[float | None] = [None] * len(values)
    for device in {v.device for v in values}:
        at = [i for i, v in enumerate(values) if v.device == device]
        for i, number in zip(at, torch.stack([values[i].double() for i in at]).cpu().tolist()):
            out[i] = number
    return out  # type: ignore[return-value]


def raise_first_non_finite(per_step: torch.Tensor, where: str, step_name: str = "local step") -> None:
    """One check (one host synchronisation) for a whole round's per-step losses; names the first
    bad step (1-based), as a per-step check would have."""
    finite = torch.isfinite(per_step)
    if not bool(finite.all()):
        step = int((~finite).nonzero()[0, 0])
        raise NonFiniteLoss(f"non-finite loss ({per_step[step].item()}) at {step_name} {step + 1}, {where}")


def objective_seed(sampling_seed: int, cid: int) -> int:
    """The seed of client ``cid``'s loss terms (SGB's gating); -1 is the server side's."""
    return sampling_seed * 100_003 + cid


def build_objective(expr: Any, context: RoundContext, cid: int, class_counts: torch.Tensor,
                    global_params: Sequence[torch.Tensor], state: dict[str, Any] | None = None):
    """The one way every side builds a local objective for a round (SPEC §2): ``expr`` with the
    round's context, the owner's class counts (a client's, or the batch the server sees), the
    weights its weight-space terms anchor at, its terms' seed (``cid``; -1 for the server side),
    and its persistent loss state restored."""
    objective = fedlt.losses.build(expr, context=context, class_counts=class_counts, global_params=list(global_params),
                                   seed=objective_seed(context.sampling_seed, cid))
    if state:
        objective.load_state_dict(state)
    return objective

"""The device contract, checked on a machine without a GPU: a round keeps its tensors on the run's
device, and a client's step loop never waits on the host.

How a CPU stands in for a device. Every tensor the run puts on ``config.device`` becomes an
:class:`OnDevice` tensor: a wrapper (``torch.Tensor._make_wrapper_subclass``) that holds an
ordinary CPU tensor and *reports* the ``meta`` device — a device that is not the host, needs no
driver, and which no real data lives on. :class:`DeviceAudit`, a ``TorchDispatchMode``, sees every
aten operation of the round (forward, autograd's backward, the optimiser, the loss terms,
aggregation) after PyTorch's own decompositions, and

- runs it on the CPU tensors inside, re-wrapping the outputs of an operation that had an
  on-device input or was asked for ``device=meta`` (``torch.zeros(n, device=x.device)``,
  ``t.to(device)``): placement propagates exactly as it would on a GPU;
- records a **mixed-device** operation: an on-device tensor and a host tensor with at least one
  dimension in one call (a 0-dimensional host tensor is a scalar, which CUDA accepts too). CUDA
  refuses most of these outright; the rest (indexing a device tensor with a host index) copy
  host→device on every call — both are what a stray CPU tensor looks like;
- records a **host-to-device copy** of a host tensor that does not go through
  ``fedlt.datasets.source.to_device`` (pinned, non-blocking on CUDA): a pageable copy, such as
  ``torch.tensor(list, device=...)``, waits for the device;
- records a **host synchronisation**: ``aten._local_scalar_dense`` (``.item()``, ``float(t)``,
  ``bool(t)``, ``int(t)``: the host reads a device value, so it waits for the device) and a copy
  of an on-device tensor to the host (``.cpu()``, ``.numpy()`` via it, ``.tolist()``).

Why this is sound for what it checks: placement and synchronisation are properties of which
operations run with which arguments, not of the values, and the mode sees every operation —
including the ones a Python-level patch of ``Tensor.item`` would miss (``bool(t)`` and
``float(t)`` reach ``_local_scalar_dense`` without calling ``item``). What it cannot see: work
done by a library outside PyTorch's dispatcher (numpy on ``.numpy()`` of a host tensor is host
work and is fine), and CUDA-only kernels (Triton: the fused path is checked on the device by
``benchmarks/device_check.py``; the audit runs with ``fused="off"``).

"No per-step synchronisation" is checked by counting: the round is run with ``local_iters`` = 2
and = 4; a synchronisation inside a client's step loop would show up twice per client more in
the second. A constant number per client is allowed (the FedAvg family's loss checks make none:
the local runner reads them once a round, fedlt.algorithms.base.deferred_losses), and every
synchronisation is reported with the line that made it.
"""

from __future__ import annotations

import dataclasses
import tempfile
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

import fedlt.algorithms
from fedlt.algorithms.base import ClientData
from fedlt.algorithms.cohort import with_cohort
from fedlt.algorithms.protocol import ClientStates, LocalRunner
from fedlt.config import RunConfig
from fedlt.datasets.source import images
from fedlt.engine import prepare, train_round
from fedlt.testing.algorithms import TINY, split_model_for
from fedlt.testing.base import Contract, registered

PRETEND = torch.device("meta")  # the device the audit pretends the run is on
_SYNC = torch.ops.aten._local_scalar_dense.default


class OnDevice(torch.Tensor):
    """A CPU tensor that reports :data:`PRETEND` as its device (see the module); only the audit's
    mode computes with it."""

    elem: torch.Tensor
    # no conversion of results at the Python level: what an operation returns is decided by the
    # audit's dispatch (a host copy stays a plain host tensor)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "OnDevice":
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=PRETEND, requires_grad=elem.requires_grad)
        t.elem = elem
        return t

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"an on-device tensor reached {func} outside the device audit")


_CLIENT_FRAMES = {("algorithms/protocol.py", "run_client"), ("algorithms/protocol.py", "_run"),
                  ("algorithms/protocol.py", "__init__")}  # client work, as every runner starts it


def _where() -> str:
    """The innermost fedlt source line (not torch's, not this module's) of the current stack,
    prefixed ``client:`` when it runs inside a client's work (``run_client``, a session's call)."""
    stack = traceback.extract_stack()
    client = any((f.filename.replace("\\", "/").rsplit("/fedlt/", 1)[-1], f.name) in _CLIENT_FRAMES for f in stack)
    for frame in reversed(stack):
        name = frame.filename.replace("\\", "/")
        if "/fedlt/" in name and "/fedlt/testing/device.py" not in name:
            return f"{'client: ' if client else ''}{name.rsplit('/fedlt/', 1)[1]}:{frame.lineno} ({frame.line})"
    return "outside fedlt"


def _pinned_upload() -> bool:
    """Whether the copy is ``fedlt.datasets.source.to_device``'s (pinned and non-blocking on CUDA:
    the host does not wait)."""
    return any(f.name == "to_device" and f.filename.replace("\\", "/").endswith("fedlt/datasets/source.py")
               for f in traceback.extract_stack())


def _unwrap(value: Any) -> Any:
    return value.elem if isinstance(value, OnDevice) else value


def _wrap(value: torch.Tensor) -> torch.Tensor:
    return value if isinstance(value, OnDevice) else OnDevice(value)


def _each(fn: Any, value: Any) -> Any:
    """``value`` with ``fn`` applied to each of its tensors: an aten call's arguments or result,
    whose tensors stand alone or sit in lists, tuples and dicts. A hand-written walk, not pytree's
    ``tree_map``: the audit sees every operation of a round, and pytree's registry lookups were
    half of its time; another container (a named tuple) goes through ``tree_map``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    kind = type(value)
    if kind is list or kind is tuple:
        return kind([_each(fn, v) for v in value])
    if kind is dict:
        return {k: _each(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple, dict)):
        return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)
    return value


def _tensors(value: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of ``value`` (as :func:`_each` walks it), appended to ``found`` in order."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif type(value) in (list, tuple):
        for v in value:
            _tensors(v, found)
    elif type(value) is dict:
        for v in value.values():
            _tensors(v, found)
    elif isinstance(value, (list, tuple, dict)):
        found.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return found


class DeviceAudit(TorchDispatchMode):
    """Runs every operation on the CPU while tracking placement (see the module); collects
    ``syncs`` and ``mixed`` as ``Counter`` s of ``"op at file:line"``."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.mixed: Counter[str] = Counter()
        self.uploads: Counter[str] = Counter()  # host→device copies (a pageable one waits for the device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensors = _tensors(kwargs, _tensors(args, []))
        on = [isinstance(a, OnDevice) for a in tensors]
        if any(on) and any(not o and t.dim() > 0 for o, t in zip(on, tensors)):
            self.mixed[f"{func} at {_where()}"] += 1
        device = kwargs.get("device")
        asked = device is not None and torch.device(device) == PRETEND
        if device is not None:
            kwargs["device"] = torch.device("cpu")
        to_host = device is not None and not asked and any(on)
        if asked and any(not o and t.numel() > 0 for o, t in zip(on, tensors)) and not _pinned_upload():
            self.uploads[f"{func} at {_where()}"] += 1
        if func is _SYNC and any(on) or to_host:
            self.syncs[f"{func} at {_where()}"] += 1
        if not any(on):  # host tensors only: nothing to unwrap
            out = func(*args, **kwargs)
            return _each(_wrap, out) if asked else out
        out = func(*_each(_unwrap, args), **_each(_unwrap, kwargs))
        return out if to_host else _each(_wrap, out)


@contextmanager
def on_pretend_device() -> Iterator[DeviceAudit]:
    """A block in which ``PRETEND`` (``meta``) is the run's device, audited."""
    with DeviceAudit() as audit:
        yield audit


def audit_round(config: RunConfig, rounds: int = 2, local_iters: tuple[int, ...] = (2,)) -> list[DeviceAudit]:
    """For each of ``local_iters``: ``rounds`` rounds of ``config``'s algorithm as the engine trains
    them (``train_round``) with the model, the data, the partition's index tensors, the counts and
    the client-state store on the pretend device; the audit of everything they did. The data is
    moved as the engine moves it (one copy, before the first round)."""
    prep = prepare(config.model_copy(update={"fused": "off"}))
    return [_audit(prep, config, rounds, iters) for iters in local_iters]


def _audit(prep: Any, config: RunConfig, rounds: int, local_iters: int) -> DeviceAudit:
    with on_pretend_device() as audit:
        server = prep.ctx.server_data  # the server's held-out images (FEDIC's proxy set), placed as run_context does
        if server is not None:
            server = ClientData(server.cid, images(server.x).to(PRETEND), server.y.to(PRETEND),
                                server.class_counts.to(PRETEND))
        ctx = dataclasses.replace(prep.ctx, device=PRETEND, local_iters=local_iters,
                                  global_counts=prep.ctx.global_counts.to(PRETEND), server_data=server)
        torch.manual_seed(config.seeds.model)
        algorithm = fedlt.algorithms.create(config.algorithm, **config.algorithm_params)
        algorithm.setup(ctx)
        x_train, y_train = images(prep.data.x_train).to(PRETEND), prep.data.y_train.to(PRETEND)
        states = ClientStates()
        for r in range(rounds):
            clients = []
            for cid in range(config.clients)[r::2]:  # two different cohorts, the second seeing states
                idx = torch.as_tensor(prep.partition.client_indices[cid], dtype=torch.long, device=PRETEND)
                clients.append(ClientData(cid, images(x_train).subset(idx), y_train[idx], prep.counts[cid].to(PRETEND)))
            train_round(algorithm, ctx, r, clients, states, with_cohort(LocalRunner(), config.cohort))
    return audit


def _describe(counter: Counter[str]) -> str:
    return "; ".join(f"{n}× {what}" for what, n in counter.most_common(4))


def check_device(algorithm: Any, params: dict[str, Any] | None = None, *, model: str | None = None,
                 **settings: Any) -> None:
    """Check an algorithm (registered name or factory) on the pretend device (see the module):
    [on the device] no operation of two rounds mixes an on-device tensor with a host one;
    [no per-step sync] the host synchronisations of a round do not grow with its local steps
    (``local_iters`` 2 vs 6). ``settings`` override :data:`fedlt.testing.algorithms.TINY`."""
    with registered(fedlt.algorithms.REGISTRY, algorithm, "contract_algorithm") as name, \
            tempfile.TemporaryDirectory(prefix="fedlt-device-") as tmp:
        c = Contract(f"algorithm {name!r}")
        base = dict(TINY, clients=4, participation=1.0, **settings, algorithm=name,
                    algorithm_params=dict(params or {}), out=Path(tmp) / "run")
        base["model"] = model or split_model_for(RunConfig(**base))
        with c.property("on the device"):
            audits = audit_round(RunConfig(**base), local_iters=(2, 4))
        for audit in audits:
            c.check(not audit.mixed, "on the device", f"host tensors met device tensors: {_describe(audit.mixed)}")
        few, many = (client_syncs(a) for a in audits)
        c.check(not many - few, "no per-step sync",
                f"{sum(few.values())} host synchronisations in client work with 2 local steps, "
                f"{sum(many.values())} with 4: {_describe(many - few)}")
        few, many = (client_syncs(a, a.uploads) for a in audits)
        c.check(not many - few, "no per-step upload",
                f"{sum(few.values())} host-to-device copies in client work with 2 local steps, "
                f"{sum(many.values())} with 4: {_describe(many - few)}")


def client_syncs(audit: DeviceAudit, events: Counter[str] | None = None) -> Counter[str]:
    """The synchronisations (or other ``events``) inside client work (a server's own loop is
    reported, not held to this: SCALA's ``server_prior="batch"`` builds its loss from each
    batch's counts on the host)."""
    return Counter({k: n for k, n in (audit.syncs if events is None else events).items() if " at client: " in k})

"""Whole-step graphs (``--graphs``, docs/gpu.md#whole-step-cuda-graphs): a client's local step —
forward, loss, backward, ``correct``, clip and the optimiser's step — captured once per (work
module, batch shape, settings) and replayed, so a step issues one graph instead of ~30 launches
and their Python.

A graph reads the tensors at the addresses it saw at capture and Python numbers as they were at
capture. So each step reads *static* tensors: the minibatch is copied into static ``x``/``y``,
the weights are the work module's own (loaded in place for each client), the optimiser is one
persistent SGD per (work module, parameters, settings) whose momentum buffers are loaded from the
client's, and the per-client objects the step reads (:class:`StepState`: the objective, the
variant's ``local``, the received weights a teacher term reads) are **transferred**: the objects
a graph was captured with stay alive (the group's *canonical* state), and before a client's first
replay every tensor of its own objects is copied into the canonical tensors at the same place of
the same structure (:func:`structure`: dataclass fields and ``__dict__``, lists, tuples, dicts;
tensors are the leaves copied; numbers, strings, dtypes and devices are leaves that must be equal,
or the client needs a graph of its own), and after its last step copied back (a step may move
them: ``end`` and ``state_dict`` read the client's own objects). Anything the walk cannot see
through is a stated fallback.

A client's first step replays too where its objects, as built, already have the structure of a
group's (a plain cross-entropy); where a loss term builds caches in its first call (a per-device
offset table), that first step runs eagerly with the client's own fresh optimiser and the objects
are walked after it. The client's momentum buffers are loaded into the persistent optimiser's (zero
for a client that has not stepped: SGD's first step makes its buffer d_p, as μ·0 + d_p does) and
handed back after its last step. A step that changes Python-level state (an attribute set to a new
tensor, a counter) is refused: its graph would freeze it.

Two backends behind one interface: CUDA (:class:`CudaGraph`, ``torch.cuda.CUDAGraph``, the
whole-network recipe of PyTorch's "CUDA Graphs" notes: warm-up on a side stream, gradients set to
None before capture) and a CPU stand-in with CUDA graphs' semantics (:class:`RecordedGraph`: every
aten operator of the captured step, backward and optimiser included, recorded and replayed on the
recorded tensors, no Python of fedlt run on replay, host synchronisations refused as CUDA's
capture refuses them). The stand-in is for correctness only (fedlt.testing.check_graphs): it says
nothing about speed.
"""

from __future__ import annotations

import copy
import enum
import functools
import types
import logging
import weakref
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

LOG = logging.getLogger("fedlt")
BACKEND = "cuda"  # what a run with --graphs captures with; fedlt.testing.check_graphs uses "recorded"
BACKENDS = ("cuda", "recorded")
MAX_GRAPHS = 32  # per work module: beyond it, a step shape or per-client setting runs eagerly (stated)
WARMUP = 3  # steps before capture, on saved and restored state (PyTorch's whole-network recipe)


@contextmanager
def default_backend(backend: str) -> Iterator[None]:
    """Runs prepared inside the block capture with ``backend`` (the contract's ``"recorded"``)."""
    global BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"graphs backend {backend!r}: one of {', '.join(BACKENDS)}")
    before, BACKEND = BACKEND, backend
    try:
        yield
    finally:
        BACKEND = before


class CaptureRefused(Exception):
    """A step that cannot be captured as a graph; the message is the stated reason."""


# -- what a step does that a graph cannot carry --------------------------------------------------
# operators whose result's shape depends on the data (a host synchronisation under capture)
DATA_DEPENDENT = frozenset({"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                            "repeat_interleave", "_local_scalar_dense", "equal", "is_nonzero", "item"})
# the profiler's markers (an optimiser's step is one record_function): no work, nothing to replay
MARKERS = frozenset({"_record_function_enter", "_record_function_enter_new", "_record_function_exit"})
EMPTY = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


def refusal(func: Any, args: tuple, kwargs: dict, out: Any, device: torch.device,
            host_state: frozenset[int] = frozenset()) -> str | None:
    """Why the operator ``func`` cannot be inside a captured step (None: it can); ``host_state``:
    the storages of the client's host tensors (a device kernel takes a host scalar's value, frozen
    at capture)."""
    name = func.overloadpacket.__name__
    if name in MARKERS:
        return None
    if name in DATA_DEPENDENT:
        return f"the step calls aten.{name}, which reads a device value on the host (a synchronisation)"
    if torch.Tag.nondeterministic_seeded in func.tags:
        return (f"the step draws random numbers (aten.{name}: dropout or an augmentation inside the step); "
                "a replay's draws would not be the eager step's")
    flat_out, _ = tree_flatten(out)
    if any(not isinstance(o, (torch.Tensor, type(None))) for o in flat_out):
        return f"the step reads aten.{name}'s result on the host (a synchronisation)"
    if device.type == "cuda":
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [o for o in flat_out if isinstance(o, torch.Tensor)]
        if any(o.device.type == "cpu" for o in outs) and any(t.device.type == "cuda" for t in tensors):
            return f"the step copies a device tensor to the host (aten.{name})"
        to_device = any(o.device.type == "cuda" for o in outs)
        if any(t.device.type == "cpu" and t.dim() > 0 for t in tensors) and to_device:
            return f"the step copies a host tensor to the device (aten.{name})"
        if to_device and any(t.device.type == "cpu" and t.untyped_storage().data_ptr() in host_state for t in tensors):
            return (f"aten.{name} reads a host scalar of the client's state, whose value a graph would freeze "
                    "(keep it on the device)")
    return None


class _Checking(TorchDispatchMode):
    """Notes the first operator a graph cannot carry (``reason``), letting the step finish: the
    checked step is a real eager step, so a refusal leaves nothing half done."""

    def __init__(self, device: torch.device, host_state: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.device, self.host_state, self.reason = device, host_state, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.reason is None:
            self.reason = refusal(func, args, kwargs, out, self.device, self.host_state)
        return out


# -- the two backends ------------------------------------------------------------------------------
class CudaGraph:
    """``torch.cuda.CUDAGraph`` with PyTorch's whole-network recipe."""

    def __init__(self, device: torch.device, pool: Any = None) -> None:
        """``pool``: a memory pool shared with other graphs (``torch.cuda.graph_pool_handle()``), safe
        where the graphs never replay at once and each one's output is read before another replays."""
        self.device, self.graph, self.pool = device, torch.cuda.CUDAGraph(), pool

    def warm_up(self, run: Callable[[], Any], times: int) -> None:
        """``run`` ``times`` times on a side stream (lazy initialisation — cuBLAS's workspace,
        autograd's streams — happens before capture, as the recipe asks)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):
                for _ in range(times):
                    run()
        finally:  # a warm-up that raises (out of memory) may leave kernels queued there, which the
            # restore of the saved state after it must not race
            torch.cuda.current_stream(self.device).wait_stream(side)

    def capture(self, run: Callable[[], Any]) -> Any:
        before = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(self.graph, pool=self.pool):
                return run()
        except BaseException:
            # torch.cuda.graph's exit calls capture_end before it leaves its stream context, so a
            # capture that fails there (one invalidated earlier) leaves its capture stream current:
            # every eager step after the stated fallback would run on it
            torch.cuda.set_stream(before)
            raise

    def replay(self) -> None:
        self.graph.replay()


class _Recording(TorchDispatchMode):
    """Records every aten operator: (operator, its arguments, its outputs), tensors as detached
    aliases (the same storage, no autograd); refuses what CUDA's capture refuses."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device, self.ops = device, []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Lets a compiled forward (``--compile``) run its compiled code while recording: dynamo
        skips compiled code under any other dispatch mode, so the stand-in recorded the eager
        forward, not the compiled one CUDA captures. (:class:`_Checking` keeps the skip: its step
        may be a new shape's first, whose compilation and autotuning run benchmark copies and
        synchronisations it would refuse; the warm-up after it compiles, before the capture.)"""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        reason = refusal(func, args, kwargs, out, self.device)
        if reason is not None:
            raise CaptureRefused(reason)
        detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
        a, k = torch.utils._pytree.tree_map(detach, (args, kwargs))
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in flat_in}
        if func.overloadpacket.__name__ in MARKERS:
            return out
        outs = [o.detach() for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        fresh = [(i, o) for i, o in enumerate(outs) if o.untyped_storage().data_ptr() not in storages]
        mutates = func._schema.is_mutable and func.overloadpacket.__name__ not in MARKERS
        if mutates or (fresh and func.overloadpacket.__name__ not in EMPTY):
            self.ops.append((func, a, k, fresh))  # a pure view of an input needs nothing on replay
        return out


class RecordedGraph:
    """The CPU stand-in: capture runs the step once under :class:`_Recording`; a replay reruns
    each recorded operator on the recorded tensors — in-place ones in place, the others' results
    copied into the recorded outputs — as a CUDA graph reruns its kernels on their addresses."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.ops = device, []

    def warm_up(self, run: Callable[[], Any], times: int) -> None:
        for _ in range(times):
            run()

    def capture(self, run: Callable[[], Any]) -> Any:
        recording = _Recording(self.device)
        with recording:
            out = run()
        self.ops = recording.ops
        return out

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, fresh in self.ops:
                result = func(*args, **kwargs)
                if fresh:
                    new = [o for o in tree_flatten(result)[0] if isinstance(o, torch.Tensor)]
                    for i, old in fresh:
                        old.copy_(new[i])


def make_backend(backend: str, device: torch.device, pool: Any = None) -> CudaGraph | RecordedGraph:
    return CudaGraph(device, pool) if backend == "cuda" else RecordedGraph(device)


def device_reason(backend: str, device: torch.device) -> str | None:
    """Why steps on ``device`` cannot be captured with ``backend`` (None: they can)."""
    if backend == "cuda" and device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the steps run eagerly on {device.type}"
    if backend == "cuda" and not torch.cuda.is_available():
        return "CUDA graphs need CUDA, which this torch cannot reach"
    return None


def compiled_reason(backend: str, compile_backend: str | None) -> str | None:
    """Why a step compiled with ``compile_backend`` cannot be captured with ``backend`` (None: it
    can): the CPU stand-in records aten operators, and inductor's CPU kernels run outside them, so
    a replay would skip the forward (the contract compiles with ``aot_eager``, aten operators)."""
    if backend == "recorded" and compile_backend == "inductor":
        return ("the CPU stand-in records aten operators, and inductor's compiled kernels run outside them "
                "(compile with aot_eager to check a compiled step's graphs on the CPU)")
    return None


# -- the per-client objects a step reads, as a structure -------------------------------------------
@dataclass
class StepState:
    """What one client's step reads besides the work module: its objective, the variant's
    ``local`` (from ``begin``), the received weights (read by a teacher term; else None) and the
    variant itself (its hyper-parameters)."""

    objective: Any
    local: Any
    weights: Any
    update: Any


OPAQUE = (nn.Module, torch.Generator, types.GeneratorType)
VALUES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum, np.generic, range, type)


@dataclass
class Structure:
    """A :class:`StepState` walked: its tensors (to transfer) and its signature (everything else,
    which a graph freezes: equal signatures, equal graphs)."""

    leaves: list[torch.Tensor]
    signature: tuple
    reason: str | None = None  # what the walk could not see through (then nothing is transferred)


def structure(state: StepState, fixed: dict[int, str]) -> Structure:
    """Walks ``state``; ``fixed`` maps the ids of the work module's own tensors (parameters,
    buffers: the same for every client, never transferred) to their names."""
    leaves: list[torch.Tensor] = []
    signature: list[Any] = []
    seen: dict[int, str] = {}
    try:
        _walk(state, "state", leaves, signature, seen, fixed)
    except CaptureRefused as exc:
        return Structure([], (), str(exc))
    return Structure(leaves, tuple(signature))


def _walk(obj: Any, path: str, leaves: list, signature: list, seen: dict[int, str], fixed: dict[int, str]) -> None:
    if id(obj) in fixed:
        signature.append(("module tensor", fixed[id(obj)]))
        return
    if isinstance(obj, VALUES):  # before the identity check: small ints and strings are shared objects
        signature.append(("value", type(obj).__qualname__, repr(obj)))
        return
    if id(obj) in seen:
        signature.append(("same as", seen[id(obj)]))
        return
    seen[id(obj)] = path
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse or obj.layout != torch.strided:
            raise CaptureRefused(f"{path} is a {obj.layout} tensor")
        leaves.append(obj)
        signature.append(("tensor", tuple(obj.shape), obj.stride(), obj.dtype, obj.device, obj.requires_grad))
    elif isinstance(obj, (list, tuple)):
        signature.append((type(obj).__qualname__, len(obj)))
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", leaves, signature, seen, fixed)
    elif isinstance(obj, dict):
        signature.append((type(obj).__qualname__, len(obj)))
        for k, v in obj.items():
            if not isinstance(k, VALUES) and not (isinstance(k, tuple) and all(isinstance(x, VALUES) for x in k)):
                raise CaptureRefused(f"{path} has a key of type {type(k).__name__}")
            signature.append(("key", repr(k)))
            _walk(v, f"{path}[{k!r}]", leaves, signature, seen, fixed)
    elif isinstance(obj, (set, frozenset)):
        if not all(isinstance(x, VALUES) for x in obj):
            raise CaptureRefused(f"{path} is a set of objects")
        signature.append((type(obj).__qualname__, tuple(sorted(map(repr, obj)))))
    elif isinstance(obj, np.ndarray):
        signature.append(("array", obj.shape, str(obj.dtype), obj.tobytes()))
    elif isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)) and not isinstance(
            getattr(obj, "__self__", None), (torch.Tensor, nn.Module, torch.Generator)):
        signature.append(("builtin", getattr(obj, "__module__", None), obj.__qualname__))
    elif isinstance(obj, types.FunctionType):  # its code is fixed; what its closure holds is walked
        signature.append(("function", obj.__module__, obj.__qualname__, len(obj.__closure__ or ())))
        for i, cell in enumerate(obj.__closure__ or ()):
            _walk(cell.cell_contents, f"{path}.<closure {i}>", leaves, signature, seen, fixed)
    elif isinstance(obj, types.MethodType):
        signature.append(("method", obj.__func__.__qualname__))
        _walk(obj.__self__, f"{path}.__self__", leaves, signature, seen, fixed)
    elif isinstance(obj, functools.partial):
        signature.append(("partial",))
        _walk((obj.func, obj.args, obj.keywords), f"{path}.<partial>", leaves, signature, seen, fixed)
    elif isinstance(obj, OPAQUE):
        raise CaptureRefused(f"{path} is a {type(obj).__qualname__}, whose state a graph transfer cannot see")
    elif hasattr(obj, "__dict__"):
        if getattr(type(obj), "__slots__", ()):
            raise CaptureRefused(f"{path} is a {type(obj).__qualname__} with __slots__")
        signature.append(("object", type(obj).__module__, type(obj).__qualname__))
        for k, v in sorted(vars(obj).items()):
            signature.append(("attr", k))
            _walk(v, f"{path}.{k}", leaves, signature, seen, fixed)
    else:
        raise CaptureRefused(f"{path} is a {type(obj).__qualname__}, whose state a graph transfer cannot see")


def transfer(into: Sequence[torch.Tensor], source: Sequence[torch.Tensor]) -> None:
    """Copies each tensor of ``source`` into the one at the same place of ``into`` (one
    multi-tensor copy per device)."""
    pairs = [(a, b) for a, b in zip(into, source) if a is not b]
    by_device: dict[torch.device, tuple[list, list]] = {}
    for a, b in pairs:
        dst, src = by_device.setdefault(a.device, ([], []))
        dst.append(a)
        src.append(b)
    with torch.no_grad():
        for dst, src in by_device.values():
            torch._foreach_copy_(dst, src)


# -- the graphs of one work module -----------------------------------------------------------------
@dataclass
class Captured:
    """One captured step: static inputs, its outputs (the loss's parts), its gradients."""

    backend: Any
    x: torch.Tensor
    y: torch.Tensor
    parts: dict[str, torch.Tensor]
    grads: list[torch.Tensor | None]


@dataclass
class Group:
    """The graphs that read one canonical :class:`StepState` (one signature): one per batch shape."""

    state: StepState
    leaves: list[torch.Tensor]
    step: Callable[..., dict[str, torch.Tensor]]
    graphs: dict[tuple, Captured] = field(default_factory=dict)


@dataclass
class ModuleGraphs:
    """Every graph of one work module, its persistent optimisers and its first fallback reason."""

    optimisers: dict[tuple, torch.optim.Optimizer] = field(default_factory=dict)
    groups: dict[tuple, Group] = field(default_factory=dict)
    cohorts: dict[tuple, Any] = field(default_factory=dict)  # a cohort's canonical stacks (fedlt.algorithms.cohort_graphs)
    cohort_pool: Any = None  # the one CUDA memory pool of its cohorts' graphs (fedlt.algorithms.cohort_graphs)
    count: int = 0
    captured: int = 0
    replays: int = 0


_GRAPHS: "weakref.WeakKeyDictionary[nn.Module, ModuleGraphs]" = weakref.WeakKeyDictionary()
_TOTALS = {"captured": 0, "replays": 0}  # over every work module of this process (benchmarks/device_check.py)


def totals() -> dict[str, int]:
    """Graphs captured and steps replayed in this process so far."""
    return dict(_TOTALS)

_EAGER: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def left_eager(model: nn.Module, reason: str) -> None:
    """Note that steps on ``model`` ran eagerly under ``--graphs``, and why (the first reason)."""
    if model not in _EAGER:
        LOG.info(f"fedlt: --graphs: steps run eagerly: {reason}")
    _EAGER.setdefault(model, reason)


def failure(model: nn.Module | None) -> str | None:
    """Why a step on ``model`` ran eagerly under ``--graphs`` (None: none did, or no model)."""
    return None if model is None else _EAGER.get(model)


def captured(model: nn.Module | None) -> int:
    """How many graphs were captured on ``model`` in this process."""
    graphs = _GRAPHS.get(model) if model is not None else None
    return graphs.captured if graphs is not None else 0


def replays(model: nn.Module | None) -> int:
    graphs = _GRAPHS.get(model) if model is not None else None
    return graphs.replays if graphs is not None else 0


def _momentum(optimiser: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    return [optimiser.state.get(p, {}).get("momentum_buffer") for p in params]


class ClientGraphs:
    """One client's steps, replayed (``step``), then its state handed back (``finish``).

    ``step_fn(state, optimiser, x, y)`` is the loop's step (returns the loss's named parts);
    ``make_optimiser(params)`` the schedule's optimiser; ``settings`` what else the graph bakes in."""

    def __init__(self, backend: str, model: nn.Module, params: list[nn.Parameter], state: StepState,
                 step_fn: Callable[..., dict[str, torch.Tensor]], make_optimiser: Callable, settings: tuple) -> None:
        self.backend, self.model, self.params, self.state = backend, model, params, state
        self.step_fn, self.make_optimiser, self.settings = step_fn, make_optimiser, settings
        self.device = params[0].device if params else torch.device("cpu")
        self.graphs = _GRAPHS.setdefault(model, ModuleGraphs())
        self.walked: Structure | None = None  # walked at its second step: after the first built its caches
        self.failed: str | None = None
        self.group: Group | None = None
        self.optimiser: torch.optim.Optimizer | None = None
        self.last: Captured | None = None
        self.steps = 0

    # -- per step ------------------------------------------------------------------------------
    def step(self, optimiser: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """One step of the client (``optimiser``: the client's own): replayed; where its shape has
        no graph yet, a checked eager step, then the capture for the steps after it; eager once a
        reason to run eagerly has come up. The first step replays only where the client's objects
        as built already have a group's structure (a loss term that builds caches in its first
        call has not: its first step runs eagerly, and the objects are walked again after it)."""
        first, self.steps = self.steps == 0, self.steps + 1
        if self.failed is not None:
            return self.step_fn(self.state, optimiser, x, y)
        try:
            if self.walked is None:
                self.walked = structure(self.state, self._fixed())
                if self.walked.reason is not None:
                    raise CaptureRefused(self.walked.reason)
            group = self.group or self.graphs.groups.get(self._key())  # hashed once a client, not every step
            graph = group.graphs.get(_shape(x, y)) if group is not None else None
        except CaptureRefused as exc:
            self._give_up(str(exc), optimiser)
            return self.step_fn(self.state, optimiser, x, y)
        if graph is None and first:
            self.walked = None
            return self.step_fn(self.state, optimiser, x, y)
        if graph is None:
            return self._checked_step_then_capture(optimiser, x, y)
        if self.group is None:
            self._enter(optimiser)
        return self._replay(graph, x, y)

    def _key(self) -> tuple:
        return (self.settings, self.walked.signature)

    def _replay(self, graph: Captured, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        graph.x.copy_(x)
        graph.y.copy_(y)
        graph.backend.replay()
        self.last = graph
        self.graphs.replays += 1
        _TOTALS["replays"] += 1
        return {k: v.clone() for k, v in graph.parts.items()}

    def _checked_step_then_capture(self, optimiser: torch.optim.Optimizer, x: torch.Tensor,
                                   y: torch.Tensor) -> dict[str, torch.Tensor]:
        """This step eagerly on the client's own objects, watched: an operator a graph cannot
        carry, or a change of what a graph would freeze (:func:`_python_change`), leaves the
        client's steps eager; else the step is captured for the steps after it."""
        if self.group is not None:
            self._hand_back(optimiser)
        before = structure(self.state, self._fixed())
        checking = _Checking(self.device, frozenset(t.untyped_storage().data_ptr() for t in before.leaves
                                                    if t.device.type == "cpu" and t.numel()))
        with checking:
            parts = self.step_fn(self.state, optimiser, x, y)
        reason = checking.reason or _python_change(before, structure(self.state, self._fixed()))
        if reason is None and self.graphs.count >= MAX_GRAPHS:
            reason = (f"more than {MAX_GRAPHS} step shapes or per-client settings on one work module (each needs a "
                      "graph of its own)")
        self.last = None  # this step's gradients stay on the parameters, as eagerly
        if reason is not None:
            self._give_up(reason, optimiser)
            return parts
        grads = [p.grad for p in self.params]
        try:
            _refuse_kept(self.model, self.params)  # before a group is made: a refusal leaves none behind
            self._enter(optimiser)
            self._capture(x, y)
        except CaptureRefused as exc:
            self._give_up(str(exc), optimiser)
        for p, g in zip(self.params, grads):
            p.grad = g
        return parts

    def _enter(self, optimiser: torch.optim.Optimizer) -> None:
        """The client's state into the canonical state of its group, its momentum into the
        persistent optimiser's (a new group's canonical state is the client's own)."""
        group = self.graphs.groups.get(self._key())
        if group is None:
            group = self._new_group()
            self.graphs.groups[self._key()] = group
        self.optimiser = self._persistent()
        transfer(group.leaves, self.walked.leaves)
        self._copy_momentum(self.optimiser, optimiser)
        self.group = group

    def _new_group(self) -> Group:
        """A group whose canonical state is a private copy of the client's (the client's own objects
        may outlive its round: its uploaded extras hold them), the work module's tensors shared."""
        memo = {id(t): t for t in [*self.model.parameters(), *self.model.buffers()]} | {id(self.model): self.model}
        try:
            with torch.no_grad():
                canonical = copy.deepcopy(self.state, memo)
        except Exception as exc:
            raise CaptureRefused(f"the step's objects cannot be copied ({type(exc).__name__}: "
                                 f"{(str(exc).splitlines() or [''])[0][:160]})") from exc
        walked = structure(canonical, self._fixed())
        if walked.signature != self.walked.signature:
            raise CaptureRefused("a copy of the step's objects is not like the original (a tensor's layout)")
        return Group(canonical, walked.leaves, self.step_fn)

    def _persistent(self) -> torch.optim.Optimizer:
        """The optimiser the graphs step with, one per (work module, trainable parameters,
        settings), its momentum buffers allocated once (so every captured step is a step with
        momentum, never torch's first step, which allocates them)."""
        key = (tuple(id(p) for p in self.params), self.settings)
        opt = self.graphs.optimisers.get(key)
        if opt is None:
            opt = self.make_optimiser(self.params)
            for group in opt.param_groups:
                if group.get("momentum", 0):
                    for p in group["params"]:
                        opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self.graphs.optimisers[key] = opt
        return opt

    def _capture(self, x: torch.Tensor, y: torch.Tensor) -> Captured:
        """PyTorch's whole-network recipe on saved and restored state (weights, buffers, the
        canonical objects, momentum): warm-up steps, gradients set to None, the capture."""
        group, graphs = self.group, self.graphs
        graphs.count += 1
        static_x, static_y = x.clone(), y.clone()
        backend = make_backend(self.backend, self.device)
        run = lambda: group.step(group.state, self.optimiser, static_x, static_y)  # noqa: E731
        def before_capture() -> None:
            _refuse_kept(self.model, self.params)  # the warm-up's nodes were made on its side stream
            self.optimiser.zero_grad(set_to_none=True)  # backward allocates the gradients inside the graph

        parts = capture_on_saved(backend, run, self._save(), before_capture)
        graph = Captured(backend, static_x, static_y, {k: v.detach() for k, v in parts.items()},
                         [p.grad for p in self.params])
        group.graphs[_shape(x, y)] = graph
        graphs.captured += 1
        _TOTALS["captured"] += 1
        return graph

    def _fixed(self) -> dict[int, str]:
        return {id(t): n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]}

    def _save(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return saved([*self.model.state_dict(keep_vars=True).values(), *self.group.leaves,
                      *(b for b in _momentum(self.optimiser, self.params) if b is not None)])

    def _give_up(self, reason: str, optimiser: torch.optim.Optimizer) -> None:
        """Eager from here: the client's state and momentum handed back first."""
        self.failed = reason
        left_eager(self.model, reason)
        if self.group is not None:
            self._hand_back(optimiser)

    def _hand_back(self, optimiser: torch.optim.Optimizer) -> None:
        transfer(self.walked.leaves, self.group.leaves)
        self._copy_momentum(optimiser, self.optimiser)
        self.group = None

    def _copy_momentum(self, into: torch.optim.Optimizer, source: torch.optim.Optimizer) -> None:
        """``source``'s momentum buffers into ``into``'s. A buffer ``into`` lacks is made (a client
        whose steps all replayed hands its momentum back); one ``source`` lacks is zero in ``into``
        (a client that has not stepped: the buffer its next step makes is d_p, as torch's first
        step makes it — SGD without dampening)."""
        buffers = []
        for p, a, b in zip(self.params, _momentum(into, self.params), _momentum(source, self.params)):
            if b is None and a is not None:
                a.zero_()
            elif a is None and b is not None:
                into.state[p]["momentum_buffer"] = b.clone()
            elif a is not None:
                buffers.append((a, b))
        transfer([a for a, _ in buffers], [b for _, b in buffers])

    def finish(self, optimiser: torch.optim.Optimizer) -> None:
        """After the client's last step: its state back in its own objects, the gradients of
        the last replay on the parameters (as the eager loop leaves them)."""
        if self.group is None:
            return
        self._hand_back(optimiser)
        if self.last is not None:
            for p, g in zip(self.params, self.last.grads):
                p.grad = g


def saved(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor with a copy of its values, for :func:`restore`."""
    with torch.no_grad():
        return [(t, t.detach().clone()) for t in tensors]


def restore(state: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for t, copy in state:
            t.copy_(copy)


def capture_on_saved(backend: CudaGraph | RecordedGraph, run: Callable[[], Any],
                     state: list[tuple[torch.Tensor, torch.Tensor]], before_capture: Callable[[], None] = lambda: None) -> Any:
    """PyTorch's whole-network recipe on saved and restored ``state`` (one client's graphs and a
    cohort's alike): warm-up steps, the state restored, ``before_capture``, the capture of ``run``
    (its output returned), the state restored again — the stand-in ran the step while recording,
    CUDA's capture ran nothing. A failure leaves the state restored and raises CaptureRefused."""
    try:
        backend.warm_up(run, WARMUP)
        restore(state)
        before_capture()
        out = backend.capture(run)
    except Exception as exc:  # a failed capture leaves the steps eager, said
        restore(state)
        if isinstance(exc, CaptureRefused):
            raise
        first = (str(exc).splitlines() or [""])[0][:200]
        raise CaptureRefused(f"capture failed: {type(exc).__name__}: {first}") from exc
    restore(state)
    return out


def kept_graph(model: nn.Module, params: Sequence[nn.Parameter]) -> str | None:
    """The first of ``params`` (by its name in ``model``) whose AccumulateGrad node is kept alive
    by an autograd graph that outlived its step (None: none). Such a node stays bound to the
    stream it was made on; a backward captured on the capture stream then synchronises with it,
    which invalidates the capture ("operation failed due to a previous error during capture", the
    H200 run of 2026-11-28). Asked on every backend, so the CPU stand-in's contract catches it.
    How: a parameter holds its node weakly; a mark set on it survives a second lookup only if
    something else holds the node."""
    names = {id(p): n for n, p in model.named_parameters()}
    with torch.enable_grad():
        for p in params:
            node = p.view_as(p).grad_fn.next_functions[0][0]
            node.metadata["fedlt_probe"] = True
            del node
            if p.view_as(p).grad_fn.next_functions[0][0].metadata.pop("fedlt_probe", False):
                return names.get(id(p), "a parameter")
    return None


def _refuse_kept(model: nn.Module, params: Sequence[nn.Parameter]) -> None:
    kept = kept_graph(model, params)
    if kept is not None:
        raise CaptureRefused(f"an autograd graph of an earlier step is still alive (it holds {kept}'s "
                             "AccumulateGrad, made on another stream: CUDA would invalidate the capture)")


def _shape(x: torch.Tensor, y: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.stride(), x.dtype, tuple(y.shape), y.dtype)


def _python_change(before: Structure, after: Structure) -> str | None:
    """Why a step changed what a graph would freeze (None: it changed tensors' values only)."""
    if before.reason or after.reason:
        return before.reason or after.reason
    if before.signature != after.signature:
        at = next((i for i, (a, b) in enumerate(zip(before.signature, after.signature)) if a != b), None)
        what = after.signature[at] if at is not None else "its structure"
        return f"a step changes Python-level state of the objective or the variant ({what}), which a graph would freeze"
    moved = [i for i, (a, b) in enumerate(zip(before.leaves, after.leaves)) if a is not b]
    if moved:
        return "a step replaces a tensor of the objective or the variant by a new one (an out-of-place update), " \
               "which a graph would not carry"
    return None


__all__ = ["BACKEND", "BACKENDS", "CaptureRefused", "ClientGraphs", "CudaGraph", "MAX_GRAPHS", "RecordedGraph",
           "StepState", "Structure", "capture_on_saved", "captured", "compiled_reason", "default_backend", "device_reason", "failure", "left_eager",
           "replays", "structure", "totals", "transfer"]

"""Compiled steps (``--compile``, docs/gpu.md#compiled-steps): the model's forward of a client's
step (and its backward, which AOTAutograd compiles with it) through ``torch.compile``.

What is compiled is the work module's forward only — ``model(x)`` in the plain step, and
``vmap(functional_call(model, θ_k, x_k))`` over a cohort's stacked weights — never the loss
objects, the clip or the optimiser: a round builds each client's objective afresh (one graph
per client would recompile every step), and the fused SGD step is already one kernel. The
compiled callable is kept per work module (weakly: it dies with the module), so every client of
every round reuses the same graphs; dynamo guards on the module's class, not its identity, so a
new run's module of the same architecture reuses them too.

- **Shapes**: the batch dimension (and a cohort's client dimension) is marked dynamic before
  the first call (``torch._dynamo.maybe_mark_dynamic``), so a client's own batch size B_k, an
  epoch's short last batch and a cohort's masked clients run one graph, not one per size. Size 1
  is the exception dynamo makes for every dynamic dimension: one more graph, compiled once.
- **Backends**: inductor, with CUDA graphs on CUDA (``mode="reduce-overhead"``'s option,
  ``triton.cudagraphs``) and the default mode on the CPU, there with max-pooling on aten's
  kernels and the convolutions channels-last (:func:`cpu_inductor`: inductor's own CPU max-pool
  made the step 1.5× eager's; with aten's it is level, docs/benchmarks.md#compile-vs-eager-issue-43). ``fallback_random`` keeps random
  operations (dropout) on torch's own generator, so a compiled step draws what the eager step
  draws from the client's stream.
- **Fallback**: a model that dynamo or the backend cannot compile runs eagerly from then on; the
  first reason is kept (:func:`failure`) for the run's summary (``compile_fallback``). An error
  of the model itself is raised by the eager rerun, as without ``--compile``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap

LOG = logging.getLogger("fedlt")
BACKEND = "inductor"  # fedlt.testing.check_compile also runs "aot_eager": the same graphs, no code generation


@contextmanager
def default_backend(backend: str) -> Iterator[None]:
    """Runs prepared inside the block compile with ``backend`` (fedlt.testing.check_compile's
    ``aot_eager``); the run's context carries it from there, copies included."""
    global BACKEND
    before, BACKEND = BACKEND, backend
    try:
        yield
    finally:
        BACKEND = before


def options(device: torch.device, cudagraphs: bool = True) -> dict[str, Any]:
    """Inductor's options on ``device``: ``mode="reduce-overhead"`` (CUDA graphs) on CUDA, the
    default mode elsewhere — and on CUDA too without ``cudagraphs`` (under ``--graphs``, whose
    whole-step graphs capture the compiled kernels: graphs cannot nest); random operations on
    torch's generator everywhere."""
    import torch._inductor  # only a run that compiles pays for importing inductor

    mode = "reduce-overhead" if device.type == "cuda" and cudagraphs else "default"
    return dict(torch._inductor.list_mode_options(mode)) | {"fallback_random": True}


def unavailable() -> str | None:
    """Why torch.compile cannot run in this Python at all (None: it can)."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python or platform (torch._dynamo.is_dynamo_supported())"
    return None


_POOL_OPS: dict[str, Any] = {}


def _pool_ops() -> dict[Any, Callable]:
    """aten's max-pool forward and backward as two opaque ops (``fedlt::max_pool2d_with_indices``
    and its backward, defined once), as decompositions of the aten ops: inductor then calls aten's
    kernels instead of generating its own. Its generated CPU max-pool (an argmax reduction for the
    indices) took 3.8 ms of FedAvgCNN's step at batch 10 where aten's channels-last kernel takes
    0.2 ms — the whole of ``--compile``'s CPU loss (docs/benchmarks.md#compile-vs-eager-issue-43)."""
    aten = torch.ops.aten
    if not _POOL_OPS:
        flexible = (torch.Tag.flexible_layout,)  # any input layout: inductor's channels-last is aten's fast one

        @torch.library.custom_op("fedlt::max_pool2d_with_indices", mutates_args=(), tags=flexible)
        def pool(x: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int],
                 dilation: list[int], ceil_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
            return aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, dilation, ceil_mode)

        @torch.library.custom_op("fedlt::max_pool2d_with_indices_backward", mutates_args=(), tags=flexible)
        def pool_backward(grad: torch.Tensor, x: torch.Tensor, kernel_size: list[int], stride: list[int],
                          padding: list[int], dilation: list[int], ceil_mode: bool,
                          indices: torch.Tensor) -> torch.Tensor:
            return aten.max_pool2d_with_indices_backward.default(grad, x, kernel_size, stride, padding, dilation,
                                                                 ceil_mode, indices)

        pool.register_fake(lambda *args: aten.max_pool2d_with_indices.default(*args))  # aten's meta kernels
        pool_backward.register_fake(lambda *args: aten.max_pool2d_with_indices_backward.default(*args))
        _POOL_OPS.update(forward=pool, backward=pool_backward)

    def forward(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        return _POOL_OPS["forward"](x, *map(_ints, (kernel_size, stride, padding, dilation)), ceil_mode)

    def backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
        return _POOL_OPS["backward"](grad, x, *map(_ints, (kernel_size, stride, padding, dilation)), ceil_mode,
                                     indices)

    return {aten.max_pool2d_with_indices.default: forward, aten.max_pool2d_with_indices_backward.default: backward}


def _ints(value: int | Sequence[int]) -> list[int]:
    return [value] if isinstance(value, int) else list(value)


def cpu_inductor(graph: torch.fx.GraphModule, inputs: list[Any]) -> Callable:
    """Inductor on the CPU (its default mode, :func:`options`), max-pooling left to aten's kernels
    (:func:`_pool_ops`); everything else — the convolutions and matmuls (aten's oneDNN/MKL
    kernels in channels-last, inductor's layout choice) and the fused pointwise code — as inductor
    makes it."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    patches = options(torch.device("cpu")) | {"force_layout_optimization": True}
    with config.patch(patches):  # the table depends on fallback_random
        table = dict(select_decomp_table()) | _pool_ops()
    return compile_fx(graph, inputs, config_patches=patches, decompositions=table)


class Compiled:
    """``eager`` through ``torch.compile``, with ``dims`` of its tensor arguments marked dynamic;
    after a compilation error, ``eager`` itself (``failed`` says why)."""

    def __init__(self, eager: Callable, dims: Callable[[tuple], list[tuple[torch.Tensor, int]]],
                 device: torch.device, backend: str, cudagraphs: bool = True) -> None:
        self.eager, self.dims, self.device = eager, dims, device
        self.failed: str | None = unavailable()
        if backend == "inductor" and device.type == "cpu":
            backend, kwargs = cpu_inductor, {}
        else:
            kwargs = {"options": options(device, cudagraphs)} if backend == "inductor" else {}
        self.compiled = torch.compile(eager, backend=backend, **kwargs) if self.failed is None else eager
        self.cudagraphs = backend == "inductor" and device.type == "cuda" and cudagraphs

    def __call__(self, *args: Any) -> Any:
        if self.failed is not None:
            return self.eager(*args)
        for tensor, dim in self.dims(args):
            if tensor.dim() > dim:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        if self.cudagraphs:  # a new step: the graphs' previous outputs are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        try:
            return self.compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a compilation inside a --graphs capture (a guard that failed only there) is the
                # capture's failure, stated by it: that shape stays eager, the compile stays on — an
                # eager rerun in an invalidated capture would fail it anyway, and turn the compile off
                raise
            out = self.eager(*args)  # the model's own error, if it is one, is raised here as without --compile
            self.failed = reason_of(exc)
            LOG.warning(f"fedlt: --compile: the step's forward runs eagerly from here: {self.failed}")
            return out


def reason_of(exc: BaseException) -> str:
    """``exc`` in one line, with the error that caused it (a backend's own error under dynamo's)."""
    root = exc
    while (getattr(root, "inner_exception", None) or root.__cause__) is not None:  # BackendCompilerFailed's own
        root = getattr(root, "inner_exception", None) or root.__cause__
    line = (str(root).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}" + (f" ({type(root).__name__}: {line})" if root is not exc else f": {line}")


_FORWARD: "weakref.WeakKeyDictionary[nn.Module, dict[str, Compiled]]" = weakref.WeakKeyDictionary()


def _cached(model: nn.Module, kind: str, backend: str, cudagraphs: bool, make: Callable[[], Compiled]) -> Compiled:
    per_model = _FORWARD.setdefault(model, {})
    key = f"{kind}/{backend}/{'cudagraphs' if cudagraphs else 'plain'}"
    if key not in per_model:
        per_model[key] = make()
    return per_model[key]


def _device(model: nn.Module) -> torch.device:
    return next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device


def forward(model: nn.Module, backend: str = BACKEND, cudagraphs: bool = True) -> Compiled:
    """``model(x)`` compiled, its batch dimension dynamic: the plain step's forward (``cudagraphs``:
    inductor's own CUDA graphs on CUDA; off under ``--graphs``, :func:`options`)."""
    ref = weakref.ref(model)  # the cache holds the module weakly: the graph must not keep it alive

    def call(x: torch.Tensor) -> torch.Tensor:
        return ref()(x)

    return _cached(model, "forward", backend, cudagraphs,
                   lambda: Compiled(call, lambda args: [(args[0], 0)], _device(model), backend, cudagraphs))


def vmapped(model: nn.Module, backend: str = BACKEND, cudagraphs: bool = True) -> Compiled:
    """``vmap(functional_call(model, ·, ·))(stacked_params, x)`` compiled, the client dimension of
    the stacked weights and inputs and the batch dimension of the inputs dynamic: a cohort's step."""
    ref = weakref.ref(model)

    def call(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return vmap(lambda p, xs: functional_call(ref(), p, (xs,)))(params, x)

    def dims(args: tuple) -> list[tuple[torch.Tensor, int]]:
        params, x = args
        return [(x, 0), (x, 1), *((t, 0) for t in params.values())]

    return _cached(model, "vmapped", backend, cudagraphs, lambda: Compiled(call, dims, _device(model), backend, cudagraphs))


_EAGER: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def left_eager(model: nn.Module, reason: str) -> None:
    """Note that a step on ``model`` ran eagerly under ``--compile``, and why (the first reason)."""
    _EAGER.setdefault(model, reason)


def failure(model: nn.Module | None) -> str | None:
    """Why a step on ``model`` ran eagerly under ``--compile``: the first compilation failure, or
    a variant's step left eager (:func:`left_eager`); None: none (or no model)."""
    if model is None:
        return None
    return next((c.failed for c in _FORWARD.get(model, {}).values() if c.failed), None) or _EAGER.get(model)


__all__ = ["BACKEND", "Compiled", "cpu_inductor", "default_backend", "failure", "forward", "left_eager", "options", "unavailable", "vmapped"]

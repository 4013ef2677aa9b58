"""Which implementation a loss runs: ``fused="auto" | "on" | "off"`` (docs/fused.md).

- ``off``: the reference (eager, term by term; the ground truth).
- ``on``: Triton kernels for CUDA tensors (when triton imports), the analytic torch path of
  :mod:`.cpu` for every other tensor.
- ``auto``: Triton on CUDA from the sizes where the device check measured it faster
  (``CUDA_AUTO_RULES``), each kernel once it passed its check on the device (:mod:`.trust`:
  value and gradient against the reference on a probe batch; a failure warns once and the
  reference runs); on the CPU the fused path only where ``benchmarks/fused_loss.py``
  measured it faster than the reference (``CPU_AUTO_RULES``); the reference elsewhere.

A combination with no fused implementation (e.g. ``fedlc(form='paper')``, a plugin's term) runs
the reference and says so once per process, naming it (:class:`FusedFallbackWarning`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fedlt.errors import FedltError
from fedlt.losses.fused import cpu, trust
from fedlt.losses.fused.parts import Part

MODES = ("auto", "on", "off")

# auto on the CPU: objective family -> (fewest classes, fewest logits B·C) from which the fused
# path was measured faster than the reference (benchmarks/fused_loss.py, docs/fused.md); below
# either, per-op overhead outweighs the saved passes and auto runs the reference. A family not
# listed stays on the reference under auto.
CPU_AUTO_RULES: dict[str, tuple[int, int]] = {
    "ce": (1000, 300_000),  # ce / logit_adjust / fedlc alone
    "composite": (100, 300_000),  # anything with vacant_kd or logit_suppression (fedvls)
    "pair": (100, 300_000),  # SCALA's offset_ce_pair, against its eager pair (a few ops for any K)
    "sgb": (10, 10_000),
}

# auto on CUDA: objective family -> the fewest logits B·C from which the Triton kernels run. Read
# from the device check's per_probe rows on the lean path (fused.md#triton-kernels: one launch
# per objective without a suppression), three H200 runs on 2026-11-28 (docs/gpu.md), eager ÷
# fused at 4096 / 16384 / 65536 × 1000: logit_adjust 0.44–0.74×, 0.74–1.47×, 1.06–1.57× (plain CE
# is autograd's own floor below that: Triton only from 65536×1000, where all three runs had it
# faster); fedvls 3.5–4.2×, logit_suppression 2.1–2.4×, SCALA's pair 1.65–1.84× already at
# 4096×1000 (from there; smaller sizes were not measured, so the reference keeps them); sgb
# (2.8–8.6× at every size) is not held back.
CUDA_AUTO_RULES: dict[str, int] = {
    "ce": 65536 * 1000,
    "composite": 4096 * 1000,
    "pair": 4096 * 1000,
}


@functools.cache  # a handful of kinds; every loss call under auto asks
def family(kind: str) -> str:
    """The CPU_AUTO_RULES row of a parts key (``"OffsetCE"``, ``"OffsetCE+VacantKD+Suppression"``...)."""
    if kind in CPU_AUTO_RULES:
        return kind
    return "ce" if kind and set(kind.split("+")) == {"OffsetCE"} else "composite"


class FusedFallbackWarning(UserWarning):
    """A loss combination has no fused implementation; the reference runs instead."""


_warned: set[str] = set()


def warn_uncovered(what: str) -> None:
    """Warn once per process per combination that the reference runs instead of a fused path."""
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(f"fused loss: {what} has no fused implementation; running the reference path",
                  FusedFallbackWarning, stacklevel=4)


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise FedltError(f"fused must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    return mode


@functools.cache
def triton_backend() -> ModuleType | None:
    """The Triton kernels module, or None when triton does not import."""
    try:
        from fedlt.losses.fused import triton_kernels
    except ImportError:
        return None
    return triton_kernels


# devices whose tensors the Triton kernels run on (tests add "cpu" under TRITON_INTERPRET=1)
TRITON_DEVICES: tuple[str, ...] = ("cuda",)


def backend(mode: str, logits: torch.Tensor, kind: str) -> ModuleType | None:
    """The module whose ``objective`` / ``sgb`` / ``offset_ce_pair`` runs ``kind`` on ``logits``,
    or None for the reference. Cheap on purpose: every loss call asks. Under ``auto`` a Triton
    kernel runs on a device only once it passed its check there (:mod:`.trust`); ``on`` trusts
    it unchecked."""
    if mode == "off":
        return None
    if logits.device.type in TRITON_DEVICES:
        floor = CUDA_AUTO_RULES.get(kind) or CUDA_AUTO_RULES.get(family(kind))
        if mode == "auto" and logits.device.type == "cuda" and floor is not None and logits.numel() < floor:
            return None
        triton = triton_backend()
        if triton is not None and (mode == "on" or trust.trusted(kind, logits, triton)):
            return triton
        return cpu if mode == "on" else None
    if mode == "on":
        return cpu
    rule = CPU_AUTO_RULES.get(kind) or CPU_AUTO_RULES.get(family(kind))
    if rule is not None and logits.is_cpu and logits.ndim == 2 and logits.shape[1] >= rule[0] \
            and logits.numel() >= rule[1]:
        return cpu
    return None


# -- autograd wrappers: the value forward, the precomputed gradient backward ---------------------
class FusedObjective(torch.autograd.Function):
    """Σ parts(logits) with its gradient computed in the forward; backward scales it. On a GPU
    each operator costs the host ~10 µs (docs/fused.md): nothing here issues one it can avoid."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None,
                parts: tuple[Part, ...], impl: ModuleType) -> torch.Tensor:
        value, grad, scale = impl.objective(logits, targets, teacher, parts)
        ctx.save_for_backward(grad)
        ctx.dtype, ctx.scale, ctx.host = logits.dtype, scale, impl is cpu and grad.device.type == "cpu"
        return value if value.dtype == logits.dtype else value.to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, upstream: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if not ctx.host:  # the Triton path (scale 1): one multiplication, no host sync
            out = grad * (upstream if ctx.scale == 1.0 else upstream * ctx.scale)
            return (out if out.dtype == ctx.dtype else out.to(ctx.dtype)), None, None, None, None
        factor = upstream.to(grad.dtype) * ctx.scale
        if grad.dtype == ctx.dtype and factor.numel() == 1 and float(factor) == 1.0:
            # loss.backward() on an unweighted composite: the gradient is ready, skip a B×C pass
            # (reading the factor is free on the CPU; elsewhere it would synchronise). The saved
            # tensor itself goes downstream: a hook that edits it in place breaks a second
            # backward through a retained graph (autograd then raises; docs/fused.md).
            return grad, None, None, None, None
        return (grad * factor).to(ctx.dtype), None, None, None, None


def objective_value(parts: tuple[Part, ...], logits: torch.Tensor, targets: torch.Tensor,
                    teacher: torch.Tensor | None, impl: ModuleType) -> torch.Tensor:
    if not parts:
        return logits[:, :0].sum()
    return FusedObjective.apply(logits, targets, teacher, parts, impl)


class _OffsetCEPair(torch.autograd.Function):
    """SCALA's two losses as two outputs of one node; ``impl.offset_ce_pair`` returns them with what
    its ``offset_ce_pair_grad`` needs (the torch path: both gradients; the Triton kernels: the
    row statistics, from which the backward recomputes the gradient in one launch)."""

    @staticmethod
    def forward(ctx: Any, logits, targets, server_offset, client_offsets, sizes, impl):
        ctx.set_materialize_grads(False)  # a loss not backpropagated costs no B×C pass
        server, clients, saved, state = impl.offset_ce_pair(logits, targets, server_offset, client_offsets, sizes)
        ctx.save_for_backward(*saved)
        ctx.dtype, ctx.state, ctx.impl = logits.dtype, state, impl
        if server.dtype != logits.dtype:
            server, clients = server.to(logits.dtype), clients.to(logits.dtype)
        return server, clients

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, up_server, up_clients):
        if up_server is None and up_clients is None:
            return None, None, None, None, None, None
        grad = ctx.impl.offset_ce_pair_grad(ctx.saved_tensors, ctx.state, up_server, up_clients)
        return (grad if grad.dtype == ctx.dtype else grad.to(ctx.dtype)), None, None, None, None, None


def pair_offsets(server_objective: Any, client_objectives: Sequence[Any],
                 num_classes: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(server_offset, client_offsets K×C) when the server's and every client's objective is ONE
    offset cross-entropy of weight 1 — SCALA's ``logit_adjust`` on both sides, ``ce``, ``fedlc`` —
    so that :func:`offset_ce_pair` computes both sides' losses; None otherwise (e.g. ``fedvls`` on
    the client side: run the objectives as they are)."""
    offsets = []
    for objective in (server_objective, *client_objectives):
        flat = objective.flat_terms() if hasattr(objective, "flat_terms") else [(1.0, objective)]
        if len(flat) != 1 or flat[0][0] != 1.0 or not hasattr(flat[0][1], "ce_offset"):
            return None
        offset = flat[0][1].ce_offset(num_classes)
        if offset is None:
            return None
        offsets.append(offset)
    return offsets[0], torch.stack(offsets[1:])


def offset_ce_pair(logits: torch.Tensor, targets: torch.Tensor, server_offset: torch.Tensor,
                   client_offsets: torch.Tensor, sizes: Sequence[int], *,
                   fused: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """SCALA's server loss and every client's loss from ONE read of the server logits.

    ``logits`` (B×C) are the server's output on the concatenated activations of K clients, client k
    owning the next ``sizes[k]`` rows (Σ sizes = B). Returns
    ``server = mean_i CE(z_i + server_offset, y_i)`` (SPEC §3 (a): server_offset = log(P_s + 1e-12))
    and ``clients[k] = mean_{i ∈ k} CE(z_i + client_offsets[k], y_i)`` ((b): client_offsets[k] =
    log(p_k + 1e-12)), a length-K vector, as two outputs of one autograd node whose gradients were
    computed in the forward: ``autograd.grad(server, server_params, retain_graph=True)`` and
    ``autograd.grad(clients.sum(), joined_activations)`` each get only their own loss's gradient.
    ``fused="off"`` computes the same with eager cross-entropies (the reference).
    """
    mode = check_mode(fused)
    sizes = [int(n) for n in sizes]
    B, C = logits.shape if logits.ndim == 2 else (None, None)
    if B is None or targets.shape != (B,):
        raise FedltError(f"offset_ce_pair: logits must be B×C and targets of length B, got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if not sizes or min(sizes) < 1 or sum(sizes) != B:
        raise FedltError(f"offset_ce_pair: sizes must be positive and sum to B={B}, got {sizes}")
    if server_offset.shape != (C,) or client_offsets.shape != (len(sizes), C):
        raise FedltError(f"offset_ce_pair: server_offset must have shape ({C},) and client_offsets "
                         f"({len(sizes)}, {C}), got {tuple(server_offset.shape)} and {tuple(client_offsets.shape)}")
    server_offset = server_offset.to(device=logits.device)
    client_offsets = client_offsets.to(device=logits.device)
    impl = backend(mode, logits, "pair")
    if impl is None:  # eager, and vectorised over the clients: a fixed handful of ops for any K
        server = F.cross_entropy(logits + server_offset.to(logits.dtype), targets)
        counts = torch.tensor(sizes, device=logits.device)
        segment = torch.repeat_interleave(torch.arange(len(sizes), device=logits.device), counts)
        per_row = F.cross_entropy(logits + client_offsets.to(logits.dtype)[segment], targets, reduction="none")
        # the segment sums accumulate in float32 at least (bfloat16 per-row losses would lose digits)
        per_row = per_row.to(cpu.work_dtype(per_row.dtype))
        clients = per_row.new_zeros(len(sizes)).index_add(0, segment, per_row) / counts
        return server, clients.to(logits.dtype)
    return _OffsetCEPair.apply(logits, targets, server_offset, client_offsets, sizes, impl)

"""The checks behind the fused path's trust gate (fedlt.losses.fused.trust; docs/fused.md).

Under ``fused="auto"`` the first loss call that would run a kernel on a device checks it once per
process, per kernel and dtype: on a fixed probe batch, its value and gradient (through the same
autograd wrapper training uses) against the eager reference computed in float64 on that device.
A kernel that fails to compile, raises, or disagrees beyond the dtype's tolerance is not used on
that device: the reference runs, and one :class:`FusedKernelWarning` names it.

The kernels (``KERNELS``) and what each probe covers:

- ``objective``: ``logit_adjust`` (CE with an offset), ``fedvls`` (CE + vacant KD + the
  reference logit suppression) and ``logit_suppression(variant='paper')``: every
  specialisation of the ``_rows`` / ``_grad`` kernels' flags;
- ``sgb``: both bases (sigmoid, softmax): value, gradient and the collector's sums;
- ``pair``: SCALA's ``offset_ce_pair``, three clients: both losses and both gradients.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

import fedlt.losses as L
from fedlt.errors import first_line
from fedlt.losses.fedgrab import phi, sgb_reference
from fedlt.losses.fused.dispatch import _OffsetCEPair, objective_value, offset_ce_pair, triton_backend
from fedlt.losses.fused.trust import (KERNELS, TOLERANCE, PROBE, FusedKernelWarning, KernelCheck,  # noqa: F401
                                      checks, forget, kernel_of, trusted, use_checker)


# -- probes: (fused value and gradient, reference value and gradient) on one device -----------------
def _problem(device: torch.device, dtype: torch.dtype, seed: int = 0, size: tuple[int, int] = PROBE):
    B, C = size
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 40, (C,), generator=gen).float()
    counts[C // 3: C // 2] = 0  # vacant classes for the KD and the suppression
    present = counts.nonzero().flatten()
    targets = present[torch.randint(len(present), (B,), generator=gen)]
    logits = torch.randn(B, C, generator=gen) * 3
    teacher = torch.randn(B, C, generator=gen) * 3
    to = dict(device=device)
    return logits.to(dtype=dtype, **to), teacher.to(dtype=dtype, **to), targets.to(**to), counts


def _grad(fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.detach().requires_grad_(True)
    value = fn(z)
    (grad,) = torch.autograd.grad(value.sum(), [z])
    return value.detach(), grad


def _objective_probes(impl: ModuleType, device: torch.device, dtype: torch.dtype, size=PROBE):
    logits, teacher, targets, counts = _problem(device, dtype, size=size)
    for expr in ("logit_adjust", "fedvls", "logit_suppression(variant='paper')"):
        ref_loss = L.build(expr, class_counts=counts, fused="off")
        parts = L.build(expr, class_counts=counts, fused="on").fused_parts(logits, targets, teacher, 1.0)
        fused = lambda z, parts=parts: objective_value(parts, z, targets, teacher, impl)  # noqa: E731
        reference = lambda z, f=ref_loss: f(z, targets, teacher_logits=teacher.to(z.dtype))  # noqa: E731
        yield expr, fused, reference, logits


def _pair_probes(impl: ModuleType, device: torch.device, dtype: torch.dtype, size=PROBE):
    logits, _, targets, counts = _problem(device, dtype, size=size)
    B, C = logits.shape
    sizes = [B // 3, B // 3, B - 2 * (B // 3)]
    gen = torch.Generator().manual_seed(1)
    server = torch.log(counts / counts.sum() + 1e-12).to(device)
    clients = torch.log(torch.rand(3, C, generator=gen) + 1e-12).to(device)

    def both(pair):  # the server's loss and the clients' as one vector: one gradient covers both
        def call(z):
            server_loss, client_losses = pair(z)
            return torch.cat([server_loss.reshape(1), client_losses])
        return call

    fused = both(lambda z: _OffsetCEPair.apply(z, targets, server, clients, sizes, impl))
    reference = both(lambda z: offset_ce_pair(z, targets, server, clients, sizes, fused="off"))
    yield "offset_ce_pair", fused, reference, logits


def _sgb_runs(impl: ModuleType, device: torch.device, dtype: torch.dtype, size=PROBE,
             reference_dtype: torch.dtype = torch.float64):
    """(label, fused call, reference call) of SGB's steps 4–6 (value, gradient, the collector's
    sums) for both bases; the reference on the logits in ``reference_dtype``."""
    logits, _, targets, _ = _problem(device, dtype, size=size)
    gen = torch.Generator().manual_seed(2)
    C = logits.shape[1]
    w_pos = phi(torch.randn(C, dtype=torch.float64, generator=gen) * 3).to(device)
    w_neg = phi(torch.randn(C, dtype=torch.float64, generator=gen) * 3).to(device)
    z_ref = logits.to(reference_dtype)
    for base in ("sigmoid", "softmax"):
        yield (f"sgb({base})", lambda base=base: impl.sgb(logits, targets, w_pos, w_neg, base),
               lambda base=base: sgb_reference(z_ref, targets, w_pos, w_neg, base))


def _worst(fused: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest |fused − reference| relative to the reference's largest magnitude, per output."""
    worst = 0.0
    for a, b in zip(fused, reference):
        a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
        if a.shape != b.shape or not torch.isfinite(a).all():
            return float("inf")
        worst = max(worst, float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6))
    return worst


def check_kernel(kernel: str, device: torch.device | str, dtype: torch.dtype, impl: ModuleType | None = None
                 ) -> KernelCheck:
    """Run ``kernel``'s probes on ``device`` in ``dtype`` (``impl``: the Triton kernels module)."""
    device = torch.device(device)
    impl = impl or triton_backend()
    name = str(dtype).removeprefix("torch.")
    if impl is None:
        return KernelCheck(kernel, str(device), name, False, "triton does not import")
    tol = TOLERANCE.get(dtype, 1e-4)
    with warnings.catch_warnings():  # the interpreter's numpy warns on the kernels' deliberate −inf arithmetic
        warnings.simplefilter("ignore", RuntimeWarning)
        return _compare(kernel, device, dtype, impl, name, tol)


def _compare(kernel: str, device: torch.device, dtype: torch.dtype, impl: ModuleType, name: str,
             tol: float) -> KernelCheck:
    worst, where = 0.0, ""
    try:
        if kernel == "sgb":
            runs = [(label, list(f()), list(r())) for label, f, r in _sgb_runs(impl, device, dtype)]
        else:
            probes = _objective_probes if kernel == "objective" else _pair_probes
            runs = []
            for label, fused, reference, logits in probes(impl, device, dtype):
                runs.append((label, list(_grad(fused, logits)), list(_grad(reference, logits.double()))))
        for label, fused_out, ref_out in runs:
            err = _worst(fused_out, ref_out)
            if err > worst or where == "":
                worst, where = err, label
    except Exception as exc:  # a kernel that does not compile or launch here is as untrusted as a wrong one
        return KernelCheck(kernel, str(device), name, False, f"it failed to run ({type(exc).__name__}: "
                                                             f"{first_line(exc)[:200]})")
    if not worst <= tol:
        return KernelCheck(kernel, str(device), name, False,
                           f"it disagrees with the reference on {where} (relative error {worst:.2g} > {tol:g})")
    return KernelCheck(kernel, str(device), name, True, f"value and gradient within {worst:.2g} of the reference")


def speed(kernel: str, device: torch.device | str, dtype: torch.dtype, size: tuple[int, int] = (4096, 1000),
          reps: int = 20, impl: ModuleType | None = None) -> tuple[float, float]:
    """Milliseconds per forward+backward of the kernel's probes and of the reference (in ``dtype``),
    on a ``size`` batch: what ``fedlt doctor`` prints."""
    device = torch.device(device)
    impl = impl or triton_backend()

    def timed(calls: list[Callable[[], object]]) -> float:
        for call in calls:  # warm-up: compilation, caches
            call()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        began = time.perf_counter()
        for _ in range(reps):
            for call in calls:
                call()
        sync()
        return (time.perf_counter() - began) / reps * 1e3

    if kernel == "sgb":
        runs = list(_sgb_runs(impl, device, dtype, size, reference_dtype=dtype))
        return timed([f for _, f, _ in runs]), timed([r for _, _, r in runs])
    probes = _objective_probes if kernel == "objective" else _pair_probes
    found = list(probes(impl, device, dtype, size))
    return (timed([lambda f=f, z=z: _grad(f, z) for _, f, _, z in found]),
            timed([lambda r=r, z=z: _grad(r, z) for _, _, r, z in found]))


def report(device: torch.device | str, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
           size: tuple[int, int] = (4096, 1000), reps: int = 20) -> list[dict]:
    """Every kernel's check on ``device`` in each dtype and, when it passed, its speed against the
    reference (ms per forward+backward on a ``size`` batch): the rows of ``fedlt doctor``."""
    rows = []
    for kernel in KERNELS:
        for dtype in dtypes:
            result = check_kernel(kernel, device, dtype)
            row = {"kernel": kernel, "dtype": result.dtype, "passed": result.passed, "detail": result.detail}
            if result.passed:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    row["fused_ms"], row["reference_ms"] = speed(kernel, device, dtype, size, reps)
            rows.append(row)
    return rows


use_checker(check_kernel)  # the gate runs these checks

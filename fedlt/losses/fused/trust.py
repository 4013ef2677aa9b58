"""The fused path's trust gate (docs/fused.md): a Triton kernel runs on a device only after it
passed its check there, once per process, per kernel and dtype; a kernel that fails is not used
on that device and one :class:`FusedKernelWarning` names it.

This module decides and remembers; the checks themselves (probes against the float64 reference,
which need the loss terms) live in fedlt.losses.fused.check, which installs its ``check_kernel``
here when it is imported (fedlt.losses imports it after its terms). May import: the bottom layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

KERNELS = ("objective", "sgb", "pair")
# the largest error allowed, relative to the reference's largest magnitude (values and gradients)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2, torch.float64: 1e-10}
PROBE = (48, 23)  # B, C: several row and class blocks' remainders, cheap under the interpreter


class FusedKernelWarning(UserWarning):
    """A Triton kernel failed its check on a device; the reference runs there instead."""


@dataclass(frozen=True)
class KernelCheck:
    """The outcome of one kernel's check on one device in one dtype."""

    kernel: str
    device: str
    dtype: str
    passed: bool
    detail: str  # the largest relative error found, or why it failed


def kernel_of(kind: str) -> str:
    """The kernel a dispatch kind runs on (``"sgb"``, ``"pair"``, every objective family)."""
    return kind if kind in ("sgb", "pair") else "objective"


_checks: dict[tuple[str, str, torch.dtype], KernelCheck] = {}
_CHECKER: list[Callable[[str, torch.device, torch.dtype, ModuleType], KernelCheck]] = []


def use_checker(check_kernel: Callable[[str, torch.device, torch.dtype, ModuleType], KernelCheck]) -> None:
    """What ``trusted`` runs on a kernel it has not checked yet (fedlt.losses.fused.check)."""
    _CHECKER[:] = [check_kernel]


# every loss call asks: its answer per (kind, device, dtype), one dictionary look-up
_answers: dict[tuple[str, torch.device, torch.dtype], bool] = {}


def trusted(kind: str, logits: torch.Tensor, impl: ModuleType) -> bool:
    """Whether ``impl``'s kernel for ``kind`` passed its check on ``logits``' device and dtype
    (checked now, once per process, if it never was; a failure warns once)."""
    fast = (kind, logits.device, logits.dtype)
    answer = _answers.get(fast)
    if answer is None:
        answer = _answers[fast] = _check(kind, logits, impl)
    return answer


def _check(kind: str, logits: torch.Tensor, impl: ModuleType) -> bool:
    key = (kernel_of(kind), str(logits.device), logits.dtype)
    result = _checks.get(key)
    if result is None:
        if not _CHECKER:
            raise RuntimeError("the fused kernels' checks are installed by fedlt.losses.fused.check: import fedlt.losses")
        result = _checks[key] = _CHECKER[0](key[0], logits.device, logits.dtype, impl)
        if not result.passed:
            warnings.warn(f"fused loss: the Triton kernel {result.kernel!r} failed its check on {result.device} "
                          f"({result.dtype}): {result.detail}; running the reference path there",
                          FusedKernelWarning, stacklevel=6)
    return result.passed


def forget() -> None:
    """Drop every recorded check (tests; a process that changed its kernels)."""
    _checks.clear()
    _answers.clear()


def checks() -> list[KernelCheck]:
    """The checks made so far in this process."""
    return list(_checks.values())

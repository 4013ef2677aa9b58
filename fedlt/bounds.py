"""Bounds on the sizes, counts, epochs and seeds components take (issue 46): one line naming the
parameter and what is allowed, before a tensor reaches the allocator or a seed reaches numpy.

- seeds: integers in numpy's range [0, 2**32 − 1] (``np.random.RandomState`` and
  ``SeedSequence`` words; torch accepts more, but a seed every consumer reads is one range);
- counts (epochs, steps, alternations, samples): integers in [low, high], ``high`` far beyond any
  published setting and low enough that a typo (1e9) is refused instead of a round that never ends;
- tensors: where memory is the limit, the bytes a tensor would take are checked against the
  machine's memory (``MAX_TENSOR_BYTES``, or the physical memory where smaller), the size in the
  message;
- numbers: finite only.
"""

from __future__ import annotations

import math
import os
from typing import Any

from fedlt.errors import FedltError

MAX_SEED = 2**32 - 1  # numpy's RandomState / SeedSequence range
MAX_ROUNDS = 100_000  # the run's rounds (fedlt.config re-exports it)
MAX_EPOCHS = 1_000  # the run's local_epochs bound (fedlt.config.MAX_LOCAL_EPOCHS)
MAX_STEPS = 100_000  # optimiser steps of a server step or a head's construction
MAX_SAMPLES = 10_000_000  # samples a server step draws per class or per step
MAX_DIM = 1_000_000  # a width (a projection's dimension)
MAX_TENSOR_BYTES = 64 * 2**30  # no single tensor of a component beyond 64 GiB


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: only MAX_TENSOR_BYTES applies
        return None


def tensor_limit() -> int:
    """The most bytes one tensor of a component may take: MAX_TENSOR_BYTES or this machine's memory."""
    memory = _physical_memory()
    return MAX_TENSOR_BYTES if memory is None else min(MAX_TENSOR_BYTES, memory)


def gib(n: int | float) -> str:
    """``n`` bytes, readable: ``12.5 GiB``, ``3.1 PiB``."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} bytes"


def integer(what: str, name: str, value: Any, low: int, high: int) -> int:
    """``value`` when it is an integer (not a bool) in [low, high]; else one FedltError line."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10**12 else f"about 1e{len(str(abs(value))) - 1}"
        raise FedltError(f"{what}: {name} must be an integer from {low} to {high}, got {shown}")
    return value


def seed(what: str, name: str, value: Any) -> int:
    """A seed in numpy's range [0, 2**32 − 1]."""
    return integer(what, name, value, 0, MAX_SEED)


def finite(what: str, name: str, value: Any, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> float:
    """``value`` as a float when it is a finite real number (not a bool) within the bounds given."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
    if not ok:
        lower = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
        upper = "" if high is None else f"<= {high:g}"
        rule = " and ".join(p for p in (lower, upper) if p)
        raise FedltError(f"{what}: {name} must be a finite number{' ' + rule if rule else ''}, got {value!r}"[:300])
    return float(value)


def tensor_bytes(what: str, shape: tuple[int, ...], itemsize: int, why: str) -> int:
    """The bytes of a tensor of ``shape`` (``itemsize`` bytes an element); a FedltError with its size
    when it exceeds :func:`tensor_limit` (``why`` says which parameters make it)."""
    n = math.prod(shape) * itemsize
    limit = tensor_limit()
    if n > limit:
        dims = "×".join(str(d) for d in shape)
        raise FedltError(f"{what}: {why} needs a tensor of {dims} ({gib(n)}), more than the {gib(limit)} allowed")
    return n


__all__ = ["MAX_SEED", "MAX_ROUNDS", "MAX_EPOCHS", "MAX_STEPS", "MAX_SAMPLES", "MAX_DIM", "MAX_TENSOR_BYTES", "tensor_limit",
           "gib", "integer", "seed", "finite", "tensor_bytes"]

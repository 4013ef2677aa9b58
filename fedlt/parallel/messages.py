"""What crosses between the main process and a worker (fedlt.parallel): values as fedlt's lossless
wire format turned into bytes for a pipe (``pack`` / ``unpack``), and errors that cross back as
themselves (or as their line, ``WorkerError``). The messages themselves — ``("ping",)``,
``("bind", key, config, partition, data)``, ``("call", job, task)``, ``("sessions", exchange,
ops, tolerate)``, ``("stop",)`` — are read by fedlt.parallel.worker and sent by
fedlt.parallel.pool.

May import: the bottom layer, fedlt.algorithms.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from fedlt import wire
from fedlt.algorithms.protocol import ClientFailure, failure_reason
from fedlt.errors import first_line

Packed = tuple[str, list[bytes]]


def pack(value: Any, name: str) -> Packed:
    text, arrays = wire.encode(value, name)
    return text, [a.numpy().tobytes() for a in arrays]


def unpack(packed: Packed, device: torch.device | str = "cpu") -> Any:
    text, blobs = packed
    return wire.decode(text, [torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)
                              for b in blobs], device)


class WorkerError(Exception):
    """An error raised in a worker whose exception could not cross back as itself."""


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (so the main process raises the same type), else its line."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return WorkerError(f"{type(exc).__name__}: {first_line(exc)}")


def tolerated_failure(cid: int, exc: BaseException) -> ClientFailure:
    """A tolerated error of client work, worded as the local runner words it."""
    return ClientFailure(cid, f"failed: {exc}" if isinstance(exc, WorkerError) else failure_reason(exc))

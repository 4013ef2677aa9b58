"""Flower records from the lossless wire format (``fedlt.wire``): any value — a task without its
data (the node has it), a result, an upload, activation gradients, a suspended session — as one
``ArrayRecord`` of raw tensor bytes beside one ``ConfigRecord`` holding the value's structure as
JSON. No field is named here, so nothing a strategy or a session adds can be dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.common import bytes_to_ndarray, ndarray_to_bytes

from fedlt import wire
from fedlt.algorithms.base import ClientData
from fedlt.algorithms.protocol import ClientTask, travelling


def records(value: Any, name: str = "value") -> dict[str, Any]:
    """``value`` as the two records that carry it (merge them into a message's RecordDict)."""
    text, arrays = wire.encode(value, name)
    return {"arrays": ArrayRecord([a.numpy() for a in arrays]), "tree": ConfigRecord({"json": text})}


def content(value: Any, name: str = "value") -> RecordDict:
    return RecordDict(records(value, name))


def value(content: RecordDict, device: torch.device | str = "cpu") -> Any:
    """The value ``records`` / ``content`` carried."""
    flat = [torch.from_numpy(np.array(a, copy=True)) for a in content["arrays"].to_numpy_ndarrays()]
    return wire.decode(str(content["tree"]["json"]), flat, device)


def task_content(task: ClientTask) -> RecordDict:
    """A task as message content: every field but its data (the node holds its own)."""
    return content(travelling(task), f"task of client {task.cid}")


def task_from(content: RecordDict, data: ClientData, device: torch.device | str = "cpu") -> ClientTask:
    return dataclasses.replace(value(content, device), data=data)


def scalars(value: Any, name: str = "value", prefix: str = "fedlt") -> dict[str, str | bytes]:
    """``value`` as flat scalars (a legacy FitIns config or FitRes metrics holds no lists): its
    structure as JSON under ``prefix.tree``, each tensor's ``.npy`` bytes under ``prefix.array.i``."""
    text, arrays = wire.encode(value, name)
    return {f"{prefix}.tree": text} | {f"{prefix}.array.{i}": ndarray_to_bytes(a.numpy()) for i, a in enumerate(arrays)}


def from_scalars(record: Any, device: torch.device | str = "cpu", prefix: str = "fedlt") -> Any:
    """The value ``scalars`` carried in ``record`` (a mapping holding its keys, and maybe others)."""
    count = sum(1 for key in record if str(key).startswith(f"{prefix}.array."))
    flat = [torch.from_numpy(np.array(bytes_to_ndarray(record[f"{prefix}.array.{i}"]), copy=True)) for i in range(count)]
    return wire.decode(str(record[f"{prefix}.tree"]), flat, device)

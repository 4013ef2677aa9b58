"""The lossless wire format: any task, result, upload or state as (JSON text, flat byte tensors).

Every value crosses exactly, with no per-field code: tensors (every dtype, bit for bit: they
travel as their raw bytes with dtype and shape beside them), ints, floats (a finite one as JSON's
shortest round-trip text; NaN and ±inf as their 8 bytes, sign and NaN payload included), strings, booleans, None, lists, tuples, dicts with any such keys,
and registered dataclasses of them (``register``; decoding creates only registered types, so a
message can never name code to run). Anything else is a one-line :class:`FedltError` naming the
field, never a silent drop. Tensors come back detached, on the requested device, in their memory
layout (a dense one, channels-last say, keeps its strides: kernels choose their path by it).

An engine that moves messages between processes (Flower) wraps the two parts in its own records;
the local engine does not encode at all.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from typing import Any

import numpy as np
import torch

from fedlt.errors import FedltError

MAX_DEPTH = 64  # nesting of containers; deeper is a malformed payload, refused before recursion fails
_TYPES: dict[str, type] = {}


def register(cls: type) -> type:
    """Let dataclass ``cls`` cross the wire (as a decorator, or called on a plugin's class)."""
    if not dataclasses.is_dataclass(cls):
        raise FedltError(f"{cls.__name__}: only dataclasses can be registered as wire types")
    _TYPES[_name(cls)] = cls
    return cls


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FedltError(f"wire: unknown tensor dtype {name!r}")
    return dtype


def _float_from_hex(text: Any) -> float:
    if not isinstance(text, str) or len(text) != 16:
        raise FedltError(f"wire: a non-finite float is 16 hex digits, got {text!r}")
    try:
        return struct.unpack(">d", bytes.fromhex(text))[0]
    except ValueError:
        raise FedltError(f"wire: a non-finite float is 16 hex digits, got {text!r}") from None


def encode(value: Any, name: str = "value") -> tuple[str, list[torch.Tensor]]:
    """``value`` as (JSON text, tensors of its raw bytes, uint8, 1-D, on the CPU)."""
    text, arrays = _encode(value, name, measure=False)
    return text, arrays


def size(value: Any, name: str = "value") -> int:
    """The bytes of ``value``'s wire form — its JSON text (UTF-8) and its tensors' raw bytes, what
    a transport moving the two parts sends (the Flower codec: fedlt.flower.codec) — counted
    without copying a tensor (off the device or otherwise): the bytes_up / bytes_down of a round."""
    text, nbytes = _encode(value, name, measure=True)
    return len(text.encode()) + sum(nbytes)


def _encode(value: Any, name: str, measure: bool) -> tuple[str, list[Any]]:
    arrays: list[Any] = []

    def enc(v: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise FedltError(f"cannot send {path}: nested deeper than {MAX_DEPTH} levels")
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, np.bool_):
            v = v.item() if isinstance(v, np.generic) else v
            if isinstance(v, float) and not math.isfinite(v):
                # JSON has no NaN / inf: the float's 8 bytes in hex, so a NaN's sign and payload survive
                return {"f": struct.pack(">d", v).hex()}
            return v
        if isinstance(v, np.bool_):
            return bool(v)
        if isinstance(v, torch.Tensor):
            t = v.detach() if measure else v.detach().cpu()
            node = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            # exact strides, not is_contiguous(): that ignores size-1 dimensions, whose strides still
            # tell a conv weight of one input channel in channels-last from the default layout
            order = None if t.stride() == _contiguous_strides(t.shape) else _dense_order(t)
            if order is not None:  # channels-last and other dense layouts keep their strides: kernels pick
                node["stride"] = list(t.stride())  # their path by layout, so the numbers depend on it
                t = t.permute(order)
            if measure:
                arrays.append(t.numel() * t.element_size())
                return {"T": len(arrays) - 1, **node}
            t = t.contiguous()
            arrays.append(t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8))
            return {"T": len(arrays) - 1, **node}
        if isinstance(v, list):
            return {"l": [enc(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, tuple):
            return {"t": [enc(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, dict):
            return {"d": [[enc(k, f"{path} key {k!r}", depth + 1), enc(x, f"{path}[{k!r}]", depth + 1)]
                          for k, x in v.items()]}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            if _name(type(v)) not in _TYPES:
                raise FedltError(f"cannot send {path}: {type(v).__name__} is a dataclass not registered with "
                                 "fedlt.wire.register")
            return {"D": _name(type(v)), "f": {f.name: enc(getattr(v, f.name), f"{path}.{f.name}", depth + 1)
                                              for f in dataclasses.fields(v) if f.init}}
        raise FedltError(f"cannot send {path}: a {type(v).__name__} is not a wire value (tensors, numbers, "
                         "strings, booleans, None, and lists, tuples, dicts or registered dataclasses of them)")

    tree = enc(value, name, 0)
    return json.dumps(tree, separators=(",", ":")), arrays


def decode(text: str, arrays: list[torch.Tensor], device: torch.device | str = "cpu") -> Any:
    """The value ``encode`` gave (text, arrays) for; tensors are placed on ``device``."""

    def dec(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise FedltError(f"wire: nested deeper than {MAX_DEPTH} levels")
        if not isinstance(node, dict):
            return node
        if "f" in node and len(node) == 1:
            return _float_from_hex(node["f"])
        if "T" in node:
            dtype = _dtype(node["dtype"])
            raw = arrays[node["T"]]
            t = raw.view(dtype) if raw.numel() else torch.zeros(0, dtype=dtype)
            if "stride" in node:
                return t.as_strided(node["shape"], node["stride"]).to(device)
            return t.reshape(node["shape"]).to(device)
        if "l" in node:
            return [dec(x, depth + 1) for x in node["l"]]
        if "t" in node:
            return tuple(dec(x, depth + 1) for x in node["t"])
        if "d" in node:
            return {_hashable(dec(k, depth + 1)): dec(x, depth + 1) for k, x in node["d"]}
        if "D" in node:
            cls = _TYPES.get(node["D"])
            if cls is None:
                raise FedltError(f"wire: {node['D']} is not a registered wire type")
            return cls(**{k: dec(x, depth + 1) for k, x in node["f"].items()})
        raise FedltError(f"wire: malformed node {sorted(node)}")

    return dec(json.loads(text), 0)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """The dimensions from outermost to innermost in memory when ``t`` fills its memory densely
    (a permutation of a contiguous tensor: channels-last, a transpose), else None."""
    order = sorted(range(t.ndim), key=lambda d: -t.stride(d))
    expected = 1
    for d in reversed(order):
        if t.size(d) != 1 and t.stride(d) != expected:
            return None
        expected *= t.size(d)
    return order


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key

"""Atomic, plain-data file writes: a crash never leaves a half-written result or checkpoint."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from fedlt.errors import FedltError


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    _atomic(Path(path), lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def write_lines(path: Path, rows: list[dict]) -> None:
    _atomic(Path(path), lambda f: f.write("".join(json.dumps(r) + "\n" for r in rows).encode()))


def append_line(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(path: Path, state: dict) -> None:
    _atomic(Path(path), lambda f: torch.save(state, f))


def load_checkpoint(path: Path) -> dict:
    """Load without executing code (``weights_only=True``); anything else is a clear error."""
    if not Path(path).exists():
        raise FedltError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, tampered or foreign: refuse, never unpickle arbitrary code
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FedltError(f"{path} is not a valid fedlt checkpoint ({reason[:200]})") from None
    if not isinstance(state, dict) or state.get("format") != "fedlt-checkpoint-1":
        raise FedltError(f"{path} is not a fedlt checkpoint")
    return state

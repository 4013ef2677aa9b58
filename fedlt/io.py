"""Atomic, plain-data file writes: a crash never leaves a half-written result or checkpoint.

Every file is written to a temporary file in the same directory, flushed to disk, then renamed
over the target, so a reader (or a resumed run) sees the old file or the new one, never a mix.
Checkpoints are loaded with ``torch.load(weights_only=True)``: tensors and plain containers
only, never arbitrary pickled objects, so a tampered file cannot run code.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from fedlt.errors import FedltError, first_line

CHECKPOINT_FORMAT = "fedlt-checkpoint-2"  # 2: the clients' states apart from the server side's
CHECKPOINT_VERSION = 2  # the N of "fedlt-checkpoint-N" this fedlt writes (docs/runs.md, "Format versions")
OLDEST_CHECKPOINT = 2  # version 1 kept the clients' states inside the algorithm's: not read
# step from version v to v + 1 (a function of the loaded dict), applied in order to an older file
CHECKPOINT_MIGRATIONS: dict[int, Any] = {}
CHECKPOINT_KEYS = {"format": str, "config_digest": str, "partition_sha256": str, "round": int, "algorithm": dict,
                   "client_states": dict, "metrics": list, "wall_time": float}


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


_FILE_MODE = 0o666 & ~_umask()  # mkstemp makes 0600 files; results should be as readable as any other


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp")  # room for the suffix
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (a power cut must not bring the old file back)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    _atomic(Path(path), lambda f: f.write((json.dumps(obj, indent=2) + "\n").encode()))


def write_lines(path: Path, rows: list[dict]) -> None:
    _atomic(Path(path), lambda f: f.write("".join(json.dumps(r) + "\n" for r in rows).encode()))


def append_line(path: Path, row: dict) -> None:
    """Append one JSON line. Not atomic on its own: a resumed run rewrites the file from the
    checkpoint's copy of the metrics, so a torn last line never survives."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json(path: Path, what: str = "file", kind: type | None = None) -> Any:
    """A JSON file (whose top level is a ``kind``, when given), or a one-line FedltError saying why
    it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise FedltError(f"no {what} at {path}")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise FedltError(f"{path} is not a valid {what}: not UTF-8 text (byte {exc.start})") from None
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise FedltError(f"{path} is not a valid {what} ({first_line(exc)[:200]})") from None
    if kind is not None and not isinstance(value, kind):
        expected = {dict: "a JSON object", list: "a JSON array"}.get(kind, kind.__name__)
        raise FedltError(f"{path} is not a valid {what}: its top level is {type(value).__name__}, not {expected}")
    return value


def save_checkpoint(path: Path, state: dict) -> None:
    _atomic(Path(path), lambda f: torch.save(state, f))


def refusal(path: Path, exc: BaseException, what: str = "checkpoint") -> FedltError:
    """Why torch would not load ``path`` (a fedlt ``what``), in fedlt's words: torch's own text suggests loading with
    ``weights_only=False``, exactly what an untrusted file must never get, so none of it is relayed."""
    text = str(exc)
    wanted = re.search(r"GLOBAL ([\w.]+)", text)
    if wanted:
        return FedltError(f"{path} is refused: it asks to import {wanted.group(1)}, and a fedlt {what} holds only "
                          "tensors and plain data (loading it could run code)")
    if isinstance(exc, pickle.UnpicklingError):
        return FedltError(f"{path} is refused: it holds pickle instructions a fedlt {what} never contains "
                          "(tampered with, or not written by fedlt)")
    if isinstance(exc, EOFError) or "central directory" in text or "zip archive" in text:
        return FedltError(f"{path} is not a valid fedlt {what}: it is empty or truncated")
    return FedltError(f"{path} is not a valid fedlt {what}: unreadable as one ({type(exc).__name__}; "
                      "truncated, tampered with, or not written by fedlt)")


def _check_metrics(path: Path, metrics: list, last_round: int) -> None:
    previous = 0
    for i, row in enumerate(metrics):
        where = f"{path} is a damaged fedlt checkpoint: metrics[{i}]"
        if not isinstance(row, dict):
            raise FedltError(f"{where} is not a table")
        r, acc = row.get("round"), row.get("accuracy")
        if isinstance(r, bool) or not isinstance(r, int) or not previous < r <= last_round:
            raise FedltError(f"{where}.round is {r!r}, not a round in {previous + 1}..{last_round}")
        if acc is not None and (isinstance(acc, bool) or not isinstance(acc, (int, float)) or not 0 <= acc <= 1):
            raise FedltError(f"{where}.accuracy is {acc!r}, not a number in [0, 1]")
        previous = r


def checkpoint_version(state: Any) -> int | None:
    """N of a checkpoint's ``"fedlt-checkpoint-N"`` format, or None when it has none."""
    found = re.fullmatch(r"fedlt-checkpoint-([1-9][0-9]{0,8})", str(state.get("format", ""))) \
        if isinstance(state, dict) else None
    return int(found.group(1)) if found else None


def _upgraded(path: Path, state: Any) -> dict:
    """A loaded checkpoint in this fedlt's format: an older supported version brought forward step
    by step; any other version refused in one line naming it and the versions read here."""
    version = checkpoint_version(state)
    readable = f"this fedlt reads formats {OLDEST_CHECKPOINT} to {CHECKPOINT_VERSION}"
    if version is None:
        raise FedltError(f"{path} is not a fedlt checkpoint (expected format {CHECKPOINT_FORMAT!r})")
    if version > CHECKPOINT_VERSION:
        raise FedltError(f"{path} was written by a newer fedlt (checkpoint format {version}); {readable}: "
                         "upgrade fedlt to resume it")
    if version < OLDEST_CHECKPOINT:
        raise FedltError(f"{path} has checkpoint format {version}, too old to resume; {readable}")
    for step in range(version, CHECKPOINT_VERSION):
        state = CHECKPOINT_MIGRATIONS[step](state)
    return dict(state, format=CHECKPOINT_FORMAT)


def load_checkpoint(path: Path) -> dict:
    """Load without executing code (``weights_only=True``); anything else is a clear error.

    A truncated, tampered or foreign file (another program's pickle, a bare state_dict, a fedlt
    checkpoint missing a key or holding a value of the wrong type) raises a one-line FedltError
    naming the file and the field; nothing is written.
    """
    path = Path(path)
    if not path.is_file():
        raise FedltError(f"no checkpoint at {path}")
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickles; the error below says it all
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # tampered, truncated or foreign
        raise refusal(path, exc) from None
    state = _upgraded(path, state)
    for key, kind in CHECKPOINT_KEYS.items():
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise FedltError(f"{path} is a damaged fedlt checkpoint: {key!r} is missing or not a {kind.__name__}")
    if state["round"] < 0 or not math.isfinite(state["wall_time"]) or state["wall_time"] < 0:
        raise FedltError(f"{path} is a damaged fedlt checkpoint: 'round' or 'wall_time' is negative or not finite")
    _check_metrics(path, state["metrics"], state["round"])
    return state

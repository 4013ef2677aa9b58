"""The engine's store of per-client persistent state (cid -> nested dict of tensors), in memory or,
above a size, in one file per client under the run directory (docs/runs.md "Client states").

Two modes behind one API (``get`` / ``put`` / ``iter`` / ``len``), so algorithms never know which:

- **memory** (a store without a directory, or while its states take at most ``memory_mb``): a
  dict; a checkpoint holds every state (``state_dict()`` is ``{cid: state}``, as before);
- **files** (once the states pass ``memory_mb``, for good): each ``put`` writes
  ``<directory>/<cid>-<generation>.pt`` (a temporary file renamed into place, never overwritten);
  memory holds only a cache of the clients touched this round, at most ``memory_mb``. A
  checkpoint holds a manifest, ``{cid: [generation, sha256, bytes]}``: ``sync()`` makes the files
  written since the last checkpoint durable before the checkpoint names them, ``collect()``
  removes the files a committed checkpoint superseded, so a checkpoint writes only what changed.

Why one file per client rather than a memory-mapped arena: states differ in size between clients
and algorithms (SGB's generator, a model, nothing), an arena would need a free list and in-place
writes that a kill can tear; a new file per write never changes what an older checkpoint names,
so a kill -9 at any moment leaves every committed manifest whole. Generation numbers grow across
the whole store; a file is garbage once a committed checkpoint of generation G names another one
for its client and its own generation is <= G — files written after that checkpoint (the next
rounds, a resumed run's redo) are never touched, and ``discard_uncommitted`` removes what a
crashed run wrote after its last checkpoint before a resume writes anything.

May import: the bottom layer.
"""

from __future__ import annotations

import hashlib
import io as bytes_io
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fedlt import io
from fedlt.errors import FedltError

FILES_FORMAT = "fedlt-client-state-files-1"  # a state_dict() in the files mode: the manifest below
_STATE_FILE = re.compile(r"^(\d+)-(\d+)\.pt$")
_TEMPORARY = re.compile(r"^\..+\.tmp$")
_SHA = re.compile(r"^[0-9a-f]{64}$")


def state_bytes(value: Any) -> int:
    """The bytes of every tensor in a nested state (what the memory mode's budget counts)."""
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_bytes(v) for v in value)
    return 0


def file_name(cid: int, generation: int) -> str:
    return f"{cid}-{generation:08d}.pt"


class ClientStates:
    """The engine's store of per-client persistent state (module docstring).

    ``directory``: where the files mode keeps its files (None: memory only, whatever the size);
    ``memory_mb``: the most the states held in memory may take (None: no limit). Only clients
    that have state are stored: ``put(cid, {})`` removes the client.
    """

    def __init__(self, directory: Path | None = None, memory_mb: float | None = None) -> None:
        self.directory = None if directory is None else Path(directory)
        self.budget = float("inf") if memory_mb is None or directory is None else memory_mb * 2**20
        self._lock = threading.RLock()  # an overlapped evaluation may read while the next round writes
        self._memory: dict[int, dict[str, Any]] = {}
        self._memory_bytes = 0
        self._files: dict[int, list] = {}  # cid -> [generation, sha256, bytes] (the files mode's index)
        self._cache: OrderedDict[int, tuple[dict[str, Any], int]] = OrderedDict()
        self._cache_bytes = 0
        self._generation = 0  # the last generation written (only grows)
        self._unsynced: set[str] = set()
        self.on_disk = False

    @property
    def mode(self) -> str:
        return "files" if self.on_disk else "memory"

    # -- the algorithms' API ------------------------------------------------------------------------
    def get(self, cid: int) -> dict[str, Any]:
        with self._lock:
            if not self.on_disk:
                return self._memory.get(cid, {})
            if cid in self._cache:
                self._cache.move_to_end(cid)
                return self._cache[cid][0]
            if cid not in self._files:
                return {}
            state = self._read(cid)
            self._remember(cid, state)
            return state

    def put(self, cid: int, state: dict[str, Any]) -> None:
        with self._lock:
            if self.on_disk:
                self._forget(cid)
                if state:
                    self._write(cid, state)
                    self._remember(cid, state)
                else:
                    self._files.pop(cid, None)
                return
            self._memory_bytes -= state_bytes(self._memory.pop(cid, {}))
            if state:
                self._memory[cid] = state
                self._memory_bytes += state_bytes(state)
            if self._memory_bytes > self.budget:
                self._spill()

    def __len__(self) -> int:
        return len(self._files) if self.on_disk else len(self._memory)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._files if self.on_disk else self._memory))

    def end_round(self) -> None:
        """Drop the cache of the clients touched so far (the engine calls it as a round starts)."""
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict[Any, Any]:
        """Memory mode: ``{cid: state}``. Files mode: the manifest naming each client's file
        (cheap: no state is read), ``{"format", "generation", "files": {cid: [gen, sha256, bytes]}}``."""
        with self._lock:
            if not self.on_disk:
                return {cid: self._memory[cid] for cid in sorted(self._memory)}
            return {"format": FILES_FORMAT, "generation": self._generation,
                    "files": {cid: list(self._files[cid]) for cid in sorted(self._files)}}

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        """The store as ``state`` (either mode's ``state_dict()``) says; a manifest's files are
        not read (``check`` looks at them, ``get`` verifies each one it reads)."""
        with self._lock:
            self.end_round()
            if state.get("format") == FILES_FORMAT:
                files = manifest_files(state)
                if self.directory is None:
                    raise FedltError("the client states are in files, but this store has no directory for them")
                self._memory, self._memory_bytes, self.on_disk = {}, 0, True
                self._files = files
                self._generation = max(self._generation, int(state["generation"]))
                return
            states = {int(k): v for k, v in state.items() if v}
            self.on_disk, self._files = False, {}
            self._memory, self._memory_bytes = states, sum(state_bytes(v) for v in states.values())
            if self._memory_bytes > self.budget:
                self._spill()

    def sync(self) -> None:
        """Make every file written since the last checkpoint durable, before a checkpoint names it."""
        with self._lock:
            for name in sorted(self._unsynced):
                try:
                    fd = os.open(self.directory / name, os.O_RDONLY)
                except FileNotFoundError:  # superseded and collected already
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if self._unsynced:
                io._fsync_dir(self.directory)
            self._unsynced.clear()

    def collect(self, committed: dict[Any, Any]) -> None:
        """After a checkpoint holding ``committed`` (a ``state_dict()``) is on disk: remove the
        files it superseded (generation <= its generation, not the one it names for the client)."""
        if committed.get("format") != FILES_FORMAT:
            return  # the next manifest collects them; a resume discards them
        kept, last = committed["files"], int(committed["generation"])
        with self._lock:
            for path, cid, generation in self._state_files():
                named = kept.get(cid, (None,))[0], self._files.get(cid, (None,))[0]
                if generation <= last and generation not in named:
                    path.unlink(missing_ok=True)
                    self._unsynced.discard(path.name)

    def check(self, where: Path) -> None:
        """Every file the manifest names is there, at its size (FedltError, one line, otherwise).
        The sha256 is verified when a file is read."""
        for cid, (generation, _, size) in self._files.items():
            path = self.directory / file_name(cid, generation)
            if not path.is_file():
                raise FedltError(f"{where} names the state of client {cid} in {path}, which is missing; the run "
                                 "cannot resume exactly without it (restore the file, or start a new run)")
            if path.stat().st_size != size:
                raise FedltError(f"{where} names the state of client {cid} in {path}, which is damaged "
                                 f"({path.stat().st_size} bytes, {size} when written); the run cannot resume "
                                 "exactly without it (restore the file, or start a new run)")

    def discard_uncommitted(self) -> None:
        """Remove the files the store does not name (what a killed run wrote after its last
        checkpoint) and the temporaries of interrupted writes; before a resumed run writes."""
        if self.directory is None or not self.directory.is_dir():
            return
        with self._lock:
            for path in self.directory.iterdir():
                if _TEMPORARY.match(path.name):
                    path.unlink(missing_ok=True)
            for path, cid, generation in self._state_files():
                if not self.on_disk or self._files.get(cid, (None,))[0] != generation:
                    path.unlink(missing_ok=True)

    # -- files --------------------------------------------------------------------------------------
    def _state_files(self) -> Iterator[tuple[Path, int, int]]:
        if self.directory is None or not self.directory.is_dir():
            return
        for path in sorted(self.directory.iterdir()):
            match = _STATE_FILE.match(path.name)
            if match:
                yield path, int(match.group(1)), int(match.group(2))

    def _spill(self) -> None:
        """From memory to files, for good: the states passed the budget."""
        states, self._memory, self._memory_bytes = self._memory, {}, 0
        self.on_disk = True
        for cid in sorted(states):
            self._write(cid, states[cid])

    def _write(self, cid: int, state: dict[str, Any]) -> None:
        buffer = bytes_io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getbuffer()
        self._generation += 1
        name = file_name(cid, self._generation)
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, io._FILE_MODE)
            os.replace(tmp, self.directory / name)  # fsynced by sync(), before a checkpoint names it
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._files[cid] = [self._generation, hashlib.sha256(data).hexdigest(), len(data)]
        self._unsynced.add(name)

    def _read(self, cid: int) -> dict[str, Any]:
        generation, sha, size = self._files[cid]
        path = self.directory / file_name(cid, generation)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise FedltError(f"the state of client {cid} in {path} cannot be read ({exc.strerror or exc}); "
                             "resume from the checkpoint once the file is restored") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            raise FedltError(f"the state of client {cid} in {path} is damaged: its sha256 is not the one recorded "
                             "when it was written (restore the file, or start a new run)")
        return torch.load(bytes_io.BytesIO(data), map_location="cpu", weights_only=True)

    def _remember(self, cid: int, state: dict[str, Any]) -> None:
        size = state_bytes(state)
        if size > self.budget:
            return
        self._cache[cid] = (state, size)
        self._cache_bytes += size
        while self._cache_bytes > self.budget:
            _, (_, dropped) = self._cache.popitem(last=False)
            self._cache_bytes -= dropped

    def _forget(self, cid: int) -> None:
        if cid in self._cache:
            self._cache_bytes -= self._cache.pop(cid)[1]


def manifest_files(state: dict[Any, Any]) -> dict[int, list]:
    """The ``files`` of a files-mode ``state_dict()``, checked (it comes from a checkpoint on disk)."""
    files, generation = state.get("files"), state.get("generation")
    if not isinstance(files, dict) or isinstance(generation, bool) or not isinstance(generation, int):
        raise FedltError("the client states' manifest is damaged (no files or generation)")
    out = {}
    for cid, entry in files.items():
        ok = (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], int)
              and 0 < entry[0] <= generation and isinstance(entry[1], str) and _SHA.match(entry[1])
              and isinstance(entry[2], int) and entry[2] > 0)
        if isinstance(cid, bool) or not isinstance(cid, int) or cid < 0 or not ok:
            raise FedltError(f"the client states' manifest is damaged (entry {str(cid)[:20]}: {str(entry)[:80]})")
        out[cid] = list(entry)
    return out

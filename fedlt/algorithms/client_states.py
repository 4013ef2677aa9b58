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

The store deletes only files it wrote: each name goes into its journal (``written.txt``) before
the file exists, and the clean-ups remove journaled or manifest-named files only — never a file
merely named like one (the folder may be a link to another disk holding other files), and a new
file never replaces one it did not write. It trusts nothing it reads: a file must match the sha256
its manifest records, unpickle as plain tensors (``weights_only``) and, once the engine has given
the store the algorithm's ``template`` (the state one round gives a client), have its structure,
shapes and dtypes; anything else is one line naming the file and what differs.

May import: the bottom layer.
"""

from __future__ import annotations

import hashlib
import io as bytes_io
import os
import re
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fedlt import io, rundir
from fedlt.errors import FedltError

FILES_FORMAT = "fedlt-client-state-files-1"  # a state_dict() in the files mode: the manifest below
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


def _parse(name: str) -> tuple[int, int]:
    cid, generation = rundir.STATE_FILE.match(name).groups()
    return int(cid), int(generation)


def _shown(value: Any) -> str:
    return repr(value)[:40]


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def difference(template: Any, state: Any, where: str = "state") -> str | None:
    """How ``state`` departs from ``template`` (the first difference, in words), or None when it has
    the template's structure (the same keys at every level), tensor shapes and dtypes."""
    if isinstance(template, dict):
        if not isinstance(state, dict):
            return f"{where} is {_described(state)}, not a mapping"
        extra, missing = [k for k in state if k not in template], [k for k in template if k not in state]
        if extra:
            return f"{where} holds {_shown(extra[0])}, which this algorithm's client state does not have"
        if missing:
            return f"{where} lacks {_shown(missing[0])}"
        return next((d for k in template if (d := difference(template[k], state[k], f"{where}[{_shown(k)}]"))), None)
    if isinstance(template, (list, tuple)):
        if not isinstance(state, (list, tuple)) or len(state) != len(template):
            return f"{where} is {_described(state)}, not a sequence of {len(template)}"
        return next((d for i, (t, v) in enumerate(zip(template, state))
                     if (d := difference(t, v, f"{where}[{i}]"))), None)
    if isinstance(template, torch.Tensor):
        if (not isinstance(state, torch.Tensor) or state.layout != torch.strided or state.dtype != template.dtype
                or state.shape != template.shape):
            return f"{where} is {_described(state)}, this algorithm's is {_described(template)}"
        return None
    if type(state) is not type(template):
        return f"{where} is {_described(state)}, this algorithm's is {_described(template)}"
    return None


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
        self._owned: set[str] = set()  # the files of this store on disk: written (journaled) or named by a manifest
        self.template: dict[str, Any] | None = None  # the structure a state must have (``expect``)
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

    def expect(self, template: dict[str, Any], where: Path | str) -> None:
        """From now on every state read must have ``template``'s structure, shapes and dtypes (the
        state the algorithm gives a client); the states held in memory are checked at once, each
        file when it is read (FedltError naming ``where`` or the file, and what differs)."""
        with self._lock:
            self.template = template
            for cid in sorted(self._memory):
                found = difference(template, self._memory[cid])
                if found:
                    raise FedltError(f"{where} holds a state for client {cid} that this run's algorithm cannot "
                                     f"have produced: {found} (resume with the settings that wrote it, or start a "
                                     "new run)")

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
                self._owned |= {file_name(cid, entry[0]) for cid, entry in files.items()}
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
        files it superseded (generation <= its generation, not the one it names for the client) —
        among the store's own, never by a listing of the folder."""
        if committed.get("format") != FILES_FORMAT:
            return  # the next manifest collects them; a resume discards them
        last = int(committed["generation"])
        with self._lock:
            named = {file_name(cid, entry[0]) for files in (committed["files"], self._files)
                     for cid, entry in files.items()}
            superseded = sorted(n for n in self._owned if _parse(n)[1] <= last and n not in named)
            for name in superseded:
                (self.directory / name).unlink(missing_ok=True)
                self._owned.discard(name)
                self._unsynced.discard(name)
            if superseded:
                self._write_journal()

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
        """Remove the files the store wrote but does not name (what a killed run wrote after its
        last checkpoint, or superseded before it could collect them) and the temporaries of its
        interrupted writes; before a resumed run writes. Files it did not write stay."""
        if self.directory is None or not self.directory.is_dir():
            return
        with self._lock:
            named = {file_name(cid, entry[0]) for cid, entry in self._files.items()} if self.on_disk else set()
            for name in rundir.journaled(self.directory):
                (self.directory / f".{name}.tmp").unlink(missing_ok=True)
                if name not in named:
                    (self.directory / name).unlink(missing_ok=True)
            self._owned = set(named)
            self._write_journal()

    # -- files --------------------------------------------------------------------------------------
    def _write_journal(self) -> None:
        """The journal as the files the store owns now (in place: a kill that tears it loses names,
        so at worst files stay behind; it never makes the store delete a file it did not write)."""
        path = self.directory / rundir.STATE_JOURNAL
        if not self._owned and not path.exists():
            return
        path.write_text("".join(f"{name}\n" for name in sorted(self._owned)), encoding="utf-8")

    def _journal(self, name: str) -> None:
        with open(self.directory / rundir.STATE_JOURNAL, "a", encoding="utf-8") as journal:
            journal.write(f"{name}\n")
        self._owned.add(name)

    def _next_name(self, cid: int) -> str:
        """The next generation's file name for ``cid``, skipping names already taken by files the
        store did not write (a new file never replaces one)."""
        while True:
            self._generation += 1
            name = file_name(cid, self._generation)
            if not any(os.path.lexists(self.directory / n) for n in (name, f".{name}.tmp")):
                return name

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
        self.directory.mkdir(parents=True, exist_ok=True)
        name = self._next_name(cid)
        self._journal(name)  # before the file exists: a kill leaves no file the journal does not name
        tmp = self.directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), io._FILE_MODE)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.directory / name)  # fsynced by sync(), before a checkpoint names it
        except BaseException:
            tmp.unlink(missing_ok=True)
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
        try:
            with warnings.catch_warnings():  # torch warns about foreign pickles; the refusal says it all
                warnings.simplefilter("ignore")
                state = torch.load(bytes_io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # weights_only refuses any object but tensors and plain containers
            raise FedltError(f"the state of client {cid}: {io.refusal(path, exc, 'client-state file')}; restore "
                             "the file, or start a new run") from None
        found = difference(self.template, state) if self.template is not None else (
            None if isinstance(state, dict) else f"state is {_described(state)}, not a mapping")
        if found:
            raise FedltError(f"the state of client {cid} in {path} is not one this run's algorithm writes: {found} "
                             "(restore the file, or start a new run)")
        return state

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

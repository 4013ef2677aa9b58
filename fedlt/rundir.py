"""Who may write where: one process per run directory, and user paths checked before any work.

``claim(out, resume=...)`` is held for the whole of a run. On entry it

1. checks ``out`` can be a directory (one line for a file in the way, a read-only or special file
   system, a name too long, ...), then creates it if needed;
2. takes an exclusive ``fcntl.flock`` on ``out/.fedlt.lock`` and writes its PID there; a second
   process gets one line naming the holder. The kernel drops the lock when its holder dies, so the
   file a SIGKILLed run leaves behind never blocks the next start;
3. for a new run, refuses a directory that is not empty: one that holds a run (``--resume`` it)
   or files fedlt did not write (which it would otherwise overwrite).

On exit the lock file is removed (while still held), and a directory that ``claim`` created and
that stayed empty is removed again, so a run refused before it wrote anything leaves the file
system as it found it; ``discard_unstarted`` removes the files of a new run refused before its
first checkpoint (a first round that fails), so that leaves nothing either. ``remove_leftovers``
deletes the temporary files a kill during an atomic write leaves; the engine calls it once
everything has been validated, just before it writes.

``check_directory`` / ``check_file`` are the one place where an OS error on a user's output path
becomes a one-line FedltError; every command that writes calls them before it does any work.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fedlt.errors import FedltError

LOCK_NAME = ".fedlt.lock"
RUN_FILES = ("config.json", "partition.json", "partition.npz", "metrics.jsonl", "checkpoint.pt",
             "checkpoint.json", "summary.json", "flower.log")
STATE_DIR = "client_states"  # the client-state store's files, when it keeps them on disk (fedlt.algorithms.client_states)
# the store's list of the files it wrote there and has not removed: the only ones it, or a discarded
# run, ever deletes (the folder may be a link to a folder on another disk, holding other files)
STATE_JOURNAL = "written.txt"
STATE_FILE = re.compile(r"^(\d+)-(\d+)\.pt$")  # <cid>-<generation>.pt
# what fedlt.io._atomic and Partition.save name their temporary files: ".<target>.<random>.tmp"
_LEFTOVER = re.compile(r"^\.(?:%s)\.[^/]+\.tmp$" % "|".join(re.escape(n) for n in RUN_FILES))

_REASONS = {
    errno.EACCES: "permission denied", errno.EPERM: "the file system does not allow it",
    errno.EROFS: "the file system is read-only", errno.ENOTDIR: "a part of the path is not a directory",
    errno.ENAMETOOLONG: "the name is too long for the file system", errno.ENOSPC: "no space left on the device",
    errno.ENOENT: "the file system does not allow creating files there", errno.EDQUOT: "disk quota exceeded",
}


def reason(exc: OSError) -> str:
    """An OS error in words, without the path (the caller names it)."""
    return _REASONS.get(exc.errno, exc.strerror or type(exc).__name__)


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (``.`` for a relative path with none)."""
    current = path
    while not os.path.lexists(current):
        if current.parent == current:
            break
        current = current.parent
    return current


def _check_names(path: Path, what: str) -> None:
    try:
        limit = os.pathconf(_nearest_existing(path.absolute()), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in path.parts:
        if len(os.fsencode(part)) > limit:
            raise FedltError(f"{what} {str(path)[:80]}…: a name in the path has {len(os.fsencode(part))} bytes, "
                             f"more than the file system allows ({limit})")


def _probe(folder: Path, target: Path, what: str) -> None:
    """Prove ``folder`` accepts new files by creating (and removing) one."""
    if not folder.is_dir():
        raise FedltError(f"{what} {target}: {folder} is not a directory")
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".fedlt-probe.", suffix=".tmp")
    except OSError as exc:
        raise FedltError(f"{what} {target}: cannot write in {folder} ({reason(exc)})") from None
    os.close(fd)
    os.unlink(name)


def check_directory(path: Path, what: str) -> None:
    """FedltError (one line) unless ``path`` is a writable directory or can be created as one."""
    path = Path(path)
    if not str(path).strip():
        raise FedltError(f"{what} is empty; name a directory")
    _check_names(path, what)
    if os.path.lexists(path):
        if not path.is_dir():
            kind = "a file" if path.is_file() else "not a directory"
            raise FedltError(f"{what} {path} exists and is {kind}; name a new or empty directory")
        _probe(path, path, what)
        return
    ancestor = _nearest_existing(path)
    if not ancestor.is_dir():
        raise FedltError(f"{what} {path}: {ancestor} is not a directory")
    _probe(ancestor, path, what)


def check_file(path: Path, what: str) -> None:
    """FedltError (one line) unless ``path`` can be written as a regular file: not a directory,
    device or other special file, inside a writable (or creatable) directory, and not one of a
    fedlt run's own files."""
    path = Path(path)
    if not str(path).strip() or path.name in ("", ".", ".."):
        raise FedltError(f"{what} must name a file, got {str(path)!r}")
    _check_names(path, what)
    if os.path.lexists(path):
        mode = os.stat(path).st_mode if path.exists() else 0
        if stat.S_ISDIR(mode):
            raise FedltError(f"{what} {path} is a directory; name a file")
        if not stat.S_ISREG(mode):
            raise FedltError(f"{what} {path} exists and is not a regular file; name a file")
    if path.name in RUN_FILES and holds_run(path.parent):
        raise FedltError(f"{what} {path} would overwrite a file of the fedlt run in {path.parent}; name another file")
    ancestor = _nearest_existing(path.parent)
    if not ancestor.is_dir():
        raise FedltError(f"{what} {path}: {ancestor} is not a directory")
    _probe(ancestor, path, what)


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds (part of) a fedlt run."""
    return any((Path(folder) / name).exists() for name in (*RUN_FILES, STATE_DIR))


def leftovers(folder: Path) -> list[Path]:
    """Temporary files of interrupted atomic writes in a run directory."""
    try:
        return sorted(p for p in Path(folder).iterdir() if _LEFTOVER.match(p.name))
    except OSError:
        return []


def remove_leftovers(folder: Path) -> None:
    for path in leftovers(folder):
        path.unlink(missing_ok=True)


def discard_unstarted(out: Path) -> None:
    """Remove what a new run wrote in ``out`` when it failed before its first checkpoint: there is
    nothing to resume, and a refused run leaves the file system as it found it. A new run's
    directory held no other file when it was claimed (``_refuse_foreign``), so each file removed
    here is the run's own; with a checkpoint on disk nothing is touched."""
    out = Path(out)
    if (out / "checkpoint.pt").exists() or (out / "checkpoint.json").exists():
        return
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    folder = out / STATE_DIR
    for name in journaled(folder):
        (folder / name).unlink(missing_ok=True)
        (folder / f".{name}.tmp").unlink(missing_ok=True)
    (folder / STATE_JOURNAL).unlink(missing_ok=True)
    if not folder.is_symlink():  # a link the user made (to another disk) stays, with what it holds
        try:
            folder.rmdir()
        except OSError:  # absent, or holding files the store did not write
            pass
    remove_leftovers(out)


def journaled(folder: Path) -> list[str]:
    """The client-state files the store's journal in ``folder`` lists (names of its own form only)."""
    try:
        lines = (Path(folder) / STATE_JOURNAL).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return sorted({line for line in lines if STATE_FILE.match(line)})


def _holder(lock: Path) -> str:
    try:
        pid = lock.read_text().strip()
    except OSError:
        pid = ""
    return f"fedlt process {pid}" if pid.isdigit() else "another fedlt process"


def _lock(out: Path, busy: str = "one process per run directory; wait for it to end, or use another --out") -> int:
    """An fd holding the exclusive lock on ``out/.fedlt.lock`` (with our PID written in it);
    ``busy``: what the refusal adds after naming the holder."""
    lock = out / LOCK_NAME
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise FedltError(f"cannot lock {out} ({reason(exc)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FedltError(f"{out} is in use by {_holder(lock)}: {busy}") from None
        try:  # the holder we waited on may have removed the file: then lock the new one
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _created_dirs(out: Path) -> list[Path]:
    """The directories ``mkdir -p out`` is about to create, deepest first."""
    missing, current = [], out
    while not os.path.lexists(current) and current.parent != current:
        missing.append(current)
        current = current.parent
    return missing


def _refuse_foreign(out: Path) -> None:
    entries = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME and not _LEFTOVER.match(p.name))
    if not entries:
        return
    if any(name in RUN_FILES or name == STATE_DIR for name in entries):
        raise FedltError(f"output directory {out} already holds a run; use another --out, or --resume it")
    shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
    raise FedltError(f"output directory {out} holds files fedlt did not write ({shown}); "
                     "use a new or empty directory")


@contextmanager
def hold(out: Path, what: str, busy: str, check: Callable[[Path], None] | None = None) -> Iterator[list[Path]]:
    """Hold the directory ``out`` for one process (a run, a sweep): created if needed, then an
    exclusive lock on ``out/.fedlt.lock`` holding our PID (atomic; a killed holder never blocks:
    the kernel drops its lock); a second holder is refused naming the first, ``busy`` saying what
    to do. ``check(out)`` runs once it is held. On exit the lock file goes, and a directory this
    call created and left empty (a refusal) is removed. Yields the directories it created,
    deepest first."""
    created = _created_dirs(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FedltError(f"{what} {out}: cannot create it ({reason(exc)})") from None
    fd = None
    try:
        fd = _lock(out, busy)
        if check is not None:
            check(out)
        yield created
    finally:
        if fd is not None:
            (out / LOCK_NAME).unlink(missing_ok=True)  # still held: nobody can have taken it meanwhile
            os.close(fd)
        for folder in created:  # only what this call made, and only if nothing was written in it
            try:
                folder.rmdir()
            except OSError:
                break


@contextmanager
def claim(out: Path, *, resume: bool) -> Iterator[Path]:
    """Hold ``out`` for one run (module docstring). A resume needs the run there already."""
    out = Path(out)
    check_directory(out, "--resume" if resume else "--out")
    if resume and not out.is_dir():
        raise FedltError(f"cannot resume {out}: no such directory")
    with hold(out, "--out", "one process per run directory; wait for it to end, or use another --out",
              None if resume else _refuse_foreign):
        yield out

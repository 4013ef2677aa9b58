"""The processes a Flower simulation starts (Ray's GCS server, raylet, agents, workers), stopped
by their own ids when the simulation ends, however it ends.

``ProcessGuard`` is held around a simulation. While it is held, this process is a child
subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): a Ray process whose parent dies (an agent whose
raylet was killed) is re-parented here instead of to init, so it stays among our descendants.
On exit, every descendant started while the guard was held gets SIGTERM, then SIGKILL after a
grace period, and is reaped. A small watchdog process snapshots the same descendants every half
second; if this process is SIGKILLed (no code of ours runs then), the watchdog kills what it last
saw, matched by pid *and* start time so a recycled pid is never hit.

Linux only (``/proc``); elsewhere the guard does nothing and Ray's own shutdown is all there is.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
GRACE_S = 5.0  # SIGTERM first: Ray's processes flush their logs and remove their sockets


def supported() -> bool:
    return sys.platform.startswith("linux") and Path("/proc/self/stat").exists()


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live, non-zombie process, else None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and ')'
    if fields[0] in ("Z", "X"):  # a zombie has already exited; it only waits to be reaped
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int, skip: frozenset[int] | set[int] = frozenset()) -> dict[int, int]:
    """Every live descendant of ``root`` (pid -> start time), but ``skip`` and their own."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            info = _stat(int(entry.name))
            if info is not None:
                parents.setdefault(info[0], []).append(int(entry.name))
                starts[int(entry.name)] = info[1]
    found, stack = {}, list(parents.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in found and pid not in skip:
            found[pid] = starts[pid]
            stack.extend(parents.get(pid, []))
    return found


def kill(processes: dict[int, int], sig: int) -> None:
    """Send ``sig`` to each process still running with its recorded start time."""
    for pid, start in processes.items():
        info = _stat(pid)
        if info is not None and info[1] == start:
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def alive(processes: dict[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in processes.items() if (_stat(pid) or (0, None))[1] == start}


def _reap(processes: dict[int, int]) -> None:
    """Collect those of ``processes`` that exited and are our children (re-parented orphans
    included), so none stays a zombie; anyone else's children are left to them."""
    for pid in processes:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child, or already collected
            pass


# The watchdog: argv = parent pid, then the pids that existed before (never touched, nor their
# children). It reads
# its stdin, which the parent holds open; EOF means the parent closed it (done, it cleaned up
# itself) or died (then it kills what it last saw of the parent's new descendants).
WATCHDOG = """
import os, select, signal, sys, time
sys.path[:0] = [sys.argv[1]]
from fedlt.flower.processes import descendants, kill
parent, before, me = int(sys.argv[2]), set(map(int, sys.argv[3:])), os.getpid()
seen = {}
while True:
    ready, _, _ = select.select([sys.stdin], [], [], 0.2)
    if ready and not os.read(sys.stdin.fileno(), 4096):
        break
    if os.getppid() != parent:
        break
    seen = descendants(parent, before | {me})
if os.getppid() != parent:  # the parent died without cleaning up
    # what it last saw, and what those still start (a process started after the last look is a
    # child of one that was seen): a few sweeps until nothing new turns up
    for _ in range(20):
        for pid in list(seen):
            seen.update(descendants(pid, {me}))
        kill(seen, signal.SIGKILL)
        time.sleep(0.1)
"""


class ProcessGuard:
    """Stops, by their pids, the processes started while it is held (module docstring)."""

    def __init__(self) -> None:
        self.active = supported()
        self.before: dict[int, int] = {}
        self.watchdog: subprocess.Popen | None = None
        self._was_subreaper = 0

    def __enter__(self) -> "ProcessGuard":
        if not self.active:
            return self
        self.before = descendants(os.getpid())
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
        self._was_subreaper = flag.value
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        root = str(Path(__file__).resolve().parents[2])
        self.watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, root, str(os.getpid()), *map(str, self.before)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a Ctrl-C in the terminal must not stop it before its job
        return self

    def started(self) -> dict[int, int]:
        """The descendants started since the guard was taken (the watchdog excepted): processes
        that were there before, and their own children, are someone else's."""
        if not self.active:
            return {}
        mine = {self.watchdog.pid} if self.watchdog is not None else set()
        return descendants(os.getpid(), set(self.before) | mine)

    def stop_all(self, grace: float = GRACE_S) -> None:
        """SIGTERM every process started since, SIGKILL what is left after ``grace`` seconds."""
        if not self.active:
            return
        started = self.started()
        kill(started, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive(started) and time.monotonic() < deadline:
            _reap(started)
            time.sleep(0.05)
        kill(alive(started), signal.SIGKILL)
        deadline = time.monotonic() + 2
        while alive(started) and time.monotonic() < deadline:
            _reap(started)
            time.sleep(0.02)
        _reap(started)

    def __exit__(self, *exc) -> None:
        if not self.active:
            return
        try:
            self.stop_all()
        finally:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, self._was_subreaper, 0, 0, 0)
            if self.watchdog is not None:
                self.watchdog.stdin.close()
                try:
                    self.watchdog.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.watchdog.kill()
                    self.watchdog.wait()

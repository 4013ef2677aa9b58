"""How fedlt starts processes (worker processes, image-loader processes): owns the start method
and the fork server's preload. Bottom layer: imports nothing of fedlt (the preload list names
modules as strings; the fork server imports them in its own process).

``forkserver`` where there is one — a clean process that imports torch and fedlt once and forks
each new process from there before any torch thread exists (a worker, or its replacement, starts
in a fraction of a second) — ``spawn`` elsewhere. Never a fork of the calling process, whose torch
threads may be running.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# imported once by the fork server, so that a process forked from it starts with them loaded
PRELOAD = ["fedlt.engine", "fedlt.parallel", "torch._dynamo"]


def process_context() -> Any:
    """The multiprocessing context fedlt starts its processes with (forkserver with PRELOAD, or
    spawn where there is no fork server)."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


@contextmanager
def main_not_rerun() -> Iterator[None]:
    """While a process is spawned: a spawned process re-runs the parent's ``__main__`` file (a
    user's script, perhaps without an ``if __name__ == "__main__"`` guard: it would run the whole
    experiment again in every worker). A worker runs fedlt's code only, so it is not told of it."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def exit_words(code: int | None) -> str:
    """How a process ended, in words: ``killed by SIGKILL``, ``exit code 1``, ``still running``."""
    if code is None:
        return "still running"
    if code < 0 and -code in signal.valid_signals():
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def alive(pid: int | None) -> bool:
    """Whether a process with this id exists (ours: a worker whose exit we could not read)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether the process has exited but is not reaped yet: a killed worker orphaned by its fork
    server is reaped by whoever adopted it (PID 1 in a container may take its time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no procfs (macOS): what kill(pid, 0) said stands
        return False
    return stat[stat.rindex(")") + 2:][:1] in ("Z", "X")


def quiet_resource_sharer() -> None:
    """No traceback from the stdlib's fd-sharing thread when a worker dies while taking a shared
    tensor's file descriptor (multiprocessing.resource_sharer hands its ConnectionResetError to
    ``sys.excepthook``): the pool names the lost worker itself, in one line. Every other
    exception reaches the previous hook unchanged. Installed once, in the main process."""
    if getattr(sys.excepthook, "fedlt_quiet", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and _raised_in_resource_sharer(tb):
            return
        previous(kind, value, tb)

    hook.fedlt_quiet = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _raised_in_resource_sharer(tb: Any) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")):
            return True
        tb = tb.tb_next
    return False

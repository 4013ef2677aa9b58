"""How a run stops on SIGINT / SIGTERM: the first signal lets the current round finish, saves a
checkpoint and raises ``RunStopped``; a second raises ``StoppedAtOnce`` mid-round (the last
checkpoint on disk stands). ``TwoSignalStop`` is that rule, written once: the run, the Flower
simulation (fedlt.flower.simulation) and a sweep (fedlt.sweep.runner, the worker processes of
fedlt.sweep.executors) all stop through it, and raise the same two exceptions.

May import: the bottom layer.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class RunStopped(KeyboardInterrupt):
    """SIGINT / SIGTERM: the run finished its current round, saved a checkpoint, and stopped."""

    def __init__(self, signum: int, round_done: int, out: Path) -> None:
        super().__init__(f"stopped by signal {signum} after round {round_done}; resume with: fedlt run --resume {out}")
        self.signum, self.round, self.out = signum, round_done, out


class StoppedAtOnce(KeyboardInterrupt):
    """A second SIGINT / SIGTERM: the run stopped mid-round; the last checkpoint on disk stands."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped at once by a second signal {signum}")
        self.signum = signum


class TwoSignalStop:
    """The two-signal stop every long job of fedlt shares (a run, the Flower simulation, a sweep):
    the first SIGINT / SIGTERM asks the job to finish cleanly — it is recorded in ``first`` and
    ``on_first(signum)`` is told — and each later one asks it to stop now: ``again(signum,
    count)`` (``count``: 2 for the second signal), by default ``on_again(signum, count)`` or, with
    none given, raising StoppedAtOnce where the signal lands. A job with more to do on a later
    signal (the Flower simulation) overrides ``again``.

    ``install()`` / ``restore()`` or ``with stop:``; outside the main thread signals cannot be
    caught and nothing is installed. Installing twice (over a handler a library put in between)
    keeps the first saved handlers, which ``restore`` puts back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_first: Callable[[int], None] | None = None,
                 on_again: Callable[[int, int], None] | None = None) -> None:
        self.first: int | None = None
        self.count = 0
        self.on_first, self.on_again = on_first, on_again
        self._previous: dict[int, Any] = {}

    def handler(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.first is None:
            self.first = signum
            if self.on_first is not None:
                self.on_first(signum)
            return
        self.again(signum, self.count)

    def again(self, signum: int, count: int) -> None:
        if self.on_again is None:
            raise StoppedAtOnce(signum)
        self.on_again(signum, count)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.SIGNALS:
            self._previous.setdefault(s, signal.signal(s, self.handler))

    def restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()

    def __enter__(self) -> "TwoSignalStop":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


@contextmanager
def stop_on_signal(state: Any) -> Iterator[None]:
    """While the loop runs: the first SIGINT / SIGTERM is recorded in ``state.stop_signal`` (the
    loop stops after the round, checkpointed); a second raises StoppedAtOnce at once. Outside the
    main thread nothing is installed (TwoSignalStop)."""
    with TwoSignalStop(on_first=lambda signum: setattr(state, "stop_signal", signum)):
        yield

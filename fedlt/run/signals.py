"""How a run stops on SIGINT / SIGTERM: the first signal lets the current round finish, saves a
checkpoint and raises ``RunStopped``; a second raises ``StoppedAtOnce`` mid-round (the last
checkpoint on disk stands). The Flower simulation (fedlt.flower.simulation) and a sweep's runs
(fedlt.sweep.executors) raise the same two exceptions.

May import: the bottom layer.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
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


@contextmanager
def stop_on_signal(state: Any) -> Iterator[None]:
    """While the loop runs: the first SIGINT / SIGTERM is recorded in ``state.stop_signal`` (the
    loop stops after the round, checkpointed); a second raises StoppedAtOnce at once. Outside the
    main thread signals cannot be caught; nothing is installed then."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if state.stop_signal is not None:
            raise StoppedAtOnce(signum)
        state.stop_signal = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

"""``fedlt run --engine flower``: the run in Flower's simulation runtime — a ServerApp thread in
this process running fedlt's loop, and one virtual SuperNode per client whose ClientApp runs in
Ray workers (one CPU each).

``simulate`` runs several runs one after another in ONE simulation (Ray starts once: several
seconds), e.g. a test's comparisons or a benchmark's settings.

Signals behave as on the local engine (docs/runs.md): the run loop lives in the ServerApp
thread, where Python cannot catch signals, so the main thread catches them here. The first
SIGINT / SIGTERM asks the loop to stop after the current round (checkpointed); a second raises
``StoppedAtOnce`` inside the loop at once (the last checkpoint stands); a third stops Ray's
processes at once. Ray's processes are stopped by their pids on every exit path
(``fedlt.flower.processes``). What Flower and Ray log goes to ``flower.log`` in the run directory,
not to the terminal.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlt.config import RunConfig
from fedlt.errors import FedltError, first_line
from fedlt.flower import require
from fedlt.flower.processes import ProcessGuard
from fedlt.run import loop
from fedlt.run.signals import StoppedAtOnce, TwoSignalStop

# the simulation's SuperNodes exist from the start and answer once Ray has started their actors,
# which a loaded machine can delay beyond a deployment's 120 s: wait longer, there is nothing to miss
SIMULATED_NODE_WAIT_S = 900.0
SIMULATED_POLL_CAP_S = 0.05  # the in-memory grid answers in milliseconds (server_app.FIRST_POLL_S)

LOG_NAME = "flower.log"  # Flower's and Ray's log lines of the run, beside its other files
LOGGERS = ("flwr", "ray")


@dataclass
class Job:
    config: RunConfig
    resume: bool = False
    on_round: Callable[[int, dict[str, Any]], None] | None = None
    on_start: Callable[[int], None] | None = None


def run(config: RunConfig, *, resume: bool = False, on_round: Callable[[int, dict[str, Any]], None] | None = None,
        on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Flower's simulation runtime: one SuperNode per client, the round loop in the ServerApp (docs/flower.md)."""
    return simulate([Job(config, resume, on_round, on_start)])[0]["summary"]


class StopSignals(TwoSignalStop):
    """SIGINT / SIGTERM in the main thread while the loop runs in ``loop_thread`` (module
    docstring): the first is recorded (the loop asks for it after each round); the second is
    raised as StoppedAtOnce inside the loop's thread; a third stops the runtime's processes."""

    def __init__(self, stop_processes: Callable[[], None]) -> None:
        super().__init__()
        self.loop_thread: threading.Thread | None = None
        self.in_loop = False  # the loop thread is inside fedlt's run loop (not Flower's code around it)
        self.stop_processes = stop_processes

    def again(self, signum: int, count: int) -> None:
        if count == 2 and self.in_loop:
            class Second(StoppedAtOnce):  # raised by class, not instance: the signal travels in it
                def __init__(self) -> None:
                    super().__init__(signum)

            # the loop's thread cannot receive the signal itself: raise in it at its next bytecode
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.loop_thread.ident), ctypes.py_object(Second))
        elif count == 2 and self.loop_thread is None:  # Ray is starting: nothing of the run's to finish
            raise StoppedAtOnce(signum)
        elif count >= 3:  # the runtime does not come down: take its processes down by their pids
            self.stop_processes()


class LogRecords(logging.Handler):
    """Flower's and Ray's log records (and Python warnings) of a simulation, kept in memory while it
    runs: the run directory may not exist yet, and nothing is written before a run's checks."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # a record that cannot be formatted is dropped, never raised into the run
            pass

    @contextmanager
    def captured(self) -> Iterator[None]:
        saved = {}
        for name in LOGGERS:
            logger = logging.getLogger(name)
            saved[name] = (logger.handlers[:], logger.propagate)
            logger.handlers[:] = [self]
            logger.propagate = False
        shown = warnings.showwarning

        def show(message, category, filename, lineno, *args, **kwargs):
            self.lines.append(f"{time.strftime('%Y-%m-%d %H:%M:%S')} warning {category.__name__}: {message} "
                              f"({filename}:{lineno})")

        warnings.showwarning = show
        try:
            yield
        finally:
            warnings.showwarning = shown
            for name, (handlers, propagate) in saved.items():
                logger = logging.getLogger(name)
                logger.handlers[:] = handlers
                logger.propagate = propagate

    def write(self, out: Path) -> None:
        """Append the lines to ``out/flower.log`` when ``out`` holds a run (else nothing is written)."""
        if not self.lines or not (out / "config.json").is_file():
            return
        try:
            with open(out / LOG_NAME, "a", encoding="utf-8") as f:
                f.write("".join(f"{line}\n" for line in self.lines))
        except OSError:  # the log is a courtesy; the run's results are written already
            pass


def start_ray(num_cpus: int | None) -> None:
    """Ray started here, before Flower would (it then reuses it), so the signal handlers installed
    after it are fedlt's: ``ray.init`` installs its own SIGTERM handler, which exits mid-round."""
    import ray

    # the workers import fedlt (and the ClientApp) from the paths this process imports them from:
    # the raylet started below inherits this environment and its workers inherit it from the raylet.
    # No runtime_env: a job's runtime_env (even env_vars alone) makes Ray start every actor's worker
    # anew through its runtime-env setup instead of taking a worker it prestarted at ray.init
    pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["PYTHONPATH"] = pythonpath
    # address="local": always a Ray of its own, never a cluster another program started (`ray start`),
    # whose processes this run could neither own nor stop
    args: dict[str, Any] = {"address": "local", "include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
    if num_cpus is not None:
        args["num_cpus"] = num_cpus
    try:
        ray.init(**args)
    except Exception as exc:  # e.g. "The current node timed out during startup" on an overloaded machine
        raise FedltError(f"--engine flower: Ray did not start: {first_line(exc)}"[:300]) from None


def simulate(jobs: list[Job], num_cpus: int | None = None) -> list[dict[str, Any]]:
    """Run ``jobs`` in turn in one simulation with max(clients) SuperNodes; for each, its summary
    and ``exchanges`` (message round trips it made). A job that stops (a signal, an error) ends
    the simulation and its exception is raised here, in the caller's thread."""
    require()
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedlt.flower.client_app import app as client_app
    from fedlt.flower.server_app import FlowerRunner

    outcomes: list[dict[str, Any]] = []
    failure: list[BaseException] = []
    server_app = ServerApp()
    records = LogRecords()

    with ProcessGuard() as guard:
        signals = StopSignals(stop_processes=lambda: guard.stop_all(grace=0))

        @server_app.main()
        def main(grid: Grid, context: Context) -> None:
            signals.loop_thread = threading.current_thread()
            signals.in_loop = True
            try:
                for job in jobs:
                    runner = FlowerRunner(grid, job.config, node_wait=SIMULATED_NODE_WAIT_S,
                                          poll_cap=SIMULATED_POLL_CAP_S)
                    summary = loop.run(job.config, resume=job.resume, on_round=job.on_round,
                                       on_start=job.on_start, runner=runner,
                                       stop_requested=lambda: signals.first)
                    outcomes.append({"summary": summary, "exchanges": runner.exchanges})
            except BaseException as exc:  # re-raised in the caller's thread, not printed by Flower's
                failure.append(exc)
            finally:
                signals.in_loop = False

        try:
            with records.captured(), warnings.catch_warnings():
                warnings.simplefilter("default")
                signals.install()  # before Ray starts: a signal during start-up asks to stop, like later ones
                try:
                    start_ray(num_cpus)
                    signals.install()  # over the SIGTERM handler ray.init installed
                    run_simulation(server_app, client_app, num_supernodes=max(job.config.partition_clients for job in jobs),
                                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                                   "init_args": {"logging_level": logging.ERROR,
                                                                 "log_to_driver": False}})
                finally:
                    try:
                        _shutdown_ray()
                    finally:
                        signals.restore()
        finally:
            guard.stop_all()
            for job in jobs:
                records.write(Path(job.config.out))
    if failure:
        raise failure[0]
    if signals.first is not None and len(outcomes) < len(jobs):
        raise StoppedAtOnce(signals.first)  # stopped before the loop could finish a round
    if len(outcomes) < len(jobs):
        raise FedltError(f"the Flower simulation ended before its runs finished (see {LOG_NAME} in the run "
                         "directory)")
    return outcomes


def _shutdown_ray() -> None:
    import ray

    try:
        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # its processes are stopped by pid next, whatever state it is in
        pass

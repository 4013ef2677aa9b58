"""Where a study's runs execute: a registry of executors, each driving the same ``run_job``.

    local   worker processes on this machine (``jobs``, default the number of cores)
    ray     tasks on a Ray cluster (``address``; the Ray that the ``flower`` extra brings)
    slurm   a Slurm job array through submitit (``cluster=local`` runs it on this machine)

An executor is a class with ``run(jobs, on_event, workdir)`` (call ``on_event("started", id,
None)`` and ``on_event("finished", id, Outcome)`` from the calling thread) and ``stop()`` (asked
on SIGINT/SIGTERM: every run stops after its round with a checkpoint). Registering another one
(``fedlt.executors`` entry points) adds ``--executor NAME``; none schedules anything itself.
"""

from __future__ import annotations

import inspect
import os
import signal
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedlt.config import RunConfig
from fedlt.engine import RunStopped, run
from fedlt.errors import FedltError, first_line
from fedlt.registry import Registry
from fedlt.run.signals import TwoSignalStop
from fedlt.start_method import main_not_rerun, process_context
from fedlt.sweep import track
from fedlt.sweep.net import reachable

CONNECT_TIMEOUT = 10.0  # seconds for a Ray cluster's address to accept a connection

EXECUTORS: Registry[Any] = Registry("executor")


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (a ``--executor-param`` value as ``--set`` reads it) has the annotated type."""
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    kind = origin or hint
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind) if isinstance(kind, type) else True


def _type_words(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is not None and args and typing.get_origin(hint) not in (dict, list):
        return " or ".join(_type_words(a) for a in args)
    return getattr(typing.get_origin(hint) or hint, "__name__", str(hint))


def check_params(name: str, params: dict[str, Any]) -> Any:
    """The executor class ``name``, after checking ``params`` against its ``__init__``: an unknown
    or ill-typed one is a one-line FedltError naming it and the executor's parameters."""
    factory = EXECUTORS.get(name)
    signature = inspect.signature(factory)
    named = {p.name: p for p in signature.parameters.values()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except Exception:  # a plugin's annotations that do not resolve: names are still checked
        hints = {}
    allowed = ", ".join(named) + (", and any other (passed on)" if open_ended else "") if named else "none"
    for key, value in params.items():
        if key not in named:
            if open_ended:
                continue
            raise FedltError(f"--executor-param {key}: the {name} executor has no such parameter (its "
                             f"parameters: {allowed})")
        hint = hints.get(key, named[key].annotation)
        if not _fits(value, hint):
            raise FedltError(f"--executor-param {key}={value!r}: the {name} executor expects {_type_words(hint)} "
                             f"(its parameters: {allowed})")
    return factory


def create(name: str, params: dict[str, Any]) -> Any:
    """``EXECUTORS.create(name, **params)`` with the parameters checked first (``check_params``)."""
    check_params(name, params)
    return EXECUTORS.create(name, **params)


def cores() -> int:
    """The cores this process may run on (its affinity mask, as taskset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Job:
    id: str
    config: dict[str, Any]  # a RunConfig as JSON
    resume: bool
    threads: int | None = None  # torch intra-op threads for the run
    tracking: tuple[dict[str, Any], ...] = ()  # tracker specs (fedlt.sweep.track)


@dataclass
class Outcome:
    id: str
    status: str  # done, failed, stopped
    error: str | None = None
    final_accuracy: float | None = None
    best_accuracy: float | None = None
    best_round: int | None = None
    rounds: int | None = None
    seconds: float = 0.0
    pid: int = field(default_factory=os.getpid)
    warnings: list[str] = field(default_factory=list)  # e.g. a tracker that failed (the run went on)


Event = Callable[[str, str, "Outcome | None"], None]

# a stop asked of a worker before (or between) its run's own handlers (fedlt.run.signals.stop_on_signal):
# remembered, and a run about to start stops at once; a later signal changes nothing
_STOP = TwoSignalStop(on_again=lambda signum, count: None)


def run_job(job: Job) -> Outcome:
    """One run, in whatever process the executor chose: never raises; a failure is an Outcome
    holding its one-line error."""
    started = time.perf_counter()
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    trackers: dict[str, Any] = {}
    warnings: list[str] = []
    status, error, summary = "failed", None, None

    def tracked(method: str, *args: Any) -> None:
        """Call ``method`` on every tracker; one that raises is dropped with a warning (tracking
        is a side channel: the run goes on)."""
        for name, tracker in list(trackers.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:
                del trackers[name]
                warnings.append(f"tracking with {name} stopped: {type(exc).__name__}: {first_line(exc)}")

    try:
        config = RunConfig.model_validate(job.config)
        trackers = {spec["name"]: track.create(spec) for spec in job.tracking}

        def on_start(done: int) -> None:
            if _STOP.first is not None:  # asked to stop while the run was being prepared
                raise RunStopped(_STOP.first, done, Path(config.out))
            tracked("start", job.id, job.config, done)

        def on_round(done: int, row: dict[str, Any]) -> None:
            tracked("log_round", done, row)

        summary = run(config, resume=job.resume, on_round=on_round, on_start=on_start)
        status = "done"
    except RunStopped as stop:
        status, error = "stopped", f"stopped after round {stop.round}"
    except KeyboardInterrupt:
        status, error = "stopped", "stopped at once; the last checkpoint stands"
    except FedltError as exc:
        error = first_line(exc)
    except Exception as exc:  # a run's bug must not end the study: recorded, the others go on
        error = f"{type(exc).__name__}: {first_line(exc)}"
    finally:
        tracked("finish", status, Path(job.config["out"]))
    outcome = Outcome(job.id, status, error, seconds=round(time.perf_counter() - started, 3), warnings=warnings)
    if summary is not None:
        outcome.final_accuracy = summary["final"]["accuracy"]
        outcome.best_accuracy, outcome.best_round = summary["best"]["accuracy"], summary["best"]["round"]
        outcome.rounds = summary["rounds"]
        outcome.warnings += summary.get("warnings", [])  # e.g. no round trained: the study goes on, and says so
    return outcome


def _worker_init() -> None:
    """A local worker: out of the terminal's process group (the coordinator alone gets Ctrl-C and
    relays one SIGTERM), dies with the coordinator (a SIGKILLed sweep leaves no run holding its
    directory), and remembers a stop that arrives between rounds' handlers."""
    os.setpgrp()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker outlives a killed coordinator
        pass
    if os.getppid() == 1:  # the coordinator died before prctl took effect
        os._exit(1)
    _STOP.install()


@EXECUTORS.register("local")
class LocalExecutor:
    """``jobs`` worker processes on this machine (default: one per core), started as fedlt starts
    every process (fedlt.start_method: forked from a fork server that imported torch and fedlt
    once — never a fork of this process, whose torch threads may run — where spawning each cost
    a full import: 12 s for two workers on a busy 2-core machine), each running one run at a
    time; no more runs are queued than there are workers, so a stop leaves nothing half-started."""

    def __init__(self, jobs: int | None = None) -> None:
        if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
            raise FedltError(f"--jobs must be at least 1, got {jobs!r}")
        self.jobs = jobs or cores()
        self._pool: Any = None
        self._stopping = False

    def threads_per_run(self) -> int:
        return max(cores() // self.jobs, 1)

    def run(self, jobs: list[Job], on_event: Event, workdir: Path) -> None:
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
        from concurrent.futures.process import BrokenProcessPool

        pending = list(jobs)
        context = process_context()
        while pending and not self._stopping:
            self._pool = ProcessPoolExecutor(max_workers=min(self.jobs, len(pending)), mp_context=context,
                                             initializer=_worker_init)
            running: dict[Any, Job] = {}
            broken = False
            try:
                while (pending or running) and not broken:
                    while pending and len(running) < self.jobs and not self._stopping:
                        job = pending.pop(0)
                        with main_not_rerun():  # the pool starts its processes in submit
                            running[self._pool.submit(run_job, job)] = job
                        on_event("started", job.id, None)
                    if not running:
                        break
                    done, _ = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                    for future in done:
                        job = running.pop(future)
                        try:
                            on_event("finished", job.id, future.result())
                        except BrokenProcessPool:  # the worker died (killed, out of memory): record it, go on
                            broken = True
                            on_event("finished", job.id, Outcome(job.id, "failed", "the worker process died "
                                                                 "(killed or out of memory)"))
                for future, job in running.items():  # lost with the pool
                    on_event("finished", job.id, Outcome(job.id, "failed", "the worker process pool broke"))
            finally:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def stop(self) -> None:
        """Relay SIGTERM to every worker: each run stops after its round with a checkpoint (a
        second stop makes them stop at once)."""
        self._stopping = True
        pool = self._pool
        # the pool's worker processes: concurrent.futures keeps them in _processes (no public accessor)
        for process in list(getattr(pool, "_processes", {}).values()) if pool is not None else []:
            try:
                os.kill(process.pid, signal.SIGTERM)
            except (ProcessLookupError, AttributeError):
                pass


@EXECUTORS.register("ray")
class RayExecutor:
    """Ray tasks, each a run with ``threads`` CPUs, on the cluster at ``address`` (``auto``: the
    one ``ray start`` made here; default: a local Ray started for the study). Workers import
    fedlt from their own environment: install it on every node (or pass a ``runtime_env``)."""

    def __init__(self, address: str | None = None, runtime_env: dict[str, Any] | None = None) -> None:
        self.address, self.runtime_env = address, runtime_env
        if isinstance(address, str) and address not in ("auto", "local"):  # a cluster elsewhere: answering?
            host, _, port = address.removeprefix("ray://").rpartition(":")
            if not host or not port.isdigit():
                raise FedltError(f"--executor ray: address {address!r} must be auto, local, HOST:PORT or "
                                 "ray://HOST:PORT")
            reachable(host.strip("[]"), int(port), CONNECT_TIMEOUT, "--executor ray: the Ray cluster")
        self._running: dict[Any, Job] = {}
        self._stopping = False

    def threads_per_run(self) -> int:
        return 1

    def run(self, jobs: list[Job], on_event: Event, workdir: Path) -> None:
        try:
            import ray
        except ImportError:
            raise FedltError('the ray executor needs Ray: pip install -e ".[flower]"') from None
        try:
            ray.init(address=self.address, runtime_env=self.runtime_env, log_to_driver=False,
                     configure_logging=False)
        except (ConnectionError, TimeoutError, RuntimeError, ValueError) as exc:  # Ray's own bounded wait ran out
            raise FedltError(f"--executor ray: could not join the Ray cluster at {self.address or 'a new local Ray'}: "
                             f"{type(exc).__name__}: {first_line(exc)[:300]}") from None
        try:
            slots = max(int(ray.cluster_resources().get("CPU", 1)), 1)
            pending = list(jobs)
            while pending or self._running:
                while pending and not self._stopping and (
                        sum(j.threads or 1 for j in self._running.values()) + (pending[0].threads or 1) <= slots
                        or not self._running):
                    job = pending.pop(0)
                    remote = ray.remote(num_cpus=job.threads or 1, max_retries=0)(run_job)
                    self._running[remote.remote(job)] = job
                    on_event("started", job.id, None)
                if self._stopping:
                    pending.clear()
                if not self._running:
                    break
                done, _ = ray.wait(list(self._running), num_returns=1, timeout=0.5)
                for ref in done:
                    job = self._running.pop(ref)
                    try:
                        outcome = ray.get(ref)
                    except Exception as exc:  # the task or its worker died
                        outcome = Outcome(job.id, "failed", f"ray: {type(exc).__name__}: {first_line(exc)}")
                    on_event("finished", job.id, outcome)
        finally:
            ray.shutdown()

    def stop(self) -> None:
        """Ray interrupts each running task as Ctrl-C would: its run stops after the round."""
        import ray

        self._stopping = True
        for ref in list(self._running):
            ray.cancel(ref)


DEFAULT_TIMEOUT_MIN = 60  # a Slurm task's time limit unless timeout_min is given


@EXECUTORS.register("slurm")
class SlurmExecutor:
    """A Slurm job array through submitit, one array task per run; ``params`` go to submitit's
    ``update_parameters`` (``slurm_partition``, ``timeout_min``, ``mem_gb``, ``gpus_per_node``,
    ``slurm_array_parallelism``, ``slurm_account``, ...; ``cpus_per_task`` defaults to the run's
    threads, ``timeout_min`` to 60). ``cluster=local`` runs the array on this machine (submitit's
    local executor), ``debug`` in this process. Logs go to ``<study>/submitit/``."""

    def __init__(self, cluster: str | None = None, poll_s: float = 2.0, **params: Any) -> None:
        self.cluster, self.poll_s, self.params = cluster, poll_s, params
        self._jobs: list[Any] = []
        self._stopping = False

    def threads_per_run(self) -> int:
        return 1

    def run(self, jobs: list[Job], on_event: Event, workdir: Path) -> None:
        try:
            import submitit
        except ImportError:
            raise FedltError('the slurm executor needs submitit: pip install -e ".[sweep]"') from None
        executor = submitit.AutoExecutor(folder=Path(workdir) / "submitit" / "%j", cluster=self.cluster)
        threads = max((j.threads or 1) for j in jobs)
        try:
            # submitit's local executor would otherwise stop a task after 2 minutes
            defaults = {"cpus_per_task": threads, "name": "fedlt-sweep", "timeout_min": DEFAULT_TIMEOUT_MIN}
            executor.update_parameters(**(defaults | self.params))
        except (ValueError, TypeError) as exc:
            raise FedltError(f"--executor-param: {first_line(exc)}") from None
        with executor.batch():  # one job array
            submitted = [executor.submit(run_job, job) for job in jobs]
        self._jobs = submitted
        waiting = dict(zip(submitted, jobs))
        for job in jobs:
            on_event("started", job.id, None)
        while waiting:
            for handle in [h for h in waiting if h.done()]:
                job = waiting.pop(handle)
                try:
                    outcome = handle.result()
                except Exception as exc:  # the array task failed outside run_job (killed, timed out)
                    status = "stopped" if self._stopping else "failed"  # cancelled by stop(): resumable
                    outcome = Outcome(job.id, status, f"slurm job {handle.job_id}: {first_line(exc)}")
                on_event("finished", job.id, outcome)
            if waiting:
                time.sleep(self.poll_s)

    def stop(self) -> None:
        self._stopping = True
        for handle in self._jobs:
            if not handle.done():
                handle.cancel(check=False)

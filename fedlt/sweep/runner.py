"""Run a study: plan its directory, hand the runs that are not done to an executor, and keep the
manifest up to date as they start and finish.

The coordinator (this process) is the only writer of ``study.json``. A run already done is
skipped; one with a run directory (``config.json`` + ``partition.npz``) is resumed from its
checkpoint (``engine.run(config, resume=True)``); the rest start afresh. SIGINT/SIGTERM ask the
executor to stop every run after its round (a checkpoint is saved); a second signal stops them at
once. A failed run is recorded with its one-line error and the others go on.
"""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlt import rundir
from fedlt.sweep import track
from fedlt.sweep.executors import EXECUTORS, Job, Outcome
from fedlt.sweep.study import Study, clear_partial, expand, plan, status_on_disk, write_manifest


@dataclass
class SweepResult:
    out: Path
    total: int
    skipped: int  # already done before this call
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    stop_signal: int | None = None

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes.values())

    @property
    def failed(self) -> int:
        return self.count("failed")


@contextmanager
def _relay_signals(stop: Callable[[int], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda signum, frame: stop(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def jobs_of(study: Study, out: Path, manifest: dict[str, Any], threads: int | None,
            tracking: tuple[dict[str, Any], ...]) -> tuple[list[Job], int]:
    """The jobs still to run (resumed or fresh) and how many runs are done already."""
    configs = {e.id: e.config for e in expand(study, out)}
    jobs, done = [], 0
    for run in manifest["runs"]:
        run_dir = out / run["dir"]
        state = status_on_disk(run_dir)
        if state == "done":
            run["status"], run["error"] = "done", None
            done += 1
            continue
        if state == "new" and run_dir.exists():
            clear_partial(run_dir)  # killed before its partition was saved: start it again
        jobs.append(Job(run["id"], configs[run["id"]], resume=state == "resumable", threads=threads,
                        tracking=tracking))
    return jobs, done


def sweep(study: Study, out: Path, *, executor: str = "local", executor_params: dict[str, Any] | None = None,
          extend: bool = False, threads: int | None = None, track_with: tuple[str, ...] = (),
          tracking_uri: str | None = None,
          on_plan: Callable[[dict[str, Any], list[Job]], None] | None = None,
          on_event: Callable[[str, str, Outcome | None], None] | None = None) -> SweepResult:
    """Run every run of ``study`` in ``out`` that is not done yet (module docstring).

    ``executor`` names an entry of ``EXECUTORS`` created with ``executor_params``; ``threads`` is
    each run's torch threads (default: the executor's, e.g. cores // jobs for ``local``).
    ``on_plan(manifest, jobs)`` is called once before the first run starts, ``on_event(kind, id,
    outcome)`` as runs start and finish. Raises FedltError for a bad study or a changed grid
    before anything is written."""
    out = Path(out)
    manifest = plan(study, out, extend=extend)
    engine = EXECUTORS.create(executor, **(executor_params or {}))
    threads = threads or engine.threads_per_run()
    rundir.check_directory(out, "study directory")
    tracking = tuple(track.spec_for(name, out, tracking_uri) for name in track_with)  # checked: nothing made yet
    created = out  # the outermost directory this call creates, if any
    while not created.parent.exists():
        created = created.parent
    created = None if created.exists() else created
    out.mkdir(parents=True, exist_ok=True)
    try:
        for spec in tracking:
            track.prepare(spec)
    except BaseException:
        if created is not None:  # a refused --track leaves no study directory behind (all in it is the trackers')
            shutil.rmtree(created, ignore_errors=True)
        raise
    jobs, done = jobs_of(study, out, manifest, threads, tracking)
    runs = {r["id"]: r for r in manifest["runs"]}
    for job in jobs:
        runs[job.id]["status"] = "pending"
    write_manifest(out, manifest)
    result = SweepResult(out, len(runs), done)
    if on_plan is not None:
        on_plan(manifest, jobs)

    def handle(kind: str, run_id: str, outcome: Outcome | None) -> None:
        run = runs[run_id]
        if kind == "started":
            run["status"], run["error"] = "running", None
        else:
            assert outcome is not None
            result.outcomes[run_id] = outcome
            run["status"], run["error"] = outcome.status, outcome.error
        write_manifest(out, manifest)
        if on_event is not None:
            on_event(kind, run_id, outcome)

    def stop(signum: int) -> None:
        result.stop_signal = signum
        engine.stop()

    if jobs:
        with _relay_signals(stop):
            engine.run(jobs, handle, out)
    for run in runs.values():  # a run the executor never started (stopped first) stays pending
        if run["status"] == "running":
            run["status"] = "stopped"
    write_manifest(out, manifest)
    return result

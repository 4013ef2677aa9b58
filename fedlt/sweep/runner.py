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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlt import rundir
from fedlt.run.signals import TwoSignalStop
from fedlt.sweep import executors, track
from fedlt.sweep.executors import Job, Outcome
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
def claim_study(out: Path) -> Iterator[list[Path]]:
    """Hold ``out`` for one sweep (fedlt.rundir.hold: created if needed, locked with our PID; a
    second sweep into it is refused naming the first; a directory this call created and left
    empty is removed on exit). Yields the directories it created, deepest first."""
    rundir.check_directory(out, "study directory")
    with rundir.hold(out, "study directory", "one fedlt sweep per study directory; wait for it to end, "
                     "or use another --out") as created:
        yield created


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
    plan(study, out, extend=extend)  # a bad study or a changed grid: refused before anything is created
    engine = executors.create(executor, executor_params or {})
    tracking = tuple(track.spec_for(name, out, tracking_uri) for name in track_with)  # checked: nothing made yet
    with claim_study(out) as created:
        return _sweep_claimed(study, out, engine, extend, threads or engine.threads_per_run(), tracking, created,
                              on_plan, on_event)


def prepare_tracking(tracking: tuple[dict[str, Any], ...], created: list[Path]) -> None:
    """Open each tracker's store; a refusal leaves no study directory behind (all that is in one
    this call created is the trackers')."""
    try:
        for spec in tracking:
            track.prepare(spec)
    except BaseException:
        if created:
            shutil.rmtree(created[-1], ignore_errors=True)
        raise


def _sweep_claimed(study: Study, out: Path, engine: Any, extend: bool, threads: int,
                   tracking: tuple[dict[str, Any], ...], created: list[Path],
                   on_plan: Callable[[dict[str, Any], list[Job]], None] | None,
                   on_event: Callable[[str, str, Outcome | None], None] | None) -> SweepResult:
    """``sweep`` once ``out`` is held: planned again (another sweep may have run meanwhile), then run."""
    manifest = plan(study, out, extend=extend)
    prepare_tracking(tracking, created)  # after the plan: a tracker's store may live inside the study
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

    if jobs:  # every signal is relayed: the first stops the runs after their round, a second at once
        with TwoSignalStop(on_first=stop, on_again=lambda signum, count: stop(signum)):
            engine.run(jobs, handle, out)
    for run in runs.values():  # a run the executor never started (stopped first) stays pending
        if run["status"] == "running":
            run["status"] = "stopped"
    write_manifest(out, manifest)
    return result

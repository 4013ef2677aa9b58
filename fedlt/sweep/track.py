"""Experiment tracking for a study's runs: MLflow (a local sqlite store) and TensorBoard.

A tracker lives in the process that trains a run and is fed by the engine's hooks:
``start(run_id, config, rounds_done)`` from ``on_start``, ``log_round(round, row)`` from
``on_round`` and ``finish(status, run_dir)`` at the end. Both are optional extras
(``pip install -e ".[track]"``); without them fedlt runs as before, and asking for one names the
install command. The study's coordinator calls ``prepare(spec)`` once before any worker starts
(MLflow creates its database and the experiment there, not in two workers at once).

- ``mlflow``: one MLflow run per fedlt run (named by its run id, tagged ``fedlt.run_id``; a
  resumed run continues the same MLflow run): the flattened config as params, every numeric
  metrics column per round (step = round), and the run directory as artifacts at the end.
  Default store: ``sqlite:///<study>/mlflow.db``, artifacts under ``<study>/mlartifacts``.

A store is checked before the study directory is created (``spec_for``): an unknown tracker, a
URI MLflow cannot use, a sqlite file that is not a database or cannot be written, a tracking
server that does not answer within ``TIMEOUT`` seconds — each is one line naming the URI (and
the address). A tracker that fails later, during a run, is dropped for the rest of that run with
one warning line; the run itself goes on (tracking is a side channel), and the study's last line
says which runs lost their tracking.
- ``tensorboard``: event files per run in ``<study>/tensorboard/<run id>/``, one scalar per
  numeric metrics column (tag ``accuracy``, ``train_loss``, ...; step = round).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fedlt import rundir
from fedlt.errors import FedltError, first_line
from fedlt.registry import Registry
from fedlt.sweep.net import answers_http

TRACKERS: Registry[Any] = Registry("tracker")
INSTALL = 'pip install -e ".[track]"'
TIMEOUT = 10.0  # seconds: a tracking server's answer, per request (MLflow's own default is 120 s, 7 retries)
# MLflow's stores fedlt checks and uses; a file store is refused by MLflow 3 itself, a database
# server (postgresql, mysql) would need a connection check of its own
SCHEMES = ("sqlite", "http", "https")


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """The numeric columns of a metrics row (per-class lists and the round itself left out)."""
    return {k: float(v) for k, v in row.items()
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def spec_for(name: str, study_dir: Path, uri: str | None = None) -> dict[str, Any]:
    """What a worker needs to build tracker ``name`` for the study in ``study_dir``; the tracker's
    store is checked here, before anything is created (the tracker's ``check_uri``)."""
    tracker = TRACKERS.get(name)  # one line naming the valid trackers
    study_dir = Path(study_dir).resolve()
    getattr(tracker, "check", lambda study_dir, uri: None)(study_dir, uri)
    return {"name": name, "study_dir": str(study_dir), "uri": uri, "experiment": study_dir.name}


def create(spec: dict[str, Any]) -> Any:
    params = {k: v for k, v in spec.items() if k != "name"}
    return TRACKERS.create(spec["name"], **params)


def prepare(spec: dict[str, Any]) -> None:
    """Once, in the coordinator, before any run starts: any failure is one line naming the store."""
    tracker = create(spec)
    try:
        getattr(tracker, "prepare", lambda: None)()
    except FedltError:
        raise
    except Exception as exc:  # MLflow's and SQLAlchemy's errors share no base; their text is many lines
        where = getattr(tracker, "uri", spec.get("uri"))
        raise FedltError(f"--track {spec['name']}: the store {where} could not be used: "
                         f"{type(exc).__name__}: {first_line(exc)[:300]}") from None


def check_sqlite(uri: str, path: Path) -> None:
    """An existing file must be a sqlite database this process can write; a new one must be
    creatable (its directory writable). Nothing is created here."""
    if not path.exists():
        rundir.check_directory(path.parent, f"--tracking-uri {uri}: the directory")
        return
    if not path.is_file():
        raise FedltError(f"--tracking-uri {uri}: {path} is not a regular file")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=rw", uri=True, timeout=TIMEOUT)
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()  # "file is not a database"
            db.execute("BEGIN IMMEDIATE")  # a write lock: refused on a read-only file or file system
            db.rollback()
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise FedltError(f"--tracking-uri {uri}: {path} cannot be used as MLflow's store ({exc})") from None


@TRACKERS.register("mlflow")
class MLflowTracker:
    def __init__(self, study_dir: str, experiment: str, uri: str | None = None) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise FedltError(f"--track mlflow needs MLflow: {INSTALL}") from None
        # several workers write at once: wait for sqlite's lock (60 s) instead of failing at 5 s
        self.uri = uri or self.default_uri(Path(study_dir))
        self.artifacts = (Path(study_dir) / "mlartifacts").as_uri()
        self.experiment = experiment
        # a server that hangs must not hang the study: bounded requests, few retries (unless the
        # user set MLflow's own variables); inherited by the workers
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(TIMEOUT)))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id: str | None = None

    @staticmethod
    def default_uri(study_dir: Path) -> str:
        return f"sqlite:///{study_dir / 'mlflow.db'}?timeout=60"

    @classmethod
    def check(cls, study_dir: Path, uri: str | None) -> None:
        """A store fedlt can check and MLflow can use: ``sqlite:///path`` (a database, or a file
        that can be created) or ``http(s)://host:port`` answering within ``TIMEOUT`` seconds."""
        uri = uri or cls.default_uri(study_dir)
        try:
            parts = urlsplit(uri)
        except ValueError as exc:  # e.g. an unclosed IPv6 bracket
            raise FedltError(f"--tracking-uri {uri!r} is not a URI ({exc})") from None
        if parts.scheme not in SCHEMES:
            raise FedltError(f"--tracking-uri {uri!r}: expected sqlite:///PATH or http(s)://HOST:PORT "
                             f"(an MLflow server)")
        if parts.scheme == "sqlite":
            if parts.netloc or not parts.path.startswith("/") or parts.path == "/":
                raise FedltError(f"--tracking-uri {uri!r}: a sqlite store is sqlite:///relative/path.db or "
                                 "sqlite:////absolute/path.db")
            check_sqlite(uri, Path(parts.path[1:]))
            return
        answers_http(uri, TIMEOUT, "--tracking-uri: the MLflow server")

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        return self.client.create_experiment(self.experiment, artifact_location=self.artifacts)

    def prepare(self) -> None:
        self._experiment_id()

    def start(self, run_id: str, config: dict[str, Any], rounds_done: int) -> None:
        experiment_id = self._experiment_id()
        previous = self.client.search_runs([experiment_id], filter_string=f"tags.`fedlt.run_id` = '{run_id}'",
                                           max_results=1)
        if previous:  # a resumed run continues its MLflow run
            self.run_id = previous[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(experiment_id, run_name=run_id, tags={"fedlt.run_id": run_id})
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log_round(self, round_done: int, row: dict[str, Any]) -> None:
        import time

        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(k, v, stamp, round_done) for k, v in numbers(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str, run_dir: Path) -> None:
        if self.run_id is None:
            return
        if status == "done":
            self.client.log_artifacts(self.run_id, str(run_dir))
        mlflow_status = {"done": "FINISHED", "failed": "FAILED"}.get(status, "KILLED")
        self.client.set_terminated(self.run_id, status=mlflow_status)


@TRACKERS.register("tensorboard")
class TensorBoardTracker:
    def __init__(self, study_dir: str, experiment: str, uri: str | None = None) -> None:
        try:
            import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
        except ImportError:
            raise FedltError(f"--track tensorboard needs TensorBoard: {INSTALL}") from None
        self.root = Path(uri) if uri else Path(study_dir) / "tensorboard"
        self.writer: Any = None

    @staticmethod
    def check(study_dir: Path, uri: str | None) -> None:
        """The event files' directory can be written (or made); the default is the study's own."""
        if uri is not None:
            rundir.check_directory(Path(uri), "--tracking-uri (TensorBoard's directory)")

    def start(self, run_id: str, config: dict[str, Any], rounds_done: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.root / run_id))
        if rounds_done == 0:
            self.writer.add_text("config", "\n".join(f"    {k} = {v}" for k, v in flatten(config).items()))

    def log_round(self, round_done: int, row: dict[str, Any]) -> None:
        for key, value in numbers(row).items():
            self.writer.add_scalar(key, value, round_done)
        self.writer.flush()

    def finish(self, status: str, run_dir: Path) -> None:
        if self.writer is not None:
            self.writer.close()

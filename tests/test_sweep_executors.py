"""The ray executor runs a 4-run study, the slurm one (submitit's local executor) a 2-task job
array (each task a fresh process importing fedlt, MLflow and TensorBoard: seconds each); the trackers
(MLflow's sqlite store, TensorBoard's event files) are read back with their own readers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fedlt.sweep import Study, sweep
from conftest import without_timings

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model="mlp", train_limit=300, test_limit=200, clients=4, participation=1.0, rounds=2, local_iters=2,
            server_batch=40, eval_every=1, partition={"name": "iid"})
STUDY = Study(TINY, {"algorithm": ["fedavg", "fedlc"]}, seeds=[0, 1])
ARRAY = Study(TINY, {"algorithm": ["fedavg", "fedlc"]}, seeds=[1])  # the slurm executor's: 2 array tasks


def check_done(out: Path, result, runs: int = 4) -> None:
    assert result.count("done") == runs and result.failed == 0, result.outcomes
    manifest = json.loads((out / "study.json").read_text())
    assert [r["status"] for r in manifest["runs"]] == ["done"] * runs
    for run in manifest["runs"]:
        rows = without_timings(out / run["dir"])
        assert [r["round"] for r in rows] == [1, 2] and all(0 <= r["accuracy"] <= 1 for r in rows)


@pytest.fixture
def worker_path(monkeypatch):
    """Processes the executors start import this tree's fedlt."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.xdist_group("ray")  # one Ray at a time (tests/conftest.py)
@pytest.mark.usefixtures("worker_path")
def test_the_ray_executor_runs_a_study_on_a_ray_head_started_on_loopback(tmp_path, monkeypatch):
    """A head node of its own (``ray start --head --block`` on 127.0.0.1, in its own process group
    and temp dir; stopped by signalling that group, never ``ray stop``, which would end every Ray
    on the machine)."""
    ray = shutil.which("ray") or pytest.fail("ray's command line is missing (pip install -e '.[flower]')")
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    head = subprocess.Popen([ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
                             "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                             "--temp-dir", temp], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and head.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        assert head.poll() is None, head.stderr.read().decode()[-2000:]
        out = tmp_path / "ray-study"
        result = sweep(STUDY, out, executor="ray", executor_params={"address": f"127.0.0.1:{port}"})
        check_done(out, result)
        pids = {o.pid for o in result.outcomes.values()}
        assert os.getpid() not in pids  # the runs ran in Ray's workers
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # --block: the head takes its processes down with it
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.usefixtures("worker_path")
def test_the_slurm_executor_runs_a_job_array_and_the_trackers_log_every_round(tmp_path):
    pytest.importorskip("submitit", reason="the slurm executor's extra: pip install -e '.[sweep]'")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "slurm-study"
    result = sweep(ARRAY, out, executor="slurm", executor_params={"cluster": "local", "poll_s": 0.5},
                   track_with=("mlflow", "tensorboard"))
    check_done(out, result, runs=2)
    assert list((out / "submitit").iterdir())  # submitit's own logs, one folder per array task

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(out.name)
    runs = {r.data.tags["fedlt.run_id"]: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["fedavg__seed1", "fedlc__seed1"]
    for run_id, mlflow_run in runs.items():
        rows = [json.loads(line) for line in (out / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
        history = client.get_metric_history(mlflow_run.info.run_id, "accuracy")
        assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == \
            [(r["round"], pytest.approx(r["accuracy"])) for r in rows]
        assert mlflow_run.info.status == "FINISHED"
        assert mlflow_run.data.params["algorithm"] == run_id.split("__")[0]
        assert mlflow_run.data.params["seeds.model"] == run_id[-1]
        artifacts = {a.path for a in client.list_artifacts(mlflow_run.info.run_id)}
        assert {"metrics.jsonl", "summary.json", "config.json"} <= artifacts

        events = EventAccumulator(str(out / "tensorboard" / run_id))
        events.Reload()
        logged = [(e.step, e.value) for e in events.Scalars("train_loss")]
        assert logged == [(r["round"], pytest.approx(r["train_loss"])) for r in rows]

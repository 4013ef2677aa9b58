"""8 short runs (MLP on MNIST) one after another vs two at a time: ``fedlt sweep --jobs 1``
against ``--jobs 2``, one torch thread per run in both (so the metrics can be compared bit for
bit), on the same machine, one after the other. Reports the wall-time ratio (target <= 0.6 on 2
cores) and whether every run's metrics (timing fields aside) are equal between the two.

Run: python benchmarks/sweep_throughput.py   (uses both cores for a few minutes)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parents[1]
# 4 algorithms x 2 seeds of a small FedAvg-family run: 10 clients, 3 rounds of one local epoch on
# all 60000 training images (~2 s of training per round: long enough that a worker's start-up, ~3 s
# of imports, does not dominate as it did with 6000 images)
STUDY = """
seeds = [0, 1]
[base]
model = "mlp"
clients = 10
participation = 1.0
rounds = 3
local_epochs = 1
batch_size = 64
partition = {name = "dirichlet", beta = 0.5}
eval_every = 1
[axes]
algorithm = ["fedavg", "fedprox", "fedlc", "fedvls"]
"""


def sweep(study: Path, out: Path, jobs: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedlt.cli", "sweep", str(study), "--out", str(out), "--jobs", str(jobs),
                    "--threads", "1", "--quiet"], env=env, check=True)
    return time.perf_counter() - started


def metrics(out: Path) -> dict[str, list[dict]]:
    return {d.name: [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
                     for line in (d / "metrics.jsonl").read_text().splitlines()]
            for d in sorted((out / "runs").iterdir())}


def step_time(out: Path) -> float:
    """Mean train_s per round over every run: the same work in both modes, so its ratio is the
    slowdown of one run when two share the machine (memory bandwidth, caches)."""
    times = [json.loads(line)["train_s"] for d in (out / "runs").iterdir()
             for line in (d / "metrics.jsonl").read_text().splitlines()]
    return sum(times) / len(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        study = Path(tmp) / "throughput.toml"
        study.write_text(STUDY)
        load_before = os.getloadavg()[0]
        sequential = sweep(study, Path(tmp) / "jobs1", 1)
        parallel = sweep(study, Path(tmp) / "jobs2", 2)
        load_after = os.getloadavg()[0]
        equal = metrics(Path(tmp) / "jobs1") == metrics(Path(tmp) / "jobs2")
        runs = len(metrics(Path(tmp) / "jobs1"))
        train = {jobs: step_time(Path(tmp) / f"jobs{jobs}") for jobs in (1, 2)}
    rows = [["--jobs 1", runs, round(sequential, 1), 1.0, round(train[1], 3), 1.0, "-"],
            ["--jobs 2", runs, round(parallel, 1), round(parallel / sequential, 3), round(train[2], 3),
             round(train[2] / train[1], 3), "equal" if equal else "DIFFER"]]
    common.report("sweep_throughput", ["executor", "runs", "wall s (command)", "ratio", "train s/round",
                                       "train ratio", "metrics vs --jobs 1"], rows,
                  {"cores": os.cpu_count(), "threads_per_run": 1, "load_1min_before": round(load_before, 2),
                   "load_1min_after": round(load_after, 2), "study": STUDY.strip()})
    if not equal:
        sys.exit("the metrics differ between --jobs 1 and --jobs 2")


if __name__ == "__main__":
    main()

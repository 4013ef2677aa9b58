"""``--cohort N`` against one client at a time, per algorithm, on the CPU (issue 43).

One process, one prepared run per algorithm (MNIST, the ``mlp``, 20 clients, 10 a round, one
local epoch of batch 10 by default); then ``--reps`` times, alternating, one round trained
sequentially (``LocalRunner``) and the same round as cohorts of ``--cohort`` (``CohortRunner``),
each from the same global model and client states, timed by the process's CPU time (the machine
this runs on may be shared: wall time is printed too but not the measure). The ratio is
sequential / cohort per pair; the table gives their median and range.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/cohort_cpu.py --algos fedper moon --reps 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (sets the benchmarks' environment)
import torch

from fedlt.algorithms.base import ClientData
from fedlt.algorithms.cohort import CohortRunner, cohort_reason
from fedlt.algorithms.protocol import ClientStates, LocalRunner
from fedlt.config import RunConfig
from fedlt.engine import prepare, train_round


def _timed_round(prep, clients, states, runner) -> tuple[float, float]:
    """One round from copies of the server's and the clients' state: (CPU s, wall s)."""
    algorithm = prep.algorithm
    saved = copy.deepcopy(algorithm.state_dict())
    work = ClientStates()
    work.load_state_dict(copy.deepcopy(states.state_dict()))
    cpu, wall = time.process_time(), time.perf_counter()
    train_round(algorithm, prep.ctx, 1, clients, work, runner)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    algorithm.load_state_dict(saved)
    return cpu, wall


def measure(name: str, args: argparse.Namespace, out: Path) -> list:
    config = RunConfig(dataset="mnist", model=args.model, algorithm=name, clients=args.clients, participation=1.0,
                       local_epochs=1, batch_size=args.batch, train_limit=args.train_limit, test_limit=100,
                       fused="off", out=out / name)
    prep = prepare(config)
    ids = list(range(args.sampled))
    clients = []
    for cid in ids:
        idx = torch.as_tensor(prep.partition.client_indices[cid], dtype=torch.long)
        clients.append(ClientData(cid, prep.data.x_train[idx], prep.data.y_train[idx], prep.counts[cid]))
    reason = cohort_reason(prep.algorithm, prep.algorithm._work)
    if reason:
        return [name, f"falls back: {reason}", "", "", "", ""]
    states = ClientStates()
    train_round(prep.algorithm, prep.ctx, 0, clients, states, LocalRunner())  # warm-up; round 2's states
    sequential, cohort, ratios = [], [], []
    for _ in range(args.reps):
        a = _timed_round(prep, clients, states, LocalRunner())
        b = _timed_round(prep, clients, states, CohortRunner(LocalRunner(), args.cohort))
        sequential.append(a[0]), cohort.append(b[0]), ratios.append(a[0] / b[0])
    return [name, statistics.median(sequential), statistics.median(cohort), statistics.median(ratios),
            f"{min(ratios):.2f}–{max(ratios):.2f}", f"{len(ids)} clients, {args.reps} pairs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", nargs="+", default=["fedavg", "fedper", "moon"])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--sampled", type=int, default=10)
    parser.add_argument("--cohort", type=int, default=10)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--train-limit", type=int, default=6000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fedlt-cohort-bench-") as tmp:
        rows = [measure(name, args, Path(tmp)) for name in args.algos]
    common.report("cohort_cpu", ["algorithm", "sequential CPU s/round", f"cohort {args.cohort} CPU s/round",
                                 "speed-up (median)", "range", "pairs"], rows, meta=vars(args) | {"out": str(args.out)},
                  out_dir=args.out)


if __name__ == "__main__":
    main()

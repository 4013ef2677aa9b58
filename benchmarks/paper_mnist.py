"""FedVLS's MNIST setting (paper Table: 10 clients, full participation, Dir(beta), MLP 784-200-200-10,
5 local epochs, batch 64, SGD lr 0.01 momentum 0.9) for FedAvg, FedLC, FedVLS and Fed-GraB, as closely
as this machine allows: fewer rounds than the paper's 50 (``--rounds``). No weight decay and no
clipping (the paper lists neither).

Run: python benchmarks/paper_mnist.py [--rounds 10] [--betas 0.5 0.1 0.05]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common  # noqa: F401

from fedlt.config import RunConfig
from fedlt.engine import run

PAPER_BETA_005 = {"fedavg": 94.77, "fedlc": 85.56, "fedvls": 95.56}  # FedVLS paper, 50 rounds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--betas", type=float, nargs="+", default=[0.5, 0.1, 0.05])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "fedlc", "fedvls", "fedgrab"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for beta in args.betas:
            for algo in args.algorithms:
                config = RunConfig(
                    dataset="mnist", model="mlp", split=None, algorithm=algo, clients=10, participation=1.0,
                    partition={"name": "dirichlet", "beta": beta}, rounds=args.rounds, local_epochs=5, batch_size=64,
                    optimiser={"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "clip": None},
                    out=Path(tmp) / f"{algo}-{beta}",
                )
                started = time.perf_counter()
                summary = run(config)
                wall = time.perf_counter() - started
                paper = PAPER_BETA_005.get(algo) if beta == 0.05 else None
                rows.append([beta, algo, round(100 * summary["best"]["accuracy"], 2),
                             round(100 * summary["final"]["accuracy"], 2),
                             round(100 * summary["final"]["balanced_accuracy"], 2), paper if paper else "-",
                             round(wall, 1)])
                print(rows[-1], flush=True)
    common.report("paper_mnist", ["beta", "algorithm", "best acc %", "final acc %", "final balanced %",
                                  "paper (50 rounds) %", "wall s"], rows, {"rounds": args.rounds})


if __name__ == "__main__":
    main()

"""FedVLS's MNIST setting (paper Table: 10 clients, full participation, Dir(beta), MLP 784-200-200-10,
5 local epochs, batch 64, SGD lr 0.01 momentum 0.9, 50 rounds) for FedAvg, FedLC, FedVLS and
Fed-GraB. No weight decay and no clipping (the paper lists neither; the authors' FedVLS client
forces weight decay 0). Evaluated every round on the 10k MNIST test set, so both the final and the
best-over-rounds accuracy are reported (the paper reports the best over rounds).

Run: python benchmarks/paper_mnist.py [--rounds 50] [--betas 0.05 0.1 0.5] [--algorithms fedavg fedvls] [--tag _beta0.1]

The same runs against the authors' own code, on the same partition: tools/fedvls_repro/README.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common  # noqa: F401
import torch

from fedlt.config import RunConfig
from fedlt.engine import run

# FedVLS paper, MNIST, Dir(0.05), best over 50 rounds. Measured by the authors' main.py, which on
# MNIST evaluates on the union of the clients' training sets (tools/fedvls_repro/README.md).
PAPER_BETA_005 = {"fedavg": 94.77, "fedlc": 85.56, "fedvls": 95.56}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--betas", type=float, nargs="+", default=[0.05])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "fedlc", "fedvls", "fedgrab"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (shared machines: 1)")
    parser.add_argument("--tag", default="", help="results/paper_mnist<tag>.json, so runs split across processes keep theirs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for beta in args.betas:
            for algo in args.algorithms:
                config = RunConfig(
                    dataset="mnist", model="mlp", split=None, algorithm=algo, clients=10, participation=1.0,
                    partition={"name": "dirichlet", "beta": beta}, rounds=args.rounds, local_epochs=5, batch_size=64,
                    optimiser={"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "clip": None},
                    eval_every=1, client_eval=True, checkpoint_every=10**6, out=Path(tmp) / f"{algo}-{beta}",
                )
                started = time.perf_counter()
                summary = run(config)
                wall = time.perf_counter() - started
                paper = PAPER_BETA_005.get(algo) if beta == 0.05 else None
                rows.append([beta, algo, round(100 * summary["final"]["accuracy"], 2),
                             round(100 * summary["best"]["accuracy"], 2), summary["best"]["round"],
                             round(100 * summary["final"]["balanced_accuracy"], 2),
                             round(100 * summary["final"]["client_mean_accuracy"], 2),
                             paper if paper else "-", round(wall, 1)])
                print(rows[-1], flush=True)
    common.report("paper_mnist" + args.tag, ["beta", "algorithm", "final acc %", "best acc %", "best round",
                                  "final balanced %", "final client-mean %", "paper (best of 50) %", "wall s"],
                  rows, {"rounds": args.rounds, "eval_every": 1, "partition_seed": 0})


if __name__ == "__main__":
    main()

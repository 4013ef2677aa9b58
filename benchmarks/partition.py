"""Time of each partitioner on 60k labels for 10, 100 and 1000 clients.

Labels are synthetic and balanced (6000 per class, 10 classes, shuffled), or MNIST's training
labels with --mnist. Each cell is the best of --repeats calls of
``fedlt.partitioners.create(name, **params)(labels, K, seed)``, manifest and sha256 included.
A setting that cannot be met (dirichlet's bounded redraws) is timed until its FedltError.
Writes benchmarks/results/partition.json (partition_mnist.json with --mnist).
Run: python benchmarks/partition.py [--repeats 5] [--mnist]
"""

from __future__ import annotations

import argparse
import os
import time

import common
import numpy as np

import fedlt.partitioners as P
from fedlt.errors import FedltError

CASES = [
    ("iid", {}),
    ("dirichlet", {"beta": 0.5}),
    ("dirichlet", {"beta": 0.1}),
    ("dirichlet", {"beta": 0.01}),
    ("quantity", {"alpha": 2}),
    ("shards", {"shards_per_client": 2}),
    ("longtail", {"imbalance_factor": 10, "then": {"name": "iid"}}),
    ("longtail", {"imbalance_factor": 10, "then": {"name": "dirichlet", "beta": 0.5}}),
]
CLIENTS = (10, 100, 1000)
os.environ.setdefault("COLUMNS", "150")  # rich would squeeze the partitioner column into 80 characters


def labels(use_mnist: bool) -> np.ndarray:
    if use_mnist:
        import fedlt.datasets

        return fedlt.datasets.create("mnist").y_train.numpy()
    return np.random.default_rng(0).permutation(np.repeat(np.arange(10), 6000))


def time_case(partitioner, y: np.ndarray, num_clients: int, repeats: int) -> tuple[float, str, str]:
    best, outcome, smallest = float("inf"), "ok", "—"
    for seed in range(repeats):
        start = time.perf_counter()
        try:
            part = partitioner(y, num_clients, seed)
            smallest = str(int(part.class_counts.sum(axis=1).min()))
        except FedltError:
            outcome = "FedltError (gave up)"
        best = min(best, time.perf_counter() - start)
    return best * 1000, outcome, smallest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mnist", action="store_true", help="MNIST's training labels instead of synthetic ones")
    args = parser.parse_args()
    y = labels(args.mnist)
    rows = []
    for name, params in CASES:
        partitioner = P.create(name, **params)
        for num_clients in CLIENTS:
            ms, outcome, smallest = time_case(partitioner, y, num_clients, args.repeats)
            rows.append([partitioner.describe(), num_clients, round(ms, 2), smallest, outcome])
    common.report("partition_mnist" if args.mnist else "partition", ["partitioner", "clients", "best ms", "smallest client", "outcome"], rows,
                  meta={"labels": "mnist" if args.mnist else "synthetic balanced 10×6000", "samples": int(y.size),
                        "repeats": args.repeats, "max_dirichlet_draws": P.schemes.MAX_DIRICHLET_DRAWS})


if __name__ == "__main__":
    main()

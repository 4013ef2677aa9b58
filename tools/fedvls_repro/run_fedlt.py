"""fedlt's side: one method on the FedVLS MNIST setting, on a saved partition, evaluated every round.

Besides fedlt's own metrics (the 10k MNIST test set), every evaluation also measures the global
model on the union of the clients' training sets, which is what the authors' main.py evaluates
on MNIST (see README.md), so both sides can be compared on both sets.

    python run_fedlt.py --algo fedvls --partition-file WORK/partition-0.05.npz --out WORK/fedlt-fedvls-0.05

On the authors' own client data (export.py's files; the union of the clients is all of x_train):

    python run_fedlt.py --algo fedavg --weight-decay 1e-5 --dataset arrays \
        --data-root WORK/authors-data/mnist-authors.npz --partition-file WORK/authors-data/partition.npz \
        --out WORK/fedlt-fedavg-0.05-authorsdata
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

import fedlt.engine
import fedlt.run.evaluation
import fedlt.run.parts
from fedlt.config import RunConfig
from fedlt.datasets.arrays import read_arrays
from fedlt.datasets.base import InMemoryDataset, normalise
from fedlt.datasets.mnist import MNIST_FILES, PACKAGED_MNIST, read_idx
from fedlt.engine import load_data

# the raw uint8 (x_train, x_test) behind each dataset this harness runs, for --authors-norm
RAW_IMAGES = {
    "mnist": lambda root: tuple(read_idx(PACKAGED_MNIST / MNIST_FILES[k]) for k in ("x_train", "x_test")),
    "arrays": lambda root: tuple(np.asarray(read_arrays(root)[k]) for k in ("x_train", "x_test")),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--algo", required=True, help="fedlt algorithm (fedavg, fedlc, fedvls, ...)")
    parser.add_argument("--loss", default=None, help="override the algorithm's local objective")
    parser.add_argument("--partition-file", type=Path, required=True)
    parser.add_argument("--dataset", choices=sorted(RAW_IMAGES), default="mnist")
    parser.add_argument("--data-root", type=Path, default=None, help="the arrays file (export.py's mnist-authors.npz)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="the paper's FedAvg: 1e-5")
    parser.add_argument("--seed", type=int, default=0, help="model and sampling seeds (the partition is the file's)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--clients", type=int, default=10, help="as many as the partition file holds")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--out", type=Path, required=True)
    # ablations: the authors' data pipeline, one difference at a time (measurement harness only)
    parser.add_argument("--authors-norm", action="store_true",
                        help="inputs (x/255 - 0.5)/0.5 as the authors' transform, instead of fedlt's "
                             "(x/255 - 0.1307)/0.3081 (mnist) or the training set's own mean and std (arrays)")
    parser.add_argument("--drop-last", action="store_true",
                        help="drop each epoch's last partial batch, as the authors' DataLoader(drop_last=True)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"[harness] command: {' '.join(sys.orig_argv[1:])}", flush=True)  # named even if the run stops early
    params = {"loss": args.loss} if args.loss else {}
    config = RunConfig(
        dataset=args.dataset, data_root=args.data_root, model="mlp", split=None, algorithm=args.algo,
        algorithm_params=params, clients=args.clients, participation=1.0, partition_file=args.partition_file,
        rounds=args.rounds, local_epochs=5, batch_size=64,
        optimiser={"lr": 0.01, "momentum": args.momentum, "weight_decay": args.weight_decay, "clip": None},
        seeds={"data": 0, "model": args.seed, "sampling": args.seed},
        eval_every=1, client_eval=True, checkpoint_every=10**6, out=args.out,
    )
    data = load_data(config)
    if args.authors_norm:
        fedlt_load = fedlt.run.parts.load_data

        def load_data_authors_norm(cfg):
            d = fedlt_load(cfg)  # same samples, same order; the images re-made from the raw uint8 files
            raw_train, raw_test = RAW_IMAGES[cfg.dataset](cfg.data_root)

            def as_authors(raw: np.ndarray) -> torch.Tensor:
                images = torch.from_numpy(np.array(raw)).reshape(-1, *d.x_train.shape[1:])  # (N, 1, 28, 28)
                return normalise(images, (0.5,), (0.5,))

            return InMemoryDataset(d.name, as_authors(raw_train), d.y_train, as_authors(raw_test), d.y_test,
                                   d.num_classes, d.groups_train, d.class_names)

        fedlt.run.parts.load_data = load_data_authors_norm
        data = load_data_authors_norm(config)
    if args.drop_last:
        from fedlt.algorithms.base import LocalSchedule

        def batches(self, n, generator, device=None):
            for _ in range(self.epochs):
                perm = torch.randperm(n, generator=generator)
                yield from perm[: n - n % self.batch].to(device or "cpu").split(self.batch)

        LocalSchedule.batches = batches
    train_acc: list[float] = []
    evaluate = fedlt.run.evaluation.evaluate

    def evaluate_both(model, *a, **k):
        with torch.no_grad():
            pred = torch.cat([model(x).argmax(1) for x in data.x_train.split(4096)])
        train_acc.append(float((pred == data.y_train).float().mean()))
        print(f"[harness] round {len(train_acc)}: train-union acc {train_acc[-1]:.4f}", flush=True)
        return evaluate(model, *a, **k)

    fedlt.run.evaluation.evaluate = evaluate_both  # measurement only: what is trained is untouched
    summary = fedlt.engine.run(config)
    rows = [json.loads(line) for line in (args.out / "metrics.jsonl").read_text().splitlines()]
    curve = {
        "side": "fedlt", "algo": args.algo, "loss": args.loss, "partition": str(args.partition_file),
        "command": " ".join(sys.orig_argv[1:]), "dataset": args.dataset,
        "data_root": None if args.data_root is None else str(args.data_root), "seed": args.seed,
        "weight_decay": args.weight_decay,
        "partition_sha256": summary["partition"]["sha256"],
        "test_acc": [r["accuracy"] for r in rows if "accuracy" in r],
        "train_union_acc": train_acc,
        "client_mean_acc": [r.get("client_mean_accuracy") for r in rows if "accuracy" in r],
        "wall_time_s": summary["wall_time_s"],
    }
    (args.out / "curve.json").write_text(json.dumps(curve))
    print(json.dumps({k: v for k, v in curve.items() if not isinstance(v, list)}))


if __name__ == "__main__":
    main()

"""The authors' side: run the authors' own main.py (krumpguo/FedVLS, a temporary copy prepared by
prepare.sh) offline, with the MNIST command line of the paper's setting, and record its per-round
accuracy. Nothing here changes how the authors' code trains; this script only

  * stubs three modules main.py imports and never uses for training on MNIST (cv2, h5py, calmsize),
  * forbids torchvision from downloading (the idx files must already be in WORK/rawdata/MNIST/raw),
  * with --data fedlt, swaps data.generate_mnist.generate_mnist for a function that builds the same
    loaders the same way (same transform, DataLoader(batch 64, drop_last=True, shuffle=True)) from
    fedlt's partition of the 60k MNIST training set, so both sides train on identical client data
    (the 10k MNIST test set stands where the authors' pooled held-out split stood),
  * with --data authors, keeps their generate_mnist and records the positions behind its draws
    (export.SplitRecorder: no draw changes), so the curve names the partition's sha256 (equal to
    the partition file export.py writes) and checks their loaders against the raw MNIST images,
  * wraps the server's compute_accuracy to record every evaluation, and also evaluates the other
    set (the real held-out set: all of it, in order), under torch.random.fork_rng so the training
    stream is unchanged.

main.py unpacks generate_mnist's (client loaders, held-out loader, pooled-train loader) as
(party2loaders, global_train_dl, test_dl) and the server evaluates ``test_dl``: on MNIST the
authors' printed "test accuracy" is the accuracy on the union of the clients' TRAINING data.
Both are recorded: ``train_union_acc`` (what the authors' code prints) and ``test_acc``.

    python run_authors.py --work /tmp/fedvls_repro --algo FedVLS --beta 0.05 --data fedlt --out curve.json
    python run_authors.py --work /tmp/fedvls_repro --algo FedAvg --weight-decay 1e-5 --data authors --out curve.json
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedlt.errors import FedltError

from authors import (ALGOS, SERVER_MODULES, authors_command, authors_commit, authors_system,  # noqa: F401
                     inside, prepare_imports)  # beside this file

def fedlt_loaders(partition_file: Path, record: dict):
    """A stand-in for the authors' generate_mnist with the same return order and loader settings,
    on fedlt's partition of the 60k training set and the 10k test set."""
    import torchvision
    import torchvision.transforms as transforms
    from torch.utils.data import DataLoader

    def generate_mnist(dir_path, num_classes, num_clients, niid, balance, partition, alpha):
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])  # theirs
        sets = {}
        for train in (True, False):
            ds = torchvision.datasets.MNIST(root=dir_path + "rawdata", train=train, download=False, transform=transform)
            x = torch.stack([ds[i][0] for i in range(len(ds))])
            sets[train] = (x, ds.targets.clone())
        x_tr, y_tr = sets[True]
        from fedlt.partitioners import Partition  # fedlt reads its own file; the authors' code never sees it

        partition = Partition.load(partition_file)
        partition.check_dataset(y_tr.numpy(), "mnist")  # same labels, same order: the indices mean the same
        parts = [np.asarray(p) for p in partition.client_indices]
        record["partition_sha256"] = partition.sha256
        print(f"[harness] partition sha256 {partition.sha256}", flush=True)  # for a run stopped early
        assert len(parts) == num_clients, (len(parts), num_clients)
        party2loaders_train = {}
        for i, idx in enumerate(parts):
            idx = torch.as_tensor(np.asarray(idx), dtype=torch.long)
            use = [(x, y) for x, y in zip(x_tr[idx], y_tr[idx])]
            party2loaders_train[i] = DataLoader(use, batch_size=64, drop_last=True, shuffle=True)
        union = torch.as_tensor(np.concatenate([np.asarray(p) for p in parts]), dtype=torch.long)
        global_train = DataLoader([(x, y) for x, y in zip(x_tr[union], y_tr[union])], batch_size=64, drop_last=True,
                                  shuffle=True)
        x_te, y_te = sets[False]
        test = DataLoader([(x, y) for x, y in zip(x_te, y_te)], batch_size=64, drop_last=True, shuffle=True)
        record["held_out"] = DataLoader([(x, y) for x, y in zip(x_te, y_te)], batch_size=1000)  # all 10k
        record["client_counts"] = [np.bincount(y_tr[torch.as_tensor(np.asarray(p))].numpy(), minlength=10).tolist()
                                   for p in parts]
        return party2loaders_train, test, global_train  # the authors' order

    return generate_mnist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True, help="the folder prepare.sh filled")
    parser.add_argument("--algo", choices=ALGOS, required=True)
    parser.add_argument("--beta", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help="their -ed: FedAvg's and FedLogitCal's client weight decay (the paper: 1e-5); "
                             "FedVLS's client forces 0")
    parser.add_argument("--data", choices=("fedlt", "authors"), default="fedlt",
                        help="fedlt: fedlt's partition (WORK/partition-<beta>.npz); authors: their own split")
    parser.add_argument("--fresh-optimiser", action="store_true",
                        help="ablation (FedAvg): a new SGD per client and round, as fedlt and their own FedVLS "
                             "client do, instead of one per client kept for the whole run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("extra", nargs="*", help="more authors' flags, after --")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = args.work.resolve()
    try:
        system = authors_system(work)
    except FedltError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    prepare_imports(system)

    record: dict = {}
    import data.generate_mnist as gm  # noqa: E402  (seeds numpy and random at import, as main.py's import does)
    if args.data == "fedlt":
        partition_file = work / f"partition-{args.beta:g}.npz"
        gm.generate_mnist = fedlt_loaders(partition_file, record)
    else:
        gm.generate_mnist = authors_loaders(gm, work, record)

    if args.fresh_optimiser:
        fresh_optimiser_each_round()
    import importlib
    server_module = importlib.import_module(f"flcore.servers.{SERVER_MODULES[args.algo]}")
    server_cls = getattr(server_module, args.algo)
    evaluate = server_cls.compute_accuracy
    curve = {"train_union_acc": [], "test_acc": []}

    def compute_accuracy(self, model, dataloader):
        acc, loss = evaluate(self, model, dataloader)
        with torch.random.fork_rng(devices=[]):
            held, _ = evaluate(self, model, record["held_out"])
        curve["train_union_acc"].append(acc)
        curve["test_acc"].append(held)
        print(f"[harness] round {len(curve['test_acc'])}: printed acc {acc:.4f}, held-out acc {held:.4f}", flush=True)
        return acc, loss

    server_cls.compute_accuracy = compute_accuracy
    argv = ["main.py", *authors_command(work, args.algo, args.beta, rounds=args.rounds,
                                       weight_decay=args.weight_decay, extra=args.extra)]
    sys.argv = argv
    started = time.perf_counter()
    try:
        with inside(system):
            runpy.run_path(str(system / "main.py"), run_name="__main__")
    finally:  # the curve so far is written even if main.py fails after training (e.g. its report)
        write(args, argv, work, curve, record, started)


def fresh_optimiser_each_round() -> None:
    """Ablation: clientAVG.train starts from a new SGD (same lr, momentum 0.9, weight decay) each
    round; their client builds one in __init__ and keeps its momentum buffers across rounds."""
    from flcore.clients.clientavg import clientAVG

    train = clientAVG.train

    def train_fresh(self, *a, **k):
        self.optimizer = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad],
                                         lr=self.learning_rate, momentum=0.9, weight_decay=self.weight_decay)
        return train(self, *a, **k)

    clientAVG.train = train_fresh


def authors_loaders(gm, work: Path, record: dict):
    """Their own generate_mnist, unchanged in every draw, with the positions behind its split
    recorded (export.SplitRecorder) so the curve names the partition's sha256 — the same as
    export.py's partition file — and checked against the raw MNIST images like export.py does."""
    from torch.utils.data import DataLoader

    from export import SplitRecorder, check_loaders

    recorder = SplitRecorder()
    recorder.install(gm)
    original = gm.generate_mnist

    def generate_and_keep(*a, **k):
        import torchvision

        train, held_out, pooled_train = original(*a, **k)
        sets = [torchvision.datasets.MNIST(root=str(work / "rawdata"), train=t, download=False) for t in (True, False)]
        pooled = np.concatenate([s.data.numpy() for s in sets])
        labels = np.concatenate([s.targets.numpy() for s in sets]).astype(np.int64)
        check_loaders(recorder, train, held_out, pooled, labels)
        recorder.pooled = None  # 220 MB the run does not need
        # all 17 500 held-out images, in order (their loader drops the last partial batch at random)
        record["held_out"] = DataLoader(held_out.dataset, batch_size=1000)
        record["partition_sha256"] = recorder.sha256()
        print(f"[harness] partition sha256 {record['partition_sha256']}", flush=True)  # for a run stopped early
        record["client_counts"] = [np.bincount(labels[recorder.train_positions[p]], minlength=10).tolist()
                                   for p in recorder.client_positions]
        return train, held_out, pooled_train

    return generate_and_keep


def write(args, argv, work, curve, record, started) -> None:
    out = {"side": "authors", "algo": args.algo, "beta": args.beta, "data": args.data, "command": " ".join(argv),
           "fresh_optimiser": args.fresh_optimiser,
           "harness_command": " ".join(sys.orig_argv[1:]),  # sys.argv now holds main.py's
           "commit": authors_commit(work), **curve,
           "client_counts": record.get("client_counts"), "partition_sha256": record.get("partition_sha256"),
           "wall_time_s": round(time.perf_counter() - started, 1)}
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    main()

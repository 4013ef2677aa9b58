"""Step-for-step check: the authors' FedVLS client (clientVLS.train, from the temporary copy
prepare.sh made) against fedlt's client_update with the fedvls preset, on the same initial weights,
the same client data and the SAME minibatches, over several rounds with FedAvg aggregation.

The authors' client reads its batches from a DataLoader; here it gets an iterable that replays
exactly the batches fedlt's schedule draws (first pass: the class-count pass it makes once).
Any difference left is in the loss or the loop, not in the data order.

    python equivalence.py --work /tmp/fedvls_repro [--rounds 3] [--epochs 2]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from fedlt.algorithms.base import ClientData, LocalSchedule, client_generator
from fedlt.algorithms.fedavg_family import client_update
from fedlt.algorithms.protocol import ClientTask
from fedlt.context import RoundContext
from fedlt.datasets import create
from fedlt.models import build


class Replay:
    """A stand-in DataLoader for one client in one round: its first iteration is the authors'
    class-count pass (only on the client's first round), then one epoch per iteration, each the
    batches fedlt's schedule draws (the same permutation, split the same way)."""

    def __init__(self, x, y, epochs, count_pass: bool):
        self.x, self.y, self.epochs, self.count_pass = x, y, list(epochs), count_pass

    def __iter__(self):
        if self.count_pass:
            self.count_pass = False
            return iter([(self.x, self.y)])
        return iter([(self.x[i], self.y[i]) for i in self.epochs.pop(0)])


def to_authors(state):
    names = {"1": "base.fc1", "3": "base.fc2", "5": "head"}
    return {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedvls_repro"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(args.work / "authors" / "system"))
    from flcore.clients.clientvls import clientVLS
    from flcore.trainmodel.models import DNN, BaseHeadSplit

    data = create("mnist")
    # two clients, label-skewed with vacant classes, sizes not multiples of the batch
    picks = [{0: 150, 1: 40, 2: 3}, {3: 120, 4: 60, 5: 1, 6: 30}]
    clients = []
    for cid, want in enumerate(picks):
        idx = torch.cat([(data.y_train == c).nonzero().flatten()[cid * 200: cid * 200 + n] for c, n in want.items()])
        x, y = data.x_train[idx], data.y_train[idx]
        clients.append(ClientData(cid, x, y, torch.bincount(y, minlength=10)))
    schedule = LocalSchedule(batch=64, epochs=args.epochs, lr=0.01, momentum=0.9, weight_decay=0.0, clip=None)

    torch.manual_seed(0)
    fedlt_global = build("mlp", in_chans=1, num_classes=10, image_size=28)
    base = DNN(784, 100, 10)
    head = copy.deepcopy(base.fc)
    base.fc = torch.nn.Identity()
    authors_global = BaseHeadSplit(base, head)
    authors_global.load_state_dict(to_authors(fedlt_global.state_dict()))
    cargs = SimpleNamespace(model=authors_global, algorithm="FedVLS", dataset="mnist", device="cpu", num_classes=10,
                            batch_size=64, local_learning_rate=0.01, local_epochs=args.epochs, weight_decay=0.0,
                            beta=0.005, lamda=0.1)
    authors_clients = [clientVLS(cargs, id=c.cid, train_samples=len(c)) for c in clients]
    work = build("mlp", in_chans=1, num_classes=10, image_size=28)
    worst = 0.0
    for r in range(args.rounds):
        global_state = {k: v.clone() for k, v in fedlt_global.state_dict().items()}
        fedlt_updates, authors_updates = [], []
        for c, ac in zip(clients, authors_clients):
            round_ctx = RoundContext(round_index=r, rounds=args.rounds, num_clients=len(clients), participants=(0, 1),
                                     num_classes=10, global_counts=sum(d.class_counts for d in clients),
                                     participant_counts=torch.stack([d.class_counts for d in clients]),
                                     classifier_weight=None, sampling_seed=0)
            task = ClientTask(c.cid, round_ctx, global_state, c, {}, schedule, "fedvls(lam=0.1)")
            fedlt_updates.append((client_update(task, work).weights, len(c)))
            batches = list(schedule.batches(len(c), client_generator(0, r, c.cid)))  # what fedlt just used
            per_epoch = len(batches) // args.epochs
            epochs = [batches[e * per_epoch:(e + 1) * per_epoch] for e in range(args.epochs)]
            ac.set_parameters(authors_global)
            ac.train(Replay(c.x, c.y, epochs, count_pass=ac.num_per_class is None), r)
            authors_updates.append((copy.deepcopy(ac.model.state_dict()), len(c)))
        total = sum(n for _, n in fedlt_updates)
        fedlt_global.load_state_dict({k: sum(w[k] * (n / total) for w, n in fedlt_updates) for k in global_state})
        authors_global.load_state_dict({k: sum(w[k] * (n / total) for w, n in authors_updates)
                                        for k in authors_updates[0][0]})
        diff = max(float((a - b).abs().max()) for a, b in zip(to_authors(fedlt_global.state_dict()).values(),
                                                               authors_global.state_dict().values()))
        worst = max(worst, diff)
        print(f"round {r + 1}: max |w_fedlt - w_authors| = {diff:.3g}")
    print(f"worst over {args.rounds} rounds: {worst:.3g}")


if __name__ == "__main__":
    main()

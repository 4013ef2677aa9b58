"""Golden outputs of FedProto's own code (github.com/yuetan031/FedProto) for fedlt's tests.

Runs, offline and in float64, the authors' ``LocalUpdate`` (its ``__init__`` and
``update_weights_het``, verbatim, lib/update.py), ``agg_func`` and ``proto_aggregation``
(lib/utils.py) and ``test_inference_new_het_lt`` (lib/update.py), with stand-ins only for what
surrounds them: the arguments (cpu, 4 classes, lr 0.1, 2 local epochs of batch 4, ld 1), their
CNNMnist replaced by a small net with the same interface (``forward -> (log_softmax(logits),
features)``) and the DataLoader without shuffling (so the batch order is known; 12 samples, so
their ``drop_last`` drops nothing); their inference's ``torch.min`` records the distance matrix it
predicts from. Writes tests/golden/fedproto.json: the model before and after
a client's local training against fixed global prototypes (class 3 without one), its mean step
loss, its class prototypes, the server's aggregation of three clients' prototypes and the
client's test accuracy with and without the prototypes, with the repository URL and commit.

    python tools/fedproto_golden/make_golden.py /work/.mirror/yuetan031+FedProto/repo
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/yuetan031/FedProto"
C, D_IN, D = 4, 5, 6
ARGS = types.SimpleNamespace(device="cpu", num_classes=C, lr=0.1, train_ep=2, local_bs=4, optimizer="sgd", ld=1.0,
                             verbose=0, num_users=1)


class StandIn(nn.Module):
    """Their CNNMnist's interface: forward -> (log_softmax(fc2(x1)), x1), x1 = relu(fc1(x))."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D), nn.ReLU())
        self.classifier = nn.Linear(D, C)

    def forward(self, x):
        x1 = self.body(x)
        return F.log_softmax(self.classifier(x1), dim=1), x1


class RecordingTorch:
    """``torch`` for their inference, whose ``min`` also records the distance matrix it is given
    (their nearest-prototype prediction is ``torch.min(dist, 1)``)."""

    def __init__(self):
        self.distances = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def min(self, input, *args, **kwargs):
        self.distances.append(input.detach().clone())
        return torch.min(input, *args, **kwargs)


def in_order(dataset, batch_size, shuffle=False, drop_last=False):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=drop_last)


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.set_default_dtype(torch.float64)
    ns = {"torch": torch, "nn": nn, "copy": copy, "np": np, "DataLoader": in_order, "Dataset": Dataset}
    code = load(git_dir, commit, "lib/update.py", ["DatasetSplit", "LocalUpdate", "test_inference_new_het_lt"], ns)
    utils = load(git_dir, commit, "lib/utils.py", ["agg_func", "proto_aggregation"], ns)

    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, D_IN, generator=g)
    y = torch.tensor([0, 1, 0, 3, 0, 1, 0, 3, 1, 0, 0, 1])  # class 2 absent
    train = [(x[i].numpy(), int(y[i])) for i in range(len(y))]
    torch.manual_seed(0)
    model = StandIn()
    start = copy.deepcopy(model.state_dict())
    global_protos = {0: [torch.randn(D, generator=g).abs()], 1: [torch.randn(D, generator=g).abs()],
                     2: [torch.randn(D, generator=g).abs()]}  # none for class 3
    local = code["LocalUpdate"](args=ARGS, dataset=train, idxs=range(len(train)))
    w, loss, _, protos = local.update_weights_het(ARGS, 0, global_protos, model=copy.deepcopy(model), global_round=0)
    mine = utils["agg_func"](protos)

    others = {1: {1: torch.randn(D, generator=g), 2: torch.randn(D, generator=g)},
              2: {0: torch.randn(D, generator=g), 2: torch.randn(D, generator=g)}}
    local_protos = {0: {k: v.detach().clone() for k, v in mine.items()}, **others}
    aggregated = utils["proto_aggregation"](copy.deepcopy(local_protos))

    x_test = torch.randn(40, D_IN, generator=g)
    y_test = torch.randint(0, C, (40,), generator=g)
    test = [(x_test[i].numpy(), int(y_test[i])) for i in range(len(y_test))]
    trained = StandIn()
    trained.load_state_dict(w)
    classes = sorted({int(c) for c in y})
    spy = RecordingTorch()
    code["test_inference_new_het_lt"].__globals__["torch"] = spy
    with contextlib.redirect_stdout(io.StringIO()):  # their per-user prints
        acc_l, acc_g, _ = code["test_inference_new_het_lt"](ARGS, [trained], test, [classes], [list(range(40))],
                                                            aggregated)
    # their counters are not reset between the two passes: acc_g = (correct_l + correct_g) / 2n
    acc_protos = acc_g[0] * 2 - acc_l[0]
    tensors = lambda sd: {k: v.tolist() for k, v in sd.items()}  # noqa: E731
    golden = {
        "source": {"repo": REPO, "commit": commit, "files": ["lib/update.py", "lib/utils.py"]},
        "args": vars(ARGS), "x": x.tolist(), "y": y.tolist(), "start": tensors(start), "trained": tensors(w),
        "global_protos": {str(k): v[0].tolist() for k, v in global_protos.items()},
        "loss_total": loss["total"], "loss_ce": loss["1"], "loss_proto": loss["2"],
        "client_protos": {str(k): v.tolist() for k, v in mine.items()},
        "local_protos": {str(i): {str(k): v.tolist() for k, v in p.items()} for i, p in local_protos.items()},
        "aggregated": {str(k): v[0].tolist() for k, v in aggregated.items()},
        "x_test": x_test.tolist(), "y_test": y_test.tolist(), "client_classes": classes,
        "accuracy_model": acc_l[0], "accuracy_protos": acc_protos,
        "distances": torch.cat(spy.distances).tolist(),
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}: loss {loss['total']:.6f}, accuracy {acc_l[0]:.3f} / {acc_protos:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fedproto.json")

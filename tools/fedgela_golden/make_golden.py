"""Golden outputs of FedGELA's own code (github.com/MediaBrain-SJTU/FedGELA) for fedlt's tests.

Runs, offline and in float64, the authors' ``get_etf``, ``produce_Ew``, ``train_net`` and
``compute_accuracy_l`` / ``compute_accuracy_g`` (FedGELA.py, verbatim), with stand-ins only for
what surrounds them: ``.cuda()`` made a no-op, a logger that keeps the messages, sklearn's
``balanced_accuracy_score`` (not compared), their ``model_cifar`` replaced by a small net with the
same interface (``forward -> (h, x, proxy(x))``, the ``etf`` proxy a BatchNorm1d) and unshuffled
DataLoaders; their ETF (float32, as theirs) is used in float64. Writes tests/golden/fedgela.json:
the uniform draw and their ETF, a client's Ew, the model before and after two local epochs
(lr 0.01, their SGD with momentum 0.9, weight decay 1e-4 and gradient clipping at norm 20,
temperature 0.2), each epoch's mean loss, and the local (Ew-adapted) and global logits of the
trained model on test inputs, with the repository URL and commit.

    python tools/fedgela_golden/make_golden.py /work/.mirror/MediaBrain-SJTU+FedGELA/repo
"""

from __future__ import annotations

import copy
import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/MediaBrain-SJTU/FedGELA"
C, D_IN, D, SEED = 4, 5, 6, 3
ARGS = {"lr": 0.01, "epochs": 2, "reg": 1e-4, "temperature": 0.2, "batch": 4}


class Holder(nn.Module):
    """Names their proxy ``classifier.bn`` so the state dict's keys are fedlt's."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(D)


class StandIn(nn.Module):
    """Their model_cifar's interface: forward -> (h, x, proxy(x)), x the representation, the etf
    proxy a BatchNorm1d over it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D), nn.ReLU())
        self.classifier = Holder()

    def forward(self, x):
        x = self.body(x)
        return x, x, self.classifier.bn(x)


class Logger:
    def __init__(self):
        self.messages = []

    def info(self, message):
        self.messages.append(message)


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.Tensor.cuda = lambda self, *a, **k: self  # offline
    nn.Module.cuda = lambda self, *a, **k: self
    logger = Logger()
    ns = {"torch": torch, "nn": nn, "np": np, "optim": optim, "time": __import__("time"), "logger": logger,
          "balanced_accuracy_score": lambda true, pred: 0.0}
    code = load(git_dir, commit, "FedGELA.py",
                ["get_etf", "produce_Ew", "train_net", "compute_accuracy_l", "compute_accuracy_g"], ns)

    np.random.seed(SEED)
    a = np.random.random(size=(D, C))
    np.random.seed(SEED)
    etf = code["get_etf"](D, C)  # float32, as theirs (torch's default dtype still float32)
    torch.set_default_dtype(torch.float64)
    ns["ETF"] = etf.double()

    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, D_IN, generator=g)
    y = torch.tensor([0, 1, 0, 3, 0, 1, 0, 3, 1, 0, 0, 1])  # class 2 absent
    _, ew_set = code["produce_Ew"]([types.SimpleNamespace(targets=y.tolist())], C)
    ns["EW_set"] = ew_set
    torch.manual_seed(0)
    net = StandIn()
    start = copy.deepcopy(net.state_dict())
    x_test = torch.randn(8, D_IN, generator=g)
    y_test = torch.randint(0, C, (8,), generator=g)
    train = DataLoader(TensorDataset(x, y), batch_size=ARGS["batch"], shuffle=False)
    test = DataLoader(TensorDataset(x_test, y_test), batch_size=100, shuffle=False)
    code["train_net"](0, net, train, test, ARGS["epochs"], ARGS["lr"], None, ARGS["reg"], ARGS["temperature"])
    losses = [float(re.search(r"Loss: ([-+0-9.e]+)", m).group(1)) for m in logger.messages if m.startswith("Epoch:")]
    net.eval()
    with torch.no_grad():
        _, _, proj = net(x_test)
        local_logits = proj @ (ew_set[0] * ns["ETF"])  # compute_accuracy_l's logits
        global_logits = proj @ ns["ETF"]  # compute_accuracy_g's
    accuracy_l, _ = code["compute_accuracy_l"](0, net, test)
    accuracy_g, _ = code["compute_accuracy_g"](net, test, ARGS["temperature"])
    tensors = lambda sd: {k: v.tolist() for k, v in sd.items()}  # noqa: E731
    golden = {
        "source": {"repo": REPO, "commit": commit, "files": ["FedGELA.py", "model.py"]},
        "args": ARGS, "uniform": a.tolist(), "etf": etf.tolist(), "ew": ew_set[0].tolist(),
        "x": x.tolist(), "y": y.tolist(), "start": tensors(start), "trained": tensors(net.state_dict()),
        "epoch_losses": losses, "x_test": x_test.tolist(), "y_test": y_test.tolist(),
        "local_logits": local_logits.tolist(), "global_logits": global_logits.tolist(),
        "accuracy_local": accuracy_l, "accuracy_global": accuracy_g,
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}: epoch losses {losses}, accuracy {accuracy_l:.3f} / {accuracy_g:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fedgela.json")

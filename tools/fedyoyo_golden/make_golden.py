"""Golden outputs of FedYoYo's own code (github.com/shanss132/FedYoYo) for fedlt's tests.

Runs, offline and in float64, the authors' ``main_fedyoyo.py`` ``Local`` class verbatim
(``get_feature_mean``, ``calculate_eff_weight`` and ``local_train``) and ``apply_change_threshold``
(``data_loader/tools.py``), with stand-ins only for what surrounds them: ``.cuda()`` made a no-op
and ``torch.tensor(..., device='cuda', dtype=torch.float)`` built on the host in float64, their
ResNet-8 replaced by a small net with the same interface (``features, logits = model(x)``, a
``classifier`` Linear), their ``DataLoader`` unshuffled with no workers, and a client dataset of
``(x, weak view, strong view, label)`` whose weak view is x and strong view x with its features
reversed (a deterministic stand-in for AutoAugment + Cutout). The client: 40 samples, counts
20/10/7/3, in a fixed shuffled order. Recorded: the effective numbers on the untrained net
(minibatches of 8, in order), and the weights after their ``local_train`` (3 epochs of one
full batch, SGD lr 0.1, round 5 of warm-up 10, λ 4, γ 0.1, τ 1.5, T 1.5) from a given prior, and
after 2 epochs of minibatches of 8 in data order (10 steps: the prior moves at every one);
and ``apply_change_threshold`` on one smoothing. Writes tests/golden/fedyoyo.json with the
repository URL and commit.

    python tools/fedyoyo_golden/make_golden.py /work/.mirror/shanss132+FedYoYo/repo
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import CrossEntropyLoss
from torch.optim import SGD
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/shanss132/FedYoYo"
C, D_IN, D, N = 4, 5, 6, 40


class Net(nn.Module):
    """Their ResNet_cifar's interface: ``(features, logits)`` and a ``classifier`` Linear."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D), nn.ReLU())
        self.classifier = nn.Linear(D, C)

    def forward(self, x):
        h = self.body(x)
        return h, self.classifier(h)


def host_torch() -> types.SimpleNamespace:
    """``torch`` for their code, with ``torch.tensor`` built on the host in float64 (their
    ``device='cuda', dtype=torch.float``)."""
    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    shim.tensor = lambda data, dtype=None, device=None: torch.tensor(data, dtype=torch.float64)
    return shim


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.set_default_dtype(torch.float64)
    torch.Tensor.cuda = lambda self, *a, **k: self  # offline
    nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.float = lambda self: self.double()  # their .float() casts: float64 throughout
    shim = host_torch()
    loader = lambda dataset, batch_size, shuffle=False, num_workers=0: DataLoader(dataset, batch_size)  # noqa: E731
    ns = {"torch": shim, "F": F, "SGD": SGD, "CrossEntropyLoss": CrossEntropyLoss, "DataLoader": loader,
          "EPS": 1e-6, "ResNet_cifar": lambda **kwargs: Net()}
    Local = load(git_dir, commit, "main_fedyoyo.py", ["Local"], ns)["Local"]
    change = load(git_dir, commit, "data_loader/tools.py", ["apply_change_threshold"], {"torch": torch})

    g = torch.Generator().manual_seed(5)
    y = torch.tensor([0] * 20 + [1] * 10 + [2] * 7 + [3] * 3)
    order = torch.randperm(N, generator=g)
    y = y[order]
    x = torch.randn(N, D_IN, generator=g) + y[:, None] * 0.4
    strong = x.flip(1)
    counts = torch.bincount(y, minlength=C).tolist()
    dataset = TensorDataset(x, x, strong, y)
    torch.manual_seed(2)
    init = Net().state_dict()
    args = types.SimpleNamespace(device="cpu", num_classes=C, lr_local_training=0.1, num_epochs_local_training=3,
                                 batch_size_local_training=8, gamma=0.1, tau=1.5, T=1.5, lamda=4.0, warmup=10)

    client = Local(data_client=dataset, args=args)
    means = client.get_feature_mean({k: v.clone() for k, v in init.items()}, counts).detach()
    effective = client.calculate_eff_weight(means, counts)

    prior = torch.tensor([0.1, 0.2, 0.3, 0.4])
    args.batch_size_local_training = N  # one full batch per epoch: fedlt's shuffled order gives the same step
    client = Local(data_client=dataset, args=args)
    trained = client.local_train(args, {k: v.clone() for k, v in init.items()}, 5, None, counts, prior=prior)

    previous = torch.tensor([10.0, 20.0, 0.5, 40.0])
    current = torch.tensor([12.0, 18.0, 800.0, 41.0])
    kept = change["apply_change_threshold"](previous * 0.9 + current * 0.1, previous.clone(), 100)

    args.batch_size_local_training, args.num_epochs_local_training = 8, 2  # 10 steps of 8, in order
    client = Local(data_client=dataset, args=args)
    minibatches = client.local_train(args, {k: v.clone() for k, v in init.items()}, 5, None, counts, prior=prior)

    tensors = lambda sd: {k: v.tolist() for k, v in sd.items()}  # noqa: E731
    golden = {
        "source": {"repo": REPO, "commit": commit, "files": ["main_fedyoyo.py", "data_loader/tools.py"]},
        "x": x.tolist(), "strong": strong.tolist(), "y": y.tolist(), "init": tensors(init),
        "effective": effective.tolist(), "feature_batch": 8,
        "train": {"round": 5, "warmup": 10, "epochs": 3, "lr": 0.1, "lam": 4.0, "gamma": 0.1, "tau": 1.5,
                  "temperature": 1.5, "prior": prior.tolist(), "weights": tensors(trained),
                  "minibatches": {"batch": 8, "epochs": 2, "weights": tensors(minibatches)}},
        "smoothing": {"previous": previous.tolist(), "current": current.tolist(), "result": kept.tolist()},
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}: effective numbers {[round(v, 3) for v in effective.tolist()]}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fedyoyo.json")

"""Golden outputs of FEDIC's own code (github.com/shangxinyi/FEDIC) for fedlt's tests.

Runs, offline and in float64, the authors' ``Ensemble_highway`` and ``Global`` classes of
``main.py`` verbatim (``__init__``, ``update_distillation_highway_feature``, ``features_logits``,
``_initialize_for_model_fusion``, ``eval``), with stand-ins only for what surrounds them: their
ResNet-8 (``ResNet_cifar_feature``, 256 features, which their calibration's ``Linear(256, 1)``
hard-codes) replaced by a small net with the same interface (``features, logits = model(x)``:
Linear(3, 256), BatchNorm1d, ReLU, then a Linear(256, 10) classifier), ``tqdm`` by the plain
iterable, their ``np.random.RandomState`` by one that records every ``choice`` it makes (so fedlt
replays their batches), and the data: a labelled proxy set of 3 images a class (their
``dataset_global_teaching``), 24 unlabelled images (their CIFAR-100), 8 client models (their
``num_online_clients``: the gate's feature mean is hard-coded as 1/8 per client) with 5..12
samples each, perturbed from one initial net and rounded to 4 decimals. Two rounds of their
server update on the same client models (the calibration and the three Adam optimisers live on
from the first round into the second, as their ``Global`` keeps them). Recorded: the inputs,
their draws, the calibration's initial state, and after each round the global (distilled) model,
the fine-tuned FedAvg model (``model2``) and the calibration. Writes tests/golden/fedic.json with
the repository URL and commit.

    python tools/fedic_golden/make_golden.py /work/.mirror/shangxinyi+FEDIC/repo
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import CrossEntropyLoss
from torch.optim import SGD, Adam
from torch.utils.data.dataloader import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/shangxinyi/FEDIC"
C, D_IN, D, K = 10, 3, 256, 8
PROXY_PER_CLASS, UNLABELED = 3, 24
SETTINGS = dict(mini_batch_size=4, mini_batch_size_unlabled=6, lr_global_teaching=0.001, temperature=2.0, ld=0.5)


class Net(nn.Module):
    """Their ResNet_cifar_feature's interface: ``(features, logits)``, features the classifier's input."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D), nn.BatchNorm1d(D), nn.ReLU())
        self.classifier = nn.Linear(D, C)

    def forward(self, x):
        h = self.body(x)
        return h, self.classifier(h)


class RecordingState:
    """``np.random.RandomState(seed)`` whose ``choice`` draws are appended to ``draws``."""

    def __init__(self, seed):
        self.state, self.draws = np.random.RandomState(seed), []

    def choice(self, *args, **kwargs):
        out = self.state.choice(*args, **kwargs)
        self.draws.append([int(i) for i in out])
        return out


class Pairs:
    """A dataset of ``(x[i], int(y[i]))``, as their ``Indices2Dataset`` yields."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])

    def __len__(self):
        return len(self.y)


def namespace(model: Any, data_loader: Any) -> dict[str, Any]:
    """What their main.py imports, for its definitions executed verbatim: ``model`` stands in for
    their ``ResNet_cifar_feature`` and ``data_loader`` for ``DataLoader``; ``tqdm`` the plain iterable.
    (The replay adapter, tools/replay/fedic.py, uses it too.)"""
    return {"nn": nn, "torch": torch, "copy": copy, "np": np, "F": F, "tqdm": lambda it, **kw: it,
            "ResNet_cifar_feature": model, "Adam": Adam, "SGD": SGD, "CrossEntropyLoss": CrossEntropyLoss,
            "softmax": F.softmax, "log_softmax": F.log_softmax, "DataLoader": data_loader,
            **{name: getattr(torch, name) for name in  # their main.py's ``from torch import ...``
               ("stack", "div", "max", "eq", "no_grad", "tensor", "add", "mul", "ones", "zeros", "ones_like", "sigmoid",
                "cat")}}


def rounded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float entries rounded to 4 decimals (a short, exact fixture); BatchNorm's variances kept positive."""
    return {k: (v.double().mul(1e4).round().div(1e4).abs().clamp(min=0.05) if k.endswith("running_var") else
                v.double().mul(1e4).round().div(1e4)) if v.is_floating_point() else v for k, v in state.items()}


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.set_default_dtype(torch.float64)
    ns = namespace(lambda **kwargs: Net(), DataLoader)
    Global = load(git_dir, commit, "main.py", ["Ensemble_highway", "Global"], ns)["Global"]

    g = torch.Generator().manual_seed(11)
    y_proxy = torch.arange(C).repeat_interleave(PROXY_PER_CLASS)
    x_proxy = torch.randn(len(y_proxy), D_IN, generator=g) + y_proxy[:, None] * 0.3
    x_unlabeled = torch.randn(UNLABELED, D_IN, generator=g) * 1.5
    y_unlabeled = torch.randint(C, (UNLABELED,), generator=g)  # never read (their CIFAR-100 labels)
    x_test, y_test = torch.randn(10, D_IN, generator=g), torch.arange(C)
    torch.manual_seed(3)
    init = rounded(Net().state_dict())
    clients = []
    for _ in range(K):
        client = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                  for k, v in init.items()}
        clients.append(rounded(client))
    sizes = [int(n) for n in torch.randint(5, 13, (K,), generator=g)]

    torch.manual_seed(7)  # their __main__'s seed: the calibration's gate and the unused models' draws
    server = Global(dataset_global_teaching=Pairs(x_proxy, y_proxy), num_classes=C, total_steps=100,
                    mini_batch_size=SETTINGS["mini_batch_size"],
                    mini_batch_size_unlabled=SETTINGS["mini_batch_size_unlabled"],
                    lr_global_teaching=SETTINGS["lr_global_teaching"], temperature=SETTINGS["temperature"],
                    device="cpu", seed=7, server_steps=100, num_online_clients=K, ld=SETTINGS["ld"], ensemble_ld=0.0,
                    unlabeled_data=Pairs(x_unlabeled, y_unlabeled))
    server.random_state = RecordingState(7)
    calibration_init = copy.deepcopy(server.highway_model.state_dict())
    rounds = []
    for r in (1, 2):
        with contextlib.redirect_stdout(io.StringIO()):
            server.update_distillation_highway_feature(r, copy.deepcopy(clients), sizes, Pairs(x_test, y_test), 10)
        rounds.append(copy.deepcopy({"global": server.dict_global_params, "finetuned": server.model2.state_dict(),
                                     "calibration": server.highway_model.state_dict(),
                                     "draws": server.random_state.draws, "accuracy": server.epoch_acc[-1]}))
        server.random_state.draws = []

    tensors = lambda sd: {k: v.tolist() for k, v in sd.items() if v.is_floating_point()}  # noqa: E731
    golden = {
        "source": {"repo": REPO, "commit": commit, "files": ["main.py", "options.py"]},
        "settings": SETTINGS | {"steps": 100, "proxy_per_class": PROXY_PER_CLASS},
        "x_proxy": x_proxy.tolist(), "y_proxy": y_proxy.tolist(), "x_unlabeled": x_unlabeled.tolist(),
        "y_unlabeled": y_unlabeled.tolist(), "sizes": sizes, "clients": [tensors(c) for c in clients],
        "calibration_init": tensors(calibration_init),
        "rounds": [{k: tensors(v) if isinstance(v, dict) else v for k, v in rnd.items()} for rnd in rounds],
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB) from {REPO} @ {commit}: accuracy after each round "
          f"{[rnd['accuracy'] for rnd in rounds]}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fedic.json")

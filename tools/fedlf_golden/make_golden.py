"""Golden outputs of FedLF's own code (github.com/18sym/FedLF, ``algorithm/our.py``) for fedlt.

Runs, offline and in float64, the authors' ``Local`` class (its ``__init__`` and ``local_train``,
verbatim) with stand-ins only for what surrounds it: ``args_parser`` (cpu, 4 classes, lr 0.1,
rs_alpha 0.25, 2 local epochs of batch 4), their ResNet-8 replaced by a small net with the same
interface (``forward -> (feature, logits)``, 256 features, ``.classifier``), the DataLoader
without shuffling (so the batch order is known) and the image augmentation as the identity; and
the server's class-centre update, the lines of ``our()`` quoted below. Writes
tests/golden/fedlf.json: the model before and after local training, the batches, every step's
loss as their logger reports it, the returned class centres f_k, and the server's f_G in the first
round after the warm-up and the next, with the repository URL and commit.

    python tools/fedlf_golden/make_golden.py /work/.mirror/18sym+FedLF/repo
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
from torch.optim import SGD
from torch.nn import CrossEntropyLoss
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/18sym/FedLF"
C, D_IN, D = 4, 8, 256
ARGS = types.SimpleNamespace(device="cpu", num_classes=C, lr_local_training=0.1, rs_alpha=0.25,
                             num_epochs_local_training=2, batch_size_local_training=4)


class StandIn(nn.Module):
    """Their ResNet_cifar's interface: forward -> (feature, classifier(feature)), 256 features."""

    def __init__(self, **kwargs):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D), nn.ReLU())
        self.classifier = nn.Linear(D, kwargs["num_classes"])

    def forward(self, x):
        feature = self.body(x)
        return feature, self.classifier(feature)


class Logger:
    def __init__(self):
        self.messages = []

    def info(self, message):
        self.messages.append(message)


def identity_transforms():
    ident = lambda *a, **k: (lambda x: x)  # noqa: E731
    return types.SimpleNamespace(Compose=lambda ts: (lambda x: x), RandomCrop=ident, RandomHorizontalFlip=ident)


def server_update(f_G, f_locals, r, warm_up_epoch, num_classes):
    """our()'s update of f_G, quoted verbatim (args.* made arguments)."""
    if r > warm_up_epoch:
        if r == warm_up_epoch + 1:
            sum_f_k = torch.zeros_like(f_locals[0])  # 初始化和向量，假设所有 f_k 的维度相同
            for f_k in f_locals:
                sum_f_k += f_k  # 累加所有本地特征向量

            f_G = sum_f_k / len(f_locals)
        else:
            sim = torch.nn.CosineSimilarity(dim=1)  # 全局质心的更新方式 就是加权取平均
            tmp = 0
            w_sum = 0
            for i in f_locals:
                sim_weight = sim(f_G, i).reshape(num_classes, 1)
                w_sum += sim_weight
                tmp += sim_weight * i
            f_G = torch.div(tmp, w_sum)
    return f_G


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.set_default_dtype(torch.float64)
    ns = {"torch": torch, "nn": nn, "copy": copy, "np": np, "SGD": SGD, "CrossEntropyLoss": CrossEntropyLoss,
          "args_parser": lambda: ARGS, "ResNet_cifar": StandIn, "transforms": identity_transforms(),
          "DataLoader": lambda dataset, batch_size, shuffle: DataLoader(dataset, batch_size, shuffle=False)}
    Local = load(git_dir, commit, "algorithm/our.py", ["Local"], ns)["Local"]

    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, D_IN, generator=g)
    y = torch.tensor([0, 0, 1, 0, 3, 0, 1, 0, 0, 3])  # class 2 absent
    counts = torch.tensor([6, 2, 0, 2])
    dist = counts / counts.sum()  # our(): cnts / cnts.sum()
    torch.manual_seed(0)
    local = Local(data_client=TensorDataset(x, y), class_list=counts.tolist())
    start = copy.deepcopy(local.local_model.state_dict())
    f_G = torch.randn(C, D, generator=g).abs() * 0.1
    logger = Logger()
    params, f_k = local.local_train(ARGS, copy.deepcopy(start), dist, f_G.clone(), logger)
    losses = [float(re.search(r"([-+0-9.e]+)$", m.replace("tensor(", "").split(",")[0]).group(1))
              for m in logger.messages if m.startswith("总的loss为")]

    f_locals = [f_k, torch.randn(C, D, generator=g), torch.randn(C, D, generator=g)]
    f_locals[1][2] = 0  # no client has seen class 2: their weights sum to 0 there
    f_locals[2][2] = 0
    first = server_update(torch.zeros(C, D), f_locals, r=3, warm_up_epoch=2, num_classes=C)
    later = server_update(first, [f_locals[1], f_locals[2], f_locals[0] * 0.5], r=4, warm_up_epoch=2, num_classes=C)
    tensors = lambda sd: {k: v.tolist() for k, v in sd.items()}  # noqa: E731
    golden = {
        "source": {"repo": REPO, "commit": commit, "files": ["algorithm/our.py"]},
        "args": vars(ARGS), "x": x.tolist(), "y": y.tolist(), "class_counts": counts.tolist(),
        "start": tensors(start), "trained": tensors(params), "f_G": f_G.tolist(), "losses": losses,
        "f_k": f_k.tolist(), "f_locals": [f.tolist() for f in f_locals],
        "server_first": first.tolist(),
        "server_later": later.nan_to_num(nan=-12345.0).tolist(),  # their 0/0 for class 2, marked
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}: {len(losses)} steps, losses {losses}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fedlf.json")

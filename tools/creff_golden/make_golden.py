"""Golden fixture for CReFF from the authors' code, github.com/shangxinyi/CReFF-FL at commit
fbec98f1a49dfb8d9f346d98bf3f9568d9004687: ``match_loss`` / ``distance_wb``
(Dataset/Gradient_matching_loss.py), ``Global.update_feature_syn`` and ``Global.feature_re_train``
(main.py), run verbatim in float64 on fixed small inputs (d = 256 and 10 classes, which the code
hard-codes). Writes tests/golden/creff.json.

    python tools/creff_golden/make_golden.py /work/.mirror/shangxinyi+CReFF-FL/repo

Stand-ins, because the functions read module globals: ``args`` (an argparse Namespace with the
options they read), ``TensorDataset`` (torch's; the authors' casts to float32, which would leave
float64), ``DataLoader`` (records the shuffled orders so fedlt replays them) and ``nn.Linear``
(records the fresh classifier's random initialisation).
"""

from __future__ import annotations

import copy
import json
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from torch.optim import SGD
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from golden_source import RecordingLoader, definitions, source, tolist  # noqa: E402

REPO, COMMIT = "https://github.com/shangxinyi/CReFF-FL", "fbec98f1a49dfb8d9f346d98bf3f9568d9004687"
D, C, M = 256, 10, 2  # feature dim and classes (hard-coded by the authors), federated features per class


class LinearRecorder:
    inits: list[dict] = []

    def __new__(cls, *args, **kwargs):
        layer = nn.Linear(*args, **kwargs)
        LinearRecorder.inits.append({k: v.detach().clone() for k, v in layer.state_dict().items()})
        return layer


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(D, C)

    def forward(self, x):
        return x, self.classifier(x)


def main(git_dir: str) -> None:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    args = Namespace(num_classes=C, match_epoch=3, device="cpu", dis_metric="ours", lr_net=0.05, crt_epoch=2)
    shim_nn = Namespace(Linear=LinearRecorder)
    namespace = {"torch": torch, "copy": copy, "np": np, "SGD": SGD, "args": args, "nn": shim_nn,
                 "TensorDataset": TensorDataset, "DataLoader": RecordingLoader, "CrossEntropyLoss": CrossEntropyLoss}
    definitions(source(git_dir, COMMIT, "Dataset/Gradient_matching_loss.py"), ["match_loss", "distance_wb"], namespace)
    definitions(source(git_dir, COMMIT, "Dataset/dataset.py"), ["get_class_num"], namespace)
    namespace.update(unsqueeze=torch.unsqueeze, time=None, DiffAugment=None)
    fns = definitions(source(git_dir, COMMIT, "main.py"), ["Global.update_feature_syn", "Global.feature_re_train",
                                                           "Local.compute_gradient"], namespace)
    g = torch.Generator().manual_seed(1)
    # match_loss on one pair of (weight, bias) gradients
    gs, gr = [torch.randn(C, D, generator=g), torch.randn(C, generator=g)], [torch.randn(C, D, generator=g),
                                                                             torch.randn(C, generator=g)]
    distance = namespace["match_loss"](gs, gr, args)
    # update_feature_syn: the classifier the features are matched under, two clients' per-class gradients
    head = {"weight": torch.randn(C, D, generator=g) * 0.1, "bias": torch.randn(C, generator=g) * 0.1}
    clients = [{c: [torch.randn(C, D, generator=g) * 0.01, torch.randn(C, generator=g) * 0.01] for c in classes}
               for classes in ([0, 1, 2, 5], [1, 2, 3, 7, 9])]  # classes 4, 6, 8: no real gradient
    features0 = torch.randn(C * M, D, generator=g)
    self = Namespace(num_classes=C, feature_net=nn.Linear(D, C), criterion=CrossEntropyLoss(), num_of_feature=M,
                     feature_syn=features0.clone().requires_grad_(True))
    self.optimizer_feature = SGD([self.feature_syn], lr=0.1)
    global_params = {"features.weight": torch.zeros(3), "classifier.weight": head["weight"].clone(),
                     "classifier.bias": head["bias"].clone()}
    fns["Global.update_feature_syn"](self, args, global_params, copy.deepcopy(clients))
    # feature_re_train on the updated features
    self.label_syn = torch.arange(C).repeat_interleave(M)
    self.device = "cpu"
    LinearRecorder.inits.clear(), RecordingLoader.orders.clear()
    fedavg = {"features.weight": torch.zeros(3), "classifier.weight": torch.zeros(C, D), "classifier.bias": torch.zeros(C)}
    ft, _ = fns["Global.feature_re_train"](self, fedavg, 4)
    # Local.compute_gradient: one client's per-class classifier gradients (features given directly:
    # its model is the identity followed by the classifier); batch_real above every class's count, so
    # each of the 10 draws is the whole class and the draws' order does not matter
    x = torch.randn(13, D, generator=g)
    y = [0, 0, 3, 3, 3, 5, 0, 8, 8, 3, 0, 5, 3]
    local = Namespace(data_client=[(x[i], y[i]) for i in range(len(y))], class_compose=np.bincount(y, minlength=C).tolist(),
                      local_model=_Net())
    sent = {"classifier.weight": head["weight"].clone(), "classifier.bias": head["bias"].clone()}
    grads = fns["Local.compute_gradient"](local, sent, Namespace(device="cpu", batch_real=64, dsa=False))
    out = {"source": {"repo": REPO, "commit": COMMIT,
                      "functions": ["Dataset/Gradient_matching_loss.py: match_loss, distance_wb",
                                    "Dataset/dataset.py: get_class_num",
                                    "main.py: Global.update_feature_syn, Global.feature_re_train, "
                                    "Local.compute_gradient"]},
           "client": {"x": tolist(x), "y": y, "head": tolist(head), "batch_real": 64, "repeats": 10,
                      "gradients": tolist({c: g_ for c, g_ in grads.items()})},
           "match": {"g_syn": tolist(gs), "g_real": tolist(gr), "distance": float(distance)},
           "update": {"head": tolist(head), "clients": tolist(clients), "features": tolist(features0),
                      "per_class": M, "steps": args.match_epoch, "lr": 0.1,
                      "features_after": tolist(self.feature_syn.detach())},
           "retrain": {"features": tolist(self.feature_syn.detach()), "labels": tolist(self.label_syn),
                       "init": tolist(LinearRecorder.inits[0]), "orders": RecordingLoader.orders, "batch_size": 4,
                       "epochs": args.crt_epoch, "lr": args.lr_net, "head": tolist(ft)}}
    path = Path(__file__).resolve().parents[2] / "tests" / "golden" / "creff.json"
    path.write_text(json.dumps(out))
    print("wrote", path, "distance", float(distance))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/work/.mirror/shangxinyi+CReFF-FL/repo")

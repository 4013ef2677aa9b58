"""Golden output of FedETF's own personalisation (github.com/ZexiLee/ICCV-2023-FedETF) for fedlt's tests.

Runs, offline and in float64, the authors' ``Client_personalization`` (client_funct.py) verbatim on
one client: ``receive_server_model`` (the global weights and ETF), ``Client_update`` (E epochs of
``client_fedetf``'s balanced softmax with the node's SGD: lr, momentum, ``local_wd_rate``), then 20
alternations of 3 epochs of CE on the ETF (SGD lr 0.1) and 3 on the projection layer (SGD lr 0.05
with momentum and weight decay). Stand-ins: a small backbone with their model's interface
(``forward`` → (normalised projected feature, logit, representation), ``linear_proto``,
``proto_classifier`` = their ``Proto_Classifier``, ``scaling_train``) in place of their CNN; a
node holding the model, its optimiser (their ``init_optimizer``'s SGD, made fresh), its batches in
order (their DataLoader without shuffling) and ``sample_per_class`` (nodes.py: absent → 1);
``.cuda()`` a no-op. Writes tests/golden/fedetf_personal.json with the repository URL and commit.

    python tools/fedetf_golden/make_personal_golden.py /work/.mirror/ZexiLee+ICCV-2023-FedETF/repo
"""

from __future__ import annotations

import copy
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import init

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/ZexiLee/ICCV-2023-FedETF"
IN, D, P, C = 6, 8, 6, 4  # input, representation, projection (d'), classes
ARGS = dict(client_method="fedetf", E=1, lr=0.04, momentum=0.9, local_wd_rate=5e-4)  # args.py defaults (E: 1)


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.Tensor.cuda = lambda self, *a, **k: self  # offline
    ns = {"torch": torch, "nn": nn, "F": F, "init": init, "copy": copy, "math": math, "np": np}
    load(git_dir, commit, "models_dict/proto_classifiers.py", ["Proto_Classifier"], ns)
    fns = load(git_dir, commit, "client_funct.py", ["receive_server_model", "Client_update", "Client_personalization",
                                                    "balanced_softmax_loss", "client_fedetf"], ns)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(IN, D), nn.ReLU())
            self.linear_proto = nn.Linear(D, P)
            self.proto_classifier = ns["Proto_Classifier"](P, C)
            self.scaling_train = torch.nn.Parameter(torch.tensor(1.5))

        def forward(self, x):  # their CNNCifar10.forward, after its backbone
            out = self.body(x)
            feature = self.linear_proto(out)
            feature_norm = torch.norm(feature, p=2, dim=1, keepdim=True).clamp(min=1e-12)
            return torch.div(feature, feature_norm), out, out

    np.random.seed(5)
    torch.manual_seed(5)
    central = types.SimpleNamespace(model=Net().double())  # built in float32 as theirs, then float64
    central.model.proto_classifier.proto = central.model.proto_classifier.proto.double()  # their .float() cast
    node_model = Net().double()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, IN, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 0, 3, 0, 1, 0])  # class 2 absent
    counts = torch.bincount(y, minlength=C)
    args = types.SimpleNamespace(**ARGS)
    node = types.SimpleNamespace(model=node_model, local_data=[(x[:4], y[:4]), (x[4:], y[4:])],
                                 sample_per_class=torch.where(counts > 0, counts, 1))
    node.optimizer = torch.optim.SGD(node.model.parameters(), lr=args.lr, momentum=args.momentum,
                                     weight_decay=args.local_wd_rate)
    nodes, _ = fns["Client_personalization"](args, [node], central, [0])
    model = nodes[0].model
    xt = torch.randn(5, IN, generator=g, dtype=torch.float64)
    with torch.no_grad():
        feature, _, _ = model(xt)
        logits = model.scaling_train * torch.matmul(feature, model.proto_classifier.proto)  # client_fedetf's lines
    sd = lambda m: {k: v.detach().tolist() for k, v in m.state_dict().items()}  # noqa: E731
    golden = {
        "source": {"repo": REPO, "commit": commit,
                   "files": ["client_funct.py", "models_dict/proto_classifiers.py", "nodes.py", "utils.py", "args.py"]},
        "args": ARGS, "x": x.tolist(), "y": y.tolist(), "batch": 4,
        "start": sd(central.model), "start_proto": central.model.proto_classifier.proto.tolist(),
        "personal": sd(model), "personal_proto": model.proto_classifier.proto.detach().tolist(),
        "x_test": xt.tolist(), "logits": logits.tolist(),
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fedetf_personal.json")

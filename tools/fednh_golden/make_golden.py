"""Golden outputs of FedNH's own code (github.com/Yutong-Dai/FedNH) for fedlt's tests.

Runs, offline and in float64, the authors' own definitions:
- ``src/flbase/models/CNN.py``: ``Conv2CifarNH`` (normalised features, frozen prototypes, the
  learnable ``scaling``), on a base class standing in for their ``Model`` (an nn.Module);
- ``src/flbase/strategies/FedNH.py``: ``FedNHClient`` (``__init__``'s counts and
  ``_estimate_prototype``) and ``FedNHServer.aggregate`` (the model update and the semantic
  infusion of the prototypes), on stand-ins for their ``FedUHClient`` / ``FedUHServer`` bases
  that only hold the attributes those methods read;
- ``src/flbase/utils.py``: ``linear_combination_state_dict``;
- the prototype initialisation of ``FedUHClient._initialize_model`` (``'orthogonal'``), quoted.

Writes tests/golden/fednh.json with the repository URL and commit.

    python tools/fednh_golden/make_golden.py /work/.mirror/Yutong-Dai+FedNH/repo
"""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/Yutong-Dai/FedNH"
C = 10


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config


class FedUHClient:
    """Stand-in base: what FedNHClient.__init__ and _estimate_prototype read."""

    def __init__(self, criterion, trainset, testset, client_config, cid, device, **kwargs):
        self.device = device
        self.trainloader = trainset  # a list of (x, y) batches
        ys = torch.cat([y for _, y in trainset]).tolist()
        self.count_by_class = Counter(ys)


class FedUHServer:
    def __init__(self, server_config, clients_dict, exclude, **kwargs):
        self.server_config, self.clients_dict, self.exclude_layer_keys = server_config, clients_dict, exclude


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.set_default_dtype(torch.float64)
    ns = {"torch": torch, "nn": nn, "F": F, "np": np, "copy": copy, "deepcopy": copy.deepcopy, "OrderedDict": OrderedDict,
          "Counter": Counter, "Model": Model, "FedUHClient": FedUHClient, "FedUHServer": FedUHServer}
    load(git_dir, commit, "src/flbase/utils.py", ["linear_combination_state_dict"], ns)
    load(git_dir, commit, "src/flbase/models/CNN.py", ["Conv2CifarNH"], ns)
    cls = load(git_dir, commit, "src/flbase/strategies/FedNH.py", ["FedNHClient", "FedNHServer"], ns)

    # the prototypes' initialisation, FedUHClient._initialize_model ('orthogonal'), under seed 0,
    # in their dtype (float32)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    init = torch.nn.init.orthogonal_(torch.rand(C, 192))
    torch.set_default_dtype(torch.float64)
    init = init.double()

    config = {"num_classes": C, "FedNH_return_embedding": False}
    torch.manual_seed(1)
    model = ns["Conv2CifarNH"](config)
    model.prototype.requires_grad_(False)
    model.prototype.data = init.clone()
    model.scaling.data = torch.tensor([1.7])
    raw = {}
    model.linear2.register_forward_hook(lambda m, i, o: None if "h" in raw else raw.update(h=F.relu(o)))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 3, 32, 32, generator=g)
    y = torch.tensor([0, 0, 3, 3, 3, 7, 9, 0])
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()

    # a client's upload: two batches of its data through the (same) model
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]
    client = cls["FedNHClient"](None, batches, None, {"num_classes": C}, 0, "cpu")
    client.model = model
    upload = client._estimate_prototype()

    # the server: three uploads (the client's, and two made up), one aggregation round
    server = object.__new__(cls["FedNHServer"])
    FedUHServer.__init__(server, {"learning_rate": 1.0, "lr_decay_per_round": 1.0, "num_classes": C,
                                  "FedNH_server_adv_prototype_agg": False, "FedNH_smoothing": 0.9},
                         {0: client}, [])
    server.server_model_state_dict = copy.deepcopy(model.state_dict())
    others = []
    for k in (3, 4):
        scaled = torch.zeros(C, 192)
        counts = torch.full((C,), 1e-12)
        for c in range(k):  # classes 0..k-1, none holds class 8
            counts[c] = float(c + 2)
            scaled[c] = F.normalize(torch.rand(192, generator=g), dim=0) * counts[c]
        state = {key: value + 0.01 * k for key, value in model.state_dict().items()}
        state["prototype"] = model.state_dict()["prototype"].clone()
        others.append((state, {"scaled_prototype": scaled, "count_by_class_full": counts}))
    uploads = [(copy.deepcopy(model.state_dict()), upload)] + others
    server.aggregate(uploads, 1)
    golden = {
        "source": {"repo": REPO, "commit": commit,
                   "files": ["src/flbase/models/CNN.py", "src/flbase/strategies/FedNH.py", "src/flbase/utils.py",
                             "src/flbase/strategies/FedUH.py"]},
        "init_seed": 0, "init": init.tolist(), "h": raw["h"].detach().tolist(), "y": y.tolist(),
        "scale": 1.7, "logits": logits.detach().tolist(), "loss": loss.item(), "grad_scale": model.scaling.grad.item(),
        "scaled_prototype": upload["scaled_prototype"].tolist(), "counts": upload["count_by_class_full"].tolist(),
        "others": [{"scaled_prototype": o["scaled_prototype"].tolist(), "counts": o["count_by_class_full"].tolist()}
                   for _, o in others],
        "prototype_after": server.server_model_state_dict["prototype"].tolist(),
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}: loss {loss.item():.10f}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fednh.json")

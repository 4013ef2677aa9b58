"""Golden outputs of FedETF's own code (github.com/ZexiLee/ICCV-2023-FedETF) for fedlt's tests.

Runs, offline and in float64 where their code allows, the authors' own definitions:
- ``models_dict/proto_classifiers.py``: ``Proto_Classifier`` (the simplex ETF from a random
  orthogonal basis; their ``.cuda()`` is made a no-op, their ``.float()`` cast stays);
- ``models_dict/cnn.py``: ``CNNCifar10`` (projection ``linear_proto``, the L2 normalisation of
  the projected feature, ``scaling_train`` = 10), cast to float64 after construction;
- ``client_funct.py``: ``balanced_softmax_loss``, and the two lines of ``client_fedetf`` that make
  the logits (``torch.matmul(feature, proto)``, times ``scaling_train``), quoted below;
- ``nodes.py``'s ``torch.where(sample_per_class > 0, sample_per_class, 1)``, quoted below.

Writes tests/golden/fedetf.json: the ETF's input matrix a and the ETF, the representation h
(their ``out``), the projection's weights, the logits, the loss and its gradients w.r.t. h, the
projection and β, with the repository URL and commit.

    python tools/fedetf_golden/make_golden.py /work/.mirror/ZexiLee+ICCV-2023-FedETF/repo
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn import init

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/ZexiLee/ICCV-2023-FedETF"


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.Tensor.cuda = lambda self, *a, **k: self  # offline: their Proto_Classifier calls .cuda()
    ns = {"torch": torch, "nn": nn, "F": F, "init": init, "copy": copy, "math": math, "np": np}
    load(git_dir, commit, "models_dict/proto_classifiers.py", ["Proto_Classifier"], ns)
    load(git_dir, commit, "models_dict/cnn.py", ["CNNCifar10"], ns)
    bsl = load(git_dir, commit, "client_funct.py", ["balanced_softmax_loss"], ns)["balanced_softmax_loss"]

    # the ETF: their np.random draw, recorded, then their construction
    np.random.seed(3)
    a = np.random.random(size=(64, 10))
    np.random.seed(3)
    torch.manual_seed(0)
    model = ns["CNNCifar10"]().double()
    proto = model.proto_classifier.proto.double()  # float32 in their code: P is cast with .float()

    x = torch.randn(6, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([0, 3, 3, 7, 9, 2])
    counts = torch.tensor([4, 0, 2, 5, 0, 0, 0, 3, 0, 1])
    sample_per_class = torch.where(counts > 0, counts, 1)  # nodes.py, generate_sample_per_class
    feature, _, h = model(x)
    h.retain_grad()
    output_local = torch.matmul(feature, proto)  # client_funct.py, client_fedetf
    output_local = model.scaling_train * output_local
    loss = bsl(output_local, target, sample_per_class)
    loss.backward()
    golden = {
        "source": {"repo": REPO, "commit": commit,
                   "files": ["models_dict/proto_classifiers.py", "models_dict/cnn.py", "client_funct.py", "nodes.py"]},
        "a": a.tolist(), "etf": proto.tolist(), "h": h.detach().tolist(),
        "proj_weight": model.linear_proto.weight.detach().tolist(), "proj_bias": model.linear_proto.bias.detach().tolist(),
        "scale": model.scaling_train.item(), "targets": target.tolist(), "class_counts": counts.tolist(),
        "logits": output_local.detach().tolist(), "loss": loss.item(), "grad_h": h.grad.tolist(),
        "grad_proj_weight": model.linear_proto.weight.grad.tolist(),
        "grad_proj_bias": model.linear_proto.bias.grad.tolist(), "grad_scale": model.scaling_train.grad.item(),
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}: loss {loss.item():.10f}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fedetf.json")

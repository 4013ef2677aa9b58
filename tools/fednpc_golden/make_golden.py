"""Golden output of FedNPC's own code (github.com/JintongGao/FedNPC) for fedlt's tests.

Runs, offline, the authors' ``generate_noisy_batch`` and ``re_train_classifier`` (FedAvg-FedNPC.py)
verbatim, in float32 as theirs, on a stand-in global model (a small body and a ``classifier``
linear layer, the names their code reads), after ``torch.manual_seed(SEED)``; their ``.cuda()`` is
a no-op, and their per-step test evaluation (``global_eval``, which picks the best step by test
accuracy) is a stand-in whose accuracy rises every step, so the classifier they return is the
last step's. Writes tests/golden/fednpc.json with the repository URL and commit.

    python tools/fednpc_golden/make_golden.py /work/.mirror/JintongGao+FedNPC/repo
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import types
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn import CrossEntropyLoss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/JintongGao/FedNPC"
SEED, D, C, M, E, LR = 11, 12, 5, 64, 6, 0.1


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, D)
        self.classifier = nn.Linear(D, C)


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.Tensor.cuda = lambda self, *a, **k: self  # offline
    nn.Module.cuda = lambda self, *a, **k: self
    ns = {"torch": torch, "copy": copy, "logging": logging, "CrossEntropyLoss": CrossEntropyLoss}
    fns = load(git_dir, commit, "FedAvg-FedNPC.py", ["generate_noisy_batch", "re_train_classifier"], ns)
    torch.manual_seed(0)
    syn = Model()
    steps = iter(range(1, 10**6))
    global_model = types.SimpleNamespace(syn_model=syn, global_eval=lambda *a, **k: next(steps) / 10**6)
    args = types.SimpleNamespace(M=M, E=E, lr=LR, batch_size_test=1)
    start = {k: v.detach().clone() for k, v in syn.classifier.state_dict().items()}
    torch.manual_seed(SEED)
    best = fns["re_train_classifier"](args, 0.0, global_model, None, None)
    assert torch.equal(best["body.weight"], syn.body.weight)  # the backbone is frozen
    golden = {"source": {"repo": REPO, "commit": commit, "files": ["FedAvg-FedNPC.py"]},
              "seed": SEED, "size": M, "steps": E - 1, "lr": LR, "momentum": 0.9,
              "start": {k: v.tolist() for k, v in start.items()},
              "retrained": {"weight": best["classifier.weight"].tolist(), "bias": best["classifier.bias"].tolist()}}
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fednpc.json")

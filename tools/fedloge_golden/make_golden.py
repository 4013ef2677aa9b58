"""Golden output of FedLoGe's own code (github.com/ZackZikaiXiao/FedLoGe) for fedlt's tests.

Runs, offline, the authors' ``ETF_Classifier`` (``util/etf_methods.py``: the simplex ETF and
``gen_sparse_ETF``, the static sparse equiangular classifier: 60% of the entries zeroed, 10 000
Adam steps on the rest; their ``.cuda()`` made a no-op; float32, as theirs) for a 16-dimensional
representation and 5 classes after ``np.random.seed(SEED)``, and the fixed bias of their
``g_head`` (``nn.Linear(in_features, out_features)``'s initial bias after ``torch.manual_seed(SEED)``).
Writes tests/golden/fedloge.json with the repository URL and commit.

    python tools/fedloge_golden/make_golden.py /work/.mirror/ZackZikaiXiao+FedLoGe/repo
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/ZackZikaiXiao/FedLoGe"
SEED, D, C = 7, 16, 5


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.Tensor.cuda = lambda self, *a, **k: self  # offline
    ns = {"torch": torch, "nn": nn, "F": F, "optim": optim, "np": np, "copy": copy}
    ETF_Classifier = load(git_dir, commit, "util/etf_methods.py", ["ETF_Classifier"], ns)["ETF_Classifier"]
    np.random.seed(SEED)
    etf = ETF_Classifier(D, C)
    with contextlib.redirect_stdout(io.StringIO()):  # their progress prints
        sparse = etf.gen_sparse_ETF(feat_in=D, num_classes=C, beta=0.6)
    torch.manual_seed(SEED)
    bias = nn.Linear(D, C).bias.detach()
    h = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    g_head = nn.Linear(D, C)
    g_head.weight.data = sparse.detach().t()  # fedloge.py: g_head.weight.data = sparse_etf_mat (transposed)
    g_head.bias.data = bias.clone()
    golden = {"source": {"repo": REPO, "commit": commit, "files": ["util/etf_methods.py", "fedloge.py"]},
              "seed": SEED, "feat_in": D, "num_classes": C, "beta": 0.6, "steps": 10000,
              "sparse_etf": sparse.detach().tolist(), "bias": bias.tolist(), "h": h.tolist(),
              "logits": g_head(h).detach().tolist()}
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fedloge.json")

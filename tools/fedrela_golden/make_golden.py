"""Golden outputs of FedReLa's own code (github.com/guangzhengh/FedReLa) for fedlt's tests.

Runs, offline and in float64, the authors' ``util/FedReLa.py`` (``collect_Q``,
``compute_normalized_priors``, ``compute_classwise_statistics``, ``zscore``,
``compute_adaptive_threshold``, ``get_rho_with_tanh_norm`` and ``relabel_local_data``, verbatim)
with stand-ins only for what surrounds them: ``.cuda()`` made a no-op, their ResNet and g_head
replaced by a small net with the same interface (``net(x, latent_output=True)`` -> features, then
a linear g_head), an unshuffled loader of ``(index, x, y)`` over a long-tailed client (40 samples,
counts 20/10/7/3), their prints silenced and their pickle written to a temporary directory. For
``thre`` 5 (their default) and 25, numpy's stream seeded before ``relabel_local_data`` (whose
``np.random.rand(C)`` per sample draws the flips) and the same draws recorded. Writes
tests/golden/fedrela.json: the model, the data, the averaged predictions and each run's new
labels, with the repository URL and commit.

    python tools/fedrela_golden/make_golden.py /work/.mirror/guangzhengh+FedReLa/repo
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/guangzhengh/FedReLa"
C, D_IN, D, N = 4, 5, 6, 40
NAMES = ["collect_Q", "compute_normalized_priors", "compute_classwise_statistics", "zscore",
         "compute_adaptive_threshold", "get_rho_with_tanh_norm", "relabel_local_data"]


class Net(nn.Module):
    """Their backbone's interface: ``net(x, latent_output=True)`` gives the features."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D), nn.ReLU())

    def forward(self, x, latent_output=False):
        return self.body(x)


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.set_default_dtype(torch.float64)
    torch.Tensor.cuda = lambda self, *a, **k: self  # offline
    ns = {"torch": torch, "F": F, "np": np, "os": os, "pickle": pickle}
    code = load(git_dir, commit, "util/FedReLa.py", NAMES, ns)

    g = torch.Generator().manual_seed(4)
    y = torch.tensor([0] * 20 + [1] * 10 + [2] * 7 + [3] * 3)
    x = torch.randn(N, D_IN, generator=g) + y[:, None] * 0.3
    torch.manual_seed(1)
    net, g_head = Net(), nn.Linear(D, C)
    loader = DataLoader(TensorDataset(torch.arange(N), x, y), batch_size=8, shuffle=False)
    args = types.SimpleNamespace(gpu=0, id="golden")
    with contextlib.redirect_stdout(io.StringIO()):
        pred_dict, _, _, preds = code["collect_Q"](g_head, net, loader, args, "loge", 5)
    runs = []
    for thre, seed in ((5.0, 0), (25.0, 1)):
        np.random.seed(seed)
        uniform = np.random.rand(N, C)  # the draws get_rho_with_tanh_norm makes, sample by sample
        np.random.seed(seed)
        with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp), contextlib.redirect_stdout(io.StringIO()):
            info = code["relabel_local_data"](g_head, net, 0, args, thre, loader, class_num=C, read=False, store=True)
        flags = {int(re.search(r"\d+", k).group()): int(v) for k, v in info["relabel_flag"].items()}  # 'tensor(i)'
        labels = [flags.get(i, int(y[i])) for i in range(N)]
        runs.append({"thre": thre, "uniform": uniform.tolist(), "labels": labels, "relabelled": len(flags)})
    tensors = lambda sd: {k: v.tolist() for k, v in sd.items()}  # noqa: E731
    golden = {
        "source": {"repo": REPO, "commit": commit, "files": ["util/FedReLa.py"]},
        "x": x.tolist(), "y": y.tolist(), "net": tensors(net.state_dict()), "g_head": tensors(g_head.state_dict()),
        "predictions": np.asarray(preds).tolist(), "runs": runs,
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}: relabelled {[r['relabelled'] for r in runs]} of {N}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else
         Path(__file__).resolve().parents[2] / "tests" / "golden" / "fedrela.json")

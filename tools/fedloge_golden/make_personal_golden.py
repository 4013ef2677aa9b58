"""Golden outputs of FedLoGe's own code (github.com/ZackZikaiXiao/FedLoGe) for its personal half
and its realignment, for fedlt's tests.

Runs, offline and in float64, the authors' own definitions from ``util/update_baseline.py``:
- ``LocalUpdate.update_weights_gaux``: one client's local training (the backbone through the
  fixed g_head, g_aux and the local head l_head on the detached features), two epochs;
- ``LocalUpdate.update_weights_norm_init`` with ``epoch=0``, as realignment.py calls it: the
  local adaptive feature realignment (LA-FR) of g_aux by l_head's row norms;
- ``localtest`` (p_mode 1): the personal logits l_head(f) + g_aux'(f), the classes the client
  lacks masked; its accuracy;
- ``globaltest_calibra``: the global adaptive feature realignment (GA-FR) of g_aux; its accuracy;
and ``shot_split`` from ``util/util.py`` (what the two tests call). Stand-ins: a small backbone with
their ``net(x, latent_output=True)`` interface; their DataLoader replaced by the batches in order;
``sklearn.metrics.f1_score`` (only printed by them) stubbed. g_head is their SSE-C from
tests/golden/fedloge.json (their ``gen_sparse_ETF``, seed 7, d = 16, C = 5).
Writes tests/golden/fedloge_personal.json with the repository URL and commit.

    python tools/fedloge_golden/make_personal_golden.py /work/.mirror/ZackZikaiXiao+FedLoGe/repo
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import sys
import types
from unittest import mock
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from authors_code import head_commit, load  # noqa: E402

REPO = "https://github.com/ZackZikaiXiao/FedLoGe"
ROOT = Path(__file__).resolve().parents[2]
D, C, IN = 16, 5, 8
LR, MOMENTUM, BATCH, EPOCHS = 0.05, 0.5, 4, 2


class Net(nn.Module):
    """Their backbone's interface: ``net(x, latent_output=True)`` gives the features."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, D), nn.ReLU())
        self.linear = nn.Linear(D, C)

    def forward(self, x, latent_output=False):
        f = self.body(x)
        return f if latent_output else self.linear(f)


def main(git_dir: str, out: Path) -> None:
    commit = head_commit(git_dir)
    torch.set_default_dtype(torch.float64)
    ns = {"torch": torch, "nn": nn, "F": F, "np": np, "copy": copy, "DataLoader": DataLoader, "Dataset": Dataset}
    load(git_dir, commit, "util/util.py", ["shot_split"], ns)
    cls = load(git_dir, commit, "util/update_baseline.py",
               ["DatasetSplit", "LocalUpdate", "localtest", "globaltest_calibra"], ns)

    sse = json.loads((ROOT / "tests" / "golden" / "fedloge.json").read_text())
    assert (sse["feat_in"], sse["num_classes"]) == (D, C)
    g_head = nn.Linear(D, C)
    g_head.weight.data = torch.tensor(sse["sparse_etf"]).t().contiguous()
    g_head.bias.data = torch.tensor(sse["bias"])
    torch.manual_seed(0)
    net, g_aux, l_head = Net(), nn.Linear(D, C), nn.Linear(D, C)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, IN, generator=g)
    y = torch.tensor([0, 1, 0, 2, 4, 0, 1, 0, 2, 0, 4, 1])  # class 3 absent
    start = {"backbone": copy.deepcopy(net.state_dict()), "g_aux": copy.deepcopy(g_aux.state_dict()),
             "l_head": copy.deepcopy(l_head.state_dict())}

    local = object.__new__(cls["LocalUpdate"])
    local.args = types.SimpleNamespace(lr=LR, momentum=MOMENTUM, device="cpu", local_bs=BATCH, num_classes=C)
    local.ldr_train = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(y), BATCH)]  # shuffle off
    w, g_aux_t, l_head_t, loss = local.update_weights_gaux(net=copy.deepcopy(net), g_head=copy.deepcopy(g_head),
                                                           g_aux=copy.deepcopy(g_aux), l_head=l_head, epoch=EPOCHS)
    trained = Net()
    trained.load_state_dict(w)

    # LA-FR, as realignment.py: update_weights_norm_init(..., epoch=0) on copies
    _, g_aux_la, _, _ = local.update_weights_norm_init(net=copy.deepcopy(trained), g_aux=copy.deepcopy(g_aux_t),
                                                       g_head=copy.deepcopy(g_head), l_head=copy.deepcopy(l_head_t),
                                                       seed=0, net_glob=None, epoch=0)
    counts = np.bincount(y.numpy(), minlength=C)
    xt = torch.randn(10, IN, generator=g)
    yt = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 4, 0])
    test = [(xt[i], int(yt[i])) for i in range(len(yt))]
    dataset_class = types.SimpleNamespace(get_args=lambda: local.args, local_test_distribution={0: counts},
                                          global_test_distribution=np.bincount(yt.numpy(), minlength=C))
    g_p, l_p = copy.deepcopy(g_aux_la), copy.deepcopy(l_head_t)
    sklearn, metrics = types.ModuleType("sklearn"), types.ModuleType("sklearn.metrics")
    metrics.f1_score = lambda **kwargs: 0.0  # their localtest only prints F1 (sklearn is not installed)
    with mock.patch.dict(sys.modules, {"sklearn": sklearn, "sklearn.metrics": metrics}):
        acc_local, *_ = cls["localtest"](copy.deepcopy(trained), g_p, l_p, test, dataset_class, range(len(yt)), 0)
    with torch.no_grad():
        f = trained(xt, latent_output=True)
        personal = l_p(f) + g_p(f)  # their localtest's line (p_mode 1), with the heads it masked
    g_ga = copy.deepcopy(g_aux_t)
    with contextlib.redirect_stdout(io.StringIO()):  # their timing print
        acc_global, _ = cls["globaltest_calibra"](copy.deepcopy(trained), g_ga, test, local.args, dataset_class)
    with torch.no_grad():
        global_logits = g_ga(f)
    sd = lambda m: {k: v.tolist() for k, v in m.state_dict().items()}  # noqa: E731
    golden = {
        "source": {"repo": REPO, "commit": commit, "files": ["util/update_baseline.py", "util/util.py",
                                                             "realignment.py", "fedloge.py"]},
        "lr": LR, "momentum": MOMENTUM, "batch": BATCH, "epochs": EPOCHS, "x": x.tolist(), "y": y.tolist(),
        "start": {k: {n: t.tolist() for n, t in v.items()} for k, v in start.items()},
        "trained": {"backbone": {k: v.tolist() for k, v in w.items()}, "g_aux": sd(g_aux_t), "l_head": sd(l_head_t)},
        "loss": loss, "g_aux_la": g_aux_la.weight.detach().tolist(),
        "x_test": xt.tolist(), "y_test": yt.tolist(), "counts": counts.tolist(),
        "personal_logits": personal.tolist(), "acc_local": acc_local,
        "g_aux_ga": g_ga.weight.detach().tolist(), "global_logits": global_logits.tolist(), "acc_global": acc_global,
    }
    out.write_text(json.dumps(golden))
    print(f"wrote {out} from {REPO} @ {commit}: loss {loss:.10f}, local acc {acc_local}, global acc {acc_global}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "tests" / "golden" / "fedloge_personal.json")

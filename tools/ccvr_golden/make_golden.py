"""Golden fixture for CCVR. The paper's authors (Luo et al., NeurIPS 2021) published no code;
the reference is FL-bench (github.com/KarhouTam/FL-bench at commit
06e658bca5af6ce732e25bb7c0f8be321e14a85e): ``CCVRClient.get_classwise_feature_means_and_covs``
(src/client/ccvr.py), ``CCVRServer.compute_classes_mean_cov`` and
``CCVRServer.calibrate_classifier`` (src/server/ccvr.py), run verbatim in float64 on fixed small
inputs. Writes tests/golden/ccvr.json.

    python tools/ccvr_golden/make_golden.py /work/.mirror/KarhouTam+FL-bench/repo

One deliberate difference, recorded in docs/algorithms.md: FL-bench's clients upload the biased
covariance (``cov(correction=0)``) but its server pools them with the paper's eq. (4), which is
the pooled covariance only for unbiased ones; fedlt follows the paper (unbiased), so the server
function is fed the unbiased covariances here (n/(n − 1) times the client function's output).
``self`` is a stand-in holding what the methods read; the DataLoader records its orders.
"""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from golden_source import RecordingLoader, definitions, source, tolist  # noqa: E402

REPO, COMMIT = "https://github.com/KarhouTam/FL-bench", "06e658bca5af6ce732e25bb7c0f8be321e14a85e"
D, C = 5, 4


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = torch.nn.Linear(D, C)

    def get_last_features(self, x):
        return x


def main(git_dir: str) -> None:
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(2)
    namespace = {"torch": torch, "np": np, "Any": object, "Dataset": Dataset, "DataLoader": RecordingLoader,
                 "NUM_CLASSES": {"fake": C}}
    fns = definitions(source(git_dir, COMMIT, "src/client/ccvr.py"),
                      ["CCVRClient.get_classwise_feature_means_and_covs"], namespace)
    fns |= definitions(source(git_dir, COMMIT, "src/server/ccvr.py"),
                       ["CCVRServer.compute_classes_mean_cov", "CCVRServer.calibrate_classifier"], namespace)
    # three clients' features (class 3: one sample in all; client 2 has no class 0)
    labels = [[0, 0, 0, 1, 1, 2, 0, 1], [2, 2, 1, 0, 3, 2], [1, 1, 2, 2, 2, 1, 1]]
    feats = [torch.randn(len(y), D, generator=g) for y in labels]
    packages, uploads = {}, []
    for k, (x, y) in enumerate(zip(feats, labels)):
        client = Namespace(set_parameters=lambda p: None, model=_Model(), device="cpu",
                           trainloader=[(x[:3], torch.tensor(y[:3])), (x[3:], torch.tensor(y[3:]))],
                           dataset=Namespace(classes=list(range(C))))
        out = fns["CCVRClient.get_classwise_feature_means_and_covs"](client, None)
        uploads.append({"counts": out["counts"], "means": tolist(out["means"]), "biased_covs": tolist(out["covs"])})
        unbiased = [cov * n / (n - 1) if n > 1 else cov for cov, n in zip(out["covs"], out["counts"])]
        packages[k] = {"means": out["means"], "covs": unbiased, "counts": out["counts"]}
    server = Namespace(trainer=Namespace(exec=lambda name, clients: packages), train_clients=[0, 1, 2], device="cpu",
                       args=Namespace(dataset=Namespace(name="fake")))
    means, covs = fns["CCVRServer.compute_classes_mean_cov"](server)
    # calibrate_classifier from fixed virtual features (FL-bench samples them with numpy's generator)
    virtual = torch.randn(12, D, generator=g)
    targets = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 1, 2])
    model = _Model()
    init = {k: v.detach().clone() for k, v in model.classifier.state_dict().items()}
    public = {"classifier.weight": init["weight"].clone(), "classifier.bias": init["bias"].clone()}
    server.model, server.public_model_params = model, public
    server.public_model_param_names = list(public)
    server.compute_classes_mean_cov = lambda: (means, covs)
    server.generate_virtual_representation = lambda m, c: (virtual, targets)
    server.args = Namespace(common=Namespace(batch_size=5), optimizer=Namespace(lr=0.3))
    fns["CCVRServer.calibrate_classifier"](server)
    out = {"source": {"repo": REPO, "commit": COMMIT,
                      "functions": ["src/client/ccvr.py: CCVRClient.get_classwise_feature_means_and_covs",
                                    "src/server/ccvr.py: CCVRServer.compute_classes_mean_cov, "
                                    "CCVRServer.calibrate_classifier"]},
           "clients": {"features": tolist(feats), "labels": labels, "uploads": uploads},
           "pooled": {"means": [tolist(m) if m is not None else None for m in means],
                      "covs": [tolist(c) if c is not None else None for c in covs]},
           "calibrate": {"features": tolist(virtual), "labels": tolist(targets), "init": tolist(init),
                         "orders": RecordingLoader.orders, "batch_size": 5, "lr": 0.3,
                         "head": {"weight": tolist(public["classifier.weight"]),
                                  "bias": tolist(public["classifier.bias"])}}}
    path = Path(__file__).resolve().parents[2] / "tests" / "golden" / "ccvr.json"
    path.write_text(json.dumps(out))
    print("wrote", path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/work/.mirror/KarhouTam+FL-bench/repo")

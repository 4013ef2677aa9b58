"""CCVR and CReFF held to their reference code (issue 33): the fixtures in tests/golden/ were
written by tools/{ccvr,creff}_golden/make_golden.py, which runs the reference functions verbatim
in float64 (repository and commit recorded in each fixture); fedlt agrees within 1e-5, and each
test rejects a deliberately wrong variant (a mutant)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedlt.server_steps import ccvr, creff, retrain_classifier

GOLDEN = Path(__file__).parent / "golden"
T = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-5, atol=1e-7))


@pytest.fixture(scope="module")
def creff_golden() -> dict:
    data = json.loads((GOLDEN / "creff.json").read_text())
    assert data["source"]["repo"] == "https://github.com/shangxinyi/CReFF-FL"
    assert len(data["source"]["commit"]) == 40
    return data


def test_creff_match_distance(creff_golden):
    m = creff_golden["match"]
    got = creff.match_distance([T(g) for g in m["g_syn"]], [T(g) for g in m["g_real"]])
    assert abs(float(got) - m["distance"]) < 1e-5 * abs(m["distance"])
    # mutant: the bias's distance taken per element (as the weight's rows) instead of over the whole vector
    mutant = creff.match_distance([T(m["g_syn"][0]), T(m["g_syn"][1])[:, None]],
                                  [T(m["g_real"][0]), T(m["g_real"][1])[:, None]])
    assert abs(float(mutant) - m["distance"]) > 1e-3


def _real(clients: list[dict]) -> dict[int, list[torch.Tensor]]:
    uploads = [{"classes": torch.tensor([int(c) for c in client]),
                "grad_weight": torch.stack([T(g[0]) for g in client.values()]),
                "grad_bias": torch.stack([T(g[1]) for g in client.values()])} for client in clients]
    return creff.average_gradients(uploads)


def test_creff_feature_update(creff_golden):
    u = creff_golden["update"]
    head = {k: T(v) for k, v in u["head"].items()}
    got = creff.update_features(T(u["features"]), head, _real(u["clients"]), steps=u["steps"], lr=u["lr"],
                                per_class=u["per_class"])
    assert _close(got, T(u["features_after"]))
    # mutant: the classes' distances averaged (the authors sum them), i.e. the step divided by their number
    real = _real(u["clients"])
    wrong = creff.update_features(T(u["features"]), head, real, steps=u["steps"], lr=u["lr"] / len(real),
                                  per_class=u["per_class"])
    assert not _close(wrong, T(u["features_after"]))
    # mutant: a client's gradients dropped (each class is the mean over all its holders)
    wrong = creff.update_features(T(u["features"]), head, _real(u["clients"][:1]), steps=u["steps"], lr=u["lr"],
                                  per_class=u["per_class"])
    assert not _close(wrong, T(u["features_after"]))


def test_creff_retrain(creff_golden):
    r = creff_golden["retrain"]
    init = {k: T(v) for k, v in r["init"].items()}
    kwargs = dict(epochs=r["epochs"], batch_size=r["batch_size"], lr=r["lr"])
    got = retrain_classifier(init, T(r["features"]), torch.tensor(r["labels"]),
                             orders=[torch.tensor(o) for o in r["orders"]], **kwargs)
    for k in ("weight", "bias"):
        assert _close(got[k], T(r["head"][k])), k
    # mutant: the same epochs over the features in their stored order
    flat = retrain_classifier(init, T(r["features"]), torch.tensor(r["labels"]),
                              orders=[torch.arange(len(r["labels"]))] * r["epochs"], **kwargs)
    assert not _close(flat["weight"], T(r["head"]["weight"]))


class _Identity(torch.nn.Module):
    """Features = the input; then the classifier (so a client's features are given directly)."""

    def __init__(self, d: int, c: int) -> None:
        super().__init__()
        self.classifier = torch.nn.Linear(d, c).double()

    def forward(self, x):
        return self.classifier(x)

    def get_classifier(self):
        return self.classifier


def test_creff_client_gradients(creff_golden):
    g = creff_golden["client"]
    x, y = T(g["x"]), torch.tensor(g["y"])
    head = {k: T(v) for k, v in g["head"].items()}
    step = creff.CReFFStep(batch_real=g["batch_real"], repeats=g["repeats"])
    model = _Identity(x.shape[1], len(head["bias"]))
    up = step.collect(model, [(x[:7], y[:7]), (x[7:], y[7:])], {"head": head}, len(head["bias"]),
                      torch.Generator().manual_seed(0))
    assert up["classes"].tolist() == [int(c) for c in g["gradients"]]
    for i, (w, b) in enumerate(g["gradients"].values()):
        assert _close(up["grad_weight"][i], T(w)) and _close(up["grad_bias"][i], T(b))
    # mutant: the gradient under the model's own classifier instead of the re-trained one sent
    own = creff.class_gradients({"weight": model.classifier.weight, "bias": model.classifier.bias}, x[y == 0], 0)
    assert not _close(own[0], T(g["gradients"]["0"][0]))


# -- CCVR (reference: FL-bench; the paper's authors published no code) ------------------------------
@pytest.fixture(scope="module")
def ccvr_golden() -> dict:
    data = json.loads((GOLDEN / "ccvr.json").read_text())
    assert data["source"]["repo"] == "https://github.com/KarhouTam/FL-bench"
    assert len(data["source"]["commit"]) == 40
    return data


def _ccvr_uploads(golden: dict) -> list[dict]:
    c = golden["clients"]
    return [ccvr.class_stats(T(x), torch.tensor(y), 4) for x, y in zip(c["features"], c["labels"])]


def test_ccvr_client_statistics(ccvr_golden):
    for mine, ref in zip(_ccvr_uploads(ccvr_golden), ccvr_golden["clients"]["uploads"]):
        assert mine["counts"].tolist() == ref["counts"]
        assert _close(mine["means"], T(ref["means"]))
        held = mine["cov_classes"]
        assert held.tolist() == [c for c, n in enumerate(ref["counts"]) if n >= 2]
        n = mine["counts"][held].double()[:, None, None]
        biased = T(ref["biased_covs"])[held]
        # fedlt uploads the unbiased covariance (the paper's eq. 4 reads it so); FL-bench's is biased
        assert _close(mine["covs"], biased * n / (n - 1))
        assert not _close(mine["covs"], biased)  # mutant: FL-bench's biased one


def test_ccvr_pooled_statistics(ccvr_golden):
    total, mean, cov = ccvr.pooled_class_stats(_ccvr_uploads(ccvr_golden))
    ref = ccvr_golden["pooled"]
    for c in range(4):
        assert _close(mean[c], T(ref["means"][c]))
        if ref["covs"][c] is not None:  # FL-bench skips classes with one sample; fedlt leaves them 0
            assert _close(cov[c], T(ref["covs"][c]))
        else:
            assert int(total[c]) < 2 and c not in cov
    # the pooled covariance is that of all the features together (float64, written another way)
    x = torch.cat([T(f) for f in ccvr_golden["clients"]["features"]])
    y = torch.tensor(sum(ccvr_golden["clients"]["labels"], []))
    assert _close(cov[1], torch.cov(x[y == 1].T))
    # mutant: the clients' means weighted equally instead of by their counts
    means = torch.stack([u["means"] for u in _ccvr_uploads(ccvr_golden)])
    assert not _close(means.mean(0)[2], T(ref["means"][2]))


def test_ccvr_calibration(ccvr_golden):
    r = ccvr_golden["calibrate"]
    init = {k: T(v) for k, v in r["init"].items()}
    got = retrain_classifier(init, T(r["features"]), torch.tensor(r["labels"]), epochs=1, batch_size=r["batch_size"],
                             lr=r["lr"], orders=[torch.tensor(o) for o in r["orders"]])
    for k in ("weight", "bias"):
        assert _close(got[k], T(r["head"][k])), k
    # mutant: a fresh classifier (CReFF's choice) instead of the aggregated one as the start
    fresh = retrain_classifier({k: torch.zeros_like(v) for k, v in init.items()}, T(r["features"]),
                               torch.tensor(r["labels"]), epochs=1, batch_size=r["batch_size"], lr=r["lr"],
                               orders=[torch.tensor(o) for o in r["orders"]])
    assert not _close(fresh["weight"], T(r["head"]["weight"]))


def test_ccvr_virtual_features_follow_the_pooled_gaussian():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 3, generator=g, dtype=torch.float64)
    mean, cov = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), a @ a.T
    x = ccvr.sample_virtual(mean, cov, 20000, torch.Generator().manual_seed(1))
    assert torch.allclose(x.mean(0), mean, atol=0.05) and torch.allclose(torch.cov(x.T), cov, atol=0.1 * cov.abs().max())
    # singular covariance (fewer samples than dimensions): the draws stay on its subspace
    v = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)
    x = ccvr.sample_virtual(torch.zeros(3, dtype=torch.float64), v.T @ v, 50, torch.Generator().manual_seed(2))
    assert torch.allclose(torch.linalg.cross(x, v.expand_as(x)), torch.zeros_like(x), atol=1e-9)

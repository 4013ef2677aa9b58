"""FedETF held to the authors' own code (tests/golden/fedetf.json, written by
tools/fedetf_golden/make_golden.py from github.com/ZexiLee/ICCV-2023-FedETF at the commit it
records): the simplex ETF, the head's logits, the balanced softmax loss with an absent class
counted as one sample, and the gradients w.r.t. the representation, the projection and β."""

import json
from pathlib import Path

import pytest
import torch

import fedlt.losses
from fedlt.models.heads import etf_logits, simplex_etf

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fedetf.json").read_text())
T = lambda key: torch.tensor(GOLDEN[key], dtype=torch.float64)  # noqa: E731


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/ZexiLee/ICCV-2023-FedETF"
    assert len(GOLDEN["source"]["commit"]) == 40


def test_simplex_etf_matches_the_authors_construction():
    got = simplex_etf(T("a"))
    assert torch.allclose(got, T("etf"), atol=1e-6)  # theirs is cast to float32 on the way
    gram = got.t() @ got  # unit columns, pairwise cosine -1/(C-1)
    c = got.shape[1]
    assert torch.allclose(gram, torch.full((c, c), -1 / (c - 1), dtype=torch.float64).fill_diagonal_(1.0), atol=1e-12)


def test_simplex_etf_mutant_without_centring_is_rejected():
    p, _ = torch.linalg.qr(T("a"))
    assert not torch.allclose(p, T("etf"), atol=1e-3)


def _forward(loss_spec: str, normalise: bool = True):
    h = T("h").requires_grad_()
    w, b = T("proj_weight").requires_grad_(), T("proj_bias").requires_grad_()
    scale = torch.tensor(GOLDEN["scale"], dtype=torch.float64, requires_grad=True)
    if normalise:
        logits = etf_logits(h, w, b, T("etf"), scale)
    else:  # mutant: no L2 normalisation of the projected feature
        logits = scale * (torch.nn.functional.linear(h, w, b) @ T("etf"))
    counts = torch.tensor(GOLDEN["class_counts"])
    loss = fedlt.losses.build(loss_spec, class_counts=counts, num_classes=len(counts))(
        logits, torch.tensor(GOLDEN["targets"]))
    loss.backward()
    return logits, loss, h.grad, w.grad, b.grad, scale.grad


def test_logits_loss_and_gradients_match_the_authors():
    logits, loss, gh, gw, gb, gs = _forward("balanced_softmax(absent='one')")
    assert torch.allclose(logits, T("logits"), atol=1e-5)
    assert loss.item() == pytest.approx(GOLDEN["loss"], abs=1e-5)
    for got, key in ((gh, "grad_h"), (gw, "grad_proj_weight"), (gb, "grad_proj_bias")):
        assert torch.allclose(got, T(key), atol=1e-5), key
    assert gs.item() == pytest.approx(GOLDEN["grad_scale"], abs=1e-5)


@pytest.mark.parametrize("mutant", ["balanced_softmax", "ce", "unnormalised"])
def test_mutants_are_rejected(mutant):
    """Absent classes excluded (fedlt's default balanced softmax), plain CE, or no feature
    normalisation: each moves the loss away from the authors' value."""
    spec = "balanced_softmax(absent='one')" if mutant == "unnormalised" else mutant
    _, loss, *_ = _forward(spec, normalise=mutant != "unnormalised")
    assert abs(loss.item() - GOLDEN["loss"]) > 1e-3

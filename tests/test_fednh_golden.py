"""FedNH held to the authors' own code (tests/golden/fednh.json, written by
tools/fednh_golden/make_golden.py from github.com/Yutong-Dai/FedNH at the commit it records):
the prototypes' initialisation, the head's logits and the scale's gradient, a client's class
prototypes, and the server's semantic infusion."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedlt.server_steps.fednh import class_prototypes, semantic_infusion
from fedlt.models.heads import PrototypeHead, prototype_logits

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fednh.json").read_text())
T = lambda key: torch.tensor(GOLDEN[key], dtype=torch.float64)  # noqa: E731


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/Yutong-Dai/FedNH"
    assert len(GOLDEN["source"]["commit"]) == 40


def test_prototypes_start_as_the_authors_orthogonal_init():
    head = PrototypeHead(192, 10, scale=1.0, seed=GOLDEN["init_seed"])
    assert torch.allclose(head.prototype.double(), T("init"), atol=1e-6)
    assert not torch.allclose(PrototypeHead(192, 10, scale=1.0, seed=1).prototype.double(), T("init"), atol=1e-3)


def test_logits_and_the_scales_gradient_match_the_authors():
    scale = torch.tensor([GOLDEN["scale"]], dtype=torch.float64, requires_grad=True)
    logits = prototype_logits(T("h"), T("init"), scale)
    loss = F.cross_entropy(logits, torch.tensor(GOLDEN["y"]))
    loss.backward()
    assert torch.allclose(logits, T("logits"), atol=1e-10)
    assert loss.item() == pytest.approx(GOLDEN["loss"], abs=1e-10)
    assert scale.grad.item() == pytest.approx(GOLDEN["grad_scale"], abs=1e-10)
    unnormalised = GOLDEN["scale"] * (T("h") @ T("init").t())  # mutant: features not normalised
    assert not torch.allclose(unnormalised, T("logits"), atol=1e-3)


def _client():
    y = torch.tensor(GOLDEN["y"])
    return class_prototypes(T("h"), y, torch.bincount(y, minlength=10))


def test_a_clients_prototypes_match_the_authors():
    scaled, counts = _client()
    assert torch.allclose(scaled, T("scaled_prototype"), atol=1e-10)
    assert torch.allclose(counts, T("counts"), rtol=0, atol=1e-20)


def test_semantic_infusion_matches_the_authors():
    scaled, counts = _client()
    others = GOLDEN["others"]
    all_scaled = [scaled] + [torch.tensor(o["scaled_prototype"], dtype=torch.float64) for o in others]
    all_counts = [counts] + [torch.tensor(o["counts"], dtype=torch.float64) for o in others]
    after = semantic_infusion(T("init"), all_scaled, all_counts, rho=0.9)
    assert torch.allclose(after, T("prototype_after"), atol=1e-10)
    # mutants: no smoothing (rho = 0), or no renormalisation of the smoothed prototypes
    assert not torch.allclose(semantic_infusion(T("init"), all_scaled, all_counts, rho=0.0), T("prototype_after"),
                              atol=1e-3)
    average = F.normalize(sum(s / torch.stack(all_counts).sum(0)[:, None] for s in all_scaled), dim=1)
    assert not torch.allclose(0.9 * T("init") + 0.1 * average, T("prototype_after"), atol=1e-3)

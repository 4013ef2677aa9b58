"""FedNPC held to the authors' own code (tests/golden/fednpc.json, written by
tools/fednpc_golden/make_golden.py from github.com/JintongGao/FedNPC at the commit it records): the
classifier re-trained on noise from the same seed ends where theirs does; and as a server step it
runs after the last round only, the trained classifier kept, the re-trained one evaluated."""

import json
from pathlib import Path

import pytest
import torch

import fedlt.server_steps
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.server_steps.fednpc import noise_retrain

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fednpc.json").read_text())


def _retrain(**change):
    start = {k: torch.tensor(v) for k, v in GOLDEN["start"].items()}
    params = dict(steps=GOLDEN["steps"], size=GOLDEN["size"], lr=GOLDEN["lr"], momentum=GOLDEN["momentum"]) | change
    return noise_retrain(start, generator=torch.Generator().manual_seed(GOLDEN["seed"]), **params)


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/JintongGao/FedNPC"
    assert len(GOLDEN["source"]["commit"]) == 40


def test_the_noise_retraining_matches_the_authors():
    out = _retrain()
    for k in ("weight", "bias"):
        assert torch.allclose(out[k], torch.tensor(GOLDEN["retrained"][k]), atol=1e-5), k
    assert not torch.allclose(torch.tensor(GOLDEN["start"]["weight"]), torch.tensor(GOLDEN["retrained"]["weight"]),
                              atol=1e-3)


@pytest.mark.parametrize("change", [{"momentum": 0.0}, {"steps": GOLDEN["steps"] - 1}, {"size": GOLDEN["size"] // 2}])
def test_mutated_retrainings_are_rejected(change):
    assert not torch.allclose(_retrain(**change)["weight"], torch.tensor(GOLDEN["retrained"]["weight"]), atol=1e-4)


def test_fednpc_runs_after_the_last_round_only(tmp_path, one_thread):
    step = fedlt.server_steps.create("fednpc")
    assert [step.due(r, 5) for r in range(5)] == [False] * 4 + [True]
    assert [fedlt.server_steps.create("fednpc", every=2).due(r, 5) for r in range(5)] == [False, True, False, True, True]
    tiny = dict(dataset="mnist", model="mlp", train_limit=300, test_limit=100, clients=5, participation=0.4,
                local_iters=2, server_batch=16, rounds=2, eval_every=1)
    run(RunConfig(**tiny, algorithm="fednpc", algorithm_params={"step": {"name": "fednpc", "size": 200}},
                  out=tmp_path / "run"))
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["algorithm"]
    head, trained = state["head"], state["model"]
    weight_key = [k for k in trained if k.endswith("weight")][-1]
    assert head is not None and not torch.equal(head["weight"], trained[weight_key])

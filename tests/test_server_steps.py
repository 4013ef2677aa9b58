"""Server-side steps (fedlt.server_steps) and the algorithms that carry them (issue 33): every
registered step passes its contract; a broken one fails naming the property; ccvr, creff and
fednh run from the CLI and in Python; the re-calibrated classifier is what is evaluated while the
aggregated one keeps training, except for a step that moves the model (FedNH's prototypes)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

import fedlt.server_steps
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.errors import FedltError
from fedlt.algorithms.protocol import ClientStates, LocalRunner
from fedlt.models import classifier
from fedlt.run.parts import client_data, prepare, train_round
from fedlt.server_steps import features
from fedlt.server_steps.ccvr import CCVRStep
from fedlt.server_steps.fednh import class_prototypes, semantic_infusion
from fedlt.testing import ContractError, check_server_step

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
SMALL = {"creff": {"match_epochs": 3, "retrain_epochs": 2, "features_per_class": 5, "repeats": 2}}
TINY = dict(dataset="mnist", model="mlp", train_limit=400, test_limit=100, clients=4, participation=0.5,
            local_iters=2, server_batch=16, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})


@pytest.mark.parametrize("name", fedlt.server_steps.list())
def test_every_server_step_passes_its_contract(name):
    check_server_step(name, SMALL.get(name))


class OrderDependent(CCVRStep):
    """Re-calibrates from the first upload only."""

    def apply(self, head, uploads, generator=None):
        return super().apply(head, uploads[:1], generator)


class Forgetful(CCVRStep):
    """Keeps a counter it does not checkpoint."""

    calls = 0

    def apply(self, head, uploads, generator=None):
        self.calls += 1
        out = super().apply(head, uploads, generator)
        return {k: v * self.calls for k, v in out.items()}


@pytest.mark.parametrize("step, prop", [(OrderDependent, "order independent"), (Forgetful, "state round trip")])
def test_broken_server_steps_fail_naming_the_property(step, prop):
    with pytest.raises(ContractError, match=re.escape(f"breaks [{prop}]")):
        check_server_step(step)


def test_bad_step_parameters_are_one_line_errors():
    with pytest.raises(FedltError, match="ccvr: samples_per_class must be an integer from 1 to 10000000"):
        fedlt.server_steps.create("ccvr", samples_per_class=0)
    with pytest.raises(Exception, match=re.escape("ccvr: step: unknown server_step 'nope' (valid: ccvr, creff, fednh, fednpc)")):
        RunConfig(**TINY, algorithm="ccvr", algorithm_params={"step": {"name": "nope"}})


def test_ccvr_evaluates_the_calibrated_classifier_and_trains_the_aggregated_one(tmp_path):
    import fedlt.engine
    from fedlt.models import classifier

    prep = fedlt.engine.prepare(RunConfig(**TINY, algorithm="ccvr", rounds=1, out=tmp_path / "a"))
    algo = prep.algorithm
    assert algo.global_model() is algo.strategy.model  # nothing calibrated yet
    run(RunConfig(**TINY, algorithm="ccvr", rounds=2, out=tmp_path / "run"))
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["algorithm"]
    head, trained = state["head"], state["model"]
    weight_key = [k for k in trained if k.endswith("weight")][-1]
    assert head is not None and not torch.equal(head["weight"], trained[weight_key])
    assert head["weight"].shape == trained[weight_key].shape


class Recording(LocalRunner):
    def call(self, algorithm, tasks):
        self.results = super().call(algorithm, tasks)
        return self.results


def test_fednh_step_moves_the_models_prototypes_after_training(tmp_path):
    """One round by hand: each upload is the prototypes of the participant's trained model (not of
    the received one), and the model trains on with the infused prototypes."""
    prep = prepare(RunConfig(**TINY, algorithm="fednh", rounds=1, out=tmp_path / "a"))
    algo = prep.algorithm
    head = classifier(algo.strategy.model)
    before = head.prototype.clone()
    received = copy.deepcopy(algo.strategy.model)
    clients = [client_data(prep, cid, torch.device("cpu")) for cid in (0, 1)]
    runner = Recording()
    train_round(algo, prep.ctx, 0, clients, ClientStates(), runner)
    uploads = [r.extras["server_step"] for r in runner.results]
    for res, client, up in zip(runner.results, clients, uploads):
        for weights, same in ((res.weights, True), (received.state_dict(), False)):
            model = copy.deepcopy(received)
            model.load_state_dict(weights)
            x, y = features(model, [(client.x, client.y)])
            scaled, _ = class_prototypes(x, y, torch.bincount(y, minlength=10))
            assert torch.allclose(scaled, up["scaled_prototype"], atol=1e-6) is same
    want = semantic_infusion(before, [u["scaled_prototype"] for u in uploads], [u["counts"] for u in uploads], 0.9)
    assert torch.allclose(head.prototype.double(), want, atol=1e-6) and not torch.allclose(head.prototype, before)
    assert algo.global_model() is algo.strategy.model  # the prototypes are the model's own


@pytest.mark.parametrize("algo", ["ccvr", "creff", "fednh"])
def test_runs_from_the_cli(algo, tmp_path):
    from fedlt.cli import main

    if algo == "fednh":
        code = main(["run", "--algo", algo, "--model", "mlp", "--rounds", "2", "--clients", "5", "--train-limit",
                     "400", "--test-limit", "100", "--eval-every", "1", "--set", "algorithm_params.rho=0.5",
                     "--out", str(tmp_path / algo)])
        assert code in (0, None)
        return
    params = json.dumps({"name": algo, **SMALL.get(algo, {})})
    code = main(["run", "--algo", algo, "--model", "mlp", "--rounds", "2", "--clients", "5", "--train-limit", "400",
                 "--test-limit", "100", "--eval-every", "1", "--set", f"algorithm_params.step={params}", "--out", str(tmp_path / algo)])
    assert code in (0, None)
    rows = [json.loads(line) for line in (tmp_path / algo / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(0 <= r["accuracy"] <= 1 for r in rows)

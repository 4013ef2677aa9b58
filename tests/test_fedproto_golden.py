"""FedProto held to the authors' own code (tests/golden/fedproto.json, written by
tools/fedproto_golden/make_golden.py from github.com/yuetan031/FedProto at the commit it records):
a client's two local epochs through fedlt's real loop (same model, same batches in the same order,
their SGD with momentum 0.5) end with their weights, their mean step loss and their class
prototypes; the server's aggregation and the nearest-prototype inference give theirs."""

import json
from pathlib import Path

import pytest
import torch

from fedlt.algorithms.base import ClientData
from fedlt.algorithms.fedproto import (FedProto, NearestPrototype, ProtoUpdate, aggregate_prototypes, bank_keys,
                                       with_prototypes)
from fedlt.algorithms.personal import EvalTask
from fedlt.algorithms.pfl import PERSONAL
from fedlt.algorithms.protocol import ClientTask
from fedlt.context import RoundContext
from golden_parts import BodyHead, InOrder

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fedproto.json").read_text())
T = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
ARGS = GOLDEN["args"]
C = ARGS["num_classes"]


def _model():
    return with_prototypes(BodyHead(5, 6, C).double())


def _ours(state: dict) -> dict:
    """Their state-dict names as fedlt's (the classifier wrapped by WithPrototypes)."""
    return {k.replace("classifier.", "classifier.linear."): T(v) for k, v in state.items()}


def _bank(protos: dict) -> tuple[torch.Tensor, torch.Tensor]:
    d = len(next(iter(protos.values())))
    table, present = torch.zeros(C, d, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
    for c, p in protos.items():
        table[int(c)], present[int(c)] = T(p), 1.0
    return table, present


def _train(update):
    model = _model()
    prototypes, present = _bank(GOLDEN["global_protos"])
    weights = _ours(GOLDEN["start"])
    weights |= dict(zip(bank_keys(model), [present, prototypes]))  # sorted: ...present, ...prototypes
    y = torch.tensor(GOLDEN["y"])
    data = ClientData(0, T(GOLDEN["x"]), y, torch.bincount(y, minlength=C))
    schedule = InOrder(ARGS["local_bs"], epochs=ARGS["train_ep"], lr=ARGS["lr"], momentum=0.5, weight_decay=0.0,
                       clip=None)
    task = ClientTask(0, RoundContext.placeholder(C), weights, data, {}, schedule, "ce", {})
    return update(task, model)


def _same_training(result) -> bool:
    trained = result.state[PERSONAL]
    same_weights = all(torch.allclose(trained[n], v, atol=1e-10) for n, v in _ours(GOLDEN["trained"]).items())
    same_loss = abs(result.train_loss - GOLDEN["loss_total"]) <= 1e-10
    present = result.extras["present"].bool()
    same_protos = ({str(c) for c in present.nonzero().flatten().tolist()} == set(GOLDEN["client_protos"]) and all(
        torch.allclose(result.extras["prototypes"][int(c)].double(), T(p), atol=1e-6)
        for c, p in GOLDEN["client_protos"].items()))
    return same_weights and same_loss and same_protos


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/yuetan031/FedProto"
    assert len(GOLDEN["source"]["commit"]) == 40


def test_local_training_matches_the_authors():
    result = _train(ProtoUpdate("all", "none", "none", lam=ARGS["ld"]))
    assert result.steps == 6 and result.weights == {}  # no weights sent
    assert set(result.state[PERSONAL]) == set(_ours(GOLDEN["trained"]))  # the server's prototypes are not kept
    assert _same_training(result)


class NoEpochRestart(ProtoUpdate):
    def begin(self, task, model, params):
        return super().begin(task, model, params) | {"size": 10**9}


class PullsToZero(ProtoUpdate):  # a class without a global prototype pulled to 0 instead of left alone
    def begin(self, task, model, params):
        local = super().begin(task, model, params)
        return local | {"present": torch.ones_like(local["present"])}


@pytest.mark.parametrize("mutant", [ProtoUpdate("all", "none", "none", lam=0.0), NoEpochRestart("all", "none", "none"),
                                    PullsToZero("all", "none", "none")], ids=["lam=0", "no epoch restart", "pull to 0"])
def test_mutants_are_rejected(mutant):
    assert not _same_training(_train(mutant))


def _server(weighted: bool = False):
    clients = GOLDEN["local_protos"]
    tables = [_bank(clients[k]) for k in sorted(clients, key=int)]
    present = [p * (1 + i) if weighted else p for i, (_, p) in enumerate(tables)]
    mean, held = aggregate_prototypes([t for t, _ in tables], present)
    if weighted:  # the mutant: each client's prototypes weighted (1, 2, 3) instead of the plain mean
        total = torch.stack(present).sum(0).clamp(min=1)
        mean = sum(p[:, None] * t for (t, _), p in zip(tables, present)) / total[:, None]
    return mean, held


def test_server_aggregation_matches_the_authors():
    mean, held = _server()
    assert {str(c) for c in held.bool().nonzero().flatten().tolist()} == set(GOLDEN["aggregated"])
    for c, p in GOLDEN["aggregated"].items():
        assert torch.allclose(mean[int(c)], T(p), atol=1e-12), c
    weighted, _ = _server(weighted=True)
    assert not all(torch.allclose(weighted[int(c)], T(p), atol=1e-6) for c, p in GOLDEN["aggregated"].items())


def _distances(restrict: bool) -> torch.Tensor:
    """−NearestPrototype's logits on the test inputs: the distance matrix their inference predicts from."""
    model = _model()
    prototypes, present = _bank(GOLDEN["aggregated"])
    model.load_state_dict(_ours(GOLDEN["trained"]) | dict(zip(bank_keys(model), [present, prototypes])))
    held = torch.zeros(C, dtype=torch.bool)
    held[GOLDEN["client_classes"]] = True
    head = NearestPrototype(prototypes, present.bool() & held if restrict else present.bool())
    with torch.no_grad():
        return -head(model.body.eval()(T(GOLDEN["x_test"])))


def test_nearest_prototype_inference_matches_the_authors():
    assert torch.allclose(_distances(restrict=True), T(GOLDEN["distances"]), atol=1e-12)
    predicted = _distances(restrict=True).argmin(1)
    assert float((predicted == torch.tensor(GOLDEN["y_test"])).double().mean()) == pytest.approx(
        GOLDEN["accuracy_protos"], abs=1e-12)
    # mutant: the classes the client lacks not excluded
    assert not torch.allclose(_distances(restrict=False), T(GOLDEN["distances"]), atol=1e-3)


class StandInProto(FedProto):
    def fresh_model(self, task):  # no run set up: the stand-in's architecture
        return _model()


def test_the_personal_model_answers_with_the_prototypes():
    """FedProto.personal_model: the server's weights (its prototypes) with the client's own model,
    answering with NearestPrototype over the classes the server and the client both have — their
    "with protos" accuracy — or, with ``inference='model'``, with its own classifier (their "w/o
    protos" accuracy)."""
    model = _model()
    prototypes, present = _bank(GOLDEN["aggregated"])
    weights = _ours(GOLDEN["start"]) | dict(zip(bank_keys(model), [present, prototypes]))
    counts = torch.bincount(torch.tensor(GOLDEN["y"]), minlength=C)
    task = EvalTask(0, RoundContext.placeholder(C), weights, {PERSONAL: _ours(GOLDEN["trained"]), "class_counts": counts},
                    "personal")
    x, y = T(GOLDEN["x_test"]), torch.tensor(GOLDEN["y_test"])
    for inference, key in (("prototypes", "accuracy_protos"), ("model", "accuracy_model")):
        algorithm = StandInProto(inference=inference)
        personal = algorithm.personal_model(task)
        assert isinstance(personal.get_classifier(), NearestPrototype) == (inference == "prototypes")
        with torch.no_grad():
            accuracy = float((personal(x).argmax(1) == y).double().mean())
        assert accuracy == pytest.approx(GOLDEN[key], abs=1e-12), inference

"""FedETF's personal model held to the authors' own personalisation (tests/golden/fedetf_personal.json,
written by tools/fedetf_golden/make_personal_golden.py from github.com/ZexiLee/ICCV-2023-FedETF at the
commit it records): the global model, one more local training through fedlt's real loop (balanced
softmax, absent classes as one sample), then ``etf_finetune``'s 20 alternations of the ETF and the
projection, ends with their weights, their ETF and their logits; ``personal_model`` builds it from
the global weights and the client's data without touching the global model."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fedlt.algorithms.base import ClientData
from fedlt.algorithms.fedavg_family import client_update
from fedlt.algorithms.longtail import etf_finetune
from fedlt.algorithms.personal import EvalTask
from fedlt.algorithms.protocol import ClientTask
from fedlt.config import RunConfig
from fedlt.context import RoundContext
from fedlt.errors import FedltError
from fedlt.models import classifier, heads
from fedlt.run.parts import client_data, prepare
from golden_parts import BodyHead, InOrder

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fedetf_personal.json").read_text())
T = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
ARGS = GOLDEN["args"]
IN, D = len(GOLDEN["x"][0]), len(GOLDEN["start"]["body.0.bias"])
P, C = len(GOLDEN["start_proto"]), len(GOLDEN["start_proto"][0])
LOSS = "balanced_softmax(absent='one')"


def _weights(state):
    names = {"linear_proto.weight": "classifier.linear_proto.weight", "linear_proto.bias": "classifier.linear_proto.bias",
             "scaling_train": "classifier.scaling_train"}
    return {names.get(k, k): T(v) for k, v in state.items()}


def _personal(schedule_for_finetune=None, alternations=20):
    model = heads.attach(BodyHead(IN, D, C), {"name": "etf", "proj_dim": P, "scale": 1.5}).double()
    classifier(model).proto = T(GOLDEN["start_proto"])  # the global ETF (rebuilt from a seed in a run)
    y = torch.tensor(GOLDEN["y"])
    data = ClientData(0, T(GOLDEN["x"]), y, torch.bincount(y, minlength=C))
    schedule = InOrder(GOLDEN["batch"], epochs=ARGS["E"], lr=ARGS["lr"], momentum=ARGS["momentum"],
                       weight_decay=ARGS["local_wd_rate"], clip=None)
    client_update(ClientTask(0, RoundContext.placeholder(C), _weights(GOLDEN["start"]), data, {}, schedule, LOSS, {}),
                  model)
    return etf_finetune(model, data, schedule_for_finetune or schedule, torch.Generator(), alternations=alternations)


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/ZexiLee/ICCV-2023-FedETF"
    assert len(GOLDEN["source"]["commit"]) == 40


def _logits(model):
    with torch.no_grad():
        return model(T(GOLDEN["x_test"]))


def test_personalisation_matches_the_authors():
    model = _personal()
    state = model.state_dict()
    for k, v in _weights(GOLDEN["personal"]).items():
        assert torch.allclose(state[k], v, atol=1e-5), k
    assert torch.allclose(classifier(model).proto.detach(), T(GOLDEN["personal_proto"]), atol=1e-5)
    assert not torch.allclose(T(GOLDEN["personal_proto"]), T(GOLDEN["start_proto"]), atol=1e-2)  # M moved
    assert torch.allclose(_logits(model), T(GOLDEN["logits"]), atol=1e-5)


@pytest.mark.parametrize("mutant", ["one alternation less", "projection without momentum"])
def test_mutated_personalisations_are_rejected(mutant):
    if mutant == "one alternation less":
        model = _personal(alternations=19)
    else:
        plain = InOrder(GOLDEN["batch"], epochs=ARGS["E"], lr=ARGS["lr"], momentum=0.0,
                        weight_decay=ARGS["local_wd_rate"], clip=None)
        model = _personal(schedule_for_finetune=plain)
    assert not torch.allclose(_logits(model), T(GOLDEN["logits"]), atol=1e-4)


TINY = dict(dataset="mnist", model="mlp", train_limit=400, test_limit=100, clients=4, participation=0.5,
            local_epochs=1, batch_size=16, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})


@pytest.mark.usefixtures("one_thread")
def test_personal_model_fine_tunes_a_copy_on_the_clients_data(tmp_path):
    prep = prepare(RunConfig(**TINY, algorithm="fedetf", algorithm_params={"alternations": 2, "finetune_epochs": 1},
                             rounds=3, out=tmp_path))
    algo = prep.algorithm
    data = client_data(prep, 0, torch.device("cpu"))
    before = {k: v.clone() for k, v in algo.strategy.model.state_dict().items()}
    context = RoundContext.placeholder(10)
    task = EvalTask(0, dataclasses.replace(context, rounds=3), before, {}, "personal", data=data, test=data)
    first, second = algo.personal_model(task), algo.personal_model(task)
    after = algo.strategy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the global model is untouched
    x = data.x[:5]
    with torch.no_grad():
        assert torch.equal(first(x), second(x))  # its own stream: the same personal model twice
        assert not torch.allclose(first(x), algo.strategy.model(x))
    assert not torch.equal(classifier(first).proto, classifier(algo.strategy.model).proto)  # M fine-tuned
    with pytest.raises(FedltError, match="EvalTask.data"):
        algo.personal_model(dataclasses.replace(task, data=None))

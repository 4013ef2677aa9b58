"""FedReLa held to the authors' own code (tests/golden/fedrela.json, written by
tools/fedrela_golden/make_golden.py from github.com/guangzhengh/FedReLa at the commit it records):
the global model's predictions on a long-tailed client and, for two thresholds with their numpy
draws, the labels their ``relabel_local_data`` gives; and FedReLa's client update trains on those
labels with the learning rate scaled, from its first relabelled round on."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fedlt.algorithms.fedrela as fedrela
from fedlt.algorithms.base import ClientData, LocalSchedule
from fedlt.algorithms.fedavg_family import client_update
from fedlt.algorithms.fedrela import STATE, Relabelled, predictions_of, relabel
from fedlt.algorithms.protocol import ClientTask
from fedlt.context import RoundContext

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fedrela.json").read_text())
T = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
Y = torch.tensor(GOLDEN["y"])
C = 4


class Model(nn.Module):
    """Their net + g_head as one model (fedlt's FedLoGe model answers with g_head's logits)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 6), nn.ReLU())
        self.classifier = nn.Linear(6, C)

    def forward(self, x):
        return self.classifier(self.body(x))

    def get_classifier(self):
        return self.classifier


def _model() -> Model:
    model = Model().double()
    model.load_state_dict({k: T(v) for k, v in GOLDEN["net"].items()} |
                          {f"classifier.{k}": T(v) for k, v in GOLDEN["g_head"].items()})
    return model


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/guangzhengh/FedReLa"
    assert len(GOLDEN["source"]["commit"]) == 40
    assert [r["relabelled"] for r in GOLDEN["runs"]] == [2, 8]  # the fixture moves some labels, not all


def test_predictions_are_the_authors():
    data = ClientData(0, T(GOLDEN["x"]), Y, torch.bincount(Y, minlength=C))
    # float64 model, float64 softmax (their mean of 5 equal passes: within an ulp)
    torch.testing.assert_close(predictions_of(_model(), data, batch=16), T(GOLDEN["predictions"]), rtol=1e-12,
                               atol=1e-15)


@pytest.mark.parametrize("run", range(2))
def test_new_labels_are_the_authors(run):
    case = GOLDEN["runs"][run]
    new = relabel(T(GOLDEN["predictions"]), Y, T(case["uniform"]), case["thre"])
    assert new.tolist() == case["labels"]


@pytest.mark.parametrize("mutant", ["threshold", "draws", "priors"])
def test_mutants_are_rejected(mutant, monkeypatch):
    """Another top percentage, another stream of draws, or every rarer class weighted 1."""
    case = GOLDEN["runs"][1]
    thre, uniform = case["thre"], T(case["uniform"])
    if mutant == "threshold":
        thre = 10.0
    if mutant == "draws":
        uniform = torch.rand(uniform.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    if mutant == "priors":
        monkeypatch.setattr(fedrela, "relabel_priors", lambda counts: -torch.arange(len(counts), dtype=torch.float64))
    assert relabel(T(GOLDEN["predictions"]), Y, uniform, thre).tolist() != case["labels"]


def _task(round_index: int, state: dict | None = None) -> ClientTask:
    data = ClientData(3, T(GOLDEN["x"]), Y, torch.bincount(Y, minlength=C))
    context = dataclasses.replace(RoundContext.placeholder(C), round_index=round_index, rounds=10)
    weights = {k: v.clone() for k, v in _model().state_dict().items()}
    return ClientTask(3, context, weights, data, state or {}, LocalSchedule(8, epochs=1, lr=0.1), "ce", {})


def test_the_client_trains_on_its_new_labels_with_the_scaled_rate():
    """Round index 9 of 10 (relabel_start 0.9): the update is the plain one on the relabelled data
    at lr 0.1 × 0.1, the labels kept in the client's state; before it, the plain update."""
    update = Relabelled(client_update, start=0.9, period=0, thre=25.0, lr_scale=0.1)
    assert STATE not in update(_task(8), _model()).state
    task = _task(9)
    result = update(task, _model())
    new = result.state[STATE]
    assert 0 < int((new != Y).sum()) < len(Y)
    expected = client_update(dataclasses.replace(task, data=dataclasses.replace(task.data, y=new),
                                                 schedule=dataclasses.replace(task.schedule, lr=0.1 * 0.1)), _model())
    assert all(torch.equal(result.weights[k], expected.weights[k]) for k in expected.weights)


def test_the_labels_are_computed_once_unless_refreshed():
    """After the first relabelled round the client's kept labels are used (their one-shot
    ``relabel_period`` 0); with a period they are recomputed every ``period`` rounds."""
    stored = torch.zeros_like(Y)
    once = Relabelled(client_update, start=2, period=0, thre=25.0, lr_scale=0.1)
    assert torch.equal(once(_task(5, {STATE: stored}), _model()).state[STATE], stored)
    refreshed = Relabelled(client_update, start=2, period=3, thre=25.0, lr_scale=0.1)
    assert not torch.equal(refreshed(_task(5, {STATE: stored}), _model()).state[STATE], stored)


def test_fedrela_is_fedloge_with_the_relabelling_wrapped_around_its_update():
    from fedlt.algorithms.fedrela import FedReLa
    from fedlt.algorithms.longtail import FedLoGeUpdate

    fn = FedReLa(relabel_start=0.8, thre=7.0).client_fn()
    assert fn.aux and fn.head == {"name": "sse_c"}
    assert fn.update == Relabelled(FedLoGeUpdate(), 0.8, 0, 7.0, 0.1)
    assert [Relabelled(client_update, s, 0, 5.0, 0.1).first_round(100) for s in (0.29, 0.9, 3)] == [29, 90, 3]

"""FedYoYo held to the authors' own code (tests/golden/fedyoyo.json, written by
tools/fedyoyo_golden/make_golden.py from github.com/shanss132/FedYoYo at the commit it records):
the effective numbers of a long-tailed client on the received model, the weights after their
``local_train`` (prior-adjusted logits of a weak and a strong view, the prior pulled towards the
client's label distribution at every step, self-distillation where the weak view is right), and
the server's smoothing of the summed effective numbers."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import fedlt.algorithms.fedyoyo as fedyoyo
from fedlt.algorithms.base import ClientData, LocalSchedule
from fedlt.algorithms.fedyoyo import COLLECT, EFFECTIVE, PRIOR, YoYoUpdate, effective_numbers, smoothed
from fedlt.algorithms.protocol import ClientResult, ClientTask
from fedlt.context import RoundContext
from fedlt.server_steps import features
from golden_parts import BodyHead, InOrder

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fedyoyo.json").read_text())
T = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
Y = torch.tensor(GOLDEN["y"])
C = 4
TRAIN = GOLDEN["train"]


def _model() -> BodyHead:
    model = BodyHead(5, 6, C).double()
    model.load_state_dict({k: T(v) for k, v in GOLDEN["init"].items()})
    return model


def _task(round_index: int, payload: dict, batch: int = len(Y), epochs: int = TRAIN["epochs"]) -> ClientTask:
    data = ClientData(1, T(GOLDEN["x"]), Y, torch.bincount(Y, minlength=C))
    context = dataclasses.replace(RoundContext.placeholder(C), round_index=round_index, rounds=20)
    schedule = InOrder(batch, epochs=epochs, lr=TRAIN["lr"], momentum=0.0, weight_decay=0.0, clip=None)
    return ClientTask(1, context, _model().state_dict(), data, {}, schedule, "ce", payload)


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/shanss132/FedYoYo"
    assert len(GOLDEN["source"]["commit"]) == 40


def test_effective_numbers_are_the_authors():
    x = T(GOLDEN["x"])
    h, labels = features(_model(), [(x, Y)])
    batches = list(torch.arange(len(Y)).split(GOLDEN["feature_batch"]))
    assert torch.allclose(effective_numbers(h, labels, batches, C), T(GOLDEN["effective"]), rtol=1e-10)
    whole = effective_numbers(h, labels, [torch.arange(len(Y))], C)  # the partition matters: a mutant
    assert not torch.allclose(whole, T(GOLDEN["effective"]), rtol=1e-3)


def _train(monkeypatch, batch: int = len(Y), epochs: int = TRAIN["epochs"], **change) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(fedyoyo, "cutout", lambda x, length: x.flip(1))  # their strong view in the fixture
    params = dict(lam=TRAIN["lam"], gamma=TRAIN["gamma"], tau=TRAIN["tau"], temperature=TRAIN["temperature"],
                  warmup=TRAIN["warmup"]) | change
    task = _task(TRAIN["round"] - 1, {PRIOR: T(TRAIN["prior"])}, batch, epochs)
    return YoYoUpdate(**params)(task, _model()).weights


def test_local_training_is_the_authors(monkeypatch):
    weights = _train(monkeypatch)
    for k, v in TRAIN["weights"].items():
        assert torch.allclose(weights[k], T(v), atol=1e-10), k
    mini = TRAIN["minibatches"]  # 10 steps of 8 in data order: the prior moves at every step
    weights = _train(monkeypatch, mini["batch"], mini["epochs"])
    for k, v in mini["weights"].items():
        assert torch.allclose(weights[k], T(v), atol=1e-10), k


@pytest.mark.parametrize("mutant", [{"gamma": 0.0}, {"tau": 1.0}, {"warmup": 5}, {"temperature": 1.0},
                                    {"lam": 0.0}])
def test_mutants_are_rejected(mutant, monkeypatch):
    """A fixed prior, another exponent, no ramp, another temperature, no distillation."""
    weights = _train(monkeypatch, **mutant)
    assert not all(torch.allclose(weights[k], T(v), atol=1e-6) for k, v in TRAIN["weights"].items())


def test_smoothing_is_the_authors():
    s = GOLDEN["smoothing"]
    assert torch.allclose(smoothed(T(s["current"]), T(s["previous"])), T(s["result"]), atol=1e-12)
    # the first round (their inline code): entries above 1e4 replaced by the mean of the others
    assert smoothed(T([2.0, 3.0, 2e4, 4.0]), None).tolist() == [2.0, 3.0, 3.0, 4.0]


def test_a_collect_task_only_measures_on_the_received_weights():
    result = YoYoUpdate()(_task(0, {COLLECT: True}), _model())
    assert result.steps == 0 and result.weights == {}
    assert result.extras[EFFECTIVE].shape == (C,) and bool((result.extras[EFFECTIVE] > 0).all())


def test_the_round_measures_before_it_trains():
    """Their order: every participant's effective numbers on the received model, then the prior,
    then training with it (a second call to the runner, as CCVR's fresh statistics)."""
    import fedlt.algorithms

    algo = fedlt.algorithms.create("fedyoyo")
    calls = []

    class Runner:
        def call(self, algorithm, tasks):
            calls.append([dict(t.payload) for t in tasks])
            if tasks[0].payload.get(COLLECT):
                return [ClientResult(t.cid, {}, 1, 0, 0.0, {}, extras={EFFECTIVE: torch.tensor([1.0, 3.0, 0, 0])})
                        for t in tasks]
            return [ClientResult(t.cid, t.weights, 1, 1, 0.5, {}) for t in tasks]

    class Ctx:
        num_classes, server_batch, sampling_seed = C, 64, 0

        def schedule(self, batch):
            return LocalSchedule(8, epochs=1)

    strategy = fedyoyo.YoYoStrategy(_model(), lambda old, results, names: old, Ctx(), "ce")
    algo._strategy = strategy
    participants = [ClientData(cid, T(GOLDEN["x"]), Y, torch.bincount(Y, minlength=C)) for cid in (0, 1)]
    states = type("States", (), {"get": lambda self, cid: {}, "put": lambda self, cid, s: None})()
    algo.train_round(RoundContext.placeholder(C), participants, states, Runner())
    assert [COLLECT in c[0] for c in calls] == [True, False]
    assert torch.allclose(calls[1][0][PRIOR].double(), T([3.0, 7.0, 1.0, 1.0]) / 12)  # 1 + the two clients' sums


def test_cutout_zeroes_one_clipped_square_per_sample():
    """Their ``Cutout(n_holes=1, length)``: rows y − L//2 .. y + L//2 − 1 (clipped), columns alike,
    around a uniform centre per sample; checked against a per-sample loop on the same draws."""
    x = torch.randn(6, 2, 9, 7) + 5
    torch.manual_seed(3)
    out = fedyoyo.cutout(x, 4)
    torch.manual_seed(3)
    cy, cx = torch.randint(9, (6, 1)), torch.randint(7, (6, 1))
    expected = x.clone()
    for i in range(6):
        y0, y1 = max(int(cy[i]) - 2, 0), min(int(cy[i]) + 2, 9)
        x0, x1 = max(int(cx[i]) - 2, 0), min(int(cx[i]) + 2, 7)
        expected[i, :, y0:y1, x0:x1] = 0
    assert torch.equal(out, expected) and bool((out == 0).any())
    assert fedyoyo.cutout(x, 0) is x and fedyoyo.cutout(x[:, 0, 0], 4) is not None

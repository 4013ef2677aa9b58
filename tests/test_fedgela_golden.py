"""FedGELA held to the authors' own code (tests/golden/fedgela.json, written by
tools/fedgela_golden/make_golden.py from github.com/MediaBrain-SJTU/FedGELA at the commit it
records): their simplex ETF from the same draw, their Ew, and a client's two local epochs through
fedlt's real loop (their ETF, same batches in the same order, their SGD settings and clipping)
ending with their weights (BatchNorm statistics included), their loss and their local (Ew-adapted)
and global logits."""

import json
from pathlib import Path

import pytest
import torch

from fedlt.algorithms.base import ClientData
from fedlt.algorithms.fedgela import FedGELA, GELAUpdate, local_adaptation, with_gela_head
from fedlt.algorithms.personal import EvalTask
from fedlt.algorithms.protocol import ClientTask
from fedlt.context import RoundContext
from fedlt.models.heads import simplex_etf
from golden_parts import BodyHead, InOrder

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fedgela.json").read_text())
T = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
ARGS = GOLDEN["args"]
C = len(GOLDEN["ew"])


def _model():
    model = with_gela_head(BodyHead(5, 6, C)).double()
    model.get_classifier().proto = T(GOLDEN["etf"])  # their draw (numpy's, after their seed)
    return model


def _train(update):
    model = _model()
    y = torch.tensor(GOLDEN["y"])
    data = ClientData(0, T(GOLDEN["x"]), y, torch.bincount(y, minlength=C))
    schedule = InOrder(ARGS["batch"], epochs=ARGS["epochs"], lr=ARGS["lr"], momentum=0.9,
                       weight_decay=ARGS["reg"], clip=20.0)
    weights = {k: T(v) if "num_batches" not in k else torch.tensor(v) for k, v in GOLDEN["start"].items()}
    task = ClientTask(0, RoundContext.placeholder(C), weights, data, {}, schedule, "ce", {})
    return update(task, model), model


def _same(result) -> bool:
    same_weights = all(torch.allclose(result.weights[n].double(), T(v), atol=1e-10)
                       for n, v in GOLDEN["trained"].items())
    return same_weights and abs(result.train_loss - sum(GOLDEN["epoch_losses"]) / ARGS["epochs"]) <= 1e-6


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/MediaBrain-SJTU/FedGELA"
    assert len(GOLDEN["source"]["commit"]) == 40


def test_the_etf_and_ew_are_the_authors():
    assert torch.allclose(simplex_etf(T(GOLDEN["uniform"])), T(GOLDEN["etf"]), atol=1e-6)  # theirs in float32
    counts = torch.bincount(torch.tensor(GOLDEN["y"]), minlength=C)
    assert torch.allclose(local_adaptation(counts), T(GOLDEN["ew"]), atol=1e-12)


def test_local_training_and_logits_match_the_authors():
    result, model = _train(GELAUpdate(temperature=ARGS["temperature"]))
    assert result.steps == 6 and _same(result)
    assert torch.equal(result.state["class_counts"], torch.bincount(torch.tensor(GOLDEN["y"]), minlength=C))
    model.eval()
    x = T(GOLDEN["x_test"])
    with torch.no_grad():
        assert torch.allclose(model(x), T(GOLDEN["global_logits"]), atol=1e-10)

    class StandIn(FedGELA):
        def personal_model(self, task):  # no run set up: FedGELA's with the stand-in's architecture
            self._ctx = type("Ctx", (), {"build_model": staticmethod(_model)})()
            return super().personal_model(task)

    task = EvalTask(0, RoundContext.placeholder(C), model.state_dict(), dict(result.state), "personal")
    with torch.no_grad():
        assert torch.allclose(StandIn().personal_model(task)(x).double(), T(GOLDEN["local_logits"]), atol=1e-10)


@pytest.mark.parametrize("mutant", [GELAUpdate(temperature=1.0), GELAUpdate(temperature=0.2 * 1.5)],
                         ids=["no temperature", "another temperature"])
def test_mutants_are_rejected(mutant):
    assert not _same(_train(mutant)[0])


class Unadapted(GELAUpdate):  # the global ETF without the client's Ew
    def begin(self, task, model, params):
        return {"scale": torch.full((C,), 1 / self.temperature, dtype=torch.float64)}


def test_training_without_the_local_adaptation_is_rejected():
    assert not _same(_train(Unadapted(temperature=ARGS["temperature"]))[0])


def test_a_batch_of_one_uses_the_running_statistics_and_leaves_them():
    """Where their BatchNorm fails (one sample in training mode), the running statistics normalise it, unmoved."""
    head = with_gela_head(BodyHead(5, 6, C)).get_classifier().train()
    head.bn.running_mean.fill_(0.5)
    h = torch.randn(1, 6)
    out = head(h)
    assert torch.equal(head.bn.running_mean, torch.full((6,), 0.5)) and head.bn.num_batches_tracked == 0
    expected = ((h - 0.5) / (1 + head.bn.eps) ** 0.5) @ head.proto
    assert torch.allclose(out, expected, atol=1e-6)

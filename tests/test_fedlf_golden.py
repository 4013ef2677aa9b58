"""FedLF held to the authors' own code (tests/golden/fedlf.json, written by
tools/fedlf_golden/make_golden.py from github.com/18sym/FedLF at the commit it records): a
client's two local epochs through fedlt's real loop (same model, same batches in the same order,
their SGD) end with their weights, their mean step loss and their class centres; the server's
class-centre update gives theirs (except where their code divides 0 by 0)."""

import json
from pathlib import Path

import pytest
import torch

from fedlt.algorithms.base import ClientData
from fedlt.algorithms.longtail import FedLFUpdate, update_centres
from fedlt.algorithms.protocol import ClientTask
from fedlt.context import RoundContext
from golden_parts import BodyHead, InOrder

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fedlf.json").read_text())
T = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
ARGS = GOLDEN["args"]


def _train(update):
    classes = ARGS["num_classes"]
    model = BodyHead(8, 256, classes).double()
    weights = {k: T(v) for k, v in GOLDEN["start"].items()}
    counts = torch.tensor(GOLDEN["class_counts"])
    data = ClientData(0, T(GOLDEN["x"]), torch.tensor(GOLDEN["y"]), counts)
    schedule = InOrder(ARGS["batch_size_local_training"], epochs=ARGS["num_epochs_local_training"],
                       lr=ARGS["lr_local_training"], momentum=0.0, weight_decay=0.0, clip=None)
    task = ClientTask(0, RoundContext.placeholder(classes), weights, data, {}, schedule, "ce",
                      {"centres": T(GOLDEN["f_G"])})
    return update(task, model)


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/18sym/FedLF"
    assert len(GOLDEN["source"]["commit"]) == 40


def test_local_training_matches_the_authors():
    result = _train(FedLFUpdate(alpha=ARGS["rs_alpha"], lam=0.5))
    assert result.steps == len(GOLDEN["losses"])
    assert result.train_loss == pytest.approx(sum(GOLDEN["losses"]) / len(GOLDEN["losses"]), abs=1e-5)
    for name, value in GOLDEN["trained"].items():
        assert torch.allclose(result.weights[name], T(value), atol=1e-5), name
    assert torch.allclose(result.extras["centres"].double(), T(GOLDEN["f_k"]), atol=1e-5)


class NoEpochReset(FedLFUpdate):
    def begin(self, task, model, params):
        return super().begin(task, model, params) | {"size": 10**9}


class WithBias(FedLFUpdate):
    def parts(self, local, model, objective, x, y, extra):
        return {"objective": objective(model(x) * local["scale"], y)}


@pytest.mark.parametrize("mutant", [
    FedLFUpdate(alpha=1.0, lam=0.5),  # no adaptive logit adjustment
    FedLFUpdate(alpha=0.25, lam=0.0),  # no class-centre term (the loss value differs)
    NoEpochReset(alpha=0.25, lam=0.5),  # running class means not restarted each local epoch
    WithBias(alpha=0.25, lam=0.5),  # the classifier's bias in the adjusted logits
], ids=["alpha=1", "lam=0", "no epoch reset", "with bias"])
def test_mutants_are_rejected(mutant):
    result = _train(mutant)
    same_loss = abs(result.train_loss - sum(GOLDEN["losses"]) / len(GOLDEN["losses"])) <= 1e-5
    same_weights = all(torch.allclose(result.weights[n], T(v), atol=1e-5) for n, v in GOLDEN["trained"].items())
    same_centres = "centres" in result.extras and torch.allclose(result.extras["centres"].double(), T(GOLDEN["f_k"]),
                                                                  atol=1e-5)
    assert not (same_loss and same_weights and same_centres)


def test_server_centres_match_the_authors():
    f_locals = [T(f) for f in GOLDEN["f_locals"]]
    first = update_centres(torch.zeros_like(f_locals[0]), f_locals, first=True)
    assert torch.allclose(first, T(GOLDEN["server_first"]), atol=1e-10)
    later = update_centres(first, [f_locals[1], f_locals[2], f_locals[0] * 0.5], first=False)
    theirs = T(GOLDEN["server_later"])
    seen = [0, 1, 3]  # class 2: no client has seen it; their code gives 0/0, fedlt keeps the centre
    assert torch.allclose(later[seen], theirs[seen], atol=1e-10)
    assert bool((theirs[2] == -12345.0).all()) and torch.equal(later[2], first[2])
    # mutant: plain mean instead of the similarity weighting
    plain = update_centres(first, [f_locals[1], f_locals[2], f_locals[0] * 0.5], first=True)
    assert not torch.allclose(plain[seen], theirs[seen], atol=1e-3)

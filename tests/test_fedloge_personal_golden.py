"""FedLoGe's personal half held to the authors' own code (tests/golden/fedloge_personal.json, written
by tools/fedloge_golden/make_personal_golden.py from github.com/ZackZikaiXiao/FedLoGe at the commit it
records): a client's two local epochs through fedlt's real loop (the backbone through the SSE-C, g_aux
and the local head on detached features) end with their weights and loss; the local (LA-FR) and the
global (GA-FR) feature realignment and the personal logits are theirs; and ``personal_model`` builds
that personal model from the global weights and the client's stored state."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlt.algorithms.base import ClientData
from fedlt.algorithms.longtail import (FedLoGeUpdate, PersonalHead, WithAux, g_aux, global_realignment,
                                       local_realignment, with_aux)
from fedlt.algorithms.personal import EvalTask
from fedlt.algorithms.protocol import ClientStates, ClientTask
from fedlt.config import RunConfig
from fedlt.context import RoundContext
from fedlt.models import heads
from fedlt.run.parts import client_data, prepare, train_round
from golden_parts import BodyHead, InOrder

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fedloge_personal.json").read_text())
SSE = json.loads((Path(__file__).parent / "golden" / "fedloge.json").read_text())
T = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
C = SSE["num_classes"]


def _model():
    model = heads.attach(BodyHead(8, SSE["feat_in"], C), {"name": "sse_c", "steps": 0, "seed": SSE["seed"]})
    head = model.get_classifier()
    head.fixed_weight = T(SSE["sparse_etf"]).t().contiguous()  # their SSE-C after the 10 000 steps
    head.fixed_bias = T(SSE["bias"])
    return with_aux(model).double()


def _linear(state):
    out = nn.Linear(SSE["feat_in"], C).double()
    out.load_state_dict({k: T(v) for k, v in state.items()})
    return out


def _train(update):
    start = GOLDEN["start"]
    model = _model()
    weights = {f"body.{k[len('body.'):]}": T(v) for k, v in start["backbone"].items() if k.startswith("body.")}
    weights |= {f"classifier.g_aux.{k}": T(v) for k, v in start["g_aux"].items()}
    y = torch.tensor(GOLDEN["y"])
    data = ClientData(0, T(GOLDEN["x"]), y, torch.bincount(y, minlength=C))
    schedule = InOrder(GOLDEN["batch"], epochs=GOLDEN["epochs"], lr=GOLDEN["lr"], momentum=GOLDEN["momentum"],
                       weight_decay=0.0, clip=None)
    state = {"fedloge": {"l_head": {k: T(v) for k, v in start["l_head"].items()}, "counts": data.class_counts}}
    return update(ClientTask(0, RoundContext.placeholder(C), weights, data, state, schedule, "ce", {}), model)


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == SSE["source"]["repo"] == "https://github.com/ZackZikaiXiao/FedLoGe"
    assert GOLDEN["source"]["commit"] == SSE["source"]["commit"] and len(GOLDEN["source"]["commit"]) == 40


def test_local_training_of_backbone_g_aux_and_local_head_matches_the_authors():
    result = _train(FedLoGeUpdate())
    trained = GOLDEN["trained"]
    assert result.train_loss == pytest.approx(GOLDEN["loss"], abs=1e-5)
    for k in ("body.0.weight", "body.0.bias"):
        assert torch.allclose(result.weights[k], T(trained["backbone"][k]), atol=1e-5), k
    for k in ("weight", "bias"):
        assert torch.allclose(result.weights[f"classifier.g_aux.{k}"], T(trained["g_aux"][k]), atol=1e-5), k
        assert torch.allclose(result.state["fedloge"]["l_head"][k], T(trained["l_head"][k]), atol=1e-5), k


class Undetached(FedLoGeUpdate):
    """Mutant: the heads' losses reach the backbone (features not detached)."""

    def parts(self, local, model, objective, x, y, extra):
        parts = super().parts(local, model, objective, x, y, extra)
        h = model.body(x)
        parts["FedLoGe's local head (CE on detached features)"] = F.cross_entropy(local["l_head"](h), y)
        return parts


def test_a_local_head_that_trains_the_backbone_is_rejected():
    result = _train(Undetached())
    assert not torch.allclose(result.weights["body.0.weight"], T(GOLDEN["trained"]["backbone"]["body.0.weight"]),
                              atol=1e-4)


def _features():
    trained = GOLDEN["trained"]["backbone"]
    return F.relu(F.linear(T(GOLDEN["x_test"]), T(trained["body.0.weight"]), T(trained["body.0.bias"])))


def test_local_realignment_and_the_personal_logits_match_the_authors():
    g, l_head = _linear(GOLDEN["trained"]["g_aux"]), GOLDEN["trained"]["l_head"]
    assert torch.allclose(local_realignment(g.weight.detach(), T(l_head["weight"])), T(GOLDEN["g_aux_la"]), atol=1e-10)
    counts = torch.tensor(GOLDEN["counts"])
    head = PersonalHead(g, {k: T(v) for k, v in l_head.items()}, counts)
    logits, want = head(_features()), T(GOLDEN["personal_logits"])
    assert torch.allclose(logits, want, rtol=1e-10, atol=1e-8)
    acc = (logits.argmax(1) == torch.tensor(GOLDEN["y_test"])).double().mean().item()
    assert acc == pytest.approx(GOLDEN["acc_local"])
    # mutants: no realignment (g_aux as trained), no mask of the classes the client lacks
    plain = PersonalHead(g, {k: T(v) for k, v in l_head.items()}, counts)
    plain.g_weight = torch.where(counts[:, None] == 0, plain.g_weight, g.weight.detach())
    assert not torch.allclose(plain(_features()), want, rtol=1e-6, atol=1e-4)
    unmasked = PersonalHead(g, {k: T(v) for k, v in l_head.items()}, torch.ones_like(counts))
    assert not torch.allclose(unmasked(_features()), want, rtol=1e-6, atol=1e-4)


def test_global_realignment_matches_the_authors():
    g = _linear(GOLDEN["trained"]["g_aux"])
    weight = global_realignment(g.weight.detach(), 1.7)
    assert torch.allclose(weight, T(GOLDEN["g_aux_ga"]), atol=1e-10)
    logits = F.linear(_features(), weight, g.bias.detach())
    assert torch.allclose(logits, T(GOLDEN["global_logits"]), atol=1e-10)
    assert (logits.argmax(1) == torch.tensor(GOLDEN["y_test"])).double().mean().item() == \
        pytest.approx(GOLDEN["acc_global"])
    assert not torch.allclose(global_realignment(g.weight.detach(), 1.0), T(GOLDEN["g_aux_ga"]), atol=1e-3)


TINY = dict(dataset="mnist", model="mlp", train_limit=400, test_limit=100, clients=4, participation=0.5,
            local_iters=2, server_batch=16, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})


@pytest.mark.usefixtures("one_thread")
def test_personal_model_is_the_clients_heads_on_the_global_backbone(tmp_path):
    prep = prepare(RunConfig(**TINY, algorithm="fedloge", rounds=2, out=tmp_path,
                             algorithm_params={"head": {"name": "sse_c", "steps": 2}, "global_head": "g_aux"}))
    algo, states = prep.algorithm, ClientStates()
    clients = [client_data(prep, cid, torch.device("cpu")) for cid in (0, 1)]
    train_round(algo, prep.ctx, 0, clients, states)
    first = states.get(0)["fedloge"]["l_head"]["weight"].clone()
    train_round(algo, prep.ctx, 1, clients, states)
    assert not torch.equal(states.get(0)["fedloge"]["l_head"]["weight"], first)  # kept and trained on
    weights = algo.strategy.model.state_dict()
    x = clients[0].x[:7]

    def task(cid, state):
        return EvalTask(cid, RoundContext.placeholder(10), weights, state, "personal", test=clients[0])

    own = states.get(0)["fedloge"]
    with torch.no_grad():
        personal = algo.personal_model(task(0, states.get(0)))
        aux = g_aux(algo.strategy.model)
        want = PersonalHead(aux, own["l_head"], own["counts"])
        feats = []
        handle = personal.get_classifier().register_forward_pre_hook(lambda m, a: feats.append(a[0]))
        out = personal(x)
        handle.remove()
        assert torch.allclose(out, want(feats[0]), atol=1e-5)
        assert isinstance(algo.strategy.model.get_classifier(), WithAux)  # the global model is untouched
        assert isinstance(algo.personal_model(task(3, {})).get_classifier(), WithAux)  # never trained: global
        # GA-FR: the evaluated global model's classifier is g_aux with rows of norm 1.7
        norms = algo.global_model().get_classifier().weight.norm(dim=1)
        assert torch.allclose(norms, torch.full_like(norms, 1.7), atol=1e-5)

"""FEDIC held to the authors' own code (tests/golden/fedic.json, written by
tools/fedic_golden/make_golden.py from github.com/shangxinyi/FEDIC at the commit it records): two
rounds of their server update (``Global.update_distillation_highway_feature``) on 8 client
models — FedAvg, the fine-tuned copy, the calibration with its gate, the distilled global model —
replayed through fedlt's ``FedicStrategy.aggregate`` with their draws; the calibration and the
optimisers carried from the first round into the second."""

import copy
import json
import types
from pathlib import Path

import pytest
import torch

import fedlt.algorithms.fedic as fedic
from fedlt.algorithms.base import ClientData, build_aggregator
from fedlt.algorithms.fedic import FedicStrategy, ServerOrders, ServerSettings
from fedlt.algorithms.protocol import ClientResult
from fedlt.context import RoundContext
from golden_parts import BodyHead

GOLDEN = json.loads((Path(__file__).parent / "golden" / "fedic.json").read_text())
T = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
C, D_IN, D = 10, 3, 256
S = GOLDEN["settings"]
NAMES = {"ensemble_scale": "client_scale", "ensemble_bias": "client_bias", "logit_scale": "class_scale",
         "logit_bias": "class_bias", "classifier2.weight": "gate.weight", "classifier2.bias": "gate.bias"}


def Net() -> BodyHead:
    """The fixture's stand-in for their ResNet-8, as fedlt runs a model: logits out, ``get_classifier``."""
    return BodyHead(D_IN, D, C, norm=True)


def _state(values: dict) -> dict[str, torch.Tensor]:
    return {k: T(v) for k, v in values.items()} | {"body.1.num_batches_tracked": torch.tensor(0)}


def _server_data() -> ClientData:
    """The proxy set's rows first (3 a class: each class's first 3 rows), then the unlabelled ones."""
    x = torch.cat([T(GOLDEN["x_proxy"]), T(GOLDEN["x_unlabeled"])])
    y = torch.cat([torch.tensor(GOLDEN["y_proxy"]), torch.tensor(GOLDEN["y_unlabeled"])])
    return ClientData(-1, x, y, torch.bincount(y, minlength=C))


def _strategy(**change) -> FedicStrategy:
    settings = dict(finetune_steps=S["steps"], calibration_steps=S["steps"], distill_steps=S["steps"],
                    batch_labeled=S["mini_batch_size"], batch_unlabeled=S["mini_batch_size_unlabled"],
                    server_lr=S["lr_global_teaching"], server_weight_decay=2e-4, temperature=S["temperature"],
                    distill_weight=S["ld"], proxy_per_class=S["proxy_per_class"]) | change
    ctx = types.SimpleNamespace(build_model=lambda: Net().double(), device=torch.device("cpu"), sampling_seed=0,
                                server_data=_server_data(), augment=())
    strategy = FedicStrategy(Net().double(), build_aggregator("fedavg"), ctx, "ce", ServerSettings(**settings))
    strategy.calibration.load_state_dict({NAMES[k]: T(v) for k, v in GOLDEN["calibration_init"].items()})
    return strategy


def _orders(draws: list[list[int]]) -> ServerOrders:
    """Their draws in their order: the fine-tune's batches, the calibration's, then per
    distillation step the unlabelled batch and the labelled one."""
    n = S["steps"]
    t = [torch.tensor(d) for d in draws]
    return ServerOrders(t[:n], t[n:2 * n], [(t[2 * n + 2 * i], t[2 * n + 2 * i + 1]) for i in range(n)])


def _cut(draws: list[list[int]]) -> ServerOrders:
    """Their draws with every unlabelled batch one image short (a mutant)."""
    orders = _orders(draws)
    return ServerOrders(orders.finetune, orders.calibrate, [(u[:-1], l) for u, l in orders.distill])


def _round(strategy: FedicStrategy, r: int, orders=_orders) -> dict[str, dict[str, torch.Tensor]]:
    """Round ``r`` of the fixture through ``strategy.aggregate``, with their draws; copies of the
    global model, the fine-tuned model and the calibration after it."""
    results = [ClientResult(k, _state(c), n) for k, (c, n) in enumerate(zip(GOLDEN["clients"], GOLDEN["sizes"]))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fedic, "draw_orders", lambda *a, **k: orders(GOLDEN["rounds"][r]["draws"]))
        strategy.aggregate(RoundContext.placeholder(C), results)
    return {name: {k: v.detach().clone() for k, v in module.state_dict().items()}
            for name, module in (("global", strategy.model), ("finetuned", strategy.finetuned),
                                 ("calibration", strategy.calibration))}


@pytest.fixture(scope="module")
def replayed() -> tuple[list[dict], FedicStrategy]:
    """fedlt's two rounds, and a copy of the strategy as the first round left it."""
    strategy = _strategy()
    first = _round(strategy, 0)
    after_first = copy.deepcopy(strategy)
    return [first, _round(strategy, 1)], after_first


def _gaps(ours: list[dict], name: str) -> list[float]:
    gaps = []
    for rnd, recorded in zip(ours, GOLDEN["rounds"]):
        theirs = recorded[name]
        names = NAMES if name == "calibration" else {k: k for k in theirs}
        gaps.append(max(float((rnd[name][names[k]] - T(v)).abs().max()) for k, v in theirs.items()))
    return gaps


def test_golden_records_its_source():
    assert GOLDEN["source"]["repo"] == "https://github.com/shangxinyi/FEDIC"
    assert len(GOLDEN["source"]["commit"]) == 40
    assert len(GOLDEN["rounds"][0]["draws"]) == 4 * S["steps"]


def test_two_server_rounds_are_the_authors(replayed):
    ours = replayed[0]
    for name in ("finetuned", "calibration", "global"):
        assert max(_gaps(ours, name)) < 1e-10, (name, _gaps(ours, name))


@pytest.mark.parametrize("mutant", [{"temperature": 1.0}, {"distill_weight": 1.0}, "unlabelled batch cut"])
def test_mutants_are_rejected(mutant):
    """Another temperature, no proxy CE in the distillation, an unlabelled batch one short: the
    first round's global model differs by more than 1e-6."""
    if mutant == "unlabelled batch cut":
        ours = [_round(_strategy(), 0, orders=_cut)]
    else:
        ours = [_round(_strategy(**mutant), 0)]
    assert _gaps(ours, "global")[0] > 1e-6


def test_the_optimisers_moments_carry_into_the_next_round(replayed):
    """Their ``Global`` creates its Adam optimisers once: with fresh moments in round 2, round 2 differs."""
    strategy = copy.deepcopy(replayed[1])
    for optimiser in strategy.optimisers.values():
        optimiser.state.clear()
    second = _round(strategy, 1)
    assert max(float((second["global"][k] - T(v)).abs().max()) for k, v in GOLDEN["rounds"][1]["global"].items()) > 1e-6


# -- the server's data: training images held out before partitioning ---------------------------------
def _dataset(n_per_class=(9, 6, 4)):
    from fedlt.datasets.base import InMemoryDataset

    y = torch.cat([torch.full((n,), c) for c, n in enumerate(n_per_class)])[torch.randperm(sum(n_per_class))]
    x = torch.arange(len(y), dtype=torch.float32)[:, None, None, None].expand(-1, 1, 2, 2).clone()
    return InMemoryDataset("toy", x, y, x[:3], y[:3], len(n_per_class), groups_train=torch.arange(len(y)))


def test_hold_out_takes_per_class_images_out_before_partitioning():
    from fedlt.run.parts import hold_out

    data = _dataset()
    reduced, server = hold_out(data, 2, seed=5)
    assert torch.bincount(server.y, minlength=3).tolist() == [2, 2, 2]
    assert len(reduced.y_train) == len(data.y_train) - 6
    rows = set(server.rows.tolist())  # the images went to the server, the rest to the clients, each once
    kept = set(reduced.groups_train.tolist())  # groups_train = original row (the toy set's)
    assert rows.isdisjoint(kept) and rows | kept == set(range(len(data.y_train)))
    assert torch.equal(server.x[:, 0, 0, 0], torch.as_tensor(server.rows, dtype=torch.float32))
    assert torch.equal(data.y_train[torch.as_tensor(server.rows)], server.y)
    again = hold_out(data, 2, seed=5)[1]
    assert again.rows.tolist() == server.rows.tolist() and hold_out(data, 2, seed=6)[1].rows.tolist() != server.rows.tolist()
    manifest = server.manifest()
    assert manifest["per_class"] == 2 and manifest["indices"] == server.rows.tolist() and len(manifest["sha256"]) == 64


def test_hold_out_refuses_to_take_every_image_of_a_class():
    from fedlt.errors import FedltError
    from fedlt.run.parts import hold_out

    with pytest.raises(FedltError, match=r"fedic's proxy_per_class: holding 4 images of each class out .* all 4 "
                                         r"training images of class 2"):
        hold_out(_dataset(), 4, seed=0, what="fedic's proxy_per_class")


def test_the_server_sets_split_the_held_out_images_by_class_rank():
    """The first proxy_per_class rows of each class are the labelled proxy set, the rest unlabelled;
    with none left, the proxy set's images are the unlabelled set."""
    s = _strategy(proxy_per_class=2)
    proxy, unlabeled = s.server_sets()
    assert torch.bincount(proxy.y, minlength=C).tolist() == [2] * C
    assert len(unlabeled) == len(GOLDEN["y_proxy"]) + len(GOLDEN["y_unlabeled"]) - 2 * C
    s = _strategy(proxy_per_class=10)
    proxy, unlabeled = s.server_sets()
    assert unlabeled is proxy and len(proxy) == len(GOLDEN["y_proxy"]) + len(GOLDEN["y_unlabeled"])


def test_a_proxy_set_larger_than_a_class_is_one_line_and_exit_2(tmp_path, capsys):
    """On the command line: one error line naming the setting, exit 2, nothing written."""
    from fedlt.cli import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["run", "--algo", "fedic", "--model", "mlp", "--train-limit", "100", "--test-limit", "50", "--clients", "2",
              "--partition", "iid", "--local-iters", "1", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()  # the authors'-settings note, then the error
    assert info.value.code == 2 and not any("Traceback" in line for line in err)
    assert [line for line in err if not line.startswith("note:")] == [err[-1]]
    assert "fedic's proxy_per_class + unlabeled_per_class: holding 100 images of each class" in err[-1]
    assert not out.exists() or not any(out.iterdir())


def test_the_client_weights_stay_finite_where_theirs_divide_zero_by_zero():
    """σ(v_k)/Σ_j σ(v_j) (theirs, main.py:38-46) as a softmax of log σ: equal in float64 where theirs
    is finite, finite in float32 where every client's σ underflows (their 0/0; a study's round 20)."""
    from fedlt.algorithms.fedic import CalibratedEnsemble

    calibration = CalibratedEnsemble(3, 2).double()
    feats, logits, fallback = torch.randn(4, 5, 2).double(), torch.randn(4, 5, 3).double() * 3, torch.zeros(5, 3).double()
    with torch.no_grad():
        calibration.gate.weight.fill_(50.0)  # the gate open: the ensemble alone
        feats = feats.abs() + 1
        sig = torch.sigmoid(logits @ calibration.client_scale + calibration.client_bias)
        theirs = (sig / sig.sum(0) * logits).sum(0) * calibration.class_scale + calibration.class_bias
        assert torch.allclose(calibration(feats, logits, fallback), theirs, atol=1e-12)
        low = CalibratedEnsemble(3, 2)
        low.client_bias.fill_(-200.0)  # v < −88 for every client: σ = 0 in float32
        out = low(feats.float(), logits.float(), fallback.float())
    assert torch.isfinite(out).all()

"""The example plugin's own tests: each component passes its kind's fedlt.testing contract in one
line, plus what is particular to it (its formula, its size law)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedlt.errors import FedltError
from fedlt.testing import (check_aggregator, check_algorithm, check_loss_term, check_model, check_partitioner,
                           check_transform)
from fedlt_example.poly import Poly1
from fedlt_example.zipf import Zipf, zipf_sizes


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("params", [{}, {"epsilon": 2.0}, {"epsilon": -1.0}])
def test_poly1_passes_the_loss_contract(params):
    check_loss_term("poly1", params)


@pytest.mark.parametrize("params", [{}, {"s": 0.0}, {"s": 2.5}])
def test_zipf_passes_the_partitioner_contract(params):
    check_partitioner("zipf", params)


@pytest.mark.parametrize("shape", [(1, 28), (3, 32)])
def test_tiny_cnn_passes_the_model_contract_and_splits(shape):
    check_model("tiny_cnn", {"width": 4}, in_chans=shape[0], image_size=shape[1], splittable=True)


def test_the_contracts_work_on_the_classes_too_before_installing():
    check_loss_term(Poly1, {"epsilon": 0.5})
    check_partitioner(Zipf, {"s": 1.0})


def test_poly1_matches_its_formula_in_float64():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randint(0, 5, (7,), generator=g)
    want = 0.0
    for i in range(7):
        p = math.exp(logits[i, targets[i]]) / sum(math.exp(v) for v in logits[i].tolist())
        want += (-math.log(p) + 2.0 * (1 - p)) / 7
    assert abs(float(Poly1(epsilon=2.0)(logits, targets)) - want) < 1e-12
    assert torch.allclose(Poly1(epsilon=0.0)(logits, targets), torch.nn.functional.cross_entropy(logits, targets))


def test_zipf_sizes_follow_the_power_law_and_sum_to_the_total():
    sizes = zipf_sizes(1000, 10, 1.0)
    assert sizes.sum() == 1000 and (sizes >= 1).all() and (np.diff(sizes) <= 0).all()
    harmonic = sum(1 / (k + 1) for k in range(10))
    ideal = [1 + 990 / harmonic / (k + 1) for k in range(10)]  # one each, the rest by the law
    assert all(abs(n - want) < 1 for n, want in zip(sizes, ideal)), (sizes, ideal)
    assert (zipf_sizes(10, 10, 3.0) == 1).all()
    with pytest.raises(FedltError, match="11 clients"):
        zipf_sizes(10, 11, 1.0)


def test_bad_parameters_are_one_line_errors():
    with pytest.raises(FedltError, match="epsilon"):
        Poly1(epsilon=float("nan"))
    with pytest.raises(Exception, match="s"):
        Zipf(s=-1)
    from fedlt_example.tiny_cnn import tiny_cnn

    with pytest.raises(FedltError, match="width"):
        tiny_cnn(width=0)


# -- the algorithm, the aggregator and the split server side ---------------------------------------
def test_example_algorithms_pass_the_algorithm_contract():
    """Two rounds; cut after round 1 (as a kill leaves the run) and resumed, the server momentum,
    each client's visit count and each client's drift are restored bit for bit."""
    check_algorithm("example_fedcm", {"alpha": 0.5})
    check_algorithm("example_feddc", {"alpha": 0.1})


def test_example_fedcm_with_alpha_one_is_fedavg(tmp_path):
    """a_k = 1 blends nothing in: the same global model as FedAvg, bit for bit."""
    from fedlt import io
    from fedlt.config import RunConfig
    from fedlt.engine import run

    common = dict(model="mlp", clients=4, participation=1.0, rounds=2, train_limit=200, local_iters=2,
                  partition={"name": "iid"})
    run(RunConfig(**common, algorithm="fedavg", out=tmp_path / "fedavg"))
    run(RunConfig(**common, algorithm="example_fedcm", algorithm_params={"alpha": 1.0}, out=tmp_path / "fedcm"))
    a, b = (io.load_checkpoint(tmp_path / d / "checkpoint.pt")["algorithm"]["model"] for d in ("fedavg", "fedcm"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_example_feddc_uploads_weights_plus_drift(tmp_path):
    """With alpha 0 the clients train as FedAvg's do, so what the server averages is θ_k + h_k
    with h_k = θ_k − w: the global model is FedAvg's plus the |D_k|-weighted mean drift (float64),
    and the drifts are not zero. Uploading θ_k alone would give FedAvg's model."""
    import json

    from fedlt import io
    from fedlt.config import RunConfig
    from fedlt.engine import run

    common = dict(model="mlp", clients=4, participation=1.0, rounds=1, train_limit=200, local_iters=2,
                  partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})
    run(RunConfig(**common, algorithm="fedavg", out=tmp_path / "fedavg"))
    run(RunConfig(**common, algorithm="example_feddc", algorithm_params={"alpha": 0.0}, out=tmp_path / "feddc"))
    fedavg, feddc = (io.load_checkpoint(tmp_path / d / "checkpoint.pt") for d in ("fedavg", "feddc"))
    sizes = [sum(row) for row in json.loads((tmp_path / "feddc" / "partition.json").read_text())["class_counts"]]
    drifts = {cid: state["drift"] for cid, state in feddc["client_states"].items()}
    assert sorted(drifts) == [0, 1, 2, 3] and all(float(h.abs().max()) > 0 for d in drifts.values() for h in d.values())
    for name, got in feddc["algorithm"]["model"].items():
        mean_drift = sum(sizes[c] * drifts[c][name].double() for c in drifts) / sum(sizes)
        want = fedavg["algorithm"]["model"][name].double() + mean_drift
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_lookahead_passes_the_aggregator_contract():
    check_aggregator("lookahead")
    check_aggregator("lookahead", {"alpha": 0.3, "k": 3})


def test_lookahead_matches_its_formula_in_float64():
    """Round 1 (k = 2): FedAvg's average; round 2: φ + α·(average − φ) with φ the start."""
    from fedlt.aggregators import create, weighted_average

    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(3, generator=g, dtype=torch.float64)}
    results = [({"w": torch.randn(3, generator=g, dtype=torch.float64)}, float(n)) for n in (3, 5)]
    agg = create("lookahead", alpha=0.25, k=2)
    first = agg(start, results, ["w"])
    torch.testing.assert_close(first["w"], weighted_average(results)["w"], rtol=0, atol=0)
    second = agg(first, results, ["w"])
    torch.testing.assert_close(second["w"], start["w"] + 0.25 * (weighted_average(results)["w"] - start["w"]))


@pytest.mark.parametrize("size, same_as", [(1, "sequential"), (8, "concat")])
def test_grouped_is_sequential_with_groups_of_one_and_concat_with_one_group(tmp_path, size, same_as):
    """The plugin's server side sits between fedlt's two: groups of one participant are SplitFed
    V2's sequential server, one group of all of them SCALA's concatenated forward."""
    from fedlt import io
    from fedlt.config import RunConfig
    from fedlt.engine import run

    common = dict(algorithm="scala", clients=5, participation=1.0, rounds=1, train_limit=200, test_limit=50, local_iters=2,
                  server_batch=20, partition={"name": "iid"})
    run(RunConfig(**common, algorithm_params={"server": same_as}, out=tmp_path / "builtin"))
    run(RunConfig(**common, algorithm_params={"server": f"grouped(size={size})"}, out=tmp_path / "grouped"))
    a, b = (io.load_checkpoint(tmp_path / d / "checkpoint.pt")["algorithm"]["model"] for d in ("builtin", "grouped"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("params", [{}, {"fraction": 0.5, "error_feedback": True}])
def test_randk_passes_the_transform_contract(params):
    check_transform("randk", params)


def test_randk_is_unbiased_and_runs_as_an_upload(tmp_path):
    """E[rand_k(v)] = v: the mean of 400 draws is within 5 standard errors of v on every
    coordinate (a coordinate is sent with probability k/d, scaled by d/k); and a run takes it by
    its registered name with fedlt unchanged, its uploads about fraction·2 of the dense ones."""
    import json

    import fedlt.transforms
    from fedlt.config import RunConfig
    from fedlt.engine import run

    v = {"x": torch.randn(40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)}
    t, n = fedlt.transforms.create("randk", fraction=0.25), 400
    torch.manual_seed(0)
    mean = sum(t.apply(v, {})[0]["x"] for _ in range(n)) / n
    std_one = v["x"].abs() * math.sqrt(1 / 0.25 - 1)  # a draw's std: |v|·√(d/k − 1)
    assert bool(((mean - v["x"]).abs() <= 5 * std_one / math.sqrt(n) + 1e-12).all())
    common = dict(algorithm="fedavg", model="mlp", clients=2, participation=1.0, rounds=1, train_limit=100,
                  test_limit=50, local_epochs=1, batch_size=50, partition={"name": "iid"})
    run(RunConfig(**common, out=tmp_path / "plain"))
    run(RunConfig(**common, upload="randk(fraction=0.05)", out=tmp_path / "randk"))
    up = [json.loads((tmp_path / d / "metrics.jsonl").read_text())["bytes_up"] for d in ("plain", "randk")]
    assert up[1] < 0.12 * up[0]

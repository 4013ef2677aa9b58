"""Differential privacy and secure aggregation (fedlt.privacy, fedlt.uploads, docs/privacy.md):
the accountant against dp-accounting's own numbers for a published example, the server's noise,
the masked sum against the plain sum (with dropouts), and a DP + secure-aggregation FedVLS run
that reports ε every round and resumes exactly, ε included."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

import fedlt.privacy as P
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.errors import FedltError
from fedlt.privacy import secagg
from fedlt.testing.base import cut_after, run_differences
from fedlt.uploads import UploadRunner, UploadSettings

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
dp_accounting = pytest.importorskip("dp_accounting")


def test_epsilon_is_dp_accountings_for_abadi_et_als_mnist_example():
    """Abadi et al. 2016's MNIST setting as in TF Privacy's tutorial (q = 256/60000, σ = 1.1, 60
    epochs = 14062 steps, δ = 1e-5; published as ε = 3.01 with the RDP conversion of its day):
    fedlt's ε is exactly what dp-accounting 0.6.0's RDP accountant gives (2.597 with its tighter
    conversion), and the fixed-size variant is the library's own event."""
    steps, q, sigma, delta = 14062, 256 / 60000, 1.1, 1e-5
    ours = P.epsilon(sigma, steps, 60000, 256, delta, sampling="poisson")
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    assert ours == accountant.get_epsilon(delta)
    assert 2.5 < ours < 3.01  # below the published bound: the conversion only got tighter
    fixed = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    fixed.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.SampledWithoutReplacementDpEvent(
        4, 2, dp_accounting.GaussianDpEvent(1.1 / 2)), 50))  # the run's setting below: one curve computed
    assert P.epsilon(1.1, 50, 4, 2, 1e-3) == fixed.get_epsilon(1e-3)


def test_calibration_meets_the_target_and_is_tight():
    """dp-accounting's calibration, on local DP's unsampled Gaussian (a subsampled curve takes
    seconds per σ tried; the search is the same)."""
    sigma = P.calibrate(4.0, 1e-3, 20, 1, 1, tol=0.01)
    assert P.epsilon(sigma, 20, 1, 1, 1e-3) <= 4.0 < P.epsilon(sigma - 0.02, 20, 1, 1, 1e-3)
    assert UploadSettings(privacy={"name": "local"}, target_epsilon=4.0, delta=1e-3, rounds=20).mechanism() \
        .noise_multiplier == pytest.approx(P.calibrate(4.0, 1e-3, 20, 1, 1))


def _masked_round(uploads, participants, seed=7, round_index=3):
    return {cid: secagg.mask(secagg.encode(x, len(participants)), cid, participants, seed, round_index)
            for cid, x in uploads.items()}


def test_masked_sum_equals_the_plain_sum_with_and_without_dropouts():
    g = torch.Generator().manual_seed(0)
    participants = [2, 5, 8, 11]
    uploads = {cid: torch.randn(300, generator=g, dtype=torch.float64) * 50 for cid in participants}
    masked = _masked_round(uploads, participants)
    step = 2.0 ** -secagg.FRACTION_BITS
    assert not torch.equal(masked[2], secagg.encode(uploads[2], 4))  # a single upload is masked
    plain = sum(uploads.values())
    total = secagg.decode(secagg.unmask_sum(masked, participants, 7, 3))
    assert float((total - plain).abs().max()) <= len(participants) * step / 2 + 1e-9
    survivors = {cid: masked[cid] for cid in (2, 11)}  # 5 and 8 dropped: their masks recovered
    total = secagg.decode(secagg.unmask_sum(survivors, participants, 7, 3))
    assert float((total - uploads[2] - uploads[11]).abs().max()) <= 2 * step / 2 + 1e-9
    with pytest.raises(FedltError, match="fixed-point range"):
        secagg.encode(torch.tensor([1e12]), 4)


def test_the_servers_noise_has_std_sigma_c_over_qk():
    """Central DP's aggregate of all-zero updates is the noise alone: N(0, (σC/(qK))²); over 200 000
    coordinates its sample std lies within 5 standard errors of σC/(qK)."""
    settings = UploadSettings(privacy={"name": "client_level", "clip": 2.0, "noise_multiplier": 1.1},
                              clients=4, per_round=2, rounds=3)
    runner = UploadRunner(None, settings)
    zero = {"w": torch.zeros(200_000, dtype=torch.float64)}
    noised = runner.private_mean(zero, 0.0, round_index=0)["w"]
    expected = 1.1 * 2.0 / 2
    assert abs(float(noised.std()) - expected) < expected * 5 / math.sqrt(2 * 200_000)
    assert runner.accountant.rounds == 1 and runner.extra["epsilon"] == P.epsilon(1.1, 1, 4, 2, 4 ** -1.1)


def test_adaptive_clipping_moves_c_toward_the_quantile():
    settings = UploadSettings(privacy={"name": "client_level", "clip": 1.0, "noise_multiplier": 1.0,
                                       "adaptive": True, "count_noise": 5.0}, clients=100, per_round=50)
    runner = UploadRunner(None, settings)
    runner.accountant.multiplier = 1.0  # no ε needed here (the adaptive σ_Δ is checked below)
    runner.accountant.epsilon = lambda: 0.0
    runner.private_mean({"w": torch.zeros(3, dtype=torch.float64)}, unclipped=50.0, round_index=0)
    # all 50 unclipped, b̄ = 1 + N(0, 5²)/50: C shrinks by exp(−0.2·(b̄ − 0.5)) (the noise drawn after the update's)
    assert 0.6 < runner.clip_norm < 1.0
    assert P.ClientLevel(noise_multiplier=1.0, adaptive=True, count_noise=5.0).update_multiplier(50) == \
        pytest.approx((1.0 - (2 * 5.0) ** -2) ** -0.5)
    state = runner.state_dict()
    other = UploadRunner(None, settings)
    other.load_state_dict(state)
    assert other.clip_norm == runner.clip_norm and other.accountant.rounds == 1


def test_fedvls_with_client_level_dp_and_secure_aggregation_reports_epsilon_and_resumes_exactly(tmp_path):
    """The issue's run, small: ε every round (growing, dp-accounting's value for the run's
    sampling), in summary.json; a run cut after round 1 and resumed gives the same rows (ε
    included), states and summary, bit for bit."""
    cfg = RunConfig(algorithm="fedvls", model="mlp", clients=4, participation=0.5, rounds=2, local_epochs=1,
                    batch_size=50, train_limit=200, test_limit=100, eval_every=2, partition={"name": "iid"},
                    privacy="client_level(clip=1.0, noise_multiplier=1.1)", secure_aggregation=True,
                    out=tmp_path / "full")
    first = run(cfg, on_round=cut_after(1, tmp_path / "full", tmp_path / "cut"))
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    delta = 4 ** -1.1
    assert [r["epsilon"] for r in rows] == [P.epsilon(1.1, n, 4, 2, delta) for n in (1, 2)]
    assert first["privacy"]["epsilon"] == rows[-1]["epsilon"] and first["privacy"]["delta"] == delta
    again = run(cfg.model_copy(update={"out": tmp_path / "cut"}), resume=True)
    assert not run_differences(tmp_path / "full", tmp_path / "cut", (first, again))


def test_secure_aggregation_alone_gives_the_plain_runs_model(tmp_path):
    """Masking changes nothing but the fixed-point rounding: the global model after 2 FedAvg rounds
    is the plain run's within 1e-6."""
    base = dict(algorithm="fedavg", model="mlp", clients=4, participation=0.5, rounds=2, local_epochs=1,
                batch_size=50, train_limit=200, test_limit=100, eval_every=2, partition={"name": "iid"})
    run(RunConfig(**base, out=tmp_path / "plain"))
    run(RunConfig(**base, secure_aggregation=True, out=tmp_path / "masked"))
    from fedlt import io
    a, b = (io.load_checkpoint(tmp_path / d / "checkpoint.pt")["algorithm"]["model"] for d in ("plain", "masked"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_secure_aggregation_on_flower_refuses_split_learning_and_lone_participants_in_one_line():
    """Flower's SecAgg+ masks one upload a participant, two or more a round: SCALA's per-iteration
    exchange and a round of one are refused, naming the reason; FedVLS is accepted."""
    with pytest.raises(ValueError, match="algorithm 'scala' trains in split-learning sessions .* Flower's SecAgg\\+"):
        RunConfig(engine="flower", secure_aggregation=True, algorithm="scala")
    with pytest.raises(ValueError, match="needs 2 or more participants a round \\(participation × clients = 0.5 × 2\\)"):
        RunConfig(engine="flower", secure_aggregation=True, algorithm="fedvls", clients=2, participation=0.5)
    assert RunConfig(engine="flower", secure_aggregation=True, algorithm="fedvls").secure_aggregation


@pytest.fixture
def secaggplus_nodes():
    """Flower's own SecAggPlusWorkflow and secaggplus_mod in this process (no Ray): five nodes whose
    ClientApp (the mod around a train handler) uploads a fixed update and weight — node 3 fails in
    the collect stage when ``failing`` holds it — reached through a grid that delivers copies, as
    the wire does (the workflow sends one content object to every node and the mod edits it)."""
    pytest.importorskip("flwr")
    import copy

    import numpy as np
    from flwr.app import Context, Error, Message, RecordDict
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp import ClientApp
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat
    from flwr.supercore.task_identity import TaskIdentity

    rng = np.random.default_rng(0)
    nodes = SimpleNamespace(updates={k: rng.uniform(-1, 1, 1000) for k in range(1, 6)}, failing=set())
    nodes.weights = {k: int(rng.integers(10, 300)) for k in nodes.updates}
    app = ClientApp()

    @app.train(mods=[secaggplus_mod])
    def train(message, context):
        node = message.metadata.dst_node_id
        if node in nodes.failing:
            raise FedltError(f"node {node} fails")
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([nodes.updates[node]]), nodes.weights[node], {})
        return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=message)

    contexts = {k: Context(run_id=0, node_id=k, node_config={}, state=RecordDict(), run_config={}) for k in nodes.updates}

    class Grid:
        def send_and_receive(self, messages, *, timeout=None):
            sent = [Message(copy.deepcopy(m.content), m.metadata.dst_node_id, m.metadata.message_type,
                            group_id=m.metadata.group_id) for m in messages]
            return [answer(m) for m in sent]

    def answer(message):  # a node's runtime turns its ClientApp's exception into an error reply
        try:
            return app(message, contexts[message.metadata.dst_node_id])
        except FedltError as exc:
            return Message(Error(code=0, reason=f"FedltError: {exc}"), reply_to=message)

    nodes.grid = Grid()
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, 0  # a ServerApp's process sets them
    yield nodes
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.mark.parametrize("uniform", [False, True])
def test_flowers_secaggplus_gives_the_weighted_mean_within_the_stated_bound(secaggplus_nodes, uniform):
    """fedlt's SecAgg+ settings (fedlt.flower.secaggplus) through Flower's real workflow and mod: the
    unmasked mean is the exact weighted mean of the uploads (|D_k| weights, or 1 each under
    client-level DP) within ``tolerance`` — one rounding step 2c/T an upload, n of them over Σ r_k —
    and not much better (the bound is not loose by orders); with node 3 failing in the collect stage,
    its masks are recovered and the mean is the other four's, within their bound."""
    import numpy as np
    from flwr.common import FitIns, Parameters

    from fedlt.flower import secaggplus
    from fedlt.privacy.upload import UploadPlan

    nodes = secaggplus_nodes
    if uniform:
        nodes.weights = dict.fromkeys(nodes.weights, 1)
    plan = UploadPlan(clip=1.0, secure=True, uniform=uniform)
    for failing in (set(), {3}):
        nodes.failing = failing
        kept = [k for k in nodes.updates if k not in failing]
        found = secaggplus.settings(plan, len(nodes.updates), max(nodes.weights.values()))
        grid = secaggplus.ErrorsSeen(nodes.grid)
        strategy = secaggplus.run_workflow(grid, {k: FitIns(Parameters([], "numpy.ndarray"), {}) for k in nodes.updates},
                                           found, 1)
        exact = sum(nodes.weights[k] * nodes.updates[k] for k in kept) / sum(nodes.weights[k] for k in kept)
        error, bound = np.abs(strategy.aggregate - exact).max(), secaggplus.tolerance(found, [nodes.weights[k] for k in kept])
        assert sorted(strategy.results) == kept and bound / 20 < error <= bound, (failing, error, bound)
        assert found.quantization_range == 2 ** 28 and found.max_weight == (1.0 if uniform else 512.0)
        assert [secaggplus.error_line(e) for e in grid.errors.values()] == [f"FedltError: node {k} fails" for k in failing]


def test_the_privacy_study_expands_to_every_method_at_every_epsilon(tmp_path):
    """benchmarks/studies/privacy_longtail_mnist.yaml: FedAvg, LA, FedVLS, FedETF, CCVR × ε ∈ {∞, 8, 2}
    × 3 seeds, each a valid run on longtail_mnist.yaml's MNIST-LT split across 500 clients (∞: no
    privacy at all); each σ is dp-accounting's calibration for its ε on that protocol (its ε after
    the 20 rounds at δ = 500^−1.1 at most the target and within 0.2 % of it)."""
    from pathlib import Path

    from fedlt.sweep.study import expand, load_study

    root = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
    study, _ = load_study(root / "privacy_longtail_mnist.yaml")
    configs = [RunConfig.model_validate(e.config) for e in expand(study, tmp_path / "study")]
    sigmas = {c.privacy["noise_multiplier"] for c in configs if c.privacy}
    target = {1.446: 8.0, 3.397: 2.0}
    assert sigmas == set(target)
    for sigma in sigmas:
        eps = P.epsilon(sigma, 20, 500, 50, 500 ** -1.1)
        assert 0.998 * target[sigma] < eps <= target[sigma]
    cells = {(c.algorithm, target[c.privacy["noise_multiplier"]] if c.privacy else math.inf, c.seeds.model)
             for c in configs}
    assert cells == {(a, e, s) for a in ("fedavg", "fedlogit", "fedvls", "fedetf", "ccvr")
                     for e in (math.inf, 8.0, 2.0) for s in (0, 1, 2)} and len(configs) == 45
    lt, _ = load_study(root / "longtail_mnist.yaml")
    kept = ("dataset", "model", "split", "optimiser", "groups")  # the protocol's; the federation's size is not
    assert all(c.model_dump()[k] == RunConfig.model_validate(lt.base | {"out": tmp_path}).model_dump()[k]
               for c in configs for k in kept)
    assert all(c.clients == 500 and c.participation == 0.1 and c.partition["then"]["min_size"] == 5 for c in configs)


def test_local_dp_noises_each_upload_and_accounts_a_gaussian_per_round(tmp_path):
    """local(clip=C, noise_multiplier=σ): every client sends clip(Δ) + N(0, (σC)²) (the global model
    moves by far more than the clip bound allows), and ε after r rounds is dp-accounting's for r
    unsampled Gaussian releases."""
    from fedlt import io

    base = dict(algorithm="fedavg", model="mlp", clients=2, participation=1.0, rounds=1, local_epochs=1,
                batch_size=50, train_limit=100, test_limit=50, eval_every=1, partition={"name": "iid"})
    run(RunConfig(**base, privacy="local(clip=0.01, noise_multiplier=1.0)", out=tmp_path / "local"))
    start = prepare_weights(RunConfig(**base, out=tmp_path / "probe"))
    end = io.load_checkpoint(tmp_path / "local" / "checkpoint.pt")["algorithm"]["model"]
    moved = math.sqrt(sum(float(((end[k] - start[k]).double() ** 2).sum()) for k in start))
    assert moved > 10 * 0.01  # the average of two noised uploads: noise of std 0.01/√2 on ~200k coordinates
    row = json.loads((tmp_path / "local" / "metrics.jsonl").read_text())
    assert row["epsilon"] == P.epsilon(1.0, 1, 1, 1, 2 ** -1.1)


def prepare_weights(cfg):
    from fedlt.engine import prepare

    return {k: v.clone() for k, v in prepare(cfg).algorithm.global_model().state_dict().items()}


# Secure aggregation and central DP give the server the participants' mean update alone: an
# algorithm or aggregator that reads each client's own update would run as something else
@pytest.mark.parametrize("algorithm,params", [("fedic", {}), ("fednova", {}), ("fedexp", {}),
                                              ("fedavg", {"aggregator": "fedexp"})])
@pytest.mark.parametrize("hiding", [{"secure_aggregation": True},
                                    {"privacy": "client_level(clip=1.0, noise_multiplier=1.0)"}])
def test_an_algorithm_reading_each_update_is_refused_where_the_server_sees_only_the_mean(algorithm, params, hiding):
    with pytest.raises(ValueError, match="sees only the participants' mean update, but algorithm .* needs each one"):
        RunConfig.model_validate({"algorithm": algorithm, "algorithm_params": params, **hiding})
    RunConfig.model_validate({"algorithm": algorithm, "algorithm_params": params,  # each update seen: allowed
                              "privacy": "local(clip=1.0, noise_multiplier=1.0)"})
    RunConfig.model_validate({"algorithm": "fedavg", **hiding})  # the mean is all FedAvg reads

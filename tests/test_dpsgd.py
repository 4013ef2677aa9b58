"""Sample-level DP (DP-SGD, fedlt.privacy.dpsgd, docs/privacy.md) and the privacy budget: per-sample
clipping against a float64 loop over single-sample gradients, the noise's standard deviation, the
per-client accountant against dp-accounting's own value for Abadi et al.'s example, a run that
reports ε every round and resumes exactly, ``stop_at_epsilon``, and the refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fedlt.privacy as P
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.errors import FedltError
from fedlt.privacy.dpsgd import PrivateStep, poisson_batches
from fedlt.testing.base import cut_after, run_differences
from fedlt.uploads import LocalPlan, UploadSettings

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
dp_accounting = pytest.importorskip("dp_accounting")


class _Scaled(nn.Module):
    """An MLP times a learned scalar: a 0-dim parameter among the per-sample gradients (FedETF's β)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.body(x)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _Scaled()


def test_per_sample_clipping_is_exact_against_a_float64_loop():
    """ḡ·b = Σ_i g_i·min(1, C/‖g_i‖) with no noise equals a float64 loop over single-sample
    gradients (autograd, one sample at a time) to float32 precision; C is the median norm, so some
    samples are clipped and some are not."""
    model, x, y = _mlp(), torch.randn(12, 6, generator=torch.Generator().manual_seed(1)), torch.arange(12) % 3
    exact = [p.detach().double() for p in model.parameters()]
    reference = _mlp().double()
    grads = [torch.autograd.grad(F.cross_entropy(reference(x[i:i + 1].double()), y[i:i + 1]), list(reference.parameters()))
             for i in range(len(y))]
    norms = torch.stack([torch.sqrt(sum((g ** 2).sum() for g in gs)) for gs in grads])
    clip = float(norms.median())
    want = [sum(gs[j] * min(1.0, clip / float(n)) for gs, n in zip(grads, norms)) / 8 for j in range(len(exact))]
    params = list(model.parameters())
    loss = PrivateStep(clip, 0.0, 8, torch.Generator().manual_seed(0)).backward(model, params, F.cross_entropy, x, y, {})
    assert (norms > clip).any() and (norms < clip).any()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad.double(), w, rtol=1e-5, atol=1e-7)
    assert float(loss.detach()) == pytest.approx(float(F.cross_entropy(model(x), y).detach()), rel=1e-5)


def test_the_noise_has_std_sigma_c_over_b():
    """An empty Poisson batch leaves the noise alone: N(0, (σC/b)²) on each of 200 000 coordinates;
    the sample std lies within 5 standard errors (1/√(2N) relative) of σC/b."""
    model = nn.Linear(1000, 200)
    params = list(model.parameters())
    sigma, clip, batch = 1.3, 0.7, 16
    PrivateStep(clip, sigma, batch, torch.Generator().manual_seed(3)).backward(
        model, params, F.cross_entropy, torch.zeros(0, 1000), torch.zeros(0, dtype=torch.long), {})
    noise = torch.cat([p.grad.reshape(-1) for p in params]).double()
    expected, n = sigma * clip / batch, noise.numel()
    assert abs(float(noise.std()) / expected - 1) < 5 / math.sqrt(2 * n)
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(n)


def test_poisson_batches_take_each_sample_with_probability_b_over_n():
    sizes = torch.tensor([len(i) for i in poisson_batches(200, 20, 500, torch.Generator().manual_seed(0))],
                         dtype=torch.float64)
    # mean of 500 Binomial(200, 0.1) sizes: 20 ± 5 standard errors (√(200·0.1·0.9/500))
    assert abs(float(sizes.mean()) - 20) < 5 * math.sqrt(18 / 500) and float(sizes.min()) < 20 < float(sizes.max())


def test_epsilon_is_dp_accountings_for_abadi_et_als_example():
    """Abadi et al. 2016 §3.1: q = 0.01, σ = 4, δ = 1e-5, T = 10 000 steps (published ε ≈ 1.26 with
    the moments accountant): fedlt's per-client ledger gives exactly dp-accounting 0.6.0's RDP value
    (1.035, the tighter conversion); two rounds of 5 000 steps compose to it; the run's ε is the
    largest client's."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(4.0)), 10_000))
    want = accountant.get_epsilon(1e-5)
    ledger = P.SampleAccountant(P.mechanism("sample_level(clip=1.0, noise_multiplier=4.0)"), 1e-5)
    assert ledger.prospective([(0, 60_000, 600, 10_000)]) == want and ledger.epsilon() == 0.0
    assert ledger.record([(0, 60_000, 600, 10_000)]) == want
    # the number docs/privacy.md quotes for this example (dp-accounting 0.6.0): pinned, so a changed accountant shows
    assert want == pytest.approx(1.0355, abs=1e-4)
    halves = P.SampleAccountant(ledger.mech, 1e-5)
    halves.record([(0, 60_000, 600, 5_000), (1, 60_000, 600, 1)])
    assert halves.record([(0, 60_000, 600, 5_000)]) == pytest.approx(want, rel=1e-12)
    again = P.SampleAccountant(ledger.mech, 1e-5)
    again.load_state_dict(halves.state_dict())
    assert again.epsilon() == halves.epsilon() and again.epsilons[1] < again.epsilons[0]


def test_the_ledger_computes_a_client_sizes_step_curve_once(monkeypatch):
    """Each (n_k, b_k)'s one-step curve is the ledger's for the run: round_rdp's bounded cache
    alone would recompute it (seconds each) every round once more than 64 sizes take part."""
    calls, curve = [], P.round_rdp.__wrapped__  # uncached: every call counted
    monkeypatch.setattr(P, "round_rdp", lambda *a: calls.append(a) or curve(*a))
    ledger = P.SampleAccountant(P.mechanism("sample_level(clip=1.0, noise_multiplier=2.0)"), 1e-5)
    first = ledger.record([(0, 500, 50, 3)])
    assert ledger.record([(0, 500, 50, 3)]) > first and ledger.prospective([(0, 500, 50, 3)]) > first
    assert [a for a in calls if a[1:3] == (500, 50)] == [(2.0, 500, 50, "poisson")]


def test_calibration_keeps_every_client_under_the_target():
    settings = UploadSettings(privacy={"name": "sample_level", "clip": 1.0}, target_epsilon=3.0, delta=1e-5,
                              clients=2, per_round=2, rounds=50, sizes=(60_000, 60_000),
                              schedule=LocalPlan(server_batch=1200, iters=20, epochs=None, batch_size=1))
    (n, batch, steps), _ = settings.worst_case_plans()
    assert (n, batch, steps) == (60_000, 600, 1000)
    sigma = settings.mechanism().noise_multiplier
    ledger = P.SampleAccountant(P.mechanism({"name": "sample_level", "noise_multiplier": sigma}), 1e-5)
    assert ledger.prospective([(0, n, batch, steps)]) <= 3.0


BASE = dict(algorithm="fedavg", model="mlp", clients=2, participation=1.0, local_epochs=1, batch_size=10,
            train_limit=100, test_limit=50, eval_every=1, partition={"name": "iid"},
            privacy="sample_level(clip=1.0, noise_multiplier=1.2)")


def test_a_dp_sgd_run_reports_epsilon_every_round_and_resumes_exactly(tmp_path):
    """FedAvg with DP-SGD (2 clients of 50 samples, b = 10: q = 0.2, 5 steps a round): ε after r
    rounds is dp-accounting's for 5r Poisson-sampled steps, the same in summary.json; a run cut
    after round 1 and resumed gives the same rows (ε included), states and summary, bit for bit."""
    cfg = RunConfig(**BASE, rounds=2, out=tmp_path / "full")
    first = run(cfg, on_round=cut_after(1, tmp_path / "full", tmp_path / "cut"))
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    delta = 100 ** -1.1
    for r, row in enumerate(rows, 1):
        accountant = dp_accounting.rdp.RdpAccountant()
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(1.2)), 5 * r))
        assert row["epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)
    assert first["privacy"]["epsilon"] == rows[-1]["epsilon"] and first["privacy"]["delta"] == delta
    assert not first["privacy"]["stopped_by_privacy_budget"]
    again = run(cfg.model_copy(update={"out": tmp_path / "cut"}), resume=True)
    assert not run_differences(tmp_path / "full", tmp_path / "cut", (first, again))


def test_the_run_stops_before_the_round_that_would_spend_past_the_budget(tmp_path, caplog):
    """stop_at_epsilon between ε after 1 and after 2 rounds: round 1 runs (and is evaluated), round
    2 does not; one line says so; summary.json records the stop and the final ε."""
    one = P.SampleAccountant(P.mechanism(BASE["privacy"]), 100 ** -1.1)
    after = [one.record([(0, 50, 10, 5)]), one.record([(0, 50, 10, 5)])]
    cfg = RunConfig(**BASE, rounds=3, stop_at_epsilon=(after[0] + after[1]) / 2, out=tmp_path / "run")
    with caplog.at_level("WARNING", logger="fedlt"):
        summary = run(cfg)
    assert summary["rounds"] == 1 and summary["final"]["round"] == 1
    assert summary["privacy"]["stopped_by_privacy_budget"] and summary["privacy"]["epsilon"] == after[0]
    assert [r.message for r in caplog.records if "budget" in r.message] == [
        f"fedlt: stopped after round 1: round 2 would take ε from {after[0]:.4g} to {after[1]:.4g}, past the "
        f"budget {cfg.stop_at_epsilon:g}"]
    assert run(cfg, resume=True)["privacy"]["stopped_by_privacy_budget"]  # resumed: stops again at once
    with pytest.raises(FedltError, match="the first round alone would spend"):
        run(cfg.model_copy(update={"stop_at_epsilon": after[0] / 2, "out": tmp_path / "none"}))
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())


def test_the_budget_looks_at_the_clients_the_round_will_draw(tmp_path, monkeypatch):
    """With availability acting before sampling, the budget's ε is that of the clients the round
    draws among the reachable ones (sample-level ε differs per client), not of a draw among all."""
    from fedlt.run import parts
    from fedlt.run.loop import RoundLoop
    from fedlt.uploads import UploadRunner

    asked, drawn = [], []
    prospective, sample = UploadRunner.prospective_epsilon, RoundLoop.sample
    monkeypatch.setattr(UploadRunner, "prospective_epsilon", lambda self, c: asked.append(list(c)) or prospective(self, c))
    monkeypatch.setattr(RoundLoop, "sample", lambda self, r: drawn.append(sample(self, r)) or drawn[-1])
    cfg = RunConfig(**(BASE | {"clients": 4, "participation": 0.5, "local_epochs": None, "local_iters": 2}), rounds=3,
                    availability={"name": "bernoulli", "p": 0.5, "when": "before"}, stop_at_epsilon=1e6,
                    out=tmp_path / "run")
    run(cfg)
    assert [list(parts.sample_clients(4, 0.5, cfg.seeds.sampling, r)) for r in range(3)] != drawn  # availability acted
    assert asked == drawn


def test_the_budget_stops_a_client_level_run_too(tmp_path):
    """local(...): ε after r rounds is dp-accounting's for r Gaussian releases; a budget between
    rounds 2 and 3 stops a 4-round run after round 2."""
    cfg = RunConfig(**(BASE | {"privacy": "local(clip=1.0, noise_multiplier=2.0)"}), rounds=4,
                    stop_at_epsilon=(P.epsilon(2.0, 2, 1, 1, 2 ** -1.1) + P.epsilon(2.0, 3, 1, 1, 2 ** -1.1)) / 2,
                    out=tmp_path / "run")
    summary = run(cfg)
    assert summary["rounds"] == 2 and summary["privacy"]["epsilon"] == P.epsilon(2.0, 2, 1, 1, 2 ** -1.1)


@pytest.mark.parametrize("spec, words", [
    ("sample_level(clip=0, noise_multiplier=1.0)", "clip"),
    ("sample_level(clip=1.0, noise_multiplier=-1)", "noise_multiplier"),
    ("sample_level(clip=1.0) + client_level(clip=1.0)", "one mechanism a run"),
])
def test_hostile_settings_are_refused_in_one_line(spec, words):
    with pytest.raises(ValueError, match=words) as info:
        RunConfig(**(BASE | {"privacy": spec}))
    assert words in str(info.value)


def test_stop_at_epsilon_needs_a_mechanism():
    with pytest.raises(ValueError, match="stop_at_epsilon: needs a --privacy mechanism"):
        RunConfig(**(BASE | {"privacy": None}), stop_at_epsilon=2.0)


def test_what_cannot_take_per_sample_gradients_is_refused(tmp_path):
    """Split learning's local update is not a step on a model's loss (refused before anything is
    written); a BatchNorm model has no per-sample gradients; a stateful loss term is named."""
    import fedlt.algorithms
    from fedlt.algorithms.private import sample_level_reason
    from fedlt.engine import prepare

    with pytest.raises(FedltError, match="sample_level .* not available for algorithm 'scala': .*not fedlt's standard"):
        prepare(RunConfig(**(BASE | {"algorithm": "scala", "local_epochs": None, "split": "1"}), rounds=1, out=tmp_path / "x"))
    assert "BatchNorm1d: per-sample gradients are undefined" in sample_level_reason(
        fedlt.algorithms.create("fedavg"), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert sample_level_reason(fedlt.algorithms.create("fedvls"), _mlp()) is None
    assert "MoonUpdate overrides ClientUpdate.terms" in sample_level_reason(fedlt.algorithms.create("moon"), _mlp())
    # SAM's two-pass step (its ascent hook): DP-SGD's private step would silently drop it
    assert "SamUpdate overrides ClientUpdate.ascent" in sample_level_reason(fedlt.algorithms.create("fedsam"), _mlp())
    with pytest.raises(FedltError, match="'fedgrab': its loss 'fedgrab' has term.* keeping state"):
        prepare(RunConfig(**(BASE | {"algorithm": "fedgrab"}), rounds=1, out=tmp_path / "sgb"))


@pytest.mark.parametrize("name", ["moon", "feddecorr", "fedlf", "fedrod", "fedproto"])
def test_a_variant_with_a_term_of_its_own_is_refused(name):
    """DP-SGD's per-sample loss is the objective alone: a variant adding a term (``terms``: MOON's
    contrastive term, FedProto's prototype distance, ...) would silently train as FedAvg."""
    import fedlt.algorithms
    from fedlt.algorithms.private import sample_level_reason

    assert "overrides ClientUpdate.terms" in (sample_level_reason(fedlt.algorithms.create(name), _mlp()) or "")

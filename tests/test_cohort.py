"""``--cohort N`` (fedlt.algorithms.cohort): the FedAvg family's participants trained together in
one vmapped step equal the sequential path (the contract, over the registry)."""

import pytest
import torch
from torch import nn

import fedlt.algorithms
from fedlt.algorithms.cohort import cohort_reason, running_names, with_cohort
from fedlt.algorithms.fedavg_family import FedAvgFamily
from fedlt.algorithms.protocol import LocalRunner
from fedlt.testing import check_cohort
from fedlt.testing.cohort import largest_gap

import cheap

FEDAVG_FAMILY = [n for n in fedlt.algorithms.REGISTRY.list()
                 if isinstance(fedlt.algorithms.create(n), fedlt.algorithms.fedavg_family.Federated)]


def test_the_family_is_found():
    assert {"fedavg", "fedprox", "fedlc", "fedvls", "fedgrab", "scaffold", "feddyn", "fednova", "moon"} <= set(FEDAVG_FAMILY)


# FedLoGe's float32 contract crosses a ReLU's kink: on client 4's 9th step by epochs a hidden unit's
# pre-activation is 3.7e-9 in the batched matmul and <= 0 alone, which moves that step's gradient
# 6.7e-3 and l_head 4.5e-4 two rounds on; in float64 cohort and sequential agree to 8e-17
FLOAT64 = {"fedloge", "fedrela"}
COHORT_PARAMS = {"fedrela": {"relabel_start": 1}}  # round 2 relabelled (the default starts at 90 % of the rounds)
# 200 training samples, not TINY's 600: 5 clients of 27 to 45 samples (the dirichlet draw), so by epochs
# (batches of 8) clients take 4 or 6 steps (masked in a group) and end on partial batches, and by
# iterations each has its own B_k; a third of the steps the sweep took with 600 (-60 s a suite)
SWEEP = {"train_limit": 200}


@pytest.mark.parametrize("name", FEDAVG_FAMILY)
def test_cohort_equals_sequential(name):
    # CReFF's, CCVR's and FedLoGe's server-side sizes cut (tests/cheap.py)
    check_cohort(name, cheap.params(name) | COHORT_PARAMS.get(name, {}), float64=name in FLOAT64, **SWEEP)


@pytest.mark.parametrize("name,why", [("feddecorr", "amplifies float32 rounding itself"),
                                      ("fedgela", "amplifies rounding itself")])
def test_what_cannot_be_vmapped_says_why(name, why):
    algorithm = fedlt.algorithms.create(name)
    assert why in cohort_reason(algorithm, nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["moon", "fedrod", "fedlf", "fedproto", "fedrep", "ditto", "fedper", "apfl", "ccvr",
                                  "fedloge", "fedrela", "fedsam", "fedyoyo"])
def test_what_now_runs_batched(name):
    # the terms hook (a representation, a second head, reference forwards), phases, SAM's ascent,
    # FedYoYo's step_input (two views) and without_loop (its measuring task), FedReLa's AroundUpdate
    assert cohort_reason(fedlt.algorithms.create(name), nn.Sequential(nn.Flatten(), nn.Linear(2, 2))) is None


class _FunctionalDropout(nn.Module):
    def forward(self, x):
        return nn.functional.dropout(x, 0.5, self.training)


def test_models_drawing_randomness_or_a_cumulative_batchnorm_fall_back():
    plain = fedlt.algorithms.create("fedavg")
    assert cohort_reason(plain, nn.Sequential(nn.Linear(2, 2))) is None
    assert cohort_reason(plain, nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))) is None
    tracking = nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, track_running_stats=True))
    assert cohort_reason(plain, tracking, torch.zeros(1, 1, 5, 5)) is None
    assert running_names(tracking) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert "momentum=None" in cohort_reason(plain, nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, momentum=None)))
    assert "Dropout" in cohort_reason(plain, nn.Sequential(nn.Dropout(0.5)))
    # the probe's forward passes BatchNorm batched buffers, so it reaches randomness behind one
    behind = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), _FunctionalDropout())
    assert "random operation" in cohort_reason(plain, behind, torch.ones(1, 2))
    assert "split learning" in cohort_reason(fedlt.algorithms.create("scala"), nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["fedavg", "apfl"])
def test_batchnorm_keeps_each_clients_running_statistics(name):
    """ResNet-8 (its smallest scaling) in float64: its float32 training amplifies rounding past 1e-5 on
    the sequential path alone. 3 clients of unequal sizes, so groups where only some step occur: a
    cohort that drops a partial group's statistics, or APFL's second forward's, fails."""
    check_cohort(name, model="resnet8(scaling=1)", clients=3, size=3, train_limit=24, float64=True)


def test_off_by_default_and_a_checked_setting(resolved):
    runner = LocalRunner()
    assert with_cohort(runner, 1) is runner
    assert resolved("--cohort", "10").cohort == 10
    from fedlt.config import RunConfig

    assert RunConfig().cohort == 1
    with pytest.raises(ValueError, match="cohort"):
        RunConfig(cohort=0)


def test_the_gap_measure_sees_a_difference():
    a = {"w": torch.ones(3), "m": [1.0, 2.0]}
    assert largest_gap(a, a)[0] == 0
    assert largest_gap({"w": torch.ones(3) * (1 + 3e-5), "m": [1.0, 2.0]}, a) [1] == ".w"
    assert largest_gap({"w": torch.ones(3) * (1 + 3e-5), "m": [1.0, 2.0]}, a)[0] == pytest.approx(3e-5, rel=1e-2)


class _Unequal(FedAvgFamily):
    """A broken cohort would show here: the contract must be able to fail."""


def test_the_contract_can_fail(monkeypatch):
    from fedlt.algorithms import cohort
    from fedlt.testing import ContractError

    real = cohort.Cohort._sgd

    def skewed(self, ks, index, leaves, grads):  # a cohort that steps 1% too far
        real(self, ks, index, leaves, [None if g is None else g * 1.01 for g in grads])

    monkeypatch.setattr(cohort.Cohort, "_sgd", skewed)
    # a gap, not an error (a patch of the wrong signature failed [same as sequential] with a TypeError);
    # at the sweep's sizes, so the failure is seen where the registry is checked
    with pytest.raises(ContractError, match=r"\[same as sequential\]: by iterations: relative gap"):
        check_cohort(_Unequal, **SWEEP)


def test_a_run_with_cohort_equals_the_sequential_run(tmp_path):
    from fedlt.config import RunConfig
    from fedlt.engine import run
    from fedlt.testing.algorithms import TINY

    settings = dict(TINY, model="mlp", algorithm="fedprox", rounds=2, local_epochs=1, batch_size=8)
    one = run(RunConfig(**settings, out=tmp_path / "one"))
    many = run(RunConfig(**settings, cohort=3, out=tmp_path / "many"))
    assert many["final"]["loss"] == pytest.approx(one["final"]["loss"], abs=1e-5)
    assert many["final"]["accuracy"] == one["final"]["accuracy"]
    assert many["cohort_fallback"] is None and "cohort_fallback" not in one  # the cohort ran; none was asked


def test_a_fallback_is_said_once_at_the_start_and_kept_in_the_summary(tmp_path, caplog):
    from fedlt.config import RunConfig
    from fedlt.engine import run
    from fedlt.testing.algorithms import TINY

    settings = dict(TINY, model="mlp", algorithm="feddecorr", rounds=2, cohort=4)
    with caplog.at_level("WARNING", logger="fedlt"):
        summary = run(RunConfig(**settings, out=tmp_path / "run"))
    said = [r.getMessage() for r in caplog.records if r.name == "fedlt"]
    assert len(said) == 1 and said[0].startswith("fedlt: --cohort 4 falls back to one client at a time: ")
    assert "\n" not in said[0] and summary["cohort_fallback"] in said[0]
    assert "FedDecorr" in summary["cohort_fallback"]


def test_phases_continue_each_clients_random_stream():
    """FedRep's and Ditto's second phase draws its augmentation where the first phase's stream
    stopped (as the sequential round, one stream for both phases): a cohort that restarted it fails."""
    check_cohort("ditto", augment="hflip", clients=2, size=2, train_limit=60)


def test_sams_ascent_is_each_clients_own():
    """SAM's ε = ρ·g/‖g‖ with ‖g‖ each client's own norm: a cohort whose ascent took the norm over the
    stacked clients fails the contract (by epochs, where two clients step in one group)."""
    from fedlt.algorithms import stateful
    from fedlt.testing import ContractError

    def pooled(self, grads):
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        return [g * (self.rho / (norm + 1e-12)) for g in grads]

    check_cohort("fedsam", {"rho": 0.5}, clients=2, size=2, train_limit=60)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(ContractError, match="by epochs"):
        patch.setattr(stateful.SamUpdate, "ascent", pooled)
        check_cohort("fedsam", {"rho": 0.5}, clients=2, size=2, train_limit=60)


def test_feddecorrs_and_fedgelas_refusal_is_their_own_sensitivity():
    """FedDecorr and FedGELA stay sequential because their sequential path itself moves far more
    than the contract's 1e-5 from a perturbation of float32's rounding size (1e-7), where FedAvg's
    does not: the premise of their cohort_refusal, measured (fedlt.testing.cohort.sensitivity)."""
    from fedlt.testing.cohort import TOLERANCE, sensitivity

    small = {"clients": 3, "train_limit": 120}
    assert sensitivity("feddecorr", **small) > 100 * TOLERANCE
    assert sensitivity("fedgela", **small) > 100 * TOLERANCE  # its refusal's premise too
    assert sensitivity("fedavg", **small) < TOLERANCE

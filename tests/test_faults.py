"""Federations that survive their clients (issue 22): availability components are deterministic
and have the rates they claim; availability acts before sampling (never sampled) or after it
(dropped during the round); the round policy drops failing, late and non-finite clients under
``drop``, stops under ``stop``, and below ``min_results`` applies nothing and stops with the last
complete round on disk; a resumed run sees the same drops."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedlt.availability
from fedlt import io
from fedlt.config import RunConfig
from fedlt.engine import run, sample_clients
from fedlt.errors import FedltError
from fedlt.faults import RoundIncomplete
from fedlt.testing.engines import differences

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = [{"name": "bernoulli", "p": 0.6}, {"name": "markov", "p_on": 0.5, "p_off": 0.2},
         {"name": "straggler", "fraction": 0.3}, {"name": "scripted", "drops": [[2, 1]], "fails": [[1, 3]]}]


def make(spec: dict):
    spec = dict(spec)
    return fedlt.availability.create(spec.pop("name"), **spec)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(SPECS), st.integers(0, 2**32), st.permutations(list(range(12))))
def test_availability_is_a_function_of_seed_round_and_client_whatever_the_order_asked(spec, seed, order):
    """Two instances, one asked round by round, the other in a shuffled order: the same answers
    (a resumed run, or a client asked out of turn, sees what the uninterrupted run saw)."""
    a, b = make(spec), make(spec)
    forward = {(r, c): (a.available(seed, r, c), a.duration(seed, r, c), a.fault(seed, r, c))
               for r in range(12) for c in range(5)}
    shuffled = {(r, c): (b.available(seed, r, c), b.duration(seed, r, c), b.fault(seed, r, c))
                for r in order for c in reversed(range(5))}
    assert forward == shuffled


def test_bernoulli_markov_and_straggler_have_the_rates_they_claim():
    """Over 400 clients × 50 rounds (a binomial share, 5 standard deviations either way)."""
    def share(flags):
        flags = np.asarray(flags, dtype=float)
        return flags.mean(), 5 * np.sqrt(0.25 / flags.size)

    bern = make({"name": "bernoulli", "p": 0.7})
    mean, tol = share([bern.available(3, r, c) for r in range(50) for c in range(400)])
    assert abs(mean - 0.7) < tol
    markov = make({"name": "markov", "p_on": 0.25, "p_off": 0.1})  # stationary share online 0.25/0.35
    states = np.array([[markov.available(3, r, c) for r in range(50)] for c in range(400)])
    mean, _ = share(states)
    assert abs(mean - 0.25 / 0.35) < 0.03
    # an absence lasts 1/p_on = 4 rounds on average (runs of False cut by the window's end aside)
    runs = [len(run) for row in states for run in "".join("x" if s else "." for s in row[:-1]).split("x") if run]
    assert 3.3 < np.mean(runs) < 4.7
    strag = make({"name": "straggler", "fraction": 0.2, "slowdown": 5, "base": 1.0, "jitter": 0.1})
    slow = [strag.duration(3, 0, c) > 2 for c in range(2000)]
    mean, tol = share(slow)
    assert abs(mean - 0.2) < tol
    assert all(1.0 <= strag.duration(3, r, c) <= 5.5 for r in range(3) for c in range(50))


@pytest.mark.parametrize("spec", ["bernoulli(p=2)", "markov(p_on=0)", "straggler(fraction=-1)",
                                  "scripted(drops=[[0, 1]])", "bernoulli(when='during')", "scripted(fails=[[1.5, 2]])"])
def test_a_bad_availability_is_one_line_naming_it(spec):
    with pytest.raises(ValueError) as info:
        RunConfig(availability=spec)
    assert "availability" in str(info.value) and str(info.value).count("\n") <= 3


def test_min_results_is_a_count_or_a_share():
    assert RunConfig(faults={"min_results": 3}).faults.required(10) == 3
    assert RunConfig(faults={"min_results": 3}).faults.required(2) == 2  # never more than were sampled
    assert RunConfig(faults={"min_results": 0.5}).faults.required(5) == 3
    assert RunConfig(faults={"min_results": 1.0}).faults.required(7) == 7
    assert RunConfig().faults.required(7) == 1
    with pytest.raises(ValueError):
        RunConfig(faults={"min_results": 1.5})


def small(out, **more) -> RunConfig:
    settings = dict(algorithm="fedavg", model="mlp", clients=8, participation=0.5, rounds=3, train_limit=400,
                    test_limit=100, local_iters=2, eval_every=1, partition={"name": "dirichlet", "beta": 1.0, "min_size": 5},
                    faults={"on_failure": "drop"}, out=out)
    return RunConfig(**(settings | more))


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_availability_before_sampling_samples_only_reachable_clients(tmp_path):
    config = small(tmp_path / "before", availability={"name": "bernoulli", "p": 0.5, "when": "before"})
    run(config)
    avail = make({"name": "bernoulli", "p": 0.5})
    for r, row in enumerate(rows(tmp_path / "before")):
        reachable = [c for c in range(8) if avail.available(0, r, c)]
        assert set(row["sampled"]) <= set(reachable) and row["reachable"] == len(reachable)
        assert row["dropped"] == {} and row["sampled"] == row["returned"]
        assert len(row["sampled"]) == min(4, len(reachable))
    # "always" samples exactly what fedlt sampled before availability existed
    assert sample_clients(8, 0.5, 0, 1, available=list(range(8))) == sample_clients(8, 0.5, 0, 1)


def test_failed_non_finite_late_and_unavailable_clients_are_dropped_with_their_reason(tmp_path):
    """One of each in three rounds; the dropped clients' stored states are untouched (fedgrab
    keeps SGB state per client) and the run ends; the same scenario under ``stop`` stops at the
    first failure with its error, naming the client."""
    first, second, third = (sample_clients(8, 0.5, 0, r) for r in range(3))
    scenario = {"name": "scripted", "fails": [[1, first[0]]], "corrupts": [[2, second[0]]], "drops": [[3, third[0]]]}
    config = small(tmp_path / "drop", algorithm="fedgrab", availability=scenario)
    run(config)
    got = rows(tmp_path / "drop")
    assert got[0]["dropped"] == {str(first[0]): f"failed: InjectedFault: injected failure of client {first[0]} in round 1"}
    assert got[1]["dropped"] == {str(second[0]): "failed: its update is not finite"}
    assert got[2]["dropped"] == {str(third[0]): "unavailable"}
    assert all(r["returned"] == [c for c in r["sampled"] if str(c) not in r["dropped"]] for r in got)
    # the client dropped in round 3 keeps exactly its state from the end of round 2
    run(small(tmp_path / "two", algorithm="fedgrab", availability=scenario, rounds=2))
    before = io.load_checkpoint(tmp_path / "two" / "checkpoint.pt")["client_states"].get(third[0], {})
    after = io.load_checkpoint(tmp_path / "drop" / "checkpoint.pt")["client_states"].get(third[0], {})
    assert not differences(before, after, 0.0)
    with pytest.raises(Exception, match=f"injected failure of client {first[0]}"):
        run(small(tmp_path / "stop", algorithm="fedgrab", availability=scenario, faults={"on_failure": "stop"}))


def test_stragglers_past_the_deadline_are_late(tmp_path):
    config = small(tmp_path / "late", availability={"name": "straggler", "fraction": 0.5, "slowdown": 10},
                   faults={"on_failure": "drop", "round_timeout": 3.0})
    run(config)
    strag = make({"name": "straggler", "fraction": 0.5, "slowdown": 10})
    for r, row in enumerate(rows(tmp_path / "late")):
        late = {str(c) for c in row["sampled"] if strag.duration(0, r, c) > 3.0}
        assert set(row["dropped"]) == late and all(v.startswith("late") for v in row["dropped"].values())
    with pytest.raises(FedltError, match="late"):  # under stop, a late client stops the run
        run(small(tmp_path / "stop", availability={"name": "straggler", "fraction": 0.9, "slowdown": 10},
                  faults={"on_failure": "stop", "round_timeout": 3.0}))


@pytest.mark.parametrize("algorithm", ["fedavg", "scala"])
def test_a_round_below_min_results_is_not_applied_and_the_run_resumes_exactly(tmp_path, algorithm):
    """Round 3 loses all but one client (SCALA's leave mid-exchange, after the server stepped):
    with min_results=2 the run stops, the checkpoint on disk is round 2's exactly (checkpoint_every=3:
    it was not on disk before the failed round), and a resume with min_results=1 ends like a run
    that had min_results=1 from the start."""
    sampled = sample_clients(8, 0.5, 0, 2)
    scenario = {"name": "scripted", "drops": [[3, c] for c in sampled[1:]]}
    extra = dict(split="s2", server_batch=32) if algorithm == "scala" else {}
    if algorithm == "scala":
        extra["model"] = "alexnet"
    cut = small(tmp_path / "cut", algorithm=algorithm, availability=scenario, checkpoint_every=3,
                faults={"on_failure": "drop", "min_results": 2, "on_short": "stop"}, **extra)
    with pytest.raises(RoundIncomplete, match="round 3: 1 of 4 sampled client"):
        run(cut)
    run(small(tmp_path / "two", algorithm=algorithm, availability=scenario, rounds=2, **extra))
    on_disk = io.load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    reference = io.load_checkpoint(tmp_path / "two" / "checkpoint.pt")
    assert on_disk["round"] == 2
    for part in ("algorithm", "client_states"):
        assert not differences(on_disk[part], reference[part], 0.0), part
    run(cut.model_copy(update={"faults": cut.faults.model_copy(update={"min_results": 1})}), resume=True)
    run(small(tmp_path / "whole", algorithm=algorithm, availability=scenario, checkpoint_every=3, **extra))
    ends = [io.load_checkpoint(tmp_path / d / "checkpoint.pt") for d in ("cut", "whole")]
    for part in ("algorithm", "client_states"):
        assert not differences(ends[0][part], ends[1][part], 0.0), part
    assert [r["returned"] for r in rows(tmp_path / "cut")] == [r["returned"] for r in rows(tmp_path / "whole")]
    assert torch.is_tensor(ends[0]["algorithm"]["model"][next(iter(ends[0]["algorithm"]["model"]))])


def test_fedlt_report_shows_the_rounds_that_lost_clients(tmp_path, capsys):
    from fedlt.cli import main

    scenario = {"name": "scripted", "drops": [[2, sample_clients(8, 0.5, 0, 1)[0]]]}
    run(small(tmp_path / "lossy", availability=scenario, eval_every=3))
    run(small(tmp_path / "whole", rounds=1))
    main(["report", str(tmp_path / "lossy"), str(tmp_path / "whole")])
    out = capsys.readouterr().out
    lost = [line for line in out.splitlines() if "unavailable" in line]
    assert len(lost) == 1 and "lossy" in lost[0] and "3/4" in lost[0]  # round 2 (not an evaluated round)
    assert f"{scenario['drops'][0][1]}: unavailable" in lost[0]


def test_a_short_round_is_skipped_by_default_and_the_run_goes_on_and_resumes_exactly(tmp_path):
    """Issue 35: under markov availability a round whose sampled clients are all unavailable
    (below min_results=1) is skipped: its row says why, the global model and the client states
    stay as they were, the run goes on; stopped after the skipped round and resumed, it ends as
    the whole run does. ``on_short="stop"`` keeps the old stop."""
    markov = {"name": "markov", "p_on": 0.3, "p_off": 0.5}
    avail = fedlt.availability.REGISTRY.create("markov", p_on=0.3, p_off=0.5)
    short = [r + 1 for r in range(4) if not any(avail.available(0, r, c) for c in sample_clients(8, 0.5, 0, r))]
    assert short == [2]  # the case the issue reports: a round with no sampled client available
    whole = small(tmp_path / "whole", availability=markov, rounds=4)
    run(whole)
    skipped = {r["round"]: r.get("skipped") for r in rows(tmp_path / "whole")}
    assert [r for r, why in skipped.items() if why] == short
    assert "0 of 4 sampled client" in skipped[2] and "accuracy" in rows(tmp_path / "whole")[1]
    run(small(tmp_path / "one", availability=markov, rounds=1))
    run(small(tmp_path / "two", availability=markov, rounds=2))
    one, two = (io.load_checkpoint(tmp_path / d / "checkpoint.pt") for d in ("one", "two"))
    for part in ("algorithm", "client_states"):
        assert not differences(one[part], two[part], 0.0), part  # the skipped round changed nothing
    cut = small(tmp_path / "cut", availability=markov, rounds=2)
    run(cut)
    run(cut.model_copy(update={"rounds": 4}), resume=True)
    ends = [io.load_checkpoint(tmp_path / d / "checkpoint.pt") for d in ("cut", "whole")]
    for part in ("algorithm", "client_states"):
        assert not differences(ends[0][part], ends[1][part], 0.0), part
    with pytest.raises(RoundIncomplete, match="round 2: 0 of 4 sampled client"):
        run(small(tmp_path / "stop", availability=markov, rounds=4,
                  faults={"on_failure": "drop", "on_short": "stop"}))

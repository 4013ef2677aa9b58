"""Checkpoint and exact resume (SPEC §6): a run killed at any point and resumed ends exactly where
the same run uninterrupted ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import without_timings

import fedlt.aggregators
import fedlt.engine
import fedlt.run.evaluation
import fedlt.run.parts
from fedlt import io
from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.engine import RunStopped, run, sample_clients
from fedlt.errors import FedltError


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


TINY = ["--train-limit", "2000", "--test-limit", "100", "--clients", "10", "--participation", "0.3", "--rounds", "4",
        "--local-iters", "2", "--server-batch", "32", "--eval-every", "1", "--quiet"]
# one thread in and out of process (see one_thread): float reductions may be split by thread
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def fedlt_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedlt.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def checkpoint_round(out: Path) -> int:
    try:
        return json.loads((out / "checkpoint.json").read_text())["round"]
    except (OSError, ValueError):  # not written yet (it is replaced atomically, never torn)
        return 0


def summary_without_time(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("wall_time_s")
    return summary


# fedgrab: SGB's per-client state and gating RNG; SCALA with clients dropping out mid-exchange
# (server optimiser state, drops drawn per round); SCAFFOLD with clients that stay away for a while
# (control variates; the Markov chain's state re-derived on resume)
KILLED = {"fedgrab": ["--algo", "fedgrab"],
          "scala": ["--algo", "scala", "--availability", "bernoulli(p=0.7)", "--on-failure", "drop"],
          "scaffold": ["--algo", "scaffold", "--model", "mlp", "--availability", "markov(p_on=0.8, p_off=0.3)",
                       "--on-failure", "drop"]}


def test_sigkill_then_resume_ends_exactly_like_the_uninterrupted_run(tmp_path):
    # the runs side by side: each process uses one thread, so they share the cores instead of queueing
    victims = {a: fedlt_process("run", *flags, *TINY, "--out", str(tmp_path / a / "killed")) for a, flags in KILLED.items()}
    deadline = time.monotonic() + 240
    pending = set(KILLED)
    while pending and time.monotonic() < deadline:
        for a in list(pending):
            if checkpoint_round(tmp_path / a / "killed") >= 2 or victims[a].poll() is not None:
                victims[a].send_signal(signal.SIGKILL)  # no handler can run: files stay as the kill left them
                pending.discard(a)
        time.sleep(0.02)
    for a in KILLED:
        killed = tmp_path / a / "killed"
        victims[a].communicate()
        assert victims[a].returncode == -signal.SIGKILL, f"{a}: the run ended before it could be killed"
        assert not (killed / "summary.json").exists()
        assert 2 <= checkpoint_round(killed) < 4

    for a, flags in KILLED.items():
        reference, killed = tmp_path / a / "reference", tmp_path / a / "killed"
        main(["run", "--resume", str(killed), "--quiet"])  # in this process: only the kill needs another
        main(["run", *flags, *TINY, "--out", str(reference)])  # the same run in one go
        assert summary_without_time(killed) == summary_without_time(reference), a
        assert without_timings(killed) == without_timings(reference), a
        rows = without_timings(reference)
        assert len(rows) == 4
        assert io.load_checkpoint(killed / "checkpoint.pt")["round"] == 4
        if a != "fedgrab":  # the rows name who dropped out, and some did (p = 0.7 / a Markov chain, 4 rounds)
            assert any(r["dropped"] for r in rows) and all(set(r["dropped"]) <= set(map(str, r["sampled"])) for r in rows)


def small_config(out: Path, **overrides) -> RunConfig:
    settings = dict(algorithm="fedgrab", model="mlp", train_limit=1200, test_limit=200, clients=6,
                    participation=0.5, rounds=4, local_iters=2, server_batch=48, eval_every=1,
                    partition={"name": "dirichlet", "beta": 0.5, "min_size": 5}, out=out)
    return RunConfig(**(settings | overrides))


def test_sigterm_finishes_the_round_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    reference = run(small_config(tmp_path / "reference"))

    def sample_then_terminate(num_clients, participation, seed, round_index):
        if round_index == 1:  # the signal lands inside round 2, which must still complete
            os.kill(os.getpid(), signal.SIGTERM)
        return sample_clients(num_clients, participation, seed, round_index)

    monkeypatch.setattr(fedlt.run.parts, "sample_clients", sample_then_terminate)
    handler_before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "stopped"
    with pytest.raises(RunStopped) as info:
        run(small_config(out, checkpoint_every=3))
    # checkpoint_every=3 would not have saved round 2: the signal did, after finishing it
    assert info.value.round == 2 and io.load_checkpoint(out / "checkpoint.pt")["round"] == 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the run's handler is removed again
    monkeypatch.undo()
    resumed = run(small_config(out, checkpoint_every=3), resume=True)
    resumed.pop("wall_time_s"), reference.pop("wall_time_s")
    assert resumed == reference
    assert without_timings(out) == without_timings(tmp_path / "reference")


def test_a_run_killed_before_its_first_checkpoint_resumes_from_the_start(tmp_path):
    reference = run(small_config(tmp_path / "reference", rounds=2))
    out = tmp_path / "early"
    run(small_config(out, rounds=2))
    (out / "checkpoint.pt").unlink()
    (out / "checkpoint.json").unlink()
    (out / "summary.json").unlink()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "accur')  # the torn line a kill during a write leaves
    resumed = run(small_config(out, rounds=2), resume=True)
    resumed.pop("wall_time_s"), reference.pop("wall_time_s")
    assert resumed == reference
    assert without_timings(out) == without_timings(tmp_path / "reference")


def test_resume_may_extend_rounds_but_not_change_results_settings(tmp_path, capsys):
    out = tmp_path / "run"
    run(small_config(out, rounds=2))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as info:
        main(["run", "--resume", str(out), "--lr", "0.5", "--quiet"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optimiser.lr" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing rewritten

    main(["run", "--resume", str(out), "--rounds", "3", "--quiet"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert json.loads((out / "config.json").read_text())["rounds"] == 3
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3


def test_a_new_run_refuses_a_directory_that_holds_one(tmp_path):
    out = tmp_path / "run"
    run(small_config(out, rounds=1))
    with pytest.raises(FedltError, match="already holds a run"):
        run(small_config(out, rounds=1))


# Every registered algorithm's exact resume: fedlt.testing.check_algorithm (tests/test_contracts.py).


@pytest.mark.parametrize("algo", ["fedavg", "scala"])
@pytest.mark.parametrize("aggregator", fedlt.aggregators.list())
def test_every_aggregator_state_resumes_exactly(algo, aggregator, tmp_path):
    """Server momentum and Adam moments are part of the strategy's checkpointed state: a run cut
    after round 1 and resumed ends byte-identical to the run in one go (registry-driven)."""
    settings = dict(algorithm=algo, algorithm_params={"aggregator": aggregator}, model="mlp", split="1",
                    train_limit=600, test_limit=100, clients=6, participation=0.5, local_iters=2, server_batch=12,
                    eval_every=1, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})
    reference = run(RunConfig(**settings, rounds=3, out=tmp_path / "reference"))
    run(RunConfig(**settings, rounds=1, out=tmp_path / "cut"))
    resumed = run(RunConfig(**settings, rounds=3, out=tmp_path / "cut"), resume=True)
    resumed.pop("wall_time_s"), reference.pop("wall_time_s")
    assert resumed == reference
    assert without_timings(tmp_path / "cut") == without_timings(tmp_path / "reference")


def test_fedavgm_without_momentum_and_unit_server_lr_is_fedavg_exactly(tmp_path):
    settings = dict(algorithm="fedavg", model="mlp", train_limit=600, test_limit=100, clients=6, participation=0.5,
                    local_iters=2, server_batch=12, eval_every=1, rounds=2, partition={"name": "iid"})
    run(RunConfig(**settings, out=tmp_path / "fedavg"))
    run(RunConfig(**settings, algorithm_params={"aggregator": {"name": "fedavgm", "beta": 0.0, "eta": 1.0}},
                  out=tmp_path / "fedavgm"))
    assert without_timings(tmp_path / "fedavg") == without_timings(tmp_path / "fedavgm")
    # with momentum it is another algorithm (the comparison has power)
    run(RunConfig(**settings, algorithm_params={"aggregator": "fedavgm"}, out=tmp_path / "momentum"))
    assert without_timings(tmp_path / "fedavg") != without_timings(tmp_path / "momentum")

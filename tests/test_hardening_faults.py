"""Hardening of the run's fault settings (issue 35): a scripted failure under ``--on-failure
stop`` ends the run in one line (not an InjectedFault traceback), scripted faults naming a client
or a round the run does not have are refused naming the bound, and ``workers`` is bounded. Every
refusal: exit 2, one stderr line, nothing created. The CLI runs in-process (tests/
test_hostile_inputs.py's way)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fedlt.cli import main
from fedlt.config import MAX_WORKERS, RunConfig
from fedlt.errors import ProcessLost, describe

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = ["--algo", "fedavg", "--model", "mlp", "--partition", "iid", "--train-limit", "200", "--test-limit", "50",
        "--clients", "5", "--participation", "1.0", "--rounds", "2", "--local-iters", "1", "--server-batch", "20",
        "--eval-every", "1", "--quiet"]


def one_line_exit_2(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("algorithm, fails, round_done", [("fedavg", [[1, 2]], None), ("fedavg", [[2, 0]], 1),
                                                          ("scala", [[1, 3]], None)])
def test_a_scripted_failure_under_on_failure_stop_is_one_line(tmp_path, capsys, algorithm, fails, round_done):
    out = tmp_path / "run"
    argv = [*TINY, "--algo", algorithm, "--availability", f"scripted(fails={fails})", "--on-failure", "stop"]
    if algorithm == "scala":
        argv = [*argv, "--model", "alexnet"]
    err = one_line_exit_2(["run", *argv, "--out", str(out)], capsys)
    (r, c), = fails
    assert f"injected failure of client {c} in round {r}" in err and "on_failure=stop" in err, err
    kept = f"the last checkpoint (round {round_done}) is kept" if round_done else "no checkpoint had been written"
    assert kept in err, err


SCRIPTED_OUT_OF_RANGE = [("fails", [[1, 99]], "client 99", "5 client(s): 0 to 4"),
                         ("drops", [[99, 0]], "round 99", "2 round(s): 1 to 2"),
                         ("corrupts", [[3, 1]], "round 3", "2 round(s): 1 to 2"),
                         ("drops", [[2, 5]], "client 5", "5 client(s): 0 to 4")]


@pytest.mark.parametrize("field, pairs, named, bound", SCRIPTED_OUT_OF_RANGE)
def test_scripted_faults_outside_the_run_are_refused_naming_the_bound(tmp_path, capsys, field, pairs, named, bound):
    out = tmp_path / "run"
    err = one_line_exit_2(["run", *TINY, "--availability", f"scripted({field}={pairs})", "--out", str(out)], capsys)
    assert f"{field} names {named}" in err and bound in err, err
    assert not out.exists()
    spec = {"name": "scripted", field: pairs}
    if named.startswith("client"):  # never a client of this run, whatever happens to it
        with pytest.raises(ValidationError, match=bound.replace("(", r"\(").replace(")", r"\)")):
            RunConfig(clients=5, rounds=2, availability=spec)
    else:  # a run cut early and resumed with more rounds keeps its later faults: refused for a new CLI run only
        assert RunConfig(clients=5, rounds=2, availability=spec).availability == spec


def test_scripted_faults_inside_the_run_are_accepted_at_the_edges():
    config = RunConfig(clients=5, rounds=2, availability="scripted(fails=[[2, 4]], drops=[[1, 0]])")
    assert config.availability["fails"] == [[2, 4]]


HUGE = 10**30
WORKERS = [(HUGE, "about 1e30"), (10**5000, "about 1e5000"), ("1" * 5000, "111"), (MAX_WORKERS + 1, str(MAX_WORKERS + 1)),
           (0, "got 0"), (-3, "got -3"), ("²", "'²'"), ("2.5", "'2.5'"), (2.0, "2.0"), (None, "None")]


@pytest.mark.parametrize("value, shown", WORKERS, ids=[f"w{k}" for k in range(len(WORKERS))])
def test_workers_beyond_the_bound_or_not_a_count_are_one_line(value, shown):
    with pytest.raises(ValidationError) as info:
        RunConfig(workers=value)
    message = describe(info.value)
    assert message.startswith("workers: must be a number of processes") and shown in message, message
    assert len(message) < 200, message  # a 5000-digit value is cut, never printed whole


@pytest.mark.parametrize("value, expected", [(1, 1), (MAX_WORKERS, MAX_WORKERS), ("16", 16), (" 0007 ", 7),
                                             ("auto", "auto")])
def test_workers_within_the_bound_are_kept(value, expected):
    assert RunConfig(workers=value).workers == expected


def test_workers_beyond_the_bound_on_the_cli_creates_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    err = one_line_exit_2(["run", *TINY, "--workers", str(HUGE), "--out", str(out)], capsys)
    assert f"from 1 to {MAX_WORKERS}" in err and not out.exists()


def test_a_dead_worker_process_is_one_line_and_exit_code_1(tmp_path, capsys, monkeypatch):
    """Issue 35: a worker process that died (ProcessLost, tests/test_parallel.py makes one) ends the
    run in one line naming it and what is on disk, exit 1 — not "stopped" / 130, not a traceback."""
    import fedlt.engine

    def dies(config, **kwargs):
        raise ProcessLost("client 3: its worker was lost twice (worker 1 (pid 4242) died (killed by SIGKILL))")

    monkeypatch.setattr(fedlt.engine, "run", dies)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["run", *TINY, "--workers", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 1, err
    assert len(err.splitlines()) == 1 and err.startswith("error: client 3") and "Traceback" not in err, err
    assert "worker 1 (pid 4242) died (killed by SIGKILL)" in err and "no checkpoint had been written" in err, err

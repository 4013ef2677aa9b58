"""Clients in worker processes (issue 24, fedlt.parallel): bit-identical to one process for every
registered algorithm; the evaluation overlapped with the next round without changing a number;
a worker that dies is replaced and its work re-run (a split session replayed), a task whose
worker dies twice is a ClientFailure; the client work's own errors arrive as themselves; the
layouts of tensors survive the wire. One pool of workers serves the whole module."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedlt.algorithms
import fedlt.engine
from fedlt import io, wire
from fedlt.algorithms.protocol import ClientFailure
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.errors import FedltError, ProcessLost
from fedlt.parallel import ParallelRunner, WorkerPool, pack, resolve_workers, shared_train_set
from fedlt.start_method import alive
from fedlt.testing import check_parallel
from fedlt.testing.algorithms import TINY
from fedlt.testing.engines import differences

import cheap
from conftest import without_timings

DROPOUT = {"model": "tiny_cnn(width=4, dropout=0.5)"}  # the example plugin's model: torch's generator in client work


@pytest.fixture(scope="module")
def pool(one_thread):
    with WorkerPool(2) as workers:
        yield workers


def same_end(a, b) -> list[str]:
    """Differences between two runs' final checkpoints (model, server and client states), exact."""
    x, y = (io.load_checkpoint(d / "checkpoint.pt") for d in (a, b))
    return [*differences(x["algorithm"], y["algorithm"], 0.0, rtol=0.0),
            *differences(x["client_states"], y["client_states"], 0.0, rtol=0.0)]


def test_every_registered_algorithm_is_bit_identical_with_two_workers(pool):
    """The contract over every registered algorithm (built-ins and the example plugin's), a
    stateful loss kept per client and models drawing from torch's generator in client work; each
    round's checkpoint compared, the overlapped evaluation's snapshot included."""
    cases = [*cheap.cases(fedlt.algorithms.list()), ("scala", {"client_loss": "fedgrab"}),  # tests/cheap.py
             ("fedavg", {}, DROPOUT), ("scaffold", {}, DROPOUT),
             ("fedrep", {}, {"new_clients": 2})]  # clients that never train, evaluated in the workers (issue 44)
    assert "example_fedcm" in cases and "scala" in cases
    # 200 training and 40 test images, not TINY's 600 and 100: every client and its matched test set
    # are still a function of its task alone, each round still evaluated while the next trains (the
    # snapshot's rows and checkpoints compared), at two thirds of the time (-30 s on one core)
    check_parallel(cases, pool=pool, train_limit=200, test_limit=40)


def test_the_contract_catches_a_runner_that_changes_a_result(pool, tmp_path, monkeypatch):
    """check_parallel is not vacuous: a worker result nudged by one ulp fails it, naming the property."""
    import fedlt.parallel.runner
    from fedlt.testing import ContractError

    real = fedlt.parallel.runner.unpack

    def nudged(packed, device="cpu"):
        value = real(packed, device)
        if hasattr(value, "weights") and hasattr(value, "num_samples"):  # a ClientResult
            first = next(iter(value.weights))
            value.weights[first] = torch.nextafter(value.weights[first], torch.full_like(value.weights[first], 9.0))
        return value

    monkeypatch.setattr(fedlt.parallel.runner, "unpack", nudged)  # where the runner reads the workers' results
    with pytest.raises(ContractError, match=r"algorithm 'fedavg' breaks \[bit-identical with workers\]"):
        check_parallel(["fedavg"], pool=pool, rounds=1)


def test_a_killed_worker_is_replaced_and_its_clients_rerun(pool, tmp_path):
    """FedAvg and SCALA: a worker killed between rounds (FedAvg) and in the middle of a round's
    sessions (SCALA: between two forward calls) is replaced; the runs end exactly where the
    one-process runs do."""
    before = pool.replaced
    fedavg = dict(TINY, algorithm="fedavg", model="mlp", rounds=3)  # row 1 closes after round 2 trains: round 3 meets the dead worker
    run(RunConfig(**fedavg, out=tmp_path / "fedavg-1"))

    def kill_worker_0(done, row):
        if done == 1:
            os.kill(pool.procs[0].process.pid, signal.SIGKILL)

    run(RunConfig(**fedavg, workers=2, out=tmp_path / "fedavg-2"), runner=ParallelRunner(pool), on_round=kill_worker_0)
    assert pool.replaced == before + 1
    assert same_end(tmp_path / "fedavg-1", tmp_path / "fedavg-2") == []

    class KillsMidRound(ParallelRunner):
        def exchange(self, algorithm, tasks):
            sessions = super().exchange(algorithm, tasks)
            calls = {"n": 0}
            forward = sessions.forward

            def forward_then_kill():
                calls["n"] += 1
                if calls["n"] == 2:  # the sessions on worker 1 have run one step: lose them
                    os.kill(pool.procs[1].process.pid, signal.SIGKILL)
                return forward()

            sessions.forward = forward_then_kill
            return sessions

    scala = dict(TINY, algorithm="scala", model="alexnet", rounds=1)
    run(RunConfig(**scala, out=tmp_path / "scala-1"))
    run(RunConfig(**scala, workers=2, out=tmp_path / "scala-2"), runner=KillsMidRound(pool))
    assert pool.replaced == before + 2
    assert same_end(tmp_path / "scala-1", tmp_path / "scala-2") == []


def test_a_task_whose_worker_dies_twice_is_a_client_failure(pool, monkeypatch):
    """A task whose worker dies each time (killed by its pid, the task in flight): a ClientFailure
    naming the client, after one re-run; the pool is whole again afterwards (both workers answer)."""
    before = pool.replaced
    send = pool._send

    def kill_then_send(i, message):
        if message[0] == "call":  # the worker is dead when its task goes out: lost with it in flight
            os.kill(pool.procs[i].process.pid, signal.SIGKILL)
            pool.procs[i].process.join(10)
        send(i, message)

    monkeypatch.setattr(pool, "_send", kill_then_send)
    out = pool.map_calls([pack(None, "x")], [1], [7])
    monkeypatch.undo()
    assert len(out) == 1 and isinstance(out[0], ClientFailure)
    assert out[0].cid == 7 and out[0].reason.startswith("failed: its worker was lost twice")
    assert pool.replaced == before + 2
    assert all(pool._ask(i, ("ping",), 60, "pinging") == pool.procs[i].process.pid for i in range(pool.size))


def test_a_worker_lost_twice_ends_the_run_in_one_line_naming_what_died(pool, tmp_path, monkeypatch):
    """Issue 35: a worker killed twice under on_failure=stop is not a stop asked by a signal nor
    the user's input: ProcessLost (exit code 1), one line naming the client, the worker and how
    it died; the pool is whole again afterwards."""
    send = pool._send

    def kill_then_send(i, message):
        if message[0] == "call":
            os.kill(pool.procs[i].process.pid, signal.SIGKILL)
            pool.procs[i].process.join(10)
        send(i, message)

    monkeypatch.setattr(pool, "_send", kill_then_send)
    with pytest.raises(ProcessLost) as info:
        run(RunConfig(**dict(TINY, algorithm="fedavg", model="mlp", rounds=1), workers=2, out=tmp_path / "r"),
            runner=ParallelRunner(pool))
    monkeypatch.undo()
    line = str(info.value)
    assert info.value.exit_code == 1 and "\n" not in line
    assert "its worker was lost twice" in line and "died (killed by SIGKILL)" in line and "pid" in line, line
    assert all(pool._ask(i, ("ping",), 60, "pinging") == pool.procs[i].process.pid for i in range(pool.size))


def test_a_killed_fork_server_is_named_and_the_run_goes_on_exactly_with_no_traceback(pool, tmp_path, capfd):
    """Issue 35: SIGKILL of the fork server the workers came from: the workers' exits can no longer
    be read, so each is named as the fork server's loss, stopped by its pid and replaced from a new
    fork server; the run ends as in one process and no worker prints a traceback."""
    import multiprocessing.forkserver as forkserver

    server = forkserver._forkserver._forkserver_pid
    assert server and all(p.forked for p in pool.procs)
    old = [p.process.pid for p in pool.procs]
    os.kill(server, signal.SIGKILL)
    pool.procs[0].process.join(10)  # its exit is read through the dead server: unknown (255)
    assert "the fork server of worker 0" in pool.procs[0].why_lost()
    fedavg = dict(TINY, algorithm="fedavg", model="mlp", rounds=1)
    run(RunConfig(**fedavg, out=tmp_path / "one"))
    run(RunConfig(**fedavg, workers=2, out=tmp_path / "two"), runner=ParallelRunner(pool))
    assert same_end(tmp_path / "one", tmp_path / "two") == []
    deadline = time.monotonic() + 10  # stopped by pid; a loaded machine may take a moment to end them
    while any(alive(pid) for pid in old) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in old)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_client_work_errors_arrive_as_themselves_and_the_pool_stays_in_step(pool, tmp_path):
    """A run whose loss overflows raises the same error with workers as in this process; the
    same pool then runs the next run exactly."""
    from fedlt.algorithms.base import NonFiniteLoss

    bad = dict(TINY, algorithm="fedavg", model="mlp", rounds=1, optimiser={"lr": 1e30, "clip": None})
    with pytest.raises(NonFiniteLoss) as here:
        run(RunConfig(**bad, out=tmp_path / "bad-1"))
    with pytest.raises(NonFiniteLoss) as there:
        run(RunConfig(**bad, workers=2, out=tmp_path / "bad-2"), runner=ParallelRunner(pool))
    assert str(there.value).replace("bad-2", "bad-1") == str(here.value)
    good = dict(TINY, algorithm="fedprox", model="mlp", rounds=1)
    run(RunConfig(**good, out=tmp_path / "good-1"))
    run(RunConfig(**good, workers=2, out=tmp_path / "good-2"), runner=ParallelRunner(pool))
    assert same_end(tmp_path / "good-1", tmp_path / "good-2") == []


@pytest.mark.parametrize("algorithm", ["fedavg", "scala"])
def test_under_drop_failing_clients_are_dropped_with_workers_as_in_one_process(pool, tmp_path, algorithm):
    """Under faults.on_failure="drop", a client whose work raises (scripted ``fails``: in a call,
    or in a split session's forward) or returns non-finite weights (``corrupts``) is dropped with
    the same reason as in one process, the others go on, and the run ends bit-identical."""
    first, second = (fedlt.engine.sample_clients(6, 0.5, 0, r) for r in range(2))
    scenario = {"name": "scripted", "fails": [[1, first[1]], [2, second[2]]], "corrupts": [[2, second[0]]]}
    model = {"model": "alexnet", "split": "s2"} if algorithm == "scala" else {"model": "mlp"}
    base = dict(TINY, algorithm=algorithm, rounds=2, availability=scenario, faults={"on_failure": "drop"}, **model)
    run(RunConfig(**base, out=tmp_path / "one"))
    run(RunConfig(**base, workers=2, out=tmp_path / "two"), runner=ParallelRunner(pool, tolerate=True))
    assert same_end(tmp_path / "one", tmp_path / "two") == []
    rows = {d: [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("one", "two")}
    assert [r["dropped"] for r in rows["two"]] == [r["dropped"] for r in rows["one"]]
    assert rows["two"][0]["dropped"] == {
        str(first[1]): f"failed: InjectedFault: injected failure of client {first[1]} in round 1"}
    assert set(rows["two"][1]["dropped"]) == {str(second[0]), str(second[2])}
    assert [r["returned"] for r in rows["two"]] == [[c for c in r["sampled"] if str(c) not in r["dropped"]]
                                                  for r in rows["one"]]


def test_overlapped_evaluation_keeps_rows_order_and_times(pool, tmp_path):
    """Three evaluated rounds with workers: the rows are those of one process (timings aside), in
    round order, each with its own eval_s; the round times add up to the run's wall time."""
    base = dict(TINY, algorithm="fedavg", model="mlp", rounds=3, posthoc=["tau_norm"])
    run(RunConfig(**base, out=tmp_path / "one"))
    seen = []
    summary = run(RunConfig(**base, workers=2, out=tmp_path / "two"), runner=ParallelRunner(pool),
                  on_round=lambda done, row: seen.append(done))
    assert seen == [1, 2, 3]
    assert without_timings(tmp_path / "one") == without_timings(tmp_path / "two")
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["eval_s"] > 0 and "tau_norm_accuracy" in r for r in rows)
    assert abs(sum(r["round_s"] for r in rows) - summary["wall_time_s"]) < 0.01


def test_client_states_in_files_resume_exactly_with_workers(pool, tmp_path):
    """The store stays in the main process: SCAFFOLD's states in files (client_state_memory_mb=0),
    stopped after round 2 in one process and resumed with workers, ends as the run in one go."""
    base = dict(TINY, algorithm="scaffold", model="mlp", rounds=4, client_state_memory_mb=0.0)
    run(RunConfig(**base, out=tmp_path / "one"))
    run(RunConfig(**base | {"rounds": 2}, out=tmp_path / "two"))
    run(RunConfig(**base, workers=2, out=tmp_path / "two"), runner=ParallelRunner(pool), resume=True)
    assert (tmp_path / "two" / "client_states").is_dir()
    assert without_timings(tmp_path / "one") == without_timings(tmp_path / "two")


def test_workers_on_the_command_line_and_across_a_resume(tmp_path):
    """--workers 2 through the CLI (the local engine's own pool), resumed with --workers 1: the
    run ends where an uninterrupted one-process run does; a bad count is one line, exit 2."""
    from fedlt.cli import main

    common = ["--algo", "fedavg", "--model", "mlp", "--train-limit", "600", "--test-limit", "100", "--clients", "6",
              "--participation", "0.5", "--local-iters", "2", "--eval-every", "1", "--beta", "0.5", "--min-size", "5", "--quiet"]
    main(["run", *common, "--rounds", "2", "--out", str(tmp_path / "straight")])
    main(["run", *common, "--rounds", "1", "--workers", "2", "--out", str(tmp_path / "cut")])
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["workers"] == 2
    main(["run", "--resume", str(tmp_path / "cut"), "--rounds", "2", "--workers", "1", "--quiet"])
    assert same_end(tmp_path / "straight", tmp_path / "cut") == []


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_worker_count_is_one_line(value, tmp_path, capsys):
    from fedlt.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", "--workers", value, "--out", str(tmp_path / "x"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err
    assert err.startswith("error: workers:") and "'auto'" in err


def test_auto_is_the_cores_and_the_training_set_is_shared(resolved):
    assert resolved("--workers", "auto").workers == "auto"
    assert resolve_workers("auto") == len(os.sched_getaffinity(0)) and resolve_workers(3) == 3
    data = fedlt.engine.load_data(RunConfig(train_limit=50, test_limit=10))
    shared = shared_train_set(data)
    assert shared.x_train.is_shared() and shared.y_train.is_shared() and len(shared.x_test) == 0
    assert torch.equal(shared.x_train, data.x_train) and shared.x_train.stride() == data.x_train.stride()


def test_a_runner_must_be_bound_before_it_runs_clients(pool):
    with pytest.raises(FedltError, match="bound to a run"):
        ParallelRunner(pool).call(None, [])


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_a_dense_tensor_crosses_the_wire_with_its_strides(shape, data):
    """Any permuted-contiguous layout (channels-last, a transpose, size-1 dimensions with their
    own strides) comes back with the same strides and bits: kernels choose their path by layout."""
    order = data.draw(st.permutations(range(len(shape))))
    t = torch.randn([shape[d] for d in order]).permute([order.index(d) for d in range(len(shape))])
    back = wire.decode(*wire.encode(t))
    assert back.shape == t.shape and back.stride() == t.stride() and torch.equal(back, t)
    conv = torch.nn.Conv2d(1, 4, 3).to(memory_format=torch.channels_last).weight.detach()
    assert wire.decode(*wire.encode(conv)).stride() == conv.stride() == (9, 1, 3, 1)


def test_a_stop_signal_with_workers_checkpoints_and_resumes_exactly(pool, tmp_path):
    """SIGINT while round 1 is being evaluated and round 2 trains: round 2 is evaluated and
    checkpointed too (it had trained), the run stops there, and resuming it ends exactly where an
    uninterrupted one-process run does."""
    from fedlt.engine import RunStopped

    base = dict(TINY, algorithm="scaffold", model="mlp", rounds=4)
    run(RunConfig(**base, out=tmp_path / "straight"))

    def interrupt(done, row):
        if done == 1:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(RunStopped) as stopped:
        run(RunConfig(**base, workers=2, out=tmp_path / "cut"), runner=ParallelRunner(pool), on_round=interrupt)
    assert stopped.value.round == 2
    assert json.loads((tmp_path / "cut" / "checkpoint.json").read_text())["round"] == 2
    run(RunConfig(**base, workers=2, out=tmp_path / "cut"), resume=True, runner=ParallelRunner(pool))
    assert same_end(tmp_path / "straight", tmp_path / "cut") == []
    assert without_timings(tmp_path / "straight") == without_timings(tmp_path / "cut")


def test_dp_sgd_is_bit_identical_with_two_workers(pool, tmp_path):
    """Sample-level DP (issue 42): the Poisson batches and the noise are each client's own streams,
    so two workers end where one process does, with the same ε (tests/test_dpsgd.py checks its value)."""
    base = dict(algorithm="fedavg", model="mlp", clients=2, participation=1.0, local_epochs=1, batch_size=10,
                train_limit=100, test_limit=50, eval_every=1, partition={"name": "iid"}, rounds=1,
                privacy="sample_level(clip=1.0, noise_multiplier=1.2)")
    one = run(RunConfig(**base, out=tmp_path / "one"))
    two = run(RunConfig(**base, workers=2, out=tmp_path / "two"), runner=ParallelRunner(pool))
    assert same_end(tmp_path / "one", tmp_path / "two") == []
    assert one["privacy"]["epsilon"] == two["privacy"]["epsilon"] > 0

"""The Flower engine: the same global model as the local engine (within 1e-6: other processes
may round differently) for the FedAvg family, a server optimiser, a stateful client loss and
SCALA's per-iteration exchange; resume under simulation continues exactly. Every Flower run
here shares ONE simulation (Ray starts once)."""

from __future__ import annotations

import json

import pytest
import torch

from fedlt import io
from fedlt.config import RunConfig
from fedlt.engine import run

pytest.importorskip("flwr")
from fedlt.flower.simulation import Job, simulate  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")  # one Ray at a time (tests/conftest.py)

COMMON = dict(clients=3, participation=1.0, rounds=2, train_limit=600, test_limit=200, server_batch=48,
              local_iters=2, eval_every=1, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})
CASES = {
    "fedavg": dict(algorithm="fedavg"),
    "fedgrab": dict(algorithm="fedgrab"),  # SGB state persists on each client across rounds
    "fedadam": dict(algorithm="fedavg", algorithm_params={"aggregator": "fedadam"}),
    "scala": dict(algorithm="scala"),  # T exchanges per round
}


def config(case: str, out, **changes) -> RunConfig:
    return RunConfig(**{**COMMON, **CASES[case], **changes, "out": out})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("flower")
    jobs = [Job(config(case, root / f"{case}-flower", engine="flower")) for case in CASES]
    jobs += [Job(config("fedgrab", root / "resumed", engine="flower", rounds=1)),
             Job(config("fedgrab", root / "resumed", engine="flower"), resume=True)]
    outcomes = simulate(jobs)
    for case in CASES:
        run(config(case, root / f"{case}-local"))
    return root, outcomes


def model_of(run_dir) -> dict[str, torch.Tensor]:
    return io.load_checkpoint(run_dir / "checkpoint.pt")["algorithm"]["model"]


@pytest.mark.parametrize("case", list(CASES))
def test_flower_and_local_engines_train_the_same_global_model(runs, case):
    root, _ = runs
    flower, local = model_of(root / f"{case}-flower"), model_of(root / f"{case}-local")
    assert flower.keys() == local.keys()
    for name in local:
        torch.testing.assert_close(flower[name], local[name], rtol=0, atol=1e-6, msg=f"{case}: {name}")



def test_the_comparison_can_tell_runs_apart(runs):
    """FedAvg and FedAdam from the same start differ by far more than the tolerance."""
    root, _ = runs
    a, b = model_of(root / "fedavg-flower"), model_of(root / "fedadam-flower")
    assert max(float((a[n] - b[n]).abs().max()) for n in a if a[n].is_floating_point()) > 1e-3


def test_the_run_directory_is_the_same_as_the_local_engines(runs):
    root, outcomes = runs
    for case in CASES:
        flower, local = root / f"{case}-flower", root / f"{case}-local"
        # and Flower's and Ray's log lines, kept off the terminal (fedlt.flower.simulation)
        assert sorted(p.name for p in flower.iterdir()) == sorted([*(p.name for p in local.iterdir()), "flower.log"])
        assert (flower / "partition.npz").read_bytes() == (local / "partition.npz").read_bytes()
        rows = [json.loads(line) for line in (flower / "metrics.jsonl").read_text().splitlines()]
        local_rows = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2] and rows[0].keys() == local_rows[0].keys()
        for r, l in zip(rows, local_rows):
            assert r["accuracy"] == l["accuracy"] and abs(r["loss"] - l["loss"]) < 1e-5
        assert json.loads((flower / "config.json").read_text())["engine"] == "flower"
    # exchanges (one message per participant each): 1 per round for FedAvg, T + 1 per round for
    # SCALA (gradients ride on the next forward)
    assert outcomes[0]["exchanges"] == 2
    assert outcomes[3]["exchanges"] == 2 * (COMMON["local_iters"] + 1)


def test_client_state_travels_and_resume_continues_exactly(runs):
    root, _ = runs
    whole = io.load_checkpoint(root / "fedgrab-flower" / "checkpoint.pt")
    resumed = io.load_checkpoint(root / "resumed" / "checkpoint.pt")
    assert sorted(whole["client_states"]) == [0, 1, 2]  # SGB's state came back from every node
    for name, tensor in whole["algorithm"]["model"].items():
        assert torch.equal(resumed["algorithm"]["model"][name], tensor), name
    assert [r["accuracy"] for r in resumed["metrics"]] == [r["accuracy"] for r in whole["metrics"]]


def test_flower_engine_without_flower_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    from fedlt.cli import main

    monkeypatch.setitem(__import__("sys").modules, "flwr", None)  # as if the extra were not installed
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--algo", "fedavg", "--engine", "flower", "--out", str(tmp_path / "r"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2
    assert len(err.splitlines()) == 1 and 'pip install -e ".[flower]"' in err
    assert not (tmp_path / "r").exists()


class NoNodes:
    """A Grid to which no SuperNode ever connects; counts how often it is asked."""

    polls = 0

    def get_node_ids(self):
        self.polls += 1
        return []

    def send_and_receive(self, messages, *, timeout=None):
        return []


def test_missing_supernodes_are_a_clear_error_after_a_bounded_wait(tmp_path, monkeypatch):
    import types

    import fedlt.flower.server_app as server_app
    from fedlt.errors import FedltError

    clock = types.SimpleNamespace(now=100.0, slept=[])  # a fake clock: the wait costs no real time

    def sleep(seconds):
        clock.slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(server_app, "time", types.SimpleNamespace(monotonic=lambda: clock.now, sleep=sleep,
                                                                  perf_counter=lambda: clock.now))
    grid = NoNodes()
    rounds = server_app.FlowerRunner(grid, config("fedavg", tmp_path / "r"), node_wait=1.0)
    with pytest.raises(FedltError, match=r"no SuperNode holds partition\(s\) \[0, 1, 2\] of 3 after 1s"):
        rounds.nodes()
    # it kept asking for nodes every 0.5 s until node_wait had passed, then stopped
    assert clock.slept == [0.5, 0.5] and grid.polls == 3

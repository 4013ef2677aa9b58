"""The Flower engine's boundaries that need no simulation: Flower missing, SuperNodes missing, the
ClientApp's partition query answered without torch.
(Its runs against the local engine are in tests/test_engines.py, which shares one simulation
among every Flower run of the suite's engine checks.)"""

from __future__ import annotations

import pytest

from fedlt.config import RunConfig

pytest.importorskip("flwr")


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
    rounds = server_app.FlowerRunner(grid, RunConfig(clients=3, out=tmp_path / "r"), node_wait=1.0)
    with pytest.raises(FedltError, match=r"no SuperNode holds partition\(s\) \[0, 1, 2\] of 3 after 1s"):
        rounds.nodes()
    # it kept asking for nodes, the pause doubling from 0.01 s, until node_wait had passed (the last
    # pause cut to the deadline), then stopped
    assert clock.slept == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.37])
    assert sum(clock.slept) == pytest.approx(1.0) and grid.polls == len(clock.slept) + 1
    clock.slept.clear()  # in simulation (poll_cap 0.05 s) the pause stops doubling at the cap
    with pytest.raises(FedltError):
        server_app.FlowerRunner(NoNodes(), RunConfig(clients=3, out=tmp_path / "r"), node_wait=1.0,
                                  poll_cap=0.05).nodes()
    assert clock.slept[:4] == pytest.approx([0.01, 0.02, 0.04, 0.05]) and max(clock.slept) == pytest.approx(0.05)
    assert sum(clock.slept) == pytest.approx(1.0)



# in a fresh process: the partition query answered by fedlt's ClientApp handler, then what it loaded
QUERY_PROBE = """
import sys
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
import fedlt.flower.client_app as client_app

for field in ("_task_id", "_run_id", "_node_id"):  # what a ClientApp process has, to create messages
    setattr(TaskIdentity, field, 1)
query = Message(RecordDict(), dst_node_id=1, message_type="query.partition")
context = Context(run_id=1, node_id=1, node_config={"partition-id": 3}, state=RecordDict(), run_config={})
reply = client_app.partition(query, context)
print(reply.content["node"]["partition_id"], sorted(m for m in ("torch", "fedlt.run", "fedlt.flower.client_work")
                                                     if m in sys.modules))
"""


def test_the_client_app_answers_the_partition_query_without_loading_torch():
    """A SuperNode starts a process per message: the query each node answers once a run must not
    pay a torch and fedlt start (fedlt.flower.client_app loads its client work on first use)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", QUERY_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().split(maxsplit=1) == ["3", "[]"], done.stdout

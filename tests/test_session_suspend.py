"""A split-learning session suspended after every call (state_dict -> bytes -> a fresh session
-> load_state_dict), as a Flower node does between messages, trains exactly as one kept alive."""

from __future__ import annotations

import pytest
import torch

from fedlt import wire
from fedlt.algorithms.base import ClientData
from fedlt.algorithms.protocol import ClientStates, LocalRunner, SeededSession, isolated
from fedlt.config import RunConfig
from fedlt.engine import prepare, train_round


class SuspendingSessions:
    """Each participant's session rebuilt from its task and its saved state before every call,
    the state carried through the wire format between calls (as a Flower node keeps it)."""

    def __init__(self, algorithm, tasks) -> None:
        self.algorithm, self.tasks = algorithm, [isolated(t) for t in tasks]
        self.saved: list[tuple | None] = [None] * len(self.tasks)

    def _each(self, call):
        out = []
        for k, task in enumerate(self.tasks):
            session = SeededSession(self.algorithm, task)
            if self.saved[k] is not None:
                session.load_state_dict(wire.decode(*self.saved[k]))
            out.append(call(k, session))
            self.saved[k] = wire.encode(session.state_dict())
        return out

    def forward(self):
        return self._each(lambda k, s: s.forward())

    def backward(self, grads):
        self._each(lambda k, s: s.backward(grads[k]))

    def finish(self):
        return self._each(lambda k, s: s.finish())


class SuspendingRunner(LocalRunner):
    def exchange(self, algorithm, tasks):
        return SuspendingSessions(algorithm, tasks)


@pytest.mark.parametrize("algorithm", ["scala", "sfl_localloss", "splitfed_v3"])
def test_a_suspended_session_trains_exactly_like_a_live_one(algorithm, one_thread):
    config = RunConfig(algorithm=algorithm, clients=3, train_limit=300, server_batch=24, local_iters=3,
                       partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})
    live, suspended = prepare(config), prepare(config)
    states = [ClientStates(), ClientStates()]
    for round_index in range(2):
        for k, prep in enumerate((live, suspended)):
            clients = []
            for cid in range(3):
                idx = torch.as_tensor(prep.partition.client_indices[cid], dtype=torch.long)
                clients.append(ClientData(cid, prep.data.x_train[idx], prep.data.y_train[idx], prep.counts[cid]))
            runner = LocalRunner() if k == 0 else SuspendingRunner()
            train_round(prep.algorithm, prep.ctx, round_index, clients, states[k], runner)
    a, b = live.algorithm.state_dict(), suspended.algorithm.state_dict()
    for name, tensor in a["client_side"].items():
        assert torch.equal(b["client_side"][name], tensor), name
    for name, tensor in a["model"].items():
        assert torch.equal(b["model"][name], tensor), name
    assert sorted(states[0]) == sorted(states[1])

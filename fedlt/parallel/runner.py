"""``ParallelRunner``: the local engine's ClientRunner when ``workers`` > 1 — a run's client work
in a fedlt.parallel.pool.WorkerPool, with the shared runner bookkeeping of
fedlt.algorithms.protocol (``Runner``, ``RoundSessions``).

May import: the bottom layer, fedlt.algorithms, fedlt.parallel.messages, fedlt.parallel.pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import torch

from fedlt.algorithms.protocol import (ClientFailure, ClientResult, ClientTask, RoundSessions, Runner, Upload,
                                       travelling)
from fedlt.errors import FedltError, ProcessLost
from fedlt.parallel.messages import pack, unpack
from fedlt.parallel.pool import WorkerPool


class ParallelRunner(Runner):
    """A ClientRunner (fedlt.algorithms.protocol) over a :class:`WorkerPool`: ``ParallelRunner(2)``
    starts (and ``close`` stops) its own pool; ``ParallelRunner(pool)`` uses a pool that outlives
    it (tests reuse one across runs). The engine binds it to a run once (``bind``) and evaluates
    round r while round r+1's clients train (``overlaps_evaluation``). ``tolerate``: a client whose
    work raises becomes a ClientFailure (its first error line), as with ``LocalRunner(tolerate)``."""

    overlaps_evaluation = True

    def __init__(self, workers: int | WorkerPool, tolerate: bool = False) -> None:
        super().__init__(tolerate)
        self.own = not isinstance(workers, WorkerPool)
        self.pool = WorkerPool(workers) if self.own else workers
        self.device = torch.device("cpu")
        self.bound = False
        self.exchanges = 0

    def bind(self, prep: Any) -> None:
        """The run's parts, given once by the engine after ``prepare``."""
        self.device = torch.device(prep.config.device)
        self.pool.bind(prep.config, prep.partition, prep.data)
        self.bound = True

    def close(self) -> None:
        if self.own:
            self.pool.close()

    def __enter__(self) -> "ParallelRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_bound(self) -> None:
        if not self.bound:
            raise FedltError("a ParallelRunner must be bound to a run (bind(prepared)) before it runs clients")

    def each(self, job: str, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
        self._check_bound()
        packed = [pack(travelling(t), f"task of client {t.cid}") for t in tasks]
        sizes = [len(t.data.y) if t.data is not None else 0 for t in tasks]
        replies = self.pool.map_calls(packed, sizes, [t.cid for t in tasks], job, tolerate=self.tolerate)
        self.lost([r for r in replies if isinstance(r, ClientFailure)])
        return [r if isinstance(r, ClientFailure) else unpack(r, self.device) for r in replies]

    def lost(self, failures: list[ClientFailure]) -> None:
        """Clients whose worker was lost twice: ClientFailures for a runner that tolerates failures;
        otherwise the run cannot go on (an error of the work itself was raised already): one
        line naming what died (ProcessLost, exit code 1)."""
        if failures and not self.tolerate:
            f = failures[0]
            raise ProcessLost(f"client {f.cid}: {f.reason.removeprefix('failed: ')} — a worker process died, "
                              "not the client's work (killed, or out of memory?)")

    def exchange(self, algorithm: Any, tasks: Sequence[ClientTask]) -> "ParallelSessions":
        self._check_bound()
        self.exchanges += 1
        return ParallelSessions(self, list(tasks), self.exchanges)


class ParallelSessions(RoundSessions):
    """The round's split-learning sessions, each pinned to one worker (the workers balanced by
    their clients' sample counts); ``backward`` sends nothing by itself: the gradients ride on
    the next ``forward`` or ``finish`` message, one per worker. A session whose work raised or
    whose worker was lost twice leaves the round, reported once (RoundSessions)."""

    def __init__(self, runner: ParallelRunner, tasks: list[ClientTask], exchange_id: int) -> None:
        super().__init__(tasks)
        self.runner, self.exchange_id = runner, exchange_id
        pool = runner.pool
        load = [(0, i) for i in range(pool.size)]
        self.worker_of: list[int] = [0] * len(tasks)
        for k in sorted(range(len(tasks)), key=lambda k: -(len(tasks[k].data.y) if tasks[k].data is not None else 0)):
            used, i = heapq.heappop(load)
            self.worker_of[k] = i
            heapq.heappush(load, (used + (len(tasks[k].data.y) if tasks[k].data is not None else 0), i))
        self.pending: list[list[tuple[int, str, Any]]] = [
            [(k, "open", pack(travelling(t), f"task of client {t.cid}"))] for k, t in enumerate(tasks)]
        self.history: dict[int, list] = {i: [] for i in range(pool.size)}  # ops each worker ran this round

    def _run(self, op: str) -> list[Any]:
        per_worker: dict[int, list] = {}
        for k in self.live():
            per_worker.setdefault(self.worker_of[k], []).extend([*self.pending[k], (k, op, None)])
        self.pending = [[] for _ in self.tasks]
        replies = self.runner.pool.session_messages(self.exchange_id, per_worker, self.history, self.runner.tolerate)
        values: dict[int, Any] = {}
        for i, ops in per_worker.items():
            reply = replies[i]
            if isinstance(reply, str):
                for k, _, _ in ops:
                    self.fail(k, f"failed: its worker was lost twice ({reply})")
                self.history[i] = []
                continue
            self.history[i].append(ops)
            for (k, o, _), value in zip(ops, reply):
                if isinstance(value, ClientFailure):
                    self.fail(k, value.reason)
                elif o == op and k not in self.gone:
                    values[k] = unpack(value, self.runner.device)
        out = self.report(values)
        self.runner.lost([v for v in out if isinstance(v, ClientFailure)])
        return out

    def forward(self) -> list[Upload | ClientFailure]:
        return self._run("forward")

    def backward(self, grads: list[torch.Tensor | None]) -> None:
        for k in self.live():
            self.pending[k].append((k, "backward", pack(grads[k], "activation gradient")))

    def finish(self) -> list[ClientResult | ClientFailure]:
        return self._run("finish")

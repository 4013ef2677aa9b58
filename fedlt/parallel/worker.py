"""The worker process's side of fedlt.parallel: ``worker_main`` answers one message at a time
(fedlt.parallel.messages) with the run's parts it rebuilt from the configuration
(fedlt.run.parts.rebuild) and the round's open split-learning sessions.

May import: the bottom layer, fedlt.algorithms, fedlt.run, fedlt.parallel.messages.
"""

from __future__ import annotations

import os
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from fedlt.algorithms.protocol import CLIENT_CALLS, ClientTask, SeededSession
from fedlt.errors import FedltError
from fedlt.parallel.messages import Packed, tolerated_failure, portable, pack, unpack
from fedlt.run.parts import client_data, rebuild, with_held


class _Worker:
    """What one worker process holds: the run's parts and the round's open sessions."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.prep: Any = None
        self.exchange_id = -1
        self.sessions: dict[int, SeededSession] = {}
        self.cids: dict[int, int] = {}  # session -> its client
        self.failed: set[int] = set()  # sessions whose work raised under a tolerant runner (left the round)
        self.current = -1  # the session whose op runs (named in an error's reply)

    def bind(self, key: str, config_json: str, partition: Any, data: Any) -> None:
        if key == self.key:
            return
        self.key, self.prep, self.sessions = None, None, {}
        self.prep = rebuild(config_json, partition, data=data)
        self.key = key

    def task(self, packed: Packed) -> Any:
        """The task with its client's data (and, for a per-client evaluation, its test set), sliced
        from the shared tensors as the engine slices them."""
        device = torch.device(self.prep.config.device)
        task = unpack(packed, device)
        return with_held(self.prep, task, client_data(self.prep, task.cid, device))

    def call(self, job: str, packed: Packed) -> Packed:
        """One-call work of kind ``job`` (fedlt.algorithms.protocol.CLIENT_CALLS) on the task."""
        task = self.task(packed)
        return pack(CLIENT_CALLS[job](self.prep.algorithm, task), f"result of client {task.cid}")

    def session_ops(self, exchange_id: int, ops: list[tuple[int, str, Any]], tolerate: bool = False) -> list[Any]:
        """Run the ops (session id, open | backward | forward | finish, argument) in order;
        the outputs of forward and finish, packed, None for the others. ``tolerate``: a session
        whose op raises leaves the round, its output that op's ClientFailure; its later ops are
        skipped (None) and the other sessions go on."""
        if exchange_id != self.exchange_id:  # a new round's exchange: the last one's sessions are over
            self.exchange_id, self.sessions, self.cids, self.failed = exchange_id, {}, {}, set()
        out: list[Any] = []
        for sid, op, arg in ops:
            self.current = sid
            if sid in self.failed:
                out.append(None)
                continue
            try:
                out.append(self._session_op(sid, op, arg))
            except Exception as exc:  # noqa: BLE001  (any failure of client work drops the client)
                if not tolerate:
                    raise
                self.sessions.pop(sid, None)
                self.failed.add(sid)
                out.append(tolerated_failure(self.cids.get(sid, -1), exc))
        return out

    def _session_op(self, sid: int, op: str, arg: Any) -> Any:
        if op == "open":
            task = self.task(arg)
            self.cids[sid] = task.cid
            self.sessions[sid] = SeededSession(self.prep.algorithm, task)
            return None
        if op == "backward":
            self.sessions[sid].backward(unpack(arg, torch.device(self.prep.config.device)))
            return None
        if op == "forward":
            return pack(self.sessions[sid].forward(), f"upload of session {sid}")
        if op == "finish":
            return pack(self.sessions.pop(sid).finish(), f"result of session {sid}")
        raise FedltError(f"unknown session op {op!r}")


def worker_main(conn: Connection) -> None:
    """A worker's loop: one message in, one reply out, until told to stop or the pipe closes."""
    torch.set_num_threads(1)  # N workers share the cores: one intra-op thread each
    # Ctrl-C reaches the whole process group: the main process finishes its round and stops the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = _Worker()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind, args = message[0], message[1:]
        if kind == "stop":
            return
        try:
            if kind == "ping":
                reply: Any = os.getpid()
            elif kind == "bind":
                reply = worker.bind(*args)
            elif kind == "call":
                reply = worker.call(*args)
            elif kind == "sessions":
                reply = worker.session_ops(*args)
            else:
                raise FedltError(f"unknown message {kind!r}")
            answer: tuple = ("ok", reply)
        except BaseException as exc:  # noqa: BLE001  (everything goes back to the main process)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            answer = ("error", portable(exc), traceback.format_exc(), worker.current)
        try:
            conn.send(answer)
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            return  # the main process gave up on this worker (or is gone): nobody to answer, nothing to print

"""Clients in parallel worker processes: the local engine's runner when ``workers`` > 1
(docs/parallel.md).

    main process ──task (wire bytes, no data)──► worker k ──result (wire bytes)──► main process

``WorkerPool`` keeps N processes alive (started with ``spawn``: never a fork of a process whose
torch threads may be running), each with one torch thread. A run binds the pool once
(``ParallelRunner.bind``): the training tensors go to every worker in shared memory (one copy
into shared memory, none per round), the configuration and the partition as plain values; each
worker builds the run's parts with ``fedlt.run.parts.rebuild`` and keeps them while the run lasts.

A task crosses as the lossless wire format without its data; the worker slices its client's
samples from the shared tensors by the partition's indices, as a Flower node does. Every client
is a function of its task (its own random stream, its own copies: fedlt.algorithms.protocol), so
the results are bit-identical to ``workers = 1`` whichever worker runs which client and in
whatever order (``fedlt.testing.check_parallel``).

- One-call work (``call``): tasks go to whichever worker is free, largest client first.
- Split learning (``exchange``): each participant's session is opened in one worker and stays
  there for the round (pinned); every ``forward`` / ``finish`` is one message per worker carrying
  its sessions' pending ``backward`` gradients and the next call. The server side stays in the
  main process.
- A worker that dies (killed, out of memory) or does not answer within ``reply_wait`` is
  replaced; its tasks are re-run (its sessions replayed from their tasks and the gradients they
  had received: the same calls give the same state). A task whose worker fails twice comes back
  as a :class:`~fedlt.algorithms.protocol.ClientFailure` in place of its result (or upload), for
  the round's fault policy to handle. Every wait is bounded.

An error raised by client work itself (a non-finite loss, a bad setting) is raised in the main
process as it would be with ``workers = 1``; a runner that tolerates failures (``tolerate``: the
round policy's ``faults.on_failure="drop"``) returns it as that client's ClientFailure instead,
worded as the local runner words it, and the other clients go on.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
import pickle
import signal
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from fedlt import wire
from fedlt.algorithms.protocol import (CLIENT_CALLS, ClientFailure, ClientResult, ClientTask, RoundSessions, Runner,
                                       SeededSession, Upload, failure_reason)
from fedlt.datasets.source import images
from fedlt.errors import FedltError, ProcessLost, first_line
from fedlt.run.parts import client_data, rebuild
from fedlt.start_method import PRELOAD, alive, exit_words, main_not_rerun, process_context  # noqa: F401  (re-exported)

STARTUP_WAIT_S = 600.0  # a worker's start and its build of the run's parts (imports, dataset, model)
REPLY_WAIT_S = 3600.0  # one message's work (a round's local training at most); then the worker is replaced
ATTEMPTS = 2  # a task whose worker fails this many times becomes a ClientFailure


def resolve_workers(workers: int | str) -> int:
    """``workers`` as a count: ``"auto"`` is the cores this process may run on."""
    if workers == "auto":
        try:
            return max(len(os.sched_getaffinity(0)), 1)
        except AttributeError:  # not on Linux
            return max(os.cpu_count() or 1, 1)
    return int(workers)


# -- the wire, as bytes through a pipe -------------------------------------------------------------
Packed = tuple[str, list[bytes]]


def pack(value: Any, name: str) -> Packed:
    text, arrays = wire.encode(value, name)
    return text, [a.numpy().tobytes() for a in arrays]


def unpack(packed: Packed, device: torch.device | str = "cpu") -> Any:
    text, blobs = packed
    return wire.decode(text, [torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8)
                              for b in blobs], device)


class WorkerError(Exception):
    """An error raised in a worker whose exception could not cross back as itself."""


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (so the main process raises the same type), else its line."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return WorkerError(f"{type(exc).__name__}: {first_line(exc)}")


def _failure(cid: int, exc: BaseException) -> ClientFailure:
    """A tolerated error of client work, worded as the local runner words it."""
    return ClientFailure(cid, f"failed: {exc}" if isinstance(exc, WorkerError) else failure_reason(exc))


# -- the worker process ---------------------------------------------------------------------------
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

    def task(self, packed: Packed) -> ClientTask:
        """The task with its client's data, sliced from the shared tensors as the engine slices it."""
        device = torch.device(self.prep.config.device)
        task = unpack(packed, device)
        return dataclasses.replace(task, data=client_data(self.prep, task.cid, device))

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
                out.append(_failure(self.cids.get(sid, -1), exc))
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
            answer = ("error", _portable(exc), traceback.format_exc(), worker.current)
        try:
            conn.send(answer)
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            return  # the main process gave up on this worker (or is gone): nobody to answer, nothing to print


# -- the main process -----------------------------------------------------------------------------
class WorkerLost(Exception):
    """A worker died or did not answer in time (its process is gone or killed)."""


class _Process:
    def __init__(self, ctx: Any, index: int) -> None:
        self.index = index
        self.forked = ctx.get_start_method() == "forkserver"
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main, args=(child,), name=f"fedlt-worker-{index}", daemon=True)
        with main_not_rerun():
            self.process.start()
        child.close()

    def why_lost(self) -> str:
        """What happened to this worker, in words naming it (for the lines a lost worker leads to)."""
        code, pid = self.process.exitcode, self.process.pid
        name = f"worker {self.index} (pid {pid})"
        if code is None:
            return f"{name} stopped answering"
        # a fork server's child reports its exit through the fork server: 255 when the server itself died
        if code == 255 and self.forked and alive(pid):
            return f"the fork server of {name} died (killed?); the worker is replaced"
        return f"{name} died ({exit_words(code)})"

    def kill(self) -> None:
        """Stop it by its pid (alive, or with an exit the fork server could not report)."""
        if alive(self.process.pid) and self.process.exitcode in (None, 255):
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.join(timeout=10)
        self.conn.close()


class WorkerPool:
    """N persistent worker processes (``spawn``ed, one torch thread each), reusable across runs:
    a run binds it with its parts (``bind``), and a worker rebuilds them only when they change."""

    def __init__(self, workers: int, *, startup_wait: float = STARTUP_WAIT_S, reply_wait: float = REPLY_WAIT_S) -> None:
        if workers < 1:
            raise FedltError(f"workers must be at least 1, got {workers}")
        self.size, self.startup_wait, self.reply_wait = workers, startup_wait, reply_wait
        self.ctx = process_context()
        self.binding: tuple | None = None
        self.replaced = 0  # workers replaced after a death or a timeout (tests and benchmarks read it)
        self.procs = [_Process(self.ctx, i) for i in range(workers)]
        for i in range(workers):
            self._ask(i, ("ping",), self.startup_wait, "starting")

    # -- plumbing -------------------------------------------------------------------------------
    def _receive(self, i: int, deadline: float, what: str) -> tuple:
        """The raw reply of worker ``i`` before ``deadline``; raises WorkerLost (the worker is then
        killed, to be replaced)."""
        proc = self.procs[i]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                raise WorkerLost(f"worker {i} gave no reply within {self.reply_wait:.0f}s while {what}")
            ready = wait([proc.conn, proc.process.sentinel], timeout=min(left, 5.0))
            if proc.conn in ready or (ready and proc.conn.poll()):
                try:
                    return proc.conn.recv()
                except (EOFError, OSError):
                    raise WorkerLost(proc.why_lost()) from None
            if proc.process.sentinel in ready:
                raise WorkerLost(proc.why_lost())

    @staticmethod
    def _value(reply: tuple) -> Any:
        """A reply's value, or the worker's error raised here as itself."""
        if reply[0] == "ok":
            return reply[1]
        exc = reply[1]
        exc.add_note(f"raised in a worker process:\n{reply[2]}")
        raise exc

    def _send(self, i: int, message: tuple) -> None:
        try:
            self.procs[i].conn.send(message)
        except (OSError, ValueError):  # a broken pipe: the worker is gone; its reply wait will say so
            pass

    def _ask(self, i: int, message: tuple, timeout: float, what: str) -> Any:
        self._send(i, message)
        return self._value(self._receive(i, time.monotonic() + timeout, what))

    def replace(self, i: int) -> None:
        """Worker ``i`` anew, bound to the current run's parts."""
        self.procs[i].kill()
        self.procs[i] = _Process(self.ctx, i)
        self.replaced += 1
        try:
            self._ask(i, ("ping",), self.startup_wait, "starting a replacement worker")
            if self.binding is not None:
                self._ask(i, ("bind", *self.binding), self.startup_wait, "building the run's parts")
        except WorkerLost as exc:
            raise ProcessLost(f"could not start a replacement for worker {i}: {exc}") from None

    # -- binding a run --------------------------------------------------------------------------
    def bind(self, config: Any, partition: Any, data: Any) -> None:
        """Hand every worker the run's configuration, partition and training tensors (in shared
        memory) and wait until each has built the run's parts."""
        key = json.dumps([config.model_dump_json(), partition.sha256, data.name, list(data.x_train.shape)])
        if self.binding is not None and self.binding[0] == key:
            return
        self.binding = None
        binding = (key, config.model_dump_json(), partition, shared_train_set(data))
        for i in range(self.size):
            self._send(i, ("bind", *binding))
        deadline = time.monotonic() + self.startup_wait
        replies, lost = [], []
        for i in range(self.size):
            try:
                replies.append(self._receive(i, deadline, "building the run's parts"))
            except WorkerLost:
                lost.append(i)
        try:
            for reply in replies:
                self._value(reply)
            self.binding = binding
            for i in lost:  # died since the last run (or now): a new one, built with the run's parts
                self.replace(i)
        except FedltError as exc:
            raise FedltError(f"a worker process could not build the run: {first_line(exc)} (a component "
                             "registered in this process only is not found there: register it with an "
                             "entry point)") from None

    def close(self) -> None:
        for i in range(self.size):
            self._send(i, ("stop",))
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.process.join(timeout=max(deadline - time.monotonic(), 0.1))
            proc.kill()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one-call work --------------------------------------------------------------------------
    def map_calls(self, packed: list[Packed], sizes: list[int], cids: list[int], job: str = "work",
                  tolerate: bool = False) -> list[Any]:
        """Each packed task run by a free worker, largest first; results in task order (packed),
        a ClientFailure where a task's worker was lost ATTEMPTS times. An error of the client work
        itself is raised once every worker has answered (the pipes stay in step): the error of
        the earliest task in task order, as one process running them in turn would raise;
        ``tolerate``: it is that task's ClientFailure instead and every task runs."""
        todo = sorted(range(len(packed)), key=lambda k: -sizes[k])
        results: list[Any] = [None] * len(packed)
        failures = [0] * len(packed)
        # an error of the client work: the one of the earliest task in task order, as in one process,
        # so tasks before it still run and tasks after it no longer start
        error: tuple | None = None
        failed_at = len(packed)
        running: dict[int, tuple[int, float]] = {}  # worker -> (task, deadline)
        while True:
            todo = [k for k in todo if k < failed_at]
            for i in range(self.size):
                if todo and i not in running:
                    k = todo.pop(0)
                    self._send(i, ("call", job, packed[k]))
                    running[i] = (k, time.monotonic() + self.reply_wait)
            if not running:
                break
            waits = {self.procs[i].conn: i for i in running} | {self.procs[i].process.sentinel: i for i in running}
            left = min(d for _, d in running.values()) - time.monotonic()
            ready = {waits[obj] for obj in wait(list(waits), timeout=max(min(left, 5.0), 0.0))}
            lost: dict[int, str] = {}
            for i in ready:
                proc = self.procs[i]
                if proc.conn.poll():
                    try:
                        reply = proc.conn.recv()
                    except (EOFError, OSError):
                        lost[i] = proc.why_lost()
                        continue
                    k, _ = running.pop(i)
                    if reply[0] == "ok":
                        results[k] = reply[1]
                    elif tolerate:
                        results[k] = _failure(cids[k], reply[1])
                    elif k < failed_at:
                        error, failed_at = reply, k
                else:
                    lost[i] = proc.why_lost()
            now = time.monotonic()
            for i, (k, deadline) in running.items():
                if i not in lost and now > deadline:
                    self.procs[i].kill()
                    lost[i] = f"worker {i} gave no reply within {self.reply_wait:.0f}s"
            for i, why in lost.items():
                k, _ = running.pop(i)
                failures[k] += 1
                if failures[k] >= ATTEMPTS:
                    results[k] = ClientFailure(cids[k], f"failed: its worker was lost twice ({why})")
                else:
                    todo.insert(0, k)
                self.replace(i)
        if error is not None:
            self._value(error)
        return results

    # -- sessions -------------------------------------------------------------------------------
    def session_messages(self, exchange_id: int, per_worker: dict[int, list], histories: dict[int, list],
                         tolerate: bool = False) -> dict[int, list[Any] | str]:
        """One message of session ops to each worker in ``per_worker``, all in flight together;
        each worker's outputs, or why it was lost twice. A lost worker is replaced, replays
        ``histories[i]`` (the ops it had run this round, so its sessions are back where they
        were) and gets its message again, once. An error of the work itself is raised once every
        worker has answered (``tolerate``: the worker returns it as that session's ClientFailure)."""
        for i, ops in per_worker.items():
            self._send(i, ("sessions", exchange_id, ops, tolerate))
        deadline = time.monotonic() + self.reply_wait
        replies: dict[int, tuple | str] = {}
        for i in per_worker:
            try:
                replies[i] = self._receive(i, deadline, "running split-learning sessions")
            except WorkerLost as exc:
                replies[i] = str(exc)
        for i, reply in replies.items():
            if not isinstance(reply, str):
                continue
            self.replace(i)
            try:
                replay = [op for message in histories[i] for op in message]
                if replay:
                    self._value(self._ask_raw(i, ("sessions", exchange_id, replay, tolerate), "replaying sessions"))
                replies[i] = self._ask_raw(i, ("sessions", exchange_id, per_worker[i], tolerate), "running sessions")
            except WorkerLost as again:
                self.replace(i)
                replies[i] = str(again)
        errors = [r for r in replies.values() if not isinstance(r, str) and r[0] != "ok"]
        if errors:  # the earliest session's, as in one process (a worker runs its sessions in order)
            self._value(min(errors, key=lambda r: r[3]))
        return {i: r if isinstance(r, str) else r[1] for i, r in replies.items()}

    def _ask_raw(self, i: int, message: tuple, what: str) -> tuple:
        self._send(i, message)
        return self._receive(i, time.monotonic() + self.reply_wait, what)


def shared_train_set(data: Any) -> Any:
    """The dataset with its training tensors in shared memory (what the workers slice clients
    from; images read from files cross as their paths, and each worker decodes its own clients')
    and no test set (the main process evaluates): moved once, never copied per round."""
    empty = lambda t: torch.empty((0, *t.shape[1:]), dtype=t.dtype)  # noqa: E731
    return dataclasses.replace(data, x_train=images(data.x_train).shared(), y_train=images(data.y_train).shared(),
                               x_test=empty(data.x_test), y_test=empty(data.y_test))


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
        packed = [pack(dataclasses.replace(t, data=None), f"task of client {t.cid}") for t in tasks]
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
            [(k, "open", pack(dataclasses.replace(t, data=None), f"task of client {t.cid}"))] for k, t in enumerate(tasks)]
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

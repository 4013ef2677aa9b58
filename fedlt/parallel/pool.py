"""The main process's side of fedlt.parallel: ``WorkerPool``, N persistent worker processes
started through fedlt.start_method (a fork server, never a fork of this process), each with one
torch thread; binding a run's parts to them; one-call work to whichever is free
(``map_calls``); split-learning session ops pinned to a worker (``session_messages``); a worker
that dies or does not answer replaced, its work re-run. Every wait is bounded.

May import: the bottom layer, components (the shared training tensors), fedlt.algorithms,
fedlt.parallel.messages and fedlt.parallel.worker (the processes' entry point).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from multiprocessing.connection import wait
from typing import Any

import torch

from fedlt.algorithms.protocol import ClientFailure
from fedlt.datasets.source import images
from fedlt.errors import FedltError, ProcessLost, first_line
from fedlt.parallel.messages import Packed, tolerated_failure
from fedlt.parallel.worker import worker_main
from fedlt.start_method import alive, exit_words, main_not_rerun, process_context, quiet_resource_sharer

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
        quiet_resource_sharer()  # a worker lost while taking the shared data: named by the pool, no traceback
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
        binding = (key, config.model_dump_json(), partition,
                   shared_train_set(data, keep_test=config.client_test is not None))
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
                        results[k] = tolerated_failure(cids[k], reply[1])
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


def shared_train_set(data: Any, keep_test: bool = False) -> Any:
    """The dataset with its training tensors in shared memory (what the workers slice clients
    from; images read from files cross as their paths, and each worker decodes its own clients')
    and no test set (the main process evaluates) unless ``keep_test`` (client test sets: a worker
    draws them and tests its clients on them), then shared too: moved once, never copied per round."""
    if keep_test:
        x_test, y_test = images(data.x_test).shared(), images(data.y_test).shared()
    else:
        x_test, y_test = (torch.empty((0, *t.shape[1:]), dtype=t.dtype) for t in (data.x_test, data.y_test))
    return dataclasses.replace(data, x_train=images(data.x_train).shared(), y_train=images(data.y_train).shared(),
                               x_test=x_test, y_test=y_test)

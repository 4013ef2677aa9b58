"""Clients in parallel worker processes: the local engine's runner when ``workers`` > 1
(docs/parallel.md).

    main process ──task (wire bytes, no data)──► worker k ──result (wire bytes)──► main process

``WorkerPool`` keeps N processes alive (started from fedlt.start_method's fork server: never a
fork of a process whose torch threads may be running), each with one torch thread. A run binds the
pool once (``ParallelRunner.bind``): the training tensors go to every worker in shared memory (one
copy into shared memory, none per round), the configuration and the partition as plain values; each
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

The package, by job (each module's docstring says what it may import):
    messages   values and errors as bytes through a pipe
    worker     the worker process (``worker_main``)
    pool       the main process's WorkerPool
    runner     ParallelRunner and its sessions (the local engine's runner for ``workers`` > 1)
How processes start (the fork server and its preload) is fedlt.start_method's.
"""

from fedlt.parallel.messages import Packed, WorkerError, pack, unpack
from fedlt.parallel.pool import (ATTEMPTS, REPLY_WAIT_S, STARTUP_WAIT_S, WorkerLost, WorkerPool, resolve_workers,
                                 shared_train_set)
from fedlt.parallel.runner import ParallelRunner, ParallelSessions
from fedlt.parallel.worker import worker_main

__all__ = ["ATTEMPTS", "REPLY_WAIT_S", "STARTUP_WAIT_S", "Packed", "ParallelRunner", "ParallelSessions", "WorkerError",
           "WorkerLost", "WorkerPool", "pack", "resolve_workers", "shared_train_set", "unpack", "worker_main"]

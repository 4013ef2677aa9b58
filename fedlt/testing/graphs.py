"""The graphs contract: an algorithm's rounds with whole-step graphs (``--graphs``,
fedlt.algorithms.graphs) equal its eager rounds — or it falls back with its stated reason and
equals them exactly.

Run on the CPU with the stand-in backend (``"recorded"``: every aten operator of the captured step
recorded and replayed on the recorded tensors, CUDA graphs' semantics — addresses read at replay,
Python numbers frozen at capture, host synchronisations refused), so what a wrong transfer or a
hidden per-client state would do on CUDA shows here. Two rounds of three clients whose class
counts differ (their logit-adjustment offsets differ: a graph that read the first client's would
be caught), all clients in both rounds, by iterations (5 steps, each client its own B_k) and by
epochs (batch 8: a short last batch, a second graph); with ``cohort`` N, both sides in cohorts of
N (a cohort's group step captured per group size and batch shape). Compared: the server's state, every
client's state and the round metrics, bitwise (:data:`TOLERANCE`: a replay reruns the very
operators of the eager step, in its order, on the CPU's deterministic kernels). One that captures
must have replayed steps (no silent fallback).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import fedlt.algorithms
from fedlt.algorithms import compiled, graphs
from fedlt.algorithms.cohort import with_cohort
from fedlt.algorithms.fedavg_family import graphs_reason
from fedlt.algorithms.protocol import LocalRunner
from fedlt.config import RunConfig
from fedlt.engine import prepare
from fedlt.testing.algorithms import TINY
from fedlt.testing.base import Contract, registered
from fedlt.testing.cohort import largest_gap, two_rounds

TOLERANCE = 0.0  # the same operators on the same tensors: bit for bit
SCHEDULES = {"by iterations": {"local_iters": 5}, "by epochs": {"local_epochs": 1, "batch_size": 8}}
BACKEND = "recorded"


def check_graphs(algorithm: Any, params: dict[str, Any] | None = None, *, replayed: bool = False,
                 cohort: int = 1, **settings: Any) -> None:
    """Check an algorithm (registered name or factory) with whole-step graphs on the CPU stand-in
    against its eager steps (see the module). ``settings`` override
    :data:`fedlt.testing.algorithms.TINY` (default here: ``mlp``, 3 clients, all sampled).
    ``replayed``: a stated fallback fails too (an algorithm whose steps must be captured).
    ``cohort``: both sides train in cohorts of that size (fedlt.algorithms.cohort_graphs captures
    the cohort's step); with 6 clients, two cohorts of one kind share the canonical stacks in a round.
    ``compile=True`` (a setting): both sides compile the step's forward, with ``aot_eager``."""
    with registered(fedlt.algorithms.REGISTRY, algorithm, "contract_algorithm") as name, \
            tempfile.TemporaryDirectory(prefix="fedlt-graphs-") as tmp:
        c = Contract(f"algorithm {name!r}")
        base = dict(TINY, model="mlp", clients=3, participation=1.0, fused="off") | settings | dict(
            algorithm=name, algorithm_params=dict(params or {}), out=Path(tmp) / "run")
        for label, schedule in SCHEDULES.items():
            config = RunConfig(**(base | schedule))
            # a compiled step on the CPU through aot_eager: aten operators, which the stand-in records
            backend = compiled.default_backend("aot_eager") if config.compile else contextlib.nullcontext()
            with c.property("same as eager", label), backend:
                eager_prep = prepare(config)
                counts = {tuple(map(int, n)) for n in eager_prep.counts[:config.clients]}
                eager = two_rounds(eager_prep, config, with_cohort(LocalRunner(), cohort))
                with graphs.default_backend(BACKEND):
                    prep = prepare(config.model_copy(update={"graphs": True}))
                    fast = two_rounds(prep, config, with_cohort(LocalRunner(), cohort))
            c.check(len(counts) > 1, "clients differ", f"{label}: every client has the same class counts, so a "
                    "graph reading another client's state could not be told apart")
            _check_one(c, label, prep.algorithm, eager, fast, replayed)


def _check_one(c: Contract, where: str, algorithm: Any, eager: Any, fast: Any, replayed: bool) -> None:
    gap, at = largest_gap(fast, eager)
    work = getattr(algorithm, "_work", None)
    reason = graphs_reason(algorithm) or graphs.failure(work)
    c.check(not (replayed and reason), "replayed", f"{where}: its steps were to be captured, yet: {reason}")
    if reason is not None:
        c.check(bool(reason.strip()), "states its fallback", f"{where}: left eager without a reason")
        c.check(gap == 0, "same as eager", f"{where}: left eager ({reason}) yet differs at {at.lstrip('.')}")
        return
    c.check(graphs.captured(work) > 0 and graphs.replays(work) > 0, "replayed",
            f"{where}: no step was captured or replayed, and no reason was given")
    c.check(gap <= TOLERANCE, "same as eager",
            f"{where}: relative gap {gap:.3g} > {TOLERANCE:g} at {at.lstrip('.')} "
            "(0: server state, 1: client states, 2: metrics)")

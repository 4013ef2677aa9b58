"""The compile contract: an algorithm's rounds with ``--compile`` (fedlt.algorithms.compiled)
equal its eager rounds within :data:`TOLERANCE`, one client after another and, where the cohort
runs it, in vmapped cohorts.

The same two rounds as the cohort contract (:mod:`fedlt.testing.cohort`: a tiny MNIST subset,
all clients in round 1, all but one in round 2, by iterations and by epochs, so a client's own
B_k, an epoch's short last batch and a cohort's masked clients all meet the compiled graphs).
Compared: the server's state, every client's state and the round metrics. An algorithm whose
steps ``--compile`` leaves eager must say why (``compile_reason``) and give the eager result
exactly; one that compiles must have run its compiled forward (no silent fallback).

``backend``: ``"inductor"`` (what a run uses) or ``"aot_eager"`` (dynamo's capture and
AOTAutograd's forward and backward graphs, without inductor's code generation: the same graphs
and guards at a fraction of the compile time — fedlt's own suite runs the registry over it and
inductor on one algorithm).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import fedlt.algorithms
from fedlt.algorithms import compiled
from fedlt.algorithms.cohort import CohortRunner
from fedlt.algorithms.fedavg_family import compile_reason
from fedlt.algorithms.protocol import LocalRunner
from fedlt.config import RunConfig
from fedlt.engine import prepare
from fedlt.testing.algorithms import TINY
from fedlt.testing.base import Contract, registered
from fedlt.testing.cohort import SCHEDULES, largest_gap, two_rounds

# inductor fuses the forward's and backward's elementwise work into loops of its own (a bias add
# with its ReLU, a reduction in another order): float32 rounding, not arithmetic, differs;
# measured ≤ 3e-7 after two rounds (fedavg, mlp); SGB's controller state (see the cohort
# contract) amplifies logit gaps, so it is held at 1e-4 there through largest_gap's scaling
TOLERANCE = 1e-5


def _rounds(config: RunConfig, runner: Any, backend: str | None) -> tuple[Any, Any]:
    """Two rounds of ``config`` with the steps' backend ``backend`` (None: eager); the results
    (server state, client states, metrics) and the work module (its compiled steps, if any)."""
    if backend is None:
        prep = prepare(config.model_copy(update={"compile": False}))
    else:
        with compiled.default_backend(backend):  # set before setup: an algorithm may copy the run's context
            prep = prepare(config.model_copy(update={"compile": True}))
    return two_rounds(prep, config, runner), getattr(prep.algorithm, "_work", None)


def check_compile(algorithm: Any, params: dict[str, Any] | None = None, *, backend: str = compiled.BACKEND,
                  cohort: int = 3, **settings: Any) -> None:
    """Check an algorithm (registered name or factory) with compiled steps against its eager
    steps (see the module); ``cohort``: the cohort size also checked (1: sequential only).
    ``settings`` override :data:`fedlt.testing.algorithms.TINY` (default here: ``mlp``, 5
    clients, all of them sampled)."""
    with registered(fedlt.algorithms.REGISTRY, algorithm, "contract_algorithm") as name, \
            tempfile.TemporaryDirectory(prefix="fedlt-compile-") as tmp:
        c = Contract(f"algorithm {name!r}")
        base = dict(TINY, model="mlp", clients=5, participation=1.0, fused="off") | settings | dict(
            algorithm=name, algorithm_params=dict(params or {}), out=Path(tmp) / "run")
        runners = {"sequential": LocalRunner} | ({f"cohort {cohort}": lambda: CohortRunner(LocalRunner(), cohort)}
                                                  if cohort > 1 else {})
        for label, schedule in SCHEDULES.items():
            config = RunConfig(**(base | schedule))
            for how, runner in runners.items():
                where = f"{label}, {how}"
                with c.property("same as eager", where):
                    eager, _ = _rounds(config, runner(), None)
                    fast, work = _rounds(config, runner(), backend)
                _check_one(c, where, compile_reason(fedlt.algorithms.create(name, **(params or {}))), eager, fast,
                           work)


def _check_one(c: Contract, where: str, reason: str | None, eager: Any, fast: Any, work: Any) -> None:
    gap, at = largest_gap(fast, eager)
    if reason is not None:
        c.check(bool(reason.strip()), "states its fallback", "left eager without a reason")
        c.check(gap == 0, "same as eager", f"{where}: left eager ({reason}) yet differs at {at}")
        return
    ran = compiled._FORWARD.get(work, {}) if work is not None else {}
    c.check(bool(ran), "compiled", f"{where}: no step went through torch.compile")
    failed = compiled.failure(work)
    c.check(failed is None, "compiled", f"{where}: the compiled step fell back: {failed}")
    c.check(gap <= TOLERANCE, "same as eager",
            f"{where}: relative gap {gap:.3g} > {TOLERANCE:g} at {at.lstrip('.')} "
            "(0: server state, 1: client states, 2: metrics)")

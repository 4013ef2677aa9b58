"""The parallel contract: clients trained in worker processes give the same run, bit for bit.

For each algorithm, two rounds on a tiny MNIST subset with ``workers = 1`` (this process) and
with N worker processes (``fedlt.parallel``) must end with the same global weights, server-side
state and client states, compared exactly (no tolerance: every client is a function of its task),
and the same metrics rows (wall-clock fields aside), the per-client evaluation's included
(``fedlt.testing.engines.PERSONAL``: each client's scores computed in the worker holding it). The N-worker runs evaluate each round while
the next one trains and close rows from a snapshot: the checkpoint of every round is compared
too, not only the last. All cases share ONE pool of workers (started once).

The workers find the algorithm by its registered name: check a built-in or an installed plugin's
entry point, not an object registered in this process only.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fedlt.algorithms
from fedlt import io
from fedlt.algorithms.protocol import LocalRunner
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.parallel import ParallelRunner, WorkerPool
from fedlt.testing.algorithms import TINY, probe, split_model_for
from fedlt.testing.base import Contract
from fedlt.testing.engines import _label, differences, with_personal


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_keeping_checkpoints(config: Any, runner: Any, keep: Path) -> None:
    """Run ``config``, copying its checkpoint after every round to ``keep/<round>.pt``."""
    keep.mkdir(parents=True)

    def copy(done: int, row: dict[str, Any]) -> None:
        shutil.copyfile(Path(config.out) / "checkpoint.pt", keep / f"{done}.pt")

    run(config, on_round=copy, runner=runner)


def check_parallel(cases: Sequence[Any], *, workers: int = 2, pool: Any = None, rounds: int = 2,
                   **settings: Any) -> None:
    """Check that every algorithm in ``cases`` — registered names, ``(name, params)`` pairs or
    ``(name, params, settings)`` triples — gives the same run with ``workers`` worker processes
    as in this process (see the module docstring). ``pool``: a :class:`fedlt.parallel.WorkerPool`
    to use (else one is started and stopped here). ``settings`` (for all cases, then a case's
    own) override :data:`fedlt.testing.algorithms.TINY`. Raises ContractError naming the
    algorithm, the property and the first differences."""
    normalised = [(c, {}, {}) if isinstance(c, str) else (c[0], dict(c[1]), dict(c[2]) if len(c) > 2 else {})
                  for c in cases]
    own_pool = pool is None
    pool = WorkerPool(workers) if own_pool else pool
    try:
        with tempfile.TemporaryDirectory(prefix="fedlt-parallel-") as tmp:
            for k, (name, params, own) in enumerate(normalised):
                fedlt.algorithms.get(name)  # an unknown name is a clear UnknownNameError
                base = dict(TINY, **{**settings, **own}, algorithm=name, algorithm_params=params, rounds=rounds)
                base.setdefault("model", split_model_for(probe(base, Path(tmp) / "probe")))
                base = with_personal(base)  # the per-client evaluation (issue 32), in the workers too
                one = RunConfig(**base, out=Path(tmp) / f"{k}-one")
                many = RunConfig(**base, workers=pool.size, out=Path(tmp) / f"{k}-many")
                _run_keeping_checkpoints(one, LocalRunner(), Path(tmp) / f"{k}-one-kept")
                _run_keeping_checkpoints(many, ParallelRunner(pool), Path(tmp) / f"{k}-many-kept")
                c = Contract(f"algorithm {_label(name, params)!r}" + (f" with {own}" if own else ""))
                for r in range(1, rounds + 1):
                    a = io.load_checkpoint(Path(tmp) / f"{k}-one-kept" / f"{r}.pt")
                    b = io.load_checkpoint(Path(tmp) / f"{k}-many-kept" / f"{r}.pt")
                    for part, what in (("algorithm", "global model and server state"),
                                       ("client_states", "client states")):
                        found = differences(a[part], b[part], 0.0, rtol=0.0)
                        c.check(not found, "bit-identical with workers",
                                f"{what} after round {r} differ between 1 and {pool.size} workers: "
                                f"{'; '.join(found[:3])}")
                c.check(_rows(one.out) == _rows(many.out), "same metrics with workers",
                        f"metrics rows differ between 1 and {pool.size} workers")
    finally:
        if own_pool:
            pool.close()

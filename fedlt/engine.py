"""The public face of a run (a door: imports everything below it, nothing imports it inside fedlt).

``run(config)`` runs ``config.engine``, an engine known by name (fedlt.config.ENGINES): ``local``
(this module: in this process, or in ``workers`` worker processes) or ``flower`` (Flower's
simulation runtime, fedlt.flower.simulation), or a plugin's. Every engine drives the same round
loop (fedlt.run) with its own runner; ``run(config, runner=...)`` drives it with a runner of
one's own. The rest is re-exported from fedlt.run: ``prepare``, ``train_round``,
``sample_clients``, ``RESUMABLE_CHANGES``, ``RunStopped``, ... (docs/runs.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedlt.algorithms.cohort import with_cohort
from fedlt.algorithms.protocol import ClientRunner, LocalRunner
from fedlt.config import ENGINES, RunConfig
from fedlt.parallel import ParallelRunner, resolve_workers
from fedlt.run import loop
from fedlt.run.evaluation import POSTHOC_KEYS  # noqa: F401  (re-exported)
from fedlt.run.parts import (Prepared, check_split_point, client_data, group_classes, load_data,  # noqa: F401
                             make_partition, prepare, round_seed, sample_clients, train_round)
from fedlt.run.resume import (CHECKPOINT_FORMAT, RESUMABLE_CHANGES, RunState, config_changes,  # noqa: F401
                              config_digest)
from fedlt.run.signals import RunStopped, StoppedAtOnce, stop_on_signal  # noqa: F401

OnRound = Callable[[int, dict[str, Any]], None]


def run(config: RunConfig, *, resume: bool = False, on_round: OnRound | None = None,
        on_start: Callable[[int], None] | None = None, runner: ClientRunner | None = None,
        stop_requested: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) the experiment ``config`` in ``config.out``: with
    ``config.engine``, or with ``runner`` running each round's client work
    (fedlt.algorithms.protocol.ClientRunner) — see fedlt.run.loop.run for the callbacks."""
    if runner is None:
        return ENGINES.get(config.engine)(config, resume=resume, on_round=on_round, on_start=on_start)
    return loop.run(config, runner=runner, resume=resume, on_round=on_round, on_start=on_start,
                    stop_requested=stop_requested)


def participants_per_round(config: RunConfig) -> int:
    """How many clients a round samples (sample_clients: round(r·K), at least 1)."""
    return max(int(round(config.participation * config.clients)), 1)


def local_engine(config: RunConfig, *, resume: bool = False, on_round: OnRound | None = None,
                 on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    """In this process: every participant in turn, each on its own copies of what it receives; with
    ``workers`` > 1, in that many worker processes (fedlt.parallel, docs/parallel.md) — never more
    than a round's participants. Under ``faults.on_failure="drop"`` a client whose work fails
    becomes a ClientFailure (docs/faults.md)."""
    workers = min(resolve_workers(config.workers), participants_per_round(config))
    tolerate = config.faults.on_failure == "drop"
    if workers == 1:
        return run(config, resume=resume, on_round=on_round, on_start=on_start,
                   runner=with_cohort(LocalRunner(tolerate), config.cohort))  # --cohort: docs/gpu.md
    with ParallelRunner(workers, tolerate) as runner:
        return run(config, resume=resume, on_round=on_round, on_start=on_start, runner=runner)

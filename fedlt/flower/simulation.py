"""``fedlt run --engine flower``: the run in Flower's simulation runtime — a ServerApp thread in
this process running fedlt's loop, and one virtual SuperNode per client whose ClientApp runs in
Ray workers (one CPU each).

``simulate`` runs several runs one after another in ONE simulation (Ray starts once: several
seconds), e.g. a test's comparisons or a benchmark's settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedlt.config import RunConfig
from fedlt.errors import FedltError
from fedlt.flower import require


@dataclass
class Job:
    config: RunConfig
    resume: bool = False
    on_round: Callable[[int, dict[str, Any]], None] | None = None
    on_start: Callable[[int], None] | None = None


def run(config: RunConfig, *, resume: bool = False, on_round: Callable[[int, dict[str, Any]], None] | None = None,
        on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    return simulate([Job(config, resume, on_round, on_start)])[0]["summary"]


def simulate(jobs: list[Job], num_cpus: int | None = None) -> list[dict[str, Any]]:
    """Run ``jobs`` in turn in one simulation with max(clients) SuperNodes; for each, its summary
    and ``exchanges`` (message round trips it made)."""
    require()
    import logging

    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedlt.engine import run as run_engine
    from fedlt.flower.client_app import app as client_app
    from fedlt.flower.server_app import FlowerRounds

    outcomes: list[dict[str, Any]] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for job in jobs:
            rounds = FlowerRounds(grid, job.config)
            summary = run_engine(job.config, resume=job.resume, on_round=job.on_round, on_start=job.on_start,
                                 runner=rounds)
            outcomes.append({"summary": summary, "exchanges": rounds.exchanges})

    logging.getLogger("flwr").setLevel(logging.WARNING)  # the run's own progress is fedlt's
    init_args: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR}
    if num_cpus is not None:
        init_args["num_cpus"] = num_cpus
    run_simulation(server_app, client_app, num_supernodes=max(job.config.clients for job in jobs),
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": init_args})
    if len(outcomes) < len(jobs):
        raise FedltError("the Flower simulation ended before its runs finished (see Flower's log above)")
    return outcomes

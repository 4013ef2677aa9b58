"""The algorithm contract: two rounds on a tiny MNIST subset give sane metrics, and the run cut
after its first round (same settings, as a kill leaves it) and resumed ends exactly like the
uninterrupted run (SPEC §6)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import fedlt.algorithms
from fedlt.config import RunConfig
from fedlt.engine import prepare, run
from fedlt.errors import FedltError
from fedlt.testing.base import Contract, cut_after, metric_rows, registered, run_differences

TINY = dict(dataset="mnist", train_limit=600, test_limit=100, clients=6, participation=0.5, local_iters=2,
            server_batch=12, eval_every=1, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})


def probe(settings: dict[str, Any], out: Any) -> RunConfig:
    """``settings`` as a RunConfig to probe (``split_model_for``) before a contract adds its
    per-client evaluation: new clients, which need one, aside."""
    return RunConfig(**{**settings, "new_clients": 0}, out=out)


def split_model_for(config: Any) -> str:
    """``mlp``, or ``alexnet`` when the algorithm of ``config`` (an ``mlp`` run) needs a model
    with named cut points (a split algorithm)."""
    try:
        prepare(config.model_copy(update={"model": "mlp"}))
    except FedltError as exc:
        if "split" not in str(exc):
            raise
        return "alexnet"
    return "mlp"


def check_algorithm(algorithm: Any, params: dict[str, Any] | None = None, *, model: str | None = None,
                    **settings: Any) -> None:
    """Check an algorithm, given by registered name or as its factory, with ``params`` (its
    ``algorithm_params``) on a tiny MNIST subset (``settings`` override :data:`TINY`).

    ``model`` defaults to ``mlp``, or ``alexnet`` when the algorithm needs split points. Properties:
    [two rounds] (metrics for rounds 1 and 2, accuracies in [0, 1], finite losses); [exact resume]
    (the 2-round run's directory as a kill after round 1 leaves it, resumed with the same settings,
    ends exactly like the uninterrupted run: the summary, every metrics row — wall-clock fields
    aside — and the checkpointed server and client states, bit for bit; a failure names the first
    field that differs).
    """
    with registered(fedlt.algorithms.REGISTRY, algorithm, "contract_algorithm") as name, \
            tempfile.TemporaryDirectory(prefix="fedlt-contract-") as tmp:
        c = Contract(f"algorithm {name!r}")
        base = dict(TINY, **settings, algorithm=name, algorithm_params=dict(params or {}), rounds=2)
        base["model"] = model or split_model_for(RunConfig(**base, out=Path(tmp) / "probe"))
        reference, cut = Path(tmp) / "reference", Path(tmp) / "cut"
        with c.property("two rounds"):
            summary = run(RunConfig(**base, out=reference), on_round=cut_after(1, reference, cut))
        rows = metric_rows(reference)
        c.check([r["round"] for r in rows] == [1, 2], "two rounds", f"metrics for rounds {[r['round'] for r in rows]}")
        c.check(all(0 <= r["accuracy"] <= 1 and r["loss"] == r["loss"] for r in rows), "two rounds",
                f"accuracies {[r['accuracy'] for r in rows]}, losses {[r['loss'] for r in rows]}")
        with c.property("exact resume"):
            resumed = run(RunConfig(**base, out=cut), resume=True)
        # the summary, every row, the server state (model, aggregator, control variates, ...) and
        # every client's state, bit for bit; the first field that differs is named
        found = run_differences(reference, cut, (summary, resumed))
        c.check(not found, "exact resume", "cut after round 1 (same settings) and resumed differs from the "
                f"uninterrupted run: {'; '.join(found[:3])}")

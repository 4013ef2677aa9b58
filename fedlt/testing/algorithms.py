"""The algorithm contract: two rounds on a tiny MNIST subset give sane metrics, and a run cut
after its first round and resumed ends exactly like the uninterrupted run (SPEC §6)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from fedlt import io
from fedlt.errors import FedltError
from fedlt.testing.base import Contract, registered

TINY = dict(dataset="mnist", train_limit=600, test_limit=100, clients=6, participation=0.5, local_iters=2,
            server_batch=12, eval_every=1, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})


def split_model_for(config: Any) -> str:
    """``mlp``, or ``alexnet`` when the algorithm of ``config`` (an ``mlp`` run) needs a model
    with named cut points (a split algorithm)."""
    from fedlt.engine import prepare

    try:
        prepare(config.model_copy(update={"model": "mlp"}))
    except FedltError as exc:
        if "split" not in str(exc):
            raise
        return "alexnet"
    return "mlp"


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without its wall-clock fields (train_s, eval_s, round_s)."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_algorithm(algorithm: Any, params: dict[str, Any] | None = None, *, model: str | None = None,
                    **settings: Any) -> None:
    """Check an algorithm, given by registered name or as its factory, with ``params`` (its
    ``algorithm_params``) on a tiny MNIST subset (``settings`` override :data:`TINY`).

    ``model`` defaults to ``mlp``, or ``alexnet`` when the algorithm needs split points. Properties:
    [two rounds] (metrics for rounds 1 and 2, accuracies in [0, 1], finite losses); [exact resume]
    (1 round, then resumed to 2, equals 2 rounds in one go: the summary and every metrics row,
    wall-clock fields aside).
    """
    import fedlt.algorithms
    from fedlt.config import RunConfig
    from fedlt.engine import run

    with registered(fedlt.algorithms.REGISTRY, algorithm, "contract_algorithm") as name, \
            tempfile.TemporaryDirectory(prefix="fedlt-contract-") as tmp:
        c = Contract(f"algorithm {name!r}")
        base = dict(TINY, **settings, algorithm=name, algorithm_params=dict(params or {}))
        base["model"] = model or split_model_for(RunConfig(**base, out=Path(tmp) / "probe"))
        with c.property("two rounds"):
            reference = run(RunConfig(**base, rounds=2, out=Path(tmp) / "reference"))
        rows = _rows(Path(tmp) / "reference")
        c.check([r["round"] for r in rows] == [1, 2], "two rounds", f"metrics for rounds {[r['round'] for r in rows]}")
        c.check(all(0 <= r["accuracy"] <= 1 and r["loss"] == r["loss"] for r in rows), "two rounds",
                f"accuracies {[r['accuracy'] for r in rows]}, losses {[r['loss'] for r in rows]}")
        with c.property("exact resume"):
            run(RunConfig(**base, rounds=1, out=Path(tmp) / "cut"))
            resumed = run(RunConfig(**base, rounds=2, out=Path(tmp) / "cut"), resume=True)
        resumed.pop("wall_time_s"), reference.pop("wall_time_s")
        c.check(resumed == reference, "exact resume", "the resumed run's summary differs from the uninterrupted run's")
        c.check(_rows(Path(tmp) / "cut") == _rows(Path(tmp) / "reference"), "exact resume",
                "the resumed run's metrics.jsonl differs from the uninterrupted run's")
        # the server state (model, aggregator, control variates, ...) and every client's state, bit for bit
        ends = [io.load_checkpoint(Path(tmp) / d / "checkpoint.pt") for d in ("cut", "reference")]
        for part in ("algorithm", "client_states"):
            c.check(_identical(ends[0][part], ends[1][part]), "exact resume",
                    f"the resumed run's checkpointed {part} state differs from the uninterrupted run's")


def _identical(a: Any, b: Any) -> bool:
    """Nested dicts of tensors and plain values, equal bit for bit."""
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b

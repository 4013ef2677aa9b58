"""A round's evaluation: the global model's test metrics (and its post-hoc calibrations'), run
inline or overlapped by one ``Evaluator``.

Overlapped (a runner whose clients work elsewhere: fedlt.parallel), round r's global model is
evaluated on a copy in a thread while round r+1 trains; its row is finished once that round has
trained (``settle``). The row's ``round_s`` is then the round's own time plus the wait for its
evaluation, so the rows still add up to the wall time; ``eval_s`` stays the evaluation's own time.

May import: the bottom layer, the components (metrics, posthoc) and the algorithms.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import fedlt.posthoc
from fedlt.algorithms.base import NonFiniteLoss
from fedlt.metrics import evaluate

# what a post-hoc calibration (e.g. tau_norm) adds to an evaluated row, as "<name>_<key>"
POSTHOC_KEYS = ("accuracy", "balanced_accuracy", "many_accuracy", "medium_accuracy", "few_accuracy")


def scores_of(model: torch.nn.Module, number: int, prep: Any, client_counts: np.ndarray | None
              ) -> tuple[dict[str, Any], float]:
    """The evaluation fields of round ``number``'s global model (and of its post-hoc
    calibrations), and the seconds they took."""
    config, data = prep.config, prep.data
    device = torch.device(config.device)
    began = time.perf_counter()
    scores = evaluate(model, data.x_test, data.y_test.cpu(), data.num_classes, prep.groups, config.eval_batch,
                      device, client_counts)
    if not np.isfinite(scores["loss"]):  # finite weights whose logits overflow float32
        raise NonFiniteLoss(f"round {number}: the global model's test loss is {scores['loss']} (its logits overflow)")
    for spec in config.posthoc:  # calibrated copies of the global model, reported beside it
        params = dict(spec) if isinstance(spec, dict) else {"name": spec}
        name = params.pop("name")
        calibrated = fedlt.posthoc.get(name)(model, **params)
        more = evaluate(calibrated, data.x_test, data.y_test.cpu(), data.num_classes, prep.groups,
                        config.eval_batch, device)
        scores.update({f"{name}_{k}": more[k] for k in POSTHOC_KEYS if k in more})
    return scores, time.perf_counter() - began


@dataclass
class Finished:
    """A round's row with its evaluation in, ready to be recorded."""

    row: dict[str, Any]
    train_s: float
    eval_s: float
    round_s: float
    snapshot: dict[str, Any] | None = None  # the states at the round's end, when training has moved on


@dataclass
class _Pending:
    row: dict[str, Any]
    train_s: float
    own_s: float
    snapshot: dict[str, Any] | None
    future: Future


class Evaluator:
    """Evaluates each round's global model, inline or (``overlapped``) in one thread beside the
    next round's training. ``submit`` returns the rows finished now, ``settle`` the one whose
    evaluation was still running (each at most once, in round order)."""

    def __init__(self, prep: Any, overlapped: bool) -> None:
        self.prep = prep
        self.client_counts = prep.counts.numpy() if prep.config.client_eval else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fedlt-eval") if overlapped else None
        self.pending: _Pending | None = None

    def scores(self, model: torch.nn.Module, number: int) -> tuple[dict[str, Any], float]:
        return scores_of(model, number, self.prep, self.client_counts)

    def submit(self, row: dict[str, Any], number: int, train_s: float, started: float, evaluated: bool,
               snapshot: Any = None) -> Finished | None:
        """Round ``number``'s row (``evaluated``: with an evaluation of the global model as it is
        now). Overlapped and not the last round: evaluated on a copy in the thread (None is
        returned; ``snapshot()`` gives the states to checkpoint with it, when one is due)."""
        model = self.prep.algorithm.global_model()
        if evaluated and self.pool is not None and number < self.prep.config.rounds:
            held = snapshot() if snapshot is not None else None
            future = self.pool.submit(self.scores, copy.deepcopy(model), number)  # fixed while the next round trains
            self.pending = _Pending(row, train_s, time.perf_counter() - started, held, future)
            return None
        scores, eval_s = self.scores(model, number) if evaluated else ({}, 0.0)
        row.update(scores)
        return Finished(row, train_s, eval_s, time.perf_counter() - started)

    def settle(self) -> Finished | None:
        """The round being evaluated, finished (its evaluation's wait counted in its round_s)."""
        if self.pending is None:
            return None
        held, self.pending = self.pending, None
        waited = time.perf_counter()
        scores, eval_s = held.future.result()
        held.row.update(scores)
        return Finished(held.row, held.train_s, eval_s, held.own_s + time.perf_counter() - waited, held.snapshot)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

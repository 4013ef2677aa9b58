"""A round's evaluation: the global model's test metrics (and its post-hoc calibrations'), run
inline or overlapped by one ``Evaluator``; and each client's own numbers (``ClientEvaluation``,
SPEC §7: the ``client_eval`` modes on the ``client_test`` sets), run inline through the runner.

Overlapped (a runner whose clients work elsewhere: fedlt.parallel), round r's global model is
evaluated on a copy in a thread while round r+1 trains; its row is finished once that round has
trained (``settle``). The row's ``round_s`` is then the round's own time plus the wait for its
evaluation, so the rows still add up to the wall time; ``eval_s`` stays the evaluation's own time.

May import: the bottom layer, the components (metrics, posthoc) and the algorithms.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import fedlt.posthoc
from fedlt.algorithms.base import ClientData, NonFiniteLoss
from fedlt.algorithms.personal import ClientScores, EvalModeSpec, EvalTask, GlobalLocal, eval_mode_of, score_clients
from fedlt.algorithms.protocol import ClientFailure, ClientStates, evaluate_with
from fedlt.algorithms.split import classifier_of
from fedlt.metrics import client_metrics, evaluate, per_client_summary
from fedlt.models import eval_mode
from fedlt.run.parts import client_data, client_test_data, group_classes, test_rows

# what a post-hoc calibration (e.g. tau_norm) adds to an evaluated row, as "<name>_<key>"
POSTHOC_KEYS = ("accuracy", "balanced_accuracy", "many_accuracy", "medium_accuracy", "few_accuracy")
NEW = "new_clients_"  # the prefix of every field about the clients that never train (new_clients)


def scores_of(model: torch.nn.Module, number: int, prep: Any, client_counts: np.ndarray | None,
              new_counts: np.ndarray | None = None) -> tuple[dict[str, Any], float]:
    """The evaluation fields of round ``number``'s global model (and of its post-hoc
    calibrations), and the seconds they took; ``client_counts`` / ``new_counts``: the training
    clients' / the new clients' class counts, for their expected accuracies (``client_*``,
    ``new_clients_client_*``)."""
    config, data = prep.config, prep.data
    device = torch.device(config.device)
    began = time.perf_counter()
    scores = evaluate(model, data.x_test, data.y_test.cpu(), data.num_classes, prep.groups, config.eval_batch,
                      device, client_counts)
    if new_counts is not None:
        scores.update({f"{NEW}{k}": v for k, v in client_metrics(scores["per_class_accuracy"], new_counts).items()})
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


EVAL_CLIENTS_SALT = 0xE7A1  # the stream of the client_eval_fraction sample
CHUNK = 64  # EvalTasks built and sent at a time: the clients' data slices held at once stay bounded


def eval_clients(num_clients: int, fraction: float, sampling_seed: int) -> list[int]:
    """The clients given the per-client modes: all, or round(fraction·K) of them (at least one),
    the same in every round, drawn from a stream of the sampling seed's own."""
    if fraction >= 1:
        return list(range(num_clients))
    m = max(int(round(fraction * num_clients)), 1)
    rng = np.random.default_rng([sampling_seed, EVAL_CLIENTS_SALT])
    return sorted(rng.choice(num_clients, m, replace=False).tolist())


class ClientEvaluation:
    """Each evaluated client's numbers for each ``client_eval`` mode (SPEC §7), through the runner
    (``runner.evaluate``: where the client's data and state live), the store only read.

    Row fields per mode ``<mode>_``: ``per_client_summary``'s (mean_weighted, mean, std, min,
    worst10, many / medium / few by the client's own training counts, clients), ``loss`` (the mean
    test cross-entropy over all the clients' test samples), ``client_accuracy`` (each client's
    accuracy, in client order; ``client_ids`` beside it when not every client is there) and
    ``failed`` (client -> why) when a tolerant runner lost some. The clients that never train
    (``new_clients``) get the same fields, all of them every time, as ``new_clients_<mode>_*``."""

    def __init__(self, prep: Any, runner: Any, states: ClientStates,
                 source: tuple[Any, torch.Tensor] | None = None) -> None:
        config = prep.config
        self.prep, self.runner, self.states, self.source = prep, runner, states, source
        self.modes: list[EvalModeSpec] = [eval_mode_of(spec) for spec in config.client_eval_modes()]
        self.clients = eval_clients(config.clients, config.client_eval_fraction, config.seeds.sampling)
        self.new = prep.new_clients  # all of them, every evaluation: they are few, and never sampled
        self.device = torch.device(config.device)

    def __bool__(self) -> bool:
        return bool(self.modes)

    def __call__(self, number: int) -> dict[str, Any]:
        """The fields of round ``number`` (its global model and the clients' states at its end):
        the training clients' ``<mode>_*``, then the new clients' ``new_clients_<mode>_*``."""
        model = self.prep.algorithm.global_model()
        weights, classifier = model.state_dict(), classifier_of(model)
        row: dict[str, Any] = {}
        for prefix, clients, everyone in (("", self.clients, range(self.prep.config.clients)),
                                          (NEW, self.new, self.new)):
            done: dict[EvalModeSpec, list[Any]] = {}
            for mode in self.modes if clients else ():
                run = self.runs_as(mode)
                if run not in done and isinstance(run, GlobalLocal):
                    done[run] = self.global_local(model, clients)
                elif run not in done:
                    done[run] = []
                    for start in range(0, len(clients), CHUNK):
                        tasks = [self.task(run, cid, number - 1, weights, classifier)
                                 for cid in clients[start:start + CHUNK]]
                        try:
                            done[run] += evaluate_with(self.runner, self.prep.algorithm, tasks)
                        except NonFiniteLoss as exc:  # a fine-tune diverged: the evaluation's, not the training's
                            raise NonFiniteLoss(f"round {number}'s {run.name} evaluation (on a copy of the round's "
                                                f"model; training was not affected): {exc}") from None
                row.update(self.fields(prefix + mode.name, done[run], list(everyone)))
        return row

    def global_local(self, model: torch.nn.Module, clients: list[int] | None = None) -> list[ClientScores]:
        """``global_local`` for ``clients`` (default: the evaluated training clients) in one pass:
        the global model scores each row any client tests on once (matched test sets are rows of
        the test set, holdout parts rows of the training set), every client's numbers gathered
        from those rows — the same as the per-client loop (tests/test_personal_eval.py), without
        a pass per client."""
        held, clients = self.prep.client_tests, self.clients if clients is None else clients
        chosen = [np.asarray(held.test_indices[cid], dtype=np.int64) for cid in clients]
        union, where = np.unique(np.concatenate(chosen) if chosen else np.zeros(0, np.int64), return_inverse=True)
        x, y = test_rows(self.prep, union, self.device, self.source)
        rows = ClientData(-1, x, y, torch.zeros(0, dtype=torch.int64))
        positions = [torch.as_tensor(p) for p in np.split(where.reshape(-1), np.cumsum([len(c) for c in chosen])[:-1])]
        with eval_mode(model):
            return score_clients(model, rows, positions, clients, self.prep.ctx.num_classes,
                                 self.prep.config.eval_batch)

    def runs_as(self, mode: EvalModeSpec) -> EvalModeSpec:
        """The mode whose tasks give ``mode``'s scores: ``personal`` of an algorithm that keeps no
        personal model is ``global_local`` (the same model, by definition: evaluated once)."""
        if mode.name == "personal" and getattr(self.prep.algorithm, "personal_model", None) is None:
            return GlobalLocal()
        return mode

    def task(self, mode: EvalModeSpec, cid: int, r: int, weights: dict, classifier: torch.Tensor | None) -> EvalTask:
        prep, ctx = self.prep, self.prep.ctx
        probe = ClientData(cid, torch.empty(0), torch.empty(0), prep.counts[cid].to(self.device))
        trains = mode.name == "finetune"
        schedule = (dataclasses.replace(ctx.schedule(ctx.batch_size), batch=ctx.batch_size, iters=None,
                                        epochs=mode.epochs) if trains else None)
        return EvalTask(cid, ctx.round(r, [probe], classifier), weights,
                        self.states.get(cid) if mode.name == "personal" else {}, mode.name,
                        data=client_data(prep, cid, self.device, self.source) if mode.name != "global_local" else None,
                        test=client_test_data(prep, cid, self.device, self.source), schedule=schedule,
                        objective=getattr(mode, "loss", "ce"), eval_batch=prep.config.eval_batch,
                        new_client=cid >= prep.config.clients)

    def fields(self, prefix: str, outcomes: list[Any], everyone: list[int]) -> dict[str, Any]:
        """The row fields ``<prefix>_*`` of one mode's outcomes; ``client_ids`` when they are not
        ``everyone`` (a sample of the clients, or some lost)."""
        scored = [o for o in outcomes if isinstance(o, ClientScores)]
        num_classes = self.prep.ctx.num_classes
        empty = np.zeros((0, num_classes), np.int64)
        correct = np.stack([o.correct.cpu().numpy() for o in scored]) if scored else empty
        total = np.stack([o.total.cpu().numpy() for o in scored]) if scored else empty
        cids = [o.cid for o in scored]
        out = per_client_summary(correct, total, self.prep.counts.numpy()[cids], prefix,
                                 group_of=lambda n: group_classes(n, self.prep.config))
        sizes = total.sum(1)
        out[f"{prefix}_loss"] = float(sum(o.loss_sum for o in scored) / sizes.sum()) if sizes.sum() else None
        out[f"{prefix}_client_accuracy"] = [round(float(c / n), 6) if n else None
                                            for c, n in zip(correct.sum(1), sizes)]
        if cids != everyone:
            out[f"{prefix}_client_ids"] = cids
        failed = {str(o.cid): o.reason for o in outcomes if isinstance(o, ClientFailure)}
        if failed:
            out[f"{prefix}_failed"] = failed
        return out


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

    def __init__(self, prep: Any, overlapped: bool, clients: ClientEvaluation | None = None) -> None:
        self.prep, self.clients = prep, clients
        expected = prep.config.client_eval_expected()
        self.client_counts = prep.training_counts.numpy() if expected else None
        self.new_counts = prep.counts[prep.config.clients:].numpy() if expected and prep.new_clients else None
        # torch's thread count is per OS thread under OpenMP: a new thread starts with the
        # machine's default, and a loss summed by 2 threads rounds unlike the run's 1 (seen on a
        # 2-core machine: 2.303905821170849 vs …083074); the evaluating thread takes the run's
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fedlt-eval", initializer=torch.set_num_threads,
                                       initargs=(torch.get_num_threads(),)) if overlapped else None
        self.pending: _Pending | None = None

    def scores(self, model: torch.nn.Module, number: int) -> tuple[dict[str, Any], float]:
        return scores_of(model, number, self.prep, self.client_counts, self.new_counts)

    def submit(self, row: dict[str, Any], number: int, train_s: float, started: float, evaluated: bool,
               snapshot: Any = None) -> Finished | None:
        """Round ``number``'s row (``evaluated``: with an evaluation of the global model as it is
        now). Overlapped and not the last round: evaluated on a copy in the thread (None is
        returned; ``snapshot()`` gives the states to checkpoint with it, when one is due)."""
        model = self.prep.algorithm.global_model()
        if evaluated and self.clients:  # inline, before the next round moves the model and the store on
            began = time.perf_counter()
            row.update(self.clients(number))
            row["client_eval_s"] = round(time.perf_counter() - began, 4)
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

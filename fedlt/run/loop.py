"""The round loop: one straight walk from a RunConfig to a run directory.

    RunConfig -> dataset (in-memory tensors) -> partition (index lists + manifest)
      -> for each round: sample -> train (tasks -> client work -> strategy) -> aggregate (checked)
         -> evaluate -> record (metrics.jsonl) -> checkpoint
      -> summary.json

A run directory holds ``config.json`` (resolved), ``partition.json`` (manifest),
``partition.npz`` (the indices, reusable with ``partition_file``), ``metrics.jsonl`` (one line
per round: train loss, participants and timings; evaluated rounds add the evaluation),
``checkpoint.pt`` (+ ``checkpoint.json``, its round in plain text) and, when done,
``summary.json``. Every file is written atomically; ``run(config, resume=True)`` continues from
the checkpoint exactly (docs/runs.md).

Randomness (SPEC §6): the data seed drives only the partition (saved with the run), the model
seed only the initial weights (saved in every checkpoint), and the sampling seed every draw made
during training — client sampling, minibatch orders, and any use of torch's global generator
(dropout, ...) — each derived from (sampling seed, round[, client]) rather than carried, so a
resumed round draws exactly what the uninterrupted run drew. Stateful generators that live
across rounds (SGB's gating) are part of the client states in the checkpoint.

May import: the bottom layer, the components, the algorithms, fedlt.config and the rest of
fedlt.run. The engines (fedlt.engine, fedlt.parallel, fedlt.flower) call ``run`` with a runner.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import fedlt.availability
import fedlt.datasets
import fedlt.partitioners
from fedlt import io, rundir
from fedlt.algorithms.base import NonFiniteLoss, from_spec
from fedlt.algorithms.cohort import cohort_fallback
from fedlt.algorithms.cohort import graphs_notice as cohort_graphs_notice
from fedlt.algorithms.fedavg_family import compile_fallback, compile_notice, graphs_fallback, graphs_notice
from fedlt.algorithms.protocol import ClientRunner, copy_tensors
from fedlt.config import RunConfig, recorded as recorded_config
from fedlt.datasets.source import images
from fedlt.errors import FedltError
from fedlt.faults import PolicyRunner, RoundIncomplete
from fedlt.uploads import UploadRunner, UploadSettings
from fedlt.uploads import summary as upload_summary
from fedlt.metrics import PER_CLIENT_HIGHER, PER_CLIENT_KEYS, best_of
from fedlt.run import parts
from fedlt.run.evaluation import NEW, ClientEvaluation, Evaluator, Finished
from fedlt.run.resume import Checkpoints, RunState, check_resumable, restore, store
from fedlt.run.signals import RunStopped, stop_on_signal

OnRound = Callable[[int, dict[str, Any]], None]
LOG = logging.getLogger("fedlt")  # a notice of a choice made for the user: one line on stderr unless configured


def check_model_finite(model: torch.nn.Module, where: str) -> None:
    for name, tensor in model.state_dict().items():
        # a float64 sum of float32 values cannot overflow, so it is finite iff every value is;
        # one reduction instead of a boolean copy of the weights
        if tensor.is_floating_point() and not torch.isfinite(tensor.sum(dtype=torch.float64)):
            raise NonFiniteLoss(f"non-finite weights in {name} of the global model after {where}")


class RoundLoop:
    """One run's rounds, each phase a named call: ``sample`` → ``train`` (client work and the
    strategy's aggregation, checked finite) → ``evaluate`` → ``record`` (with the checkpoint when
    due); ``stop_if_asked`` between rounds."""

    def __init__(self, prep: parts.Prepared, state: RunState, runner: ClientRunner, on_round: OnRound | None,
                 stop_requested: Callable[[], int | None] | None) -> None:
        config = prep.config
        self.config, self.prep, self.state, self.algorithm = config, prep, state, prep.algorithm
        self.out = Path(config.out)
        self.on_round, self.stop_requested = on_round, stop_requested
        self.device = torch.device(config.device)
        self.uploads = UploadRunner(runner, UploadSettings.of(config, prep.train_sizes))  # upload plan, bytes, DP, secure aggregation
        self.uploads.load_state_dict(state.uploads)
        self.checkpoints = Checkpoints(self.out, config, prep, state, server=self.uploads)
        self.availability = from_spec(fedlt.availability.REGISTRY, config.availability)
        self.policy = PolicyRunner(self.uploads, self.availability, config.faults, config.seeds.sampling)
        self.faults_possible = (config.faults.on_failure == "drop" or self.availability.acts
                                or config.faults.round_timeout is not None)
        self.source = (images(prep.data.x_train).to(self.device), prep.data.y_train.to(self.device))
        self.evaluator = Evaluator(prep, overlapped=bool(getattr(runner, "overlaps_evaluation", False)),
                                   clients=ClientEvaluation(prep, self.policy, state.client_states, self.source))
        self.trained = state.round  # rounds trained; one ahead of state.round while a round is evaluated
        self._budget_checked: tuple[int, bool] | None = None  # (round, spent): the budget's last answer

    def run(self) -> None:
        try:
            with stop_on_signal(self.state):
                while self.trained < self.config.rounds:
                    if self.budget_spent(self.trained):
                        break
                    started = time.perf_counter()
                    chosen = self.sample(self.trained)
                    row = self.train(self.trained, chosen)
                    self.trained += 1
                    self.evaluate(row, started)
                    self.stop_if_asked()
                self.record(self.settle())
        finally:
            self.evaluator.close()

    # -- phases -----------------------------------------------------------------------------------
    def sample(self, r: int) -> list[int]:
        """Round ``r``'s participants (:meth:`participants`), announced to the round policy."""
        chosen, reachable = self.participants(r)
        self.policy.begin(r, chosen, reachable)
        return chosen

    def participants(self, r: int) -> tuple[list[int], list[int] | None]:
        """(round ``r``'s participants, the reachable clients they are drawn from when availability
        acts before sampling, else None)."""
        c = self.config
        reachable = None
        if self.availability.acts and self.availability.when == "before":
            reachable = [cid for cid in range(c.clients) if self.availability.available(c.seeds.sampling, r, cid)]
        chosen = (parts.sample_clients(c.clients, c.participation, c.seeds.sampling, r) if reachable is None
                  else parts.sample_clients(c.clients, c.participation, c.seeds.sampling, r, available=reachable))
        return chosen, reachable

    def train(self, r: int, chosen: list[int]) -> dict[str, Any]:
        """The round's client work and aggregation; its row. A failure finishes the round being
        evaluated first, then is raised with what stands on disk."""
        # a round that ends below min_results is not applied: keep the last complete round's state
        # when it may not be on disk already (checkpoint_every > 1)
        skip = self.config.faults.on_short == "skip"
        self.state.client_states.end_round()  # the store's cache holds this round's clients only
        before = (copy.deepcopy((self.algorithm.state_dict(), self.state.client_states.state_dict()))
                  if self.faults_possible and (skip or self.state.checkpoint_round != r) else None)
        clients = [parts.client_data(self.prep, cid, self.device, self.source) for cid in chosen]
        try:
            row: dict[str, Any] = {"round": r + 1, "participants": len(chosen),
                                   **parts.train_round(self.algorithm, self.prep.ctx, r, clients,
                                                       self.state.client_states, self.policy)}
            row.update(self.policy.log.row() | self.uploads.row())
            check_model_finite(self.algorithm.global_model(), "aggregation")
            return row
        except RoundIncomplete as exc:
            if not skip:
                self.record(self.settle())
                raise self.explain(exc, r, chosen, before) from None
            return self.skipped(exc, r, chosen, before)
        except Exception as exc:
            self.record(self.settle())
            failure = self.explain(exc, r, chosen, before)
            if failure is exc:
                raise
            raise failure from None

    def skipped(self, exc: RoundIncomplete, r: int, chosen: list[int], before: Any) -> dict[str, Any]:
        """A short round under ``on_short="skip"``: the algorithm's and the clients' states as they
        were before it; its row says why (the run goes on)."""
        if before is not None:
            self.algorithm.load_state_dict(before[0])
            self.state.client_states.load_state_dict(before[1])
        row = {"round": r + 1, "participants": len(chosen), "skipped": str(exc)}
        row.update(self.policy.log.row() | self.uploads.row())
        return row

    def explain(self, exc: Exception, r: int, chosen: list[int], before: Any) -> Exception:
        """The error a failed round ends the run with (the round is never applied)."""
        kept = self.checkpoints.kept
        if isinstance(exc, RoundIncomplete):
            if before is not None:  # the last complete round, as it was, onto disk
                self.algorithm.load_state_dict(before[0])
                self.state.client_states.load_state_dict(before[1])
                self.checkpoints.save()
            return RoundIncomplete(f"{exc}; the round is not applied, {kept()}; resume with: fedlt run "
                                   f"--resume {self.out} (e.g. with a lower --min-results)")
        if isinstance(exc, NonFiniteLoss):
            return NonFiniteLoss(f"round {r + 1} (clients {chosen}): {exc}; {kept()}")
        if isinstance(exc, ValueError) and "Expected more than 1 value per channel" in str(exc):
            return FedltError(
                f"round {r + 1} (clients {chosen}): a BatchNorm layer got one value per channel "
                f"in training (a batch of 1 sample at a 1×1 feature map); give clients larger batches "
                f"(server_batch, or batch_size with local_epochs) or cut the model before that layer; {kept()}")
        return exc

    def evaluate(self, row: dict[str, Any], started: float) -> None:
        """The trained round's evaluation (when due), inline or overlapped with the next round;
        whatever rows are finished are recorded, the previous round's first."""
        trained, c = self.trained, self.config
        train_s = time.perf_counter() - started
        evaluated = trained % c.eval_every == 0 or trained == c.rounds or self.budget_spent(trained)
        self.record(self.settle())
        snapshot = self.snapshot if trained % c.checkpoint_every == 0 else None
        try:
            finished = self.evaluator.submit(row, trained, train_s, started, evaluated, snapshot)
        except NonFiniteLoss as exc:
            raise NonFiniteLoss(f"{exc}; {self.checkpoints.kept()}") from None
        self.record(finished)

    def record(self, finished: Finished | None) -> None:
        """A round's row written (and checkpointed when due), in round order."""
        if finished is None:
            return
        state, row = self.state, finished.row
        row.update(train_s=round(finished.train_s, 4), eval_s=round(finished.eval_s, 4),
                   round_s=round(finished.round_s, 4))
        state.wall_time += finished.round_s
        state.round += 1
        state.metrics.append(row)
        io.append_line(self.out / "metrics.jsonl", row)
        if self.checkpoints.due(state.round):
            self.checkpoints.save(finished.snapshot)
        if self.on_round is not None:
            self.on_round(state.round, row)

    def stop_if_asked(self) -> None:
        """After a round: a stop asked by a signal (or by the engine's ``stop_requested``) ends
        the run here, checkpointed."""
        state = self.state
        if state.stop_signal is None and self.stop_requested is not None:
            state.stop_signal = self.stop_requested()
        if state.stop_signal is not None and self.trained < self.config.rounds:
            self.record(self.settle())
            if state.checkpoint_round != state.round:
                self.checkpoints.save()
            raise RunStopped(state.stop_signal, state.round, self.out)

    # -- the privacy budget -----------------------------------------------------------------------
    def budget_spent(self, r: int) -> bool:
        """Whether round ``r`` (from 0) would take the run's ε past ``stop_at_epsilon`` were its
        participants to train as planned; said once, in one line. A run whose first round alone
        would is refused."""
        budget = self.config.stop_at_epsilon
        if budget is None or r >= self.config.rounds:
            return False
        if self._budget_checked is not None and self._budget_checked[0] == r:
            return self._budget_checked[1]
        after = self.uploads.prospective_epsilon(self.participants(r)[0])  # the clients sample() will draw
        spent = after > budget
        if spent and r == 0:
            raise FedltError(f"stop_at_epsilon: the first round alone would spend ε = {after:.4g} > {budget:g} "
                             "(raise the budget or the noise multiplier)")
        if spent and (self._budget_checked is None or self._budget_checked[0] != r):
            LOG.warning(f"fedlt: stopped after round {r}: round {r + 1} would take ε from "
                        f"{self.uploads.accountant.epsilon():.4g} to {after:.4g}, past the budget {budget:g}")
        self._budget_checked = (r, spent)
        return spent

    # -- helpers ----------------------------------------------------------------------------------
    def settle(self) -> Finished | None:
        try:
            return self.evaluator.settle()
        except NonFiniteLoss as exc:
            raise NonFiniteLoss(f"{exc}; {self.checkpoints.kept()}") from None

    def snapshot(self) -> dict[str, Any]:
        """The states at a round's end, copied: the next round's training moves them on."""
        return copy_tensors(self.checkpoints.snapshot())


def start(config: RunConfig, resume: bool) -> tuple[parts.Prepared, RunState]:
    """The run's parts and state (from its checkpoint when resuming), checked before anything is
    written: a bad setting or checkpoint leaves the directory as it was; then its first files."""
    out = Path(config.out)
    partition, recorded = None, None
    if resume:
        recorded = check_resumable(out, config)
        partition = fedlt.partitioners.Partition.load(out / "partition.npz")
    prep = parts.prepare(config, partition)
    if resume:
        prep.partition.check_dataset(prep.data.y_train.numpy(), prep.data.name)
    fingerprint = fedlt.datasets.fingerprint(prep.data)  # the training inputs, not only the labels
    state = RunState(round=0, metrics=[], wall_time=0.0, client_states=store(out, config), data_fingerprint=fingerprint)
    checkpoint = out / "checkpoint.pt"
    if resume and checkpoint.exists():
        state = restore(prep, io.load_checkpoint(checkpoint), checkpoint, config, fingerprint, recorded)
        if len(state.client_states):  # states read back must be ones this algorithm can have written
            state.client_states.expect(parts.client_state_template(prep, max(state.round - 1, 0)), checkpoint)
    rundir.remove_leftovers(out)  # temporary files of a write a kill interrupted
    state.client_states.discard_uncommitted()  # and the client-state files written after the checkpoint
    io.write_json(out / "config.json", recorded_config(config))
    if not resume:
        io.write_json(out / "partition.json", prep.manifest())
        prep.partition.save(out / "partition.npz")
    io.write_lines(out / "metrics.jsonl", state.metrics)  # on resume: drop lines written after the checkpoint
    (out / "summary.json").unlink(missing_ok=True)  # a resumed run's summary is rewritten at its end
    return prep, state


@contextmanager
def run_threads(config: RunConfig) -> Iterator[RunConfig]:
    """The run's torch intra-op threads, set for its duration (the process's count restored after):
    ``config.threads``, or the count the process has, written into the config the run records — a
    float reduction split over another number of threads rounds differently, so a rerun from the
    run's config.json needs the same count to give the same bits."""
    before = torch.get_num_threads()
    threads = config.threads or before
    torch.set_num_threads(threads)
    try:
        yield config if config.threads == threads else config.model_copy(update={"threads": threads})
    finally:
        torch.set_num_threads(before)


def run(config: RunConfig, *, runner: ClientRunner, resume: bool = False, on_round: OnRound | None = None,
        on_start: Callable[[int], None] | None = None,
        stop_requested: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) the experiment ``config`` in ``config.out`` with
    ``runner`` running each round's client work, holding the run directory for the whole run
    (``fedlt.rundir.claim``: one process per directory, a new run only into a new or empty one).

    ``on_start(rounds_done)`` is called once every check has passed, just before the first round
    (a progress display starts there); ``on_round(rounds_done, row)`` after every round.
    ``stop_requested()`` is asked after every round when the loop runs off the main thread (where
    it cannot catch signals): the signal number the engine's own handler caught, or None.

    Raises FedltError for bad settings (before anything is written), NonFiniteLoss when a loss or
    the global model stops being finite (the last good checkpoint stays), and RunStopped after
    saving a checkpoint when SIGINT/SIGTERM arrives.
    """
    with rundir.claim(Path(config.out), resume=resume), run_threads(config) as config:
        try:
            prep, state = start(config, resume)
            bind = getattr(runner, "bind", None)
            if bind is not None:  # a runner with processes of its own (fedlt.parallel) gets the run's parts once
                bind(prep)
            fallback = cohort_fallback(runner, prep.algorithm, config.cohort,
                                       sample_level=(config.privacy or {}).get("name") == "sample_level")
            if fallback is not None:  # said once, before the first round (and kept in summary.json)
                LOG.warning(f"fedlt: --cohort {config.cohort} falls back to one client at a time: {fallback}")
            if config.compile:  # what --compile does here, said once (docs/gpu.md#compiled-steps)
                LOG.warning(compile_notice(prep.algorithm, torch.device(config.device)))
            if config.graphs:  # docs/gpu.md#whole-step-cuda-graphs
                notice = cohort_graphs_notice if config.cohort > 1 and fallback is None else graphs_notice
                LOG.warning(notice(prep.algorithm, torch.device(config.device)))
            if on_start is not None:
                on_start(state.round)
            RoundLoop(prep, state, runner, on_round, stop_requested).run()
        except FedltError:
            if not resume:  # refused in its first rounds, before any checkpoint: nothing worth keeping
                rundir.discard_unstarted(Path(config.out))
            raise
        summary = summarise(state, config, prep)
        if config.cohort > 1:
            summary["cohort_fallback"] = fallback or getattr(runner, "first_fallback", None)
        if config.compile:
            summary["compile_fallback"] = compile_fallback(prep.algorithm)
        if config.graphs:
            summary["graphs_fallback"] = graphs_fallback(prep.algorithm, torch.device(config.device))
        io.write_json(Path(config.out) / "summary.json", summary)
        return summary


def summarise(state: RunState, config: RunConfig, prep: parts.Prepared) -> dict[str, Any]:
    """The run in one file: the final and the best evaluated round, and what they were measured on."""
    evaluated = [r for r in state.metrics if "accuracy" in r]
    final = evaluated[-1]
    best = max(evaluated, key=lambda r: r["accuracy"])  # the earliest round on ties
    expected = ("client_mean_accuracy", "client_min_accuracy", "client_std_accuracy")
    keep = ("accuracy", "balanced_accuracy", "loss", "many_accuracy", "medium_accuracy", "few_accuracy",
            *expected, *(NEW + k for k in expected))
    skipped = sum(1 for r in state.metrics if "skipped" in r)
    summary = {
        "algorithm": config.algorithm, "dataset": config.dataset, "model": config.model, "rounds": state.round,
        "rounds_trained": state.round - skipped, "rounds_skipped": skipped,
        "partition": {"name": prep.partition.manifest.get("name"), "sha256": prep.partition.sha256},
        "groups": {"rule": config.groups.rule} | {k: v.tolist() for k, v in prep.groups.items()},
        "final": {"round": final["round"]} | {k: final[k] for k in keep if k in final}
                 | {"per_class_accuracy": final["per_class_accuracy"]},
        "best": {"round": best["round"], "accuracy": best["accuracy"], "balanced_accuracy": best["balanced_accuracy"]},
        "wall_time_s": round(state.wall_time, 3),
    } | upload_summary(state.metrics, config, prep.train_sizes) | per_client_summaries(evaluated, config)
    warnings = ([f"no round trained: all {state.round} rounds were short and skipped (on_short=skip), so every "
                 "number is the initial model's"] if skipped == state.round else [])
    warnings += [f"{mode}: no client evaluated, {why}" for mode, why in unevaluated(evaluated[-1], config, prep)]
    return summary | ({"warnings": warnings} if warnings else {})


def unevaluated(row: dict[str, Any], config: RunConfig, prep: parts.Prepared) -> list[tuple[str, str]]:
    """The per-client modes that scored no client in ``row`` (an evaluated round), each with why."""
    out = []
    for mode in (m["name"] for m in config.client_eval_modes()):
        if row.get(f"{mode}_clients", 1):
            continue
        held = prep.client_tests
        if row.get(f"{mode}_failed"):
            why = f"every evaluated client failed (metrics.jsonl's {mode}_failed says why)"
        elif held is not None and not any(len(held.test_indices[cid]) for cid in range(config.clients)):
            name = held.manifest.get("name")
            why = f"every client's test set is empty (client_test {name}" + (
                ": a holdout takes test samples only from the classes a client holds twice or more)"
                if name == "holdout" else ")")
        else:
            why = "the evaluated clients' test sets are empty (client_eval_fraction picked only such clients)"
        out.append((mode, why))
    return out


def per_client_summaries(evaluated: list[dict[str, Any]], config: RunConfig) -> dict[str, Any]:
    """Each ``client_eval`` mode's numbers (SPEC §7) in the last evaluated round and at their best
    (each field's highest value over the evaluated rounds, with its round), as ``per_client``:
    ``{mode: {"final": {key: value}, "best": {key: {"value": v, "round": r}}}}``."""
    modes = [m["name"] for m in config.client_eval_modes()]
    modes += [NEW + m for m in modes] if config.new_clients else []  # the clients that never train, apart
    if not modes:
        return {}
    out: dict[str, Any] = {}
    for mode in modes:
        final = {k: evaluated[-1].get(f"{mode}_{k}") for k in PER_CLIENT_KEYS}
        best = {k: found for k in PER_CLIENT_HIGHER if (found := best_of(evaluated, f"{mode}_{k}")) is not None}
        out[mode] = {"final": final, "best": {k: {"value": v, "round": r} for k, (v, r) in best.items()}}
    return {"per_client": out}

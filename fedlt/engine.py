"""The round loop: one straight walk from a RunConfig to a run directory.

    RunConfig -> dataset (in-memory tensors) -> partition (index lists + manifest)
      -> for each round: sample clients -> algorithm.train_round (tasks -> client work -> strategy)
         -> evaluate
         -> metrics.jsonl + checkpoint -> summary.json

A run directory holds ``config.json`` (resolved), ``partition.json`` (manifest),
``partition.npz`` (the indices, reusable with ``partition_file``), ``metrics.jsonl`` (one line
per round: train loss, participants and timings; evaluated rounds add the evaluation), ``checkpoint.pt`` (+ ``checkpoint.json``, its round in plain text) and,
when done, ``summary.json``. Every file is written atomically; ``run(config, resume=True)``
continues from the checkpoint exactly (docs/runs.md).

Randomness (SPEC §6): the data seed drives only the partition (saved with the run), the model
seed only the initial weights (saved in every checkpoint), and the sampling seed every draw made
during training — client sampling, minibatch orders, and any use of torch's global generator
(dropout, ...) — each derived from (sampling seed, round[, client]) rather than carried, so a
resumed round draws exactly what the uninterrupted run drew. Stateful generators that live
across rounds (SGB's gating) are part of the client states in the checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fedlt.algorithms
import fedlt.augment
import fedlt.availability
import fedlt.datasets
import fedlt.models
import fedlt.partitioners
import fedlt.posthoc
from fedlt import io, rundir
from fedlt.algorithms.base import ClientData, NonFiniteLoss, RunContext, from_spec
from fedlt.algorithms.protocol import ClientRunner, ClientStates, LocalRunner, copy_tensors
from fedlt.algorithms.cohort import with_cohort
from fedlt.algorithms.split import classifier_of
from fedlt.config import RunConfig
from fedlt.context import ModelSpec
from fedlt.datasets.base import InMemoryDataset
from fedlt.datasets.source import images
from fedlt.errors import FedltError, first_line
from fedlt.faults import PolicyRunner, RoundIncomplete
from fedlt.metrics import class_groups, evaluate
from fedlt.registry import Registry

CHECKPOINT_FORMAT = io.CHECKPOINT_FORMAT
# Settings that may differ between a run and its resumption: where it goes, how long it runs, and
# what does not change a single number (device placement aside, which users may move on purpose).
# The engine too: local and Flower runs give the same model (to float rounding across processes).
RESUMABLE_CHANGES = {"out", "rounds", "checkpoint_every", "data_root", "download", "device", "fused", "eval_batch",
                     "engine", "workers", "loader_workers", "faults.min_results", "faults.on_failure"}
# (how many clients a round needs and what a failure does decide whether the run goes on, not
# what a completed round computed: a run stopped below min_results may resume with a lower one)


def _engine_check(obj: Any) -> str | None:
    return None if callable(obj) else f"{type(obj).__name__} is not callable (an engine runs a RunConfig)"


# Engines: ``engine(config, *, resume, on_round, on_start) -> summary``, each driving the loop
# below (``run(..., runner=...)``) with its own ClientRunner; a third-party engine registers
# under the entry-point group ``fedlt.engines``.
ENGINES: Registry = Registry("engine", entry=_engine_check)


# what a post-hoc calibration (e.g. tau_norm) adds to an evaluated row, as "<name>_<key>"
POSTHOC_KEYS = ("accuracy", "balanced_accuracy", "many_accuracy", "medium_accuracy", "few_accuracy")


class RunStopped(KeyboardInterrupt):
    """SIGINT / SIGTERM: the run finished its current round, saved a checkpoint, and stopped."""

    def __init__(self, signum: int, round_done: int, out: Path) -> None:
        super().__init__(f"stopped by signal {signum} after round {round_done}; resume with: fedlt run --resume {out}")
        self.signum, self.round, self.out = signum, round_done, out


class StoppedAtOnce(KeyboardInterrupt):
    """A second SIGINT / SIGTERM: the run stopped mid-round; the last checkpoint on disk stands."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped at once by a second signal {signum}")
        self.signum = signum


def load_data(config: RunConfig) -> InMemoryDataset:
    data = fedlt.datasets.load(config.dataset, root=config.data_root, download=config.download)
    return data.limit(config.train_limit, config.test_limit).loading(config.loader_workers)


def make_partition(config: RunConfig, data: InMemoryDataset):
    labels = data.y_train.numpy()
    if config.partition_file is not None:
        partition = load_partition(config.partition_file)
        partition.check_dataset(labels, data.name)
    else:
        spec = dict(config.partition)
        partitioner = fedlt.partitioners.create(spec.pop("name"), **spec)
        partition = fedlt.partitioners.partition_data(partitioner, data, config.clients, config.seeds.data)
    if len(partition.client_indices) != config.clients:
        raise FedltError(f"the partition has {len(partition.client_indices)} clients but clients={config.clients}")
    return partition


def load_partition(path: Path):
    return fedlt.partitioners.Partition.load(path)


def sample_clients(num_clients: int, participation: float, sampling_seed: int, round_index: int,
                   available: list[int] | None = None) -> list[int]:
    """round(r·K) clients (at least 1) without replacement; a stream of its own per round, so
    resuming at any round draws what the uninterrupted run drew. With ``available`` (availability
    acting before sampling), the draw is among those clients only (all of them if fewer)."""
    m = max(int(round(participation * num_clients)), 1)
    rng = np.random.default_rng([sampling_seed, round_index])
    if available is None:
        return sorted(rng.choice(num_clients, size=m, replace=False).tolist())
    if not available:
        return []
    return sorted(rng.choice(np.asarray(available), size=min(m, len(available)), replace=False).tolist())


def round_seed(sampling_seed: int, round_index: int) -> int:
    """Seed of torch's global generator during one round (a stream apart from sample_clients')."""
    words = np.random.SeedSequence([sampling_seed, round_index, 0x70C4]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def config_digest(config: RunConfig) -> str:
    """What must match for a resume: every setting that can change a number in the results."""
    relevant = config.model_dump(mode="json")
    for name in RESUMABLE_CHANGES:
        *parents, leaf = name.split(".")
        node = relevant
        for parent in parents:
            node = node.get(parent, {})
        node.pop(leaf, None)
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def config_changes(saved: dict[str, Any], config: RunConfig) -> list[str]:
    """Settings (dotted names) whose value differs from ``saved`` (a config.json), ignoring the
    ones a resume may change."""
    now = config.model_dump(mode="json")

    def walk(a: Any, b: Any, prefix: str) -> Iterator[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                yield from walk(a.get(key), b.get(key), f"{prefix}{key}.")
        elif a != b:
            yield prefix.rstrip(".")

    def resumable(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:i]) in RESUMABLE_CHANGES for i in range(1, len(parts) + 1))

    return [name for name in walk(saved, now, "") if not resumable(name)]


def group_classes(train_counts: np.ndarray, config: RunConfig) -> dict[str, np.ndarray]:
    g = config.groups
    return class_groups(train_counts, rule=g.rule, thresholds=(g.many_above, g.few_below),
                        shares=(g.many_share, g.medium_share))


@dataclass
class Prepared:
    """Everything a run needs before its first round; building it checks what only the data and
    the model can tell (partition parameters against the classes, the split point against the
    model), so a bad setting fails before anything is trained or written."""

    config: RunConfig
    data: InMemoryDataset
    partition: Any
    counts: torch.Tensor  # K×C int64
    groups: dict[str, np.ndarray]
    algorithm: Any
    ctx: RunContext


def prepare(config: RunConfig, partition: Any = None, data: InMemoryDataset | None = None) -> Prepared:
    # torch imports torch._dynamo lazily inside the first optimiser's constructor (~1.8 s on a
    # CPU): a process start-up cost, paid here rather than inside the first round's train_s
    import torch._dynamo  # noqa: F401

    fresh = data is None
    data = load_data(config) if data is None else data  # a worker process gets the run's, in shared memory
    # augmentation: normalize()'s statistics come from the training set, the model is built for the
    # pipeline's output, and the test set gets its evaluation form (resize, crops, normalize) once
    augment = fedlt.augment.fit(config.augment, data.x_train)
    pipeline = fedlt.augment.build(augment)
    input_shape = pipeline.output_shape(tuple(data.x_train.shape[1:]))
    if pipeline.changes_eval and fresh:
        data = dataclasses.replace(data, x_test=pipeline.eval_all(data.x_test))
    if partition is None:
        partition = make_partition(config, data)
    counts = torch.as_tensor(np.asarray(partition.class_counts), dtype=torch.int64)
    if counts.shape[1] != data.num_classes:
        raise FedltError(f"the partition has {counts.shape[1]} classes but {config.dataset} has {data.num_classes}")
    device = torch.device(config.device)

    model_spec = ModelSpec(config.model, input_shape[0], data.num_classes, input_shape[-1])
    ctx = RunContext(
        num_classes=data.num_classes, input_shape=input_shape, build_model=model_spec.build,
        split=config.split, server_batch=config.server_batch, local_iters=config.local_iters,
        local_epochs=config.local_epochs, batch_size=config.batch_size, lr=config.optimiser.lr,
        momentum=config.optimiser.momentum, weight_decay=config.optimiser.weight_decay, clip=config.optimiser.clip,
        sampling_seed=config.seeds.sampling, device=device, model=model_spec, global_counts=counts.sum(0).to(device),
        fused=config.fused, num_clients=config.clients, rounds=config.rounds, augment=tuple(augment),
        precision=config.precision, cohort=config.cohort,  # issue 34 (docs/gpu.md)
    )
    with torch.device("meta"):  # the layer structure without allocating the weights
        check_split_point(model_spec.build(), config)
    algorithm = fedlt.algorithms.create(config.algorithm, **config.algorithm_params)
    with torch.random.fork_rng(devices=[]):  # the model seed alone decides the initial weights
        torch.manual_seed(config.seeds.model)
        algorithm.setup(ctx)  # builds (and splits) the model: a split point of other models is checked here
    return Prepared(config, data, partition, counts, group_classes(counts.sum(0).numpy(), config), algorithm, ctx)


def check_split_point(model: torch.nn.Module, config: RunConfig) -> None:
    """A model that names its own cut points (AlexNet: s1..s5) has ``split`` checked for every
    algorithm: the FedAvg family never splits, so a typo would otherwise pass unnoticed. Other
    models are checked when a split algorithm cuts them (the default 's2' is AlexNet's)."""
    from fedlt.models.splitting import SPLITTERS, resolve_cut

    if config.split is None or not SPLITTERS.get("own").applies(model):
        return
    try:
        resolve_cut(model, config.split)
    except FedltError:
        names = list(model.split_points())
        raise FedltError(f"split: {config.split!r} is not a split point of {config.model} (valid: {', '.join(names)}, "
                         f"or an index 0..{len(names) - 1})") from None


@dataclass
class RunState:
    round: int  # rounds completed
    metrics: list[dict]  # every round's row (evaluated rounds carry the evaluation fields)
    wall_time: float
    client_states: ClientStates = field(default_factory=ClientStates)
    checkpoint_round: int | None = None  # the round of the checkpoint on disk, if any
    stop_signal: int | None = field(default=None, repr=False)


@contextmanager
def stop_on_signal(state: RunState) -> Iterator[None]:
    """SIGINT/SIGTERM ask the loop to stop after the current round (which is then checkpointed):
    a checkpoint taken mid-round would not resume exactly. A second signal stops at once, and the
    last checkpoint on disk stands. Outside the main thread signals cannot be caught; nothing is
    installed then."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if state.stop_signal is not None:
            raise StoppedAtOnce(signum)
        state.stop_signal = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _check_model_finite(model: torch.nn.Module, where: str) -> None:
    for name, tensor in model.state_dict().items():
        # a float64 sum of float32 values cannot overflow, so it is finite iff every value is;
        # one reduction instead of a boolean copy of the weights
        if tensor.is_floating_point() and not torch.isfinite(tensor.sum(dtype=torch.float64)):
            raise NonFiniteLoss(f"non-finite weights in {name} of the global model after {where}")


def _restore(prep: Prepared, saved: dict, path: Path, config: RunConfig, data_fingerprint: str) -> RunState:
    kept = saved.get("data_fingerprint", data_fingerprint)  # checkpoints written before it have none
    if kept != data_fingerprint:
        raise FedltError(f"{path} was trained on other data: the inputs of {config.dataset} differ from those the run "
                         f"began with (fingerprint {str(kept)[:12]}…, now {data_fingerprint[:12]}…); "
                         "resume with the same data or start a new run")
    if saved["config_digest"] != config_digest(config):
        raise FedltError(f"{path} was written by a different configuration; resume it with the settings in its "
                         "config.json")
    if saved["partition_sha256"] != prep.partition.sha256:
        raise FedltError(f"{path} belongs to another partition (sha256 {saved['partition_sha256'][:12]}…, "
                         f"this run's is {prep.partition.sha256[:12]}…)")
    if not 0 <= saved["round"] <= config.rounds:
        raise FedltError(f"{path} is at round {saved['round']}, beyond rounds={config.rounds}")
    last = saved["metrics"][-1] if saved["metrics"] else {}
    if saved["round"] == config.rounds and (last.get("round") != config.rounds or "accuracy" not in last):
        raise FedltError(f"{path} is at round {saved['round']} but holds no evaluation of it; resume with "
                         f"--rounds above {saved['round']}")
    client_states = ClientStates()
    try:
        prep.algorithm.load_state_dict(saved["algorithm"])
        client_states.load_state_dict(saved["client_states"])
    except (KeyError, RuntimeError, ValueError, TypeError, FedltError) as exc:
        raise FedltError(f"{path} does not fit this run's model or algorithm ({first_line(exc)[:200]})") from None
    return RunState(saved["round"], list(saved["metrics"]), saved["wall_time"], client_states,
                    checkpoint_round=saved["round"])


def train_round(algorithm: Any, ctx: RunContext, round_index: int, participants: list[ClientData],
                states: ClientStates, runner: ClientRunner | None = None) -> dict[str, float]:
    """One round as the engine runs it: the round's context (with the global classifier at its
    start), the server side's draws in the round's own random stream (clients draw from theirs),
    the client work through ``runner`` (default: this process). Also the way to drive an
    algorithm by hand (tests, notebooks, benchmarks) exactly as a run would."""
    round_ctx = ctx.round(round_index, participants, classifier_of(algorithm.global_model()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(round_seed(ctx.sampling_seed, round_index))
        return algorithm.train_round(round_ctx, participants, states, runner or LocalRunner())


def run(config: RunConfig, *, resume: bool = False,
        on_round: Callable[[int, dict[str, Any]], None] | None = None,
        on_start: Callable[[int], None] | None = None,
        runner: ClientRunner | None = None,
        stop_requested: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) the experiment ``config`` in ``config.out``, holding
    the run directory for the whole run (``fedlt.rundir.claim``: one process per directory, and a
    new run only into a new or empty one).

    ``runner`` runs each round's client work (fedlt.algorithms.protocol.ClientRunner): an
    engine passes its own (Flower's ServerApp sends messages). Without one, ``config.engine``
    picks the registered engine, which calls back here with its runner (``local``: this process).
    ``stop_requested()`` is asked after every round when the loop runs off the main thread (where
    it cannot catch signals): the signal number the engine's own handler caught, or None.
    """
    if runner is None:
        return ENGINES.get(config.engine)(config, resume=resume, on_round=on_round, on_start=on_start)
    with rundir.claim(Path(config.out), resume=resume):
        try:
            return _run_claimed(config, resume=resume, on_round=on_round, on_start=on_start, runner=runner,
                                stop_requested=stop_requested)
        except FedltError:
            if not resume:  # refused in its first rounds, before any checkpoint: nothing worth keeping
                rundir.discard_unstarted(Path(config.out))
            raise


@ENGINES.register("local")
def local_engine(config: RunConfig, *, resume: bool = False,
                 on_round: Callable[[int, dict[str, Any]], None] | None = None,
                 on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    """In this process: every participant in turn, each on its own copies of what it receives; with
    ``workers`` > 1, in that many worker processes (fedlt.parallel, docs/parallel.md). Under
    ``faults.on_failure="drop"`` a client whose work fails becomes a ClientFailure (docs/faults.md)."""
    from fedlt.parallel import ParallelRunner, resolve_workers

    workers = resolve_workers(config.workers)
    tolerate = config.faults.on_failure == "drop"
    if workers == 1:
        return run(config, resume=resume, on_round=on_round, on_start=on_start,
                   runner=with_cohort(LocalRunner(tolerate), config.cohort))  # --cohort: docs/gpu.md
    with ParallelRunner(workers, tolerate) as runner:
        return run(config, resume=resume, on_round=on_round, on_start=on_start, runner=runner)


@ENGINES.register("flower")
def flower_engine(config: RunConfig, **options: Any) -> dict[str, Any]:
    """Flower's simulation runtime: a ServerApp running this loop, a SuperNode per client
    (docs/flower.md; needs the ``flower`` extra)."""
    from fedlt.flower.simulation import run as simulate

    return simulate(config, **options)


def _run_claimed(config: RunConfig, *, resume: bool = False,
                 on_round: Callable[[int, dict[str, Any]], None] | None = None,
                 on_start: Callable[[int], None] | None = None,
                 runner: ClientRunner,
                 stop_requested: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) the experiment ``config`` in ``config.out``.

    ``on_start(rounds_done)`` is called once every check has passed, just before the first round
    (a progress display starts there); ``on_round(rounds_done, row)`` after every round.

    Raises FedltError for bad settings (before anything is written), NonFiniteLoss when a loss or
    the global model stops being finite (the last good checkpoint stays), and RunStopped after
    saving a checkpoint when SIGINT/SIGTERM arrives.
    """
    out = Path(config.out)
    checkpoint_path = out / "checkpoint.pt"
    partition = None
    if resume:
        if not (out / "config.json").is_file() or not (out / "partition.npz").is_file():
            raise FedltError(f"cannot resume {out}: it holds no run (config.json and partition.npz are missing)")
        changed = config_changes(io.read_json(out / "config.json", "run configuration", dict), config)
        if changed:
            raise FedltError(f"cannot resume {out} with changed settings: {', '.join(changed)} "
                             f"(only {', '.join(sorted(RESUMABLE_CHANGES))} may change)")
        partition = load_partition(out / "partition.npz")

    prep = prepare(config, partition)
    data_fingerprint = fedlt.datasets.fingerprint(prep.data)  # the training inputs, not only the labels
    if resume:
        prep.partition.check_dataset(prep.data.y_train.numpy(), prep.data.name)
    algorithm, data = prep.algorithm, prep.data
    device = torch.device(config.device)

    state = RunState(round=0, metrics=[], wall_time=0.0)
    if resume and checkpoint_path.exists():
        state = _restore(prep, io.load_checkpoint(checkpoint_path), checkpoint_path, config, data_fingerprint)
    # nothing has been written up to here: a bad setting or checkpoint leaves the directory as it was
    rundir.remove_leftovers(out)  # temporary files of a write a kill interrupted
    io.write_json(out / "config.json", config.model_dump(mode="json"))
    if not resume:
        io.write_json(out / "partition.json", prep.partition.manifest)
        prep.partition.save(out / "partition.npz")
    io.write_lines(out / "metrics.jsonl", state.metrics)  # on resume: drop lines written after the checkpoint
    (out / "summary.json").unlink(missing_ok=True)  # a resumed run's summary is rewritten at its end

    def save_checkpoint(snapshot: dict[str, Any] | None = None) -> None:
        """The run at ``state.round``; ``snapshot``: the algorithm and client states as they were
        at that round's end, when later training has moved them on (an overlapped evaluation)."""
        snapshot = snapshot or {"algorithm": algorithm.state_dict(), "client_states": state.client_states.state_dict()}
        io.save_checkpoint(checkpoint_path, {
            "format": CHECKPOINT_FORMAT, "config_digest": config_digest(config),
            "partition_sha256": prep.partition.sha256, "data_fingerprint": data_fingerprint, "round": state.round,
            **snapshot,
            "metrics": state.metrics, "wall_time": float(state.wall_time),
        })
        state.checkpoint_round = state.round
        io.write_json(out / "checkpoint.json", {"round": state.round, "file": checkpoint_path.name,
                                                "bytes": checkpoint_path.stat().st_size})

    def kept() -> str:
        if state.checkpoint_round is None:
            return "no checkpoint had been written yet"
        return f"the last good checkpoint (round {state.checkpoint_round}) is kept in {checkpoint_path}"

    availability = from_spec(fedlt.availability.REGISTRY, config.availability)
    policy = PolicyRunner(runner, availability, config.faults, config.seeds.sampling)
    faults_possible = config.faults.on_failure == "drop" or availability.acts or config.faults.round_timeout is not None
    x_train, y_train = images(data.x_train).to(device), data.y_train.to(device)
    bind = getattr(runner, "bind", None)
    if bind is not None:  # a runner with processes of its own (fedlt.parallel) gets the run's parts once
        bind(prep)
    if on_start is not None:
        on_start(state.round)
    client_counts = prep.counts.numpy() if config.client_eval else None

    def evaluation(model: torch.nn.Module, number: int) -> tuple[dict[str, Any], float]:
        """The evaluation fields of round ``number``'s global model (and of its post-hoc
        calibrations), and the seconds they took."""
        began = time.perf_counter()
        scores = evaluate(model, data.x_test, data.y_test.cpu(), data.num_classes, prep.groups, config.eval_batch,
                          device, client_counts)
        if not np.isfinite(scores["loss"]):  # finite weights whose logits overflow float32
            raise NonFiniteLoss(f"round {number}: the global model's test loss is {scores['loss']} "
                                "(its logits overflow)")
        for spec in config.posthoc:  # calibrated copies of the global model, reported beside it
            params = dict(spec) if isinstance(spec, dict) else {"name": spec}
            name = params.pop("name")
            calibrated = fedlt.posthoc.get(name)(model, **params)
            more = evaluate(calibrated, data.x_test, data.y_test.cpu(), data.num_classes, prep.groups,
                            config.eval_batch, device)
            scores.update({f"{name}_{k}": more[k] for k in POSTHOC_KEYS if k in more})
        return scores, time.perf_counter() - began

    def close(row: dict[str, Any], train_s: float, eval_s: float, round_s: float,
              snapshot: dict[str, Any] | None = None) -> None:
        """A round's row written (and checkpointed when due), in round order."""
        row.update(train_s=round(train_s, 4), eval_s=round(eval_s, 4), round_s=round(round_s, 4))
        state.wall_time += round_s
        state.round += 1
        state.metrics.append(row)
        io.append_line(out / "metrics.jsonl", row)
        if state.round % config.checkpoint_every == 0 or state.round == config.rounds:
            save_checkpoint(snapshot)
        if on_round is not None:
            on_round(state.round, row)

    # With a runner whose clients work elsewhere (fedlt.parallel), round r's global model is
    # evaluated on a copy in a thread while round r+1 trains; its row is closed once that round
    # has trained. round_s is then the round's own time plus the wait for its evaluation, so the
    # rows still add up to the wall time; eval_s stays the evaluation's own time.
    overlap = bool(getattr(runner, "overlaps_evaluation", False))
    evaluator = ThreadPoolExecutor(1, thread_name_prefix="fedlt-eval") if overlap else None
    pending: dict[str, Any] | None = None  # the round being evaluated

    def settle() -> None:
        """Close the round being evaluated, if any (its evaluation finished first)."""
        nonlocal pending
        if pending is None:
            return
        waited = time.perf_counter()
        try:
            scores, eval_s = pending["evaluation"].result()
        except NonFiniteLoss as exc:
            raise NonFiniteLoss(f"{exc}; {kept()}") from None
        held, pending = pending, None
        held["row"].update(scores)
        close(held["row"], held["train_s"], eval_s, held["own_s"] + time.perf_counter() - waited, held["snapshot"])

    trained = state.round  # rounds trained; one ahead of state.round while a round is being evaluated
    try:
        with stop_on_signal(state):
            while trained < config.rounds:
                started = time.perf_counter()
                round_index = trained
                if availability.acts and availability.when == "before":
                    reachable = [c for c in range(config.clients)
                                 if availability.available(config.seeds.sampling, round_index, c)]
                    chosen = sample_clients(config.clients, config.participation, config.seeds.sampling, round_index,
                                            available=reachable)
                else:
                    reachable = None
                    chosen = sample_clients(config.clients, config.participation, config.seeds.sampling, round_index)
                policy.begin(round_index, chosen, reachable)
                # a round that ends below min_results is not applied: keep the last complete round's
                # state when it may not be on disk already (checkpoint_every > 1)
                before = (copy.deepcopy((algorithm.state_dict(), state.client_states.state_dict()))
                          if faults_possible and state.checkpoint_round != trained else None)
                clients = []
                for cid in chosen:
                    idx = torch.as_tensor(prep.partition.client_indices[cid], dtype=torch.long, device=device)
                    clients.append(ClientData(cid, images(x_train).subset(idx), y_train[idx],
                                              prep.counts[cid].to(device)))
                try:
                    row: dict[str, Any] = {"round": round_index + 1, "participants": len(chosen),
                                           **train_round(algorithm, prep.ctx, round_index, clients,
                                                         state.client_states, policy)}
                    row.update(policy.log.row())
                    _check_model_finite(algorithm.global_model(), "aggregation")
                except RoundIncomplete as exc:
                    settle()
                    if before is not None:  # the last complete round, as it was, onto disk
                        algorithm.load_state_dict(before[0])
                        state.client_states.load_state_dict(before[1])
                        save_checkpoint()
                    raise RoundIncomplete(f"{exc}; the round is not applied, {kept()}; resume with: fedlt run "
                                          f"--resume {out} (e.g. with a lower --min-results)") from None
                except NonFiniteLoss as exc:
                    settle()
                    raise NonFiniteLoss(f"round {round_index + 1} (clients {chosen}): {exc}; {kept()}") from None
                except ValueError as exc:
                    settle()
                    if "Expected more than 1 value per channel" not in str(exc):
                        raise
                    raise FedltError(
                        f"round {round_index + 1} (clients {chosen}): a BatchNorm layer got one value per channel "
                        f"in training (a batch of 1 sample at a 1×1 feature map); give clients larger batches "
                        f"(server_batch, or batch_size with local_epochs) or cut the model before that layer; "
                        f"{kept()}"
                    ) from None
                except Exception:
                    settle()
                    raise
                trained += 1
                train_s = time.perf_counter() - started
                evaluated = trained % config.eval_every == 0 or trained == config.rounds
                settle()  # the previous round's row first
                if evaluated and overlap and trained < config.rounds:
                    due = trained % config.checkpoint_every == 0
                    snapshot = copy_tensors({"algorithm": algorithm.state_dict(),
                                             "client_states": state.client_states.state_dict()}) if due else None
                    model = copy.deepcopy(algorithm.global_model())  # fixed while the next round trains
                    pending = {"row": row, "train_s": train_s, "snapshot": snapshot,
                               "evaluation": evaluator.submit(evaluation, model, trained),
                               "own_s": time.perf_counter() - started}
                else:
                    scores, eval_s = {}, 0.0
                    if evaluated:
                        try:
                            scores, eval_s = evaluation(algorithm.global_model(), trained)
                        except NonFiniteLoss as exc:
                            raise NonFiniteLoss(f"{exc}; {kept()}") from None
                    row.update(scores)
                    close(row, train_s, eval_s, time.perf_counter() - started)
                if state.stop_signal is None and stop_requested is not None:
                    state.stop_signal = stop_requested()
                if state.stop_signal is not None and trained < config.rounds:
                    settle()
                    if state.checkpoint_round != state.round:
                        save_checkpoint()
                    raise RunStopped(state.stop_signal, state.round, out)
            settle()
    finally:
        if evaluator is not None:
            evaluator.shutdown(wait=True, cancel_futures=True)

    summary = summarise(state, config, prep)
    io.write_json(out / "summary.json", summary)
    return summary


def summarise(state: RunState, config: RunConfig, prep: Prepared) -> dict[str, Any]:
    """The run in one file: the final and the best evaluated round, and what they were measured on."""
    evaluated = [r for r in state.metrics if "accuracy" in r]
    final = evaluated[-1]
    best = max(evaluated, key=lambda r: r["accuracy"])  # the earliest round on ties
    keep = ("accuracy", "balanced_accuracy", "loss", "many_accuracy", "medium_accuracy", "few_accuracy",
            "client_mean_accuracy", "client_min_accuracy", "client_std_accuracy")
    return {
        "algorithm": config.algorithm, "dataset": config.dataset, "model": config.model, "rounds": state.round,
        "partition": {"name": prep.partition.manifest.get("name"), "sha256": prep.partition.sha256},
        "groups": {"rule": config.groups.rule} | {k: v.tolist() for k, v in prep.groups.items()},
        "final": {"round": final["round"]} | {k: final[k] for k in keep if k in final}
                 | {"per_class_accuracy": final["per_class_accuracy"]},
        "best": {"round": best["round"], "accuracy": best["accuracy"], "balanced_accuracy": best["balanced_accuracy"]},
        "wall_time_s": round(state.wall_time, 3),
    }

"""A run's parts, built before its first round: the data, the partition, the algorithm and its
context (``prepare``), one client's slice of the training set (``client_data``), the round's
participants (``sample_clients``) and random stream (``round_seed``), and one round driven as the
loop drives it (``train_round``). ``rebuild`` is how a process that holds no run — a worker
process (fedlt.parallel) or a Flower node (fedlt.flower) — builds the same parts from the run's
configuration (as JSON) and partition.

May import: the bottom layer, the components, the algorithms and fedlt.config.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._dynamo  # noqa: F401  (torch imports it inside the first optimiser: a start-up cost, paid here)

import fedlt.algorithms
import fedlt.augment
import fedlt.client_tests
import fedlt.datasets
import fedlt.models
import fedlt.partitioners
from fedlt.algorithms import compiled, graphs
from fedlt.algorithms.base import ClientData, RunContext
from fedlt.algorithms.protocol import ClientRunner, ClientStates, LocalRunner
from fedlt.algorithms.split import classifier_of
from fedlt.algorithms.private import check_sample_level
from fedlt.config import RunConfig
from fedlt.context import ModelSpec
from fedlt.datasets.base import InMemoryDataset
from fedlt.datasets.source import images
from fedlt.errors import FedltError
from fedlt.metrics import class_groups
from fedlt.partitioners.base import class_counts_of
from fedlt.uploads import UploadRunner, UploadSettings
from fedlt.models.splitting import SPLITTERS, resolve_cut


def load_data(config: RunConfig) -> InMemoryDataset:
    data = fedlt.datasets.load(config.dataset, root=config.data_root, download=config.download)
    return data.limit(config.train_limit, config.test_limit).loading(config.loader_workers)


def make_partition(config: RunConfig, data: InMemoryDataset):
    labels = data.y_train.numpy()
    if config.partition_file is not None:
        partition = fedlt.partitioners.Partition.load(config.partition_file)
        partition.check_dataset(labels, data.name)
    else:
        spec = dict(config.partition)
        partitioner = fedlt.partitioners.create(spec.pop("name"), **spec)
        partition = fedlt.partitioners.partition_data(partitioner, data, config.partition_clients, config.seeds.data)
    if len(partition.client_indices) != config.partition_clients:
        wanted = (f"clients={config.clients}" if not config.new_clients else
                  f"clients + new_clients = {config.clients} + {config.new_clients}")
        raise FedltError(f"the partition has {len(partition.client_indices)} clients but {wanted}")
    return partition


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
    counts: torch.Tensor  # (K + new clients)×C int64: every client of the partition, the K training ones first
    groups: dict[str, np.ndarray]
    algorithm: Any
    ctx: RunContext
    client_tests: fedlt.client_tests.ClientTestSets | None = None  # each client's own test set (client_test)
    server: "ServerHoldout | None" = None  # training images held out for the server (FEDIC's proxy set)

    @property
    def train_indices(self) -> list[np.ndarray]:
        """Each client's training samples: the partition's, less what a ``holdout`` carved out."""
        held = self.client_tests
        return self.partition.client_indices if held is None or held.train_indices is None else held.train_indices

    @property
    def train_sizes(self) -> list[int]:
        """|D_k| of every client that trains (sample-level DP's accountant)."""
        return [len(i) for i in self.train_indices[:self.config.clients]]

    @property
    def new_clients(self) -> list[int]:
        """The clients that never train (``new_clients``): the partition's last ones."""
        return list(range(self.config.clients, self.config.partition_clients))

    @property
    def training_counts(self) -> torch.Tensor:
        """K×C: the class counts of the clients that train (the new clients' data is never trained on)."""
        return self.counts[:self.config.clients]

    def manifest(self) -> dict[str, Any]:
        """The partition manifest the run records: the partition's, with its client test sets
        (each client's test part and, for ``holdout``, the training part it keeps) and the new
        clients' ids."""
        extra = {} if self.client_tests is None else {"client_test": self.client_tests.manifest}
        new = {"new_clients": self.new_clients} if self.new_clients else {}
        server = {} if self.server is None else {"server_data": self.server.manifest()}
        return self.partition.manifest | extra | new | server


@dataclass(frozen=True)
class ServerHoldout:
    """Training images the server holds and no client ever sees (an algorithm's
    ``server_data_per_class``, e.g. FEDIC's proxy set): per class, the first ``per_class`` of a
    permutation of its training samples drawn from the data seed, taken out of the training set
    before it is partitioned. ``rows`` index the training set as loaded (after ``train_limit``)."""

    per_class: int
    rows: np.ndarray
    x: Any
    y: torch.Tensor

    def manifest(self) -> dict[str, Any]:
        return {"per_class": self.per_class, "indices": self.rows.tolist(),
                "sha256": hashlib.sha256(self.rows.astype(np.int64).tobytes()).hexdigest()}

    def on(self, device: torch.device, num_classes: int) -> ClientData:
        """The held-out images as the server's data (client id -1), on ``device``."""
        counts = torch.bincount(self.y, minlength=num_classes)
        return ClientData(-1, images(self.x).to(device), self.y.to(device), counts.to(device))


def hold_out(data: InMemoryDataset, per_class: int, seed: int, what: str = "server_data_per_class"
             ) -> tuple[InMemoryDataset, ServerHoldout]:
    """``data`` less ``per_class`` training images of each class (see :class:`ServerHoldout`),
    and those images; a class left with no training image is refused (``what``: the setting, named)."""
    labels = data.y_train.numpy()
    rng = np.random.default_rng([seed, 0x5E4D])
    taken = []
    for c in range(data.num_classes):  # one draw per class, in class order
        own = np.flatnonzero(labels == c)
        if 0 < len(own) <= per_class:
            raise FedltError(f"{what}: holding {per_class} images of each class out for the server would take all "
                             f"{len(own)} training images of class {c} from the clients: lower it (or raise train_limit)")
        taken.append(rng.permutation(own)[:per_class])
    rows = np.sort(np.concatenate(taken)).astype(np.int64)
    keep = np.setdiff1d(np.arange(len(labels)), rows)
    kept, held = torch.as_tensor(keep), torch.as_tensor(rows)
    reduced = dataclasses.replace(data, x_train=images(data.x_train).subset(kept), y_train=data.y_train[kept],
                                  groups_train=None if data.groups_train is None else data.groups_train[kept])
    return reduced, ServerHoldout(per_class, rows, images(data.x_train).subset(held), data.y_train[held])


def make_client_tests(config: RunConfig, data: InMemoryDataset, partition: Any) -> Any:
    """The run's client test sets (``client_test``), drawn from the data seed, or None."""
    if config.client_test is None:
        return None
    spec = dict(config.client_test)
    scheme = fedlt.client_tests.create(spec.pop("name"), **spec)
    return scheme(partition, data.y_train.numpy(), data.y_test.numpy(), config.seeds.data)


def run_context(config: RunConfig, model_spec: ModelSpec, input_shape: tuple, counts: torch.Tensor,
                augment: list, server: ServerHoldout | None = None) -> RunContext:
    device = torch.device(config.device)
    return RunContext(
        num_classes=model_spec.num_classes, input_shape=input_shape, build_model=model_spec.build,
        split=config.split, server_batch=config.server_batch, local_iters=config.local_iters,
        local_epochs=config.local_epochs, batch_size=config.batch_size, lr=config.optimiser.lr,
        momentum=config.optimiser.momentum, weight_decay=config.optimiser.weight_decay, clip=config.optimiser.clip,
        sampling_seed=config.seeds.sampling, device=device, model=model_spec, global_counts=counts.sum(0).to(device),
        fused=config.fused, num_clients=config.clients, rounds=config.rounds, augment=tuple(augment),
        precision=config.precision, cohort=config.cohort,  # issue 34 (docs/gpu.md)
        drop_last=config.drop_last,  # issue 41
        server_data=None if server is None else server.on(device, model_spec.num_classes),
        compile=compiled.BACKEND if config.compile else None,  # issue 43 (docs/gpu.md#compiled-steps)
        graphs=graphs.BACKEND if config.graphs else None,  # docs/gpu.md#whole-step-cuda-graphs
    )


def prepare(config: RunConfig, partition: Any = None, data: InMemoryDataset | None = None) -> Prepared:
    """The run's parts; ``data``: a worker process gets the run's, in shared memory."""
    fresh = data is None
    data = load_data(config) if data is None else data
    algorithm = fedlt.algorithms.create(config.algorithm, **config.algorithm_params)
    server = None
    per_class, what = fedlt.algorithms.server_data_per_class(algorithm)
    if per_class and fresh:  # a worker process gets the run's data with the server's images already out
        data, server = hold_out(data, per_class, config.seeds.data, f"{config.algorithm}'s {what}")
    # augmentation: normalize()'s statistics come from the training set, the model is built for the
    # pipeline's output, and the test set gets its evaluation form (resize, crops, normalize) once
    augment = fedlt.augment.fit(config.augment, data.x_train)
    pipeline = fedlt.augment.build(augment)
    input_shape = pipeline.output_shape(tuple(data.x_train.shape[1:]))
    if pipeline.changes_eval and fresh:
        data = dataclasses.replace(data, x_test=pipeline.eval_all(data.x_test))
    if partition is None:
        try:
            partition = make_partition(config, data)
        except FedltError as exc:  # a partition file cut from the whole set, before the server's images left it
            raise FedltError(f"{exc} (the server holds {per_class} images of each class out of the training set "
                             f"first: {config.algorithm}'s {what})" if per_class and config.partition_file
                             else str(exc)) from None
    client_tests = make_client_tests(config, data, partition)
    counts = np.asarray(partition.class_counts)
    if client_tests is not None and client_tests.train_indices is not None:  # holdout: trained on what is left
        counts = class_counts_of(client_tests.train_indices, data.y_train.numpy(), counts.shape[1])
    counts = torch.as_tensor(counts, dtype=torch.int64)
    if counts.shape[1] != data.num_classes:
        raise FedltError(f"the partition has {counts.shape[1]} classes but {config.dataset} has {data.num_classes}")
    model_spec = ModelSpec(config.model, input_shape[0], data.num_classes, input_shape[-1])
    training = counts[:config.clients]  # what the federation trains on: the new clients' parts aside
    ctx = run_context(config, model_spec, input_shape, training, augment, server)
    fedlt.models.check_fits(config.model, in_chans=input_shape[0], num_classes=data.num_classes,
                            image_size=input_shape[-1])  # one sample's shape through the model, on meta
    with torch.device("meta"):  # the layer structure without allocating the weights
        check_split_point(model_spec.build(), config)
    with torch.random.fork_rng(devices=[]):  # the model seed alone decides the initial weights
        torch.manual_seed(config.seeds.model)
        algorithm.setup(ctx)  # builds (and splits) the model: a split point of other models is checked here
    check_sample_level(config, algorithm)  # DP-SGD needs a standard local step on a model without BatchNorm
    return Prepared(config, data, partition, counts, group_classes(training.sum(0).numpy(), config), algorithm, ctx,
                    client_tests, server)


def rebuild(config_json: str, partition: Any, data: InMemoryDataset | None = None) -> Prepared:
    """The run's parts in a process that holds no run (a worker process, a Flower node), from the
    run's configuration as JSON and its partition (a Partition or the path of its file)."""
    if not isinstance(partition, fedlt.partitioners.Partition):
        path = Path(partition)
        if not path.is_file():
            raise FedltError(f"no partition file at {path}: give the node one with "
                             "--node-config 'partition-file=\"/path/partition.npz\"'")
        partition = fedlt.partitioners.Partition.load(path)
    return prepare(RunConfig.model_validate(json.loads(config_json)), partition, data=data)


def client_data(prep: Prepared, cid: int, device: torch.device, source: tuple[Any, torch.Tensor] | None = None
                ) -> ClientData:
    """Client ``cid``'s training samples (by the partition's indices) and class counts on
    ``device``; ``source``: the training set already on ``device`` (the main process moves it
    once), else the run's own (shared memory in a worker; images read from files are decoded here)."""
    x, y = source if source is not None else (prep.data.x_train, prep.data.y_train)
    idx = torch.as_tensor(prep.train_indices[cid], dtype=torch.long, device=y.device)
    return ClientData(cid, images(x).subset(idx).to(device), y[idx].to(device), prep.counts[cid].to(device))


def with_held(prep: Prepared, task: Any, data: ClientData) -> Any:
    """A task that crossed without what its client holds (fedlt.algorithms.protocol.travelling),
    given it back where the client's data lives (a worker process, a Flower node): its training
    ``data`` and, for a task with a ``test`` field (a per-client evaluation), its test set."""
    names = {f.name for f in dataclasses.fields(task)}
    held = {"data": data} | ({"test": client_test_data(prep, task.cid, data.y.device)} if "test" in names else {})
    return dataclasses.replace(task, **held)


def client_test_data(prep: Prepared, cid: int, device: torch.device,
                     source: tuple[Any, torch.Tensor] | None = None) -> ClientData:
    """Client ``cid``'s test set (``client_test``) on ``device``, in the test set's evaluation form;
    its ``class_counts`` are the test set's own. ``source``: the training set already on
    ``device`` (a holdout's test part is carved from it)."""
    held = prep.client_tests
    if held is None:
        raise FedltError("per-client evaluation needs client test sets: set client_test (docs/evaluation.md)")
    x, y = test_rows(prep, held.test_indices[cid], device, source)
    counts = torch.as_tensor(held.class_counts[cid], dtype=torch.int64)
    return ClientData(cid, x, y, counts.to(device))


def test_rows(prep: Prepared, rows: np.ndarray, device: torch.device,
              source: tuple[Any, torch.Tensor] | None = None) -> tuple[Any, torch.Tensor]:
    """Rows ``rows`` of the set the client test sets are drawn from (the test set; the training
    set for a holdout, then in the test set's evaluation form), on ``device``."""
    held = prep.client_tests
    if held.source == "test":
        x, y = prep.data.x_test, prep.data.y_test
    else:
        x, y = source if source is not None else (prep.data.x_train, prep.data.y_train)
    idx = torch.as_tensor(rows, dtype=torch.long, device=y.device)
    chosen = images(x).subset(idx)
    pipeline = fedlt.augment.build(prep.ctx.augment)
    if held.source == "train" and pipeline.changes_eval:  # training images, tested as the test set is
        chosen = pipeline.eval_all(chosen)
    return images(chosen).to(device), y[idx].to(device)


def check_split_point(model: torch.nn.Module, config: RunConfig) -> None:
    """A model that names its own cut points (AlexNet: s1..s5) has ``split`` checked for every
    algorithm: the FedAvg family never splits, so a typo would otherwise pass unnoticed. Other
    models are checked when a split algorithm cuts them (the default 's2' is AlexNet's)."""
    if config.split is None or not SPLITTERS.get("own").applies(model):
        return
    try:
        resolve_cut(model, config.split)
    except FedltError:
        names = list(model.split_points())
        raise FedltError(f"split: {config.split!r} is not a split point of {config.model} (valid: {', '.join(names)}, "
                         f"or an index 0..{len(names) - 1})") from None


def train_round(algorithm: Any, ctx: RunContext, round_index: int, participants: list[ClientData],
                states: ClientStates, runner: ClientRunner | None = None) -> dict[str, float]:
    """One round as the loop runs it: the round's context (with the global classifier at its
    start), the server side's draws in the round's own random stream (clients draw from theirs),
    the client work through ``runner`` (default: this process). Also the way to drive an
    algorithm by hand (tests, notebooks, benchmarks) exactly as a run would."""
    round_ctx = ctx.round(round_index, participants, classifier_of(algorithm.global_model()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(round_seed(ctx.sampling_seed, round_index))
        return algorithm.train_round(round_ctx, participants, states, runner or LocalRunner())


def client_state_template(prep: Prepared, round_index: int) -> dict[str, Any]:
    """A client's state as this run's algorithm produces it: the state round ``round_index`` gives
    the smallest client with two samples or more, trained in this process, the algorithm's own
    state put back afterwards. The store refuses a state read back (a checkpoint's, a file's) whose
    structure, shapes or dtypes differ (fedlt.algorithms.client_states.difference)."""
    sizes = [len(i) for i in prep.train_indices]
    cid = min((c for c, n in enumerate(sizes) if n >= 2), key=sizes.__getitem__, default=int(np.argmax(sizes)))
    algorithm, config = prep.algorithm, prep.config
    kept = copy.deepcopy(algorithm.state_dict())
    states = ClientStates()
    # the upload plan keeps its transforms' state (an error-feedback residual) in the client's: the
    # run's own plan (its clip, noise and masks decide the chain's layout)
    runner = UploadRunner(LocalRunner(), UploadSettings.of(config, prep.train_sizes))
    try:
        train_round(algorithm, prep.ctx, round_index, [client_data(prep, cid, torch.device(config.device))],
                    states, runner)
    finally:
        algorithm.load_state_dict(kept)
    return states.get(cid)

"""The round loop: one straight walk from a RunConfig to a run directory.

    RunConfig -> dataset (in-memory tensors) -> partition (index lists + manifest)
      -> for each round: sample clients -> algorithm.train_round -> evaluate
         -> metrics.jsonl + checkpoint -> summary.json

A run directory holds ``config.json`` (resolved), ``partition.json`` (manifest),
``partition.npz`` (the indices, reusable with ``partition_file``), ``metrics.jsonl`` (one line
per evaluated round), ``checkpoint.pt`` and, when done, ``summary.json``. Every file is written
atomically; ``run(config, resume=True)`` continues from the checkpoint exactly.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fedlt.algorithms
import fedlt.datasets
import fedlt.models
import fedlt.partitioners
from fedlt import io
from fedlt.algorithms.base import ClientData, RunContext
from fedlt.config import RunConfig
from fedlt.datasets.base import InMemoryDataset
from fedlt.errors import FedltError
from fedlt.metrics import class_groups, evaluate

CHECKPOINT_FORMAT = "fedlt-checkpoint-1"


def load_data(config: RunConfig) -> InMemoryDataset:
    data = fedlt.datasets.create(config.dataset, root=config.data_root, download=config.download)
    return data.limit(config.train_limit, config.test_limit)


def make_partition(config: RunConfig, data: InMemoryDataset):
    labels = data.y_train.numpy()
    if config.partition_file is not None:
        partition = fedlt.partitioners.Partition.load(config.partition_file)
        partition.check_dataset(labels, data.name)
        if len(partition.client_indices) != config.clients:
            raise FedltError(f"partition_file {config.partition_file} has {len(partition.client_indices)} clients "
                             f"but clients={config.clients}")
        return partition
    spec = dict(config.partition)
    partitioner = fedlt.partitioners.create(spec.pop("name"), **spec)
    return partitioner(labels, config.clients, config.seeds.data, num_classes=data.num_classes, dataset_name=data.name)


def sample_clients(num_clients: int, participation: float, sampling_seed: int, round_index: int) -> list[int]:
    """round(r·K) clients (at least 1) without replacement; a stream of its own per round, so
    resuming at any round draws what the uninterrupted run drew."""
    m = max(int(round(participation * num_clients)), 1)
    rng = np.random.default_rng([sampling_seed, round_index])
    return sorted(rng.choice(num_clients, size=m, replace=False).tolist())


def config_digest(config: RunConfig) -> str:
    """What must match for a resume: everything but where the output goes and the round count."""
    relevant = config.model_dump(mode="json", exclude={"out", "rounds"})
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


@dataclass
class RunState:
    round: int  # rounds completed
    metrics: list[dict]
    wall_time: float


@contextmanager
def checkpoint_on_signal(save: Callable[[], None]):
    """On SIGINT/SIGTERM: save a checkpoint, then stop with KeyboardInterrupt."""
    def handler(signum, frame):
        save()
        raise KeyboardInterrupt(f"stopped by signal {signum}; resume with --resume")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run(config: RunConfig, *, resume: bool = False,
        on_round: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    out = Path(config.out)
    checkpoint_path = out / "checkpoint.pt"
    if not resume and (out / "metrics.jsonl").exists():
        raise FedltError(f"output directory {out} already holds a run; use another --out, or --resume it")
    device = torch.device(config.device)

    data = load_data(config)
    partition = make_partition(config, data)
    counts = torch.as_tensor(np.asarray(partition.class_counts), dtype=torch.int64)
    groups = class_groups(counts.sum(0).numpy())

    def build_model() -> torch.nn.Module:
        return fedlt.models.build(config.model, in_chans=data.in_chans, num_classes=data.num_classes,
                                  image_size=data.image_size)

    ctx = RunContext(
        num_classes=data.num_classes, input_shape=tuple(data.x_train.shape[1:]), build_model=build_model, split=config.split,
        server_batch=config.server_batch, local_iters=config.local_iters, local_epochs=config.local_epochs,
        batch_size=config.batch_size, lr=config.optimiser.lr, momentum=config.optimiser.momentum,
        weight_decay=config.optimiser.weight_decay, clip=config.optimiser.clip,
        sampling_seed=config.seeds.sampling, device=device,
    )
    algorithm = fedlt.algorithms.create(config.algorithm, **config.algorithm_params)
    torch.manual_seed(config.seeds.model)
    algorithm.setup(ctx)

    state = RunState(round=0, metrics=[], wall_time=0.0)
    if resume:
        saved = io.load_checkpoint(checkpoint_path)
        if saved["config_digest"] != config_digest(config):
            raise FedltError(f"{out}: the checkpoint was written by a different configuration")
        algorithm.load_state_dict(saved["algorithm"])
        torch.set_rng_state(saved["torch_rng"])
        state = RunState(saved["round"], list(saved["metrics"]), saved["wall_time"])
        io.write_lines(out / "metrics.jsonl", state.metrics)  # drop lines written after the checkpoint
    else:
        out.mkdir(parents=True, exist_ok=True)
        io.write_json(out / "config.json", config.model_dump(mode="json"))
        io.write_json(out / "partition.json", partition.manifest)
        partition.save(out / "partition.npz")
        io.write_lines(out / "metrics.jsonl", [])

    def save_checkpoint() -> None:
        io.save_checkpoint(checkpoint_path, {
            "format": CHECKPOINT_FORMAT, "config_digest": config_digest(config), "round": state.round,
            "algorithm": algorithm.state_dict(), "torch_rng": torch.get_rng_state(),
            "metrics": state.metrics, "wall_time": state.wall_time,
        })

    x_train, y_train = data.x_train.to(device), data.y_train.to(device)
    with checkpoint_on_signal(save_checkpoint):
        while state.round < config.rounds:
            started = time.perf_counter()
            round_index = state.round
            chosen = sample_clients(config.clients, config.participation, config.seeds.sampling, round_index)
            clients = []
            for cid in chosen:
                idx = torch.as_tensor(partition.client_indices[cid], dtype=torch.long, device=device)
                clients.append(ClientData(cid, x_train[idx], y_train[idx], counts[cid].to(device)))
            row: dict[str, Any] = {"round": round_index + 1, **algorithm.train_round(round_index, clients)}
            if (round_index + 1) % config.eval_every == 0 or round_index + 1 == config.rounds:
                row.update(evaluate(algorithm.global_model(), data.x_test, data.y_test.cpu(), data.num_classes,
                                    groups, config.eval_batch, device))
            state.wall_time += time.perf_counter() - started
            state.round += 1
            if "accuracy" in row:
                state.metrics.append(row)
                io.append_line(out / "metrics.jsonl", row)
            if state.round % config.checkpoint_every == 0 or state.round == config.rounds:
                save_checkpoint()
            if on_round is not None:
                on_round(state.round, row)

    summary = summarise(state, config)
    io.write_json(out / "summary.json", summary)
    return summary


def summarise(state: RunState, config: RunConfig) -> dict[str, Any]:
    final = state.metrics[-1]
    best = max(state.metrics, key=lambda r: r["accuracy"])
    keep = ("accuracy", "balanced_accuracy", "loss", "many_accuracy", "medium_accuracy", "few_accuracy")
    return {
        "algorithm": config.algorithm, "dataset": config.dataset, "rounds": state.round,
        "final": {k: final.get(k) for k in keep} | {"per_class_accuracy": final["per_class_accuracy"]},
        "best": {"round": best["round"], "accuracy": best["accuracy"], "balanced_accuracy": best["balanced_accuracy"]},
        "wall_time_s": round(state.wall_time, 3),
    }

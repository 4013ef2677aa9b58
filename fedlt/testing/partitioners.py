"""The partitioner contract (SPEC §1): disjoint clients, covering what the manifest claims,
deterministic per seed and different across seeds, a manifest consistent with the indices, and a
clear error (not a hang) when the partition is impossible."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

import fedlt.partitioners
from fedlt.errors import FedltError
from fedlt.partitioners import Partition
from fedlt.partitioners.base import class_counts_of, indices_sha256
from fedlt.testing.base import Contract, registered

HANG_SECONDS = 30.0


def _labels(per_class: int = 60, num_classes: int = 10) -> np.ndarray:
    """A long-tailed label vector (class c has per_class·0.8^c samples), shuffled."""
    sizes = [max(8, int(per_class * 0.8 ** c)) for c in range(num_classes)]
    return np.random.default_rng(0).permutation(np.repeat(np.arange(num_classes), sizes))


def _partition(partitioner, y: np.ndarray, num_clients: int, seed: int, groups: np.ndarray | None = None):
    extra = {} if groups is None else {"groups": groups}
    return partitioner(y, num_clients, seed, num_classes=int(y.max()) + 1, dataset_name="contract", **extra)


def check_partitioner(partitioner: Any, params: dict[str, Any] | None = None, *, covers_all: bool = True,
                      num_clients: int = 5, labels: Any = None, groups: Any = None) -> None:
    """Check a partitioner, given by registered name or as its class/factory, created with ``params``.

    Properties: [returns a Partition]; [disjoint] (no sample held by two clients); [covers]
    (indices in range, the manifest's ``assigned_samples`` is what the clients hold, and every
    sample is held when ``covers_all``; pass False for a scheme that drops samples by design, like
    ``longtail``); [manifest] (class counts, sizes, sha256 and client count match the indices);
    [deterministic per seed]; [different across seeds]; [clear error when impossible] (more
    clients than samples raises FedltError within 30 s). ``groups`` (one id per label) are passed
    to a partitioner that follows the data's natural groups (``natural``).
    """
    y = _labels() if labels is None else np.asarray(labels)
    groups = None if groups is None else np.asarray(groups)
    num_classes = int(y.max()) + 1
    with registered(fedlt.partitioners.REGISTRY, partitioner, "contract_partitioner") as name:
        c = Contract(f"partitioner {name!r}")
        with c.property("construction"):
            instance = fedlt.partitioners.create(name, **(params or {}))
        with c.property("returns a Partition"):
            part = _partition(instance, y, num_clients, seed=0, groups=groups)
        c.check(isinstance(part, Partition), "returns a Partition", f"returned {type(part).__name__}")
        c.check(part.num_clients == num_clients, "manifest", f"{part.num_clients} clients, asked for {num_clients}")
        held = np.concatenate([np.asarray(i, dtype=np.int64) for i in part.client_indices])
        c.check(len(np.unique(held)) == held.size, "disjoint",
                f"{held.size - len(np.unique(held))} samples are held by more than one client")
        c.check(held.size == 0 or (held.min() >= 0 and held.max() < y.size), "covers",
                f"indices outside [0, {y.size})")
        assigned = part.manifest["summary"]["assigned_samples"]
        c.check(assigned == held.size, "covers", f"the manifest claims {assigned} assigned samples, clients hold {held.size}")
        if covers_all:
            c.check(held.size == y.size, "covers", f"{y.size - held.size} of {y.size} samples are held by no client "
                    "(pass covers_all=False for a scheme that drops samples by design)")
        counts = class_counts_of(part.client_indices, y, num_classes)
        c.check(np.array_equal(np.asarray(part.class_counts), counts), "manifest",
                "class_counts differ from the counts of the clients' indices")
        c.check(part.manifest["sha256"] == indices_sha256(part.client_indices), "manifest",
                "sha256 is not the hash of the indices")
        again = _partition(fedlt.partitioners.create(name, **(params or {})), y, num_clients, seed=0, groups=groups)
        c.check(again.sha256 == part.sha256, "deterministic per seed", "seed 0 gave two different partitions")
        others = [_partition(instance, y, num_clients, seed=s, groups=groups).sha256 for s in (1, 2, 3)]
        c.check(any(h != part.sha256 for h in others), "different across seeds",
                "seeds 0, 1, 2 and 3 all give the same partition")

        # impossible: more clients than samples; must raise a FedltError, and quickly
        result: dict[str, BaseException | None] = {}

        def attempt() -> None:
            try:
                _partition(instance, y[:num_classes * 2], 10 * y.size, seed=0,
                           groups=None if groups is None else groups[:num_classes * 2])
                result["error"] = None
            except BaseException as exc:  # reported below
                result["error"] = exc

        worker = threading.Thread(target=attempt, daemon=True)
        worker.start()
        worker.join(HANG_SECONDS)
        c.check(not worker.is_alive(), "clear error when impossible",
                f"still running after {HANG_SECONDS:.0f} s with {10 * y.size} clients for {num_classes * 2} samples")
        error = result["error"]
        c.check(isinstance(error, FedltError), "clear error when impossible",
                "no error for more clients than samples" if error is None else
                f"raised {type(error).__name__} ({' '.join(str(error).split())[:120]}), not a one-line FedltError")
        c.check(len(str(error).strip().splitlines()) == 1, "clear error when impossible",
                "the error message is more than one line")

"""Client test sets (SPEC §7): what each client is tested on for its personalised numbers.

``create(name, **params)(partition, y_train, y_test, seed) -> ClientTestSets``. Two built-ins:

- ``matched(size=None)`` — the FedRoD / FedBABU protocol: for client k with training class counts
  n_k and |D_k| samples, per class c draw round(m_k · n_kc / |D_k|) held-out *test* samples without
  replacement (capped by what the class has; the shortfall is recorded). ``size`` fixes m_k for
  every client; the default gives each client its share of the test set, scaled so that the
  largest client gets min(|D_max|, 500). Clients may share test samples (independent draws).
- ``holdout(fraction=0.25)`` — the PFLlib / FL-bench protocol: before training, each client's own
  indices are split per class, round(fraction · n_kc) to its test part (at least one per class it
  holds two or more of, never all of them); the client trains on the rest.

Each draw is deterministic from the partition seed and the client id. Only indices are kept (into
the test set for ``matched``, into the training set for ``holdout``), never copies of the data, so
every dataset works, streamed image folders included. The manifest records the parameters, the
sizes, the shortfall and a sha256 of every index list; ``holdout`` also the training part's.

A plugin adds a scheme through the entry-point group ``fedlt.client_tests``: a ``ClientTest``
subclass (or any callable with the same signature) returning ``ClientTestSets``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from fedlt.errors import FedltError
from fedlt.partitioners.base import Partition, as_labels, class_counts_of, indices_sha256
from fedlt.registry import Registry
from fedlt.spec import SpecModel

MATCHED_LARGEST = 500  # SPEC §7: the largest client's default matched test-set size is min(|D_k|, 500)

REGISTRY: Registry = Registry(
    "client_test", product=lambda obj: None if callable(obj) else f"{type(obj).__name__}, not a callable "
    "client_test(partition, y_train, y_test, seed)")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list


@dataclass
class ClientTestSets:
    """Each client's test indices and where they point (``"test"``: the held-out test set;
    ``"train"``: the training set, carved out of the client's own data).

    ``train_indices`` is the training part each client keeps (``None``: unchanged, the
    partition's own lists). ``manifest`` is JSON: name, params, source, sizes, shortfall, sha256s.
    """

    source: Literal["test", "train"]
    test_indices: list[np.ndarray]
    manifest: dict[str, Any]
    train_indices: list[np.ndarray] | None = None
    class_counts: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))

    @property
    def num_clients(self) -> int:
        return len(self.test_indices)


def _client_rng(seed: int, client: int, purpose: str) -> np.random.Generator:
    """A stream of its own for (partition seed, client, purpose): one client's draw never shifts
    another's, and the same seed always gives the same sets."""
    tag = int.from_bytes(purpose.encode()[:8].ljust(8, b"\0"), "little")
    return np.random.default_rng([int(seed), int(client), tag])


def _round_half_up(x: np.ndarray) -> np.ndarray:
    return np.floor(np.asarray(x, dtype=np.float64) + 0.5).astype(np.int64)


def _manifest(scheme: "ClientTest", source: str, test: list[np.ndarray], counts: np.ndarray,
              shortfall: int, train: list[np.ndarray] | None) -> dict[str, Any]:
    sizes = [int(len(t)) for t in test]
    out = {"name": scheme.name, "params": scheme.params(), "source": source, "sizes": sizes,
           "class_counts": counts.tolist(), "shortfall": int(shortfall), "sha256": indices_sha256(test)}
    if train is not None:
        out["train_sizes"] = [int(len(t)) for t in train]
        out["train_sha256"] = indices_sha256(train)
    return out


class ClientTest(SpecModel):
    """A client test-set scheme; its parameters are the model's fields, validated at construction."""

    name: ClassVar[str] = "client_test"

    def __call__(self, partition: Partition, y_train: Any, y_test: Any, seed: int) -> ClientTestSets:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")


@register("matched")
class Matched(ClientTest):
    """Test data drawn from the held-out test set to follow each client's training labels."""

    name: ClassVar[str] = "matched"
    size: int | None = Field(None, ge=1, le=10**7, description="samples per client (default: its share, "
                                                                 "the largest client getting min(|D_k|, 500))")

    def sizes(self, client_sizes: np.ndarray) -> np.ndarray:
        """m_k for each client (float64, before per-class rounding)."""
        if self.size is not None:
            return np.full(client_sizes.shape, float(self.size))
        largest = float(client_sizes.max())
        return client_sizes.astype(np.float64) * (min(largest, MATCHED_LARGEST) / largest)

    def __call__(self, partition: Partition, y_train: Any, y_test: Any, seed: int) -> ClientTestSets:
        counts = np.asarray(partition.class_counts, dtype=np.int64)
        y, num_classes = as_labels(y_test, counts.shape[1])
        by_class = [np.flatnonzero(y == c) for c in range(num_classes)]
        client_sizes = counts.sum(axis=1)
        wanted = _round_half_up(self.sizes(client_sizes)[:, None] * counts / client_sizes[:, None])
        test, shortfall = [], 0
        for k in range(len(counts)):
            rng = _client_rng(seed, k, "matched")
            picks = []
            for c in np.flatnonzero(wanted[k]):
                take = min(int(wanted[k, c]), by_class[c].size)
                shortfall += int(wanted[k, c]) - take
                picks.append(rng.choice(by_class[c], size=take, replace=False))
            test.append(np.sort(np.concatenate(picks)).astype(np.int64) if picks else np.zeros(0, np.int64))
        test_counts = class_counts_of(test, y, num_classes)
        return ClientTestSets("test", test, _manifest(self, "test", test, test_counts, shortfall, None),
                              class_counts=test_counts)


@register("holdout")
class Holdout(ClientTest):
    """Test data carved out of each client's own data before training."""

    name: ClassVar[str] = "holdout"
    fraction: float = Field(0.25, gt=0.0, lt=1.0, allow_inf_nan=False, description="share of each class moved to the client's test part")

    def test_count(self, n: np.ndarray) -> np.ndarray:
        """How many of n samples of one class go to the test part: round(fraction·n), at least one
        when n ≥ 2, never all n (the client keeps at least one to train on)."""
        n = np.asarray(n, dtype=np.int64)
        t = _round_half_up(self.fraction * n)
        t = np.where(n >= 2, np.maximum(t, 1), 0)
        return np.minimum(t, np.maximum(n - 1, 0))

    def __call__(self, partition: Partition, y_train: Any, y_test: Any, seed: int) -> ClientTestSets:
        y, num_classes = as_labels(y_train, partition.class_counts.shape[1])
        test, train = [], []
        for k, idx in enumerate(partition.client_indices):
            rng = _client_rng(seed, k, "holdout")
            labels = y[idx]
            chosen = np.zeros(idx.size, dtype=bool)
            for c in np.unique(labels):
                members = np.flatnonzero(labels == c)
                chosen[rng.choice(members, size=int(self.test_count(members.size)), replace=False)] = True
            test.append(idx[chosen].astype(np.int64))
            train.append(idx[~chosen].astype(np.int64))
        empty = [k for k, t in enumerate(train) if t.size == 0]
        if empty:  # cannot happen with test_count's rule; a guard for subclasses that change it
            raise FedltError(f"{self.describe()} left client {empty[0]} nothing to train on")
        test_counts = class_counts_of(test, y, num_classes)
        return ClientTestSets("train", test, _manifest(self, "train", test, test_counts, 0, train),
                              train_indices=train, class_counts=test_counts)


__all__ = ["REGISTRY", "ClientTest", "ClientTestSets", "Holdout", "Matched", "create", "get", "list", "register"]

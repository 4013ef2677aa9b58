"""The client test-set contract: what the run relies on from every ``client_test`` scheme."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedlt import client_tests, partitioners
from fedlt.client_tests import ClientTestSets
from fedlt.partitioners.base import class_counts_of, indices_sha256
from fedlt.testing.base import Contract, registered


def _labels(n: int, num_classes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, num_classes, n)
    y[:num_classes] = np.arange(num_classes)  # every class present
    return y.astype(np.int64)


def check_client_test(scheme: Any, params: dict[str, Any] | None = None, *, num_clients: int = 6) -> None:
    """Check a client test-set scheme, given by registered name or as its class/factory.

    Properties: [returns ClientTestSets] (one index list per client, ``source`` "test" or
    "train"); [indices valid] (inside the set ``source`` names; for "train": inside the client's
    own data, disjoint from the training part it keeps, the two covering its data, and every
    client keeps at least one sample to train on); [manifest] (sizes, class counts and sha256s
    match the indices); [deterministic per seed]; [different across seeds].
    """
    y_train, y_test = _labels(600, 5, 0), _labels(300, 5, 1)
    part = partitioners.create("dirichlet", beta=0.5)(y_train, num_clients, seed=0)
    with registered(client_tests.REGISTRY, scheme, "contract_client_test") as name:
        c = Contract(f"client_test {name!r}")
        with c.property("construction"):
            instance = client_tests.create(name, **(params or {}))
        with c.property("returns ClientTestSets"):
            sets = instance(part, y_train, y_test, 0)
        c.check(isinstance(sets, ClientTestSets), "returns ClientTestSets", f"returned {type(sets).__name__}")
        c.check(sets.num_clients == num_clients, "returns ClientTestSets",
                f"{sets.num_clients} test sets for {num_clients} clients")
        c.check(sets.source in ("test", "train"), "returns ClientTestSets", f"source {sets.source!r}")
        _check_indices(c, sets, part, y_train.size, y_test.size)
        labels = y_test if sets.source == "test" else y_train
        c.check(np.array_equal(sets.class_counts, class_counts_of(sets.test_indices, labels, 5)), "manifest",
                "class_counts differ from the counts of the test indices")
        c.check(sets.manifest.get("sha256") == indices_sha256(sets.test_indices), "manifest",
                "sha256 does not match the test indices")
        c.check(sets.manifest.get("sizes") == [len(t) for t in sets.test_indices], "manifest", "sizes differ")
        again = instance(part, y_train, y_test, 0)
        c.check(all(np.array_equal(a, b) for a, b in zip(sets.test_indices, again.test_indices)),
                "deterministic per seed", "two calls with seed 0 differ")
        other = instance(part, y_train, y_test, 1)
        c.check(any(not np.array_equal(a, b) for a, b in zip(sets.test_indices, other.test_indices)),
                "different across seeds", "seeds 0 and 1 give the same test sets")


def _check_indices(c: Contract, sets: ClientTestSets, part: Any, train_size: int, test_size: int) -> None:
    for k, test in enumerate(sets.test_indices):
        test = np.asarray(test)
        c.check(test.dtype == np.int64 and test.ndim == 1, "indices valid", f"client {k}: not 1-D int64")
        c.check(np.unique(test).size == test.size, "indices valid", f"client {k}: a test sample listed twice")
        if sets.source == "test":
            c.check(test.size == 0 or (test.min() >= 0 and test.max() < test_size), "indices valid",
                    f"client {k}: indices outside the test set's {test_size} samples")
            continue
        own = np.asarray(part.client_indices[k])
        c.check(sets.train_indices is not None, "indices valid", "source 'train' without a training part")
        keep = np.asarray(sets.train_indices[k])
        c.check(keep.size > 0, "indices valid", f"client {k} keeps nothing to train on")
        c.check(np.intersect1d(keep, test).size == 0, "indices valid", f"client {k}: a sample both trains and tests")
        c.check(np.array_equal(np.sort(np.concatenate([keep, test])), np.sort(own)), "indices valid",
                f"client {k}: training and test parts do not make up its own data")
        c.check(bool(np.all((test >= 0) & (test < train_size))), "indices valid", f"client {k}: outside the training set")

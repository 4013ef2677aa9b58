"""The built-in label-skew schemes of SPEC §1: ``iid``, ``dirichlet``, ``quantity``, ``shards``,
``longtail``; and ``natural``, which follows the dataset's own groups (writers, users, sites).

Each returns the owner of every training sample (``Partitioner.assign``), vectorised: the only
Python loops run over classes or redraws, never over samples. Only training labels are ever seen;
the test set is not partitioned or subsampled and stays balanced, as in the papers.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_serializer, field_validator

from fedlt.bounds import MAX_SAMPLES as MAX_COUNT  # no partition of a dataset that fits in memory needs more
from fedlt.errors import FedltError
from fedlt.partitioners import REGISTRY, register  # defined before fedlt.partitioners imports this module
from fedlt.partitioners.base import Partitioner
from fedlt.registry import create_from_spec

# A draw costs O(C·K); 100 bounds a hopeless dirichlet setting to well under a second on MNIST
# while feasible settings succeed within a handful of draws.
MAX_DIRICHLET_DRAWS = 100


def split_sizes(total: int, parts: int) -> np.ndarray:
    """Sizes of ``np.array_split(range(total), parts)``: equal up to 1, the larger ones first."""
    sizes = np.full(parts, total // parts, dtype=np.int64)
    sizes[: total % parts] += 1
    return sizes


def class_sorted_order(y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sample positions grouped by class (class 0 first), in random order within each class."""
    perm = rng.permutation(y.size)
    return perm[np.argsort(y[perm], kind="stable")]


def owners_from_runs(order: np.ndarray, run_owner: np.ndarray, run_sizes: np.ndarray) -> np.ndarray:
    """Cut ``order`` into consecutive runs of ``run_sizes``; run j goes to ``run_owner[j]``."""
    owner = np.empty(order.size, dtype=np.int64)
    owner[order] = np.repeat(run_owner.astype(np.int64), run_sizes)
    return owner


def deal(num_items: int, per_client: int, rng: np.random.Generator) -> np.ndarray:
    """Shuffle ``num_items`` items and give each client ``per_client`` of them: item -> client."""
    owner = np.empty(num_items, dtype=np.int64)
    owner[rng.permutation(num_items)] = np.arange(num_items) // per_client
    return owner


@register("iid")
class IID(Partitioner):
    """Shuffle, then split into K parts whose sizes differ by at most 1 (SPEC §1 ``iid``)."""

    name = "iid"

    def assign(self, y: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        if y.size < num_clients:
            raise FedltError(f"iid: {y.size} samples cannot give each of {num_clients} clients one; use fewer clients")
        return owners_from_runs(rng.permutation(y.size), np.arange(num_clients), split_sizes(y.size, num_clients))


@register("dirichlet")
class Dirichlet(Partitioner):
    """Distribution-based label skew D(β) (SPEC §1 ``dirichlet``; NIID-Bench's loop).

    For each class c in turn: q ~ Dir(β·1_K); clients already holding ≥ N/K samples get q_k = 0;
    q is renormalised and the class's shuffled samples are cut at ⌊n_c·cumsum(q)⌋. The whole draw
    is repeated until every client holds ≥ ``min_size`` samples, at most ``MAX_DIRICHLET_DRAWS``
    times; then a FedltError names beta, min_size and the client count.
    """

    name = "dirichlet"
    # above 1e6 the draws are iid's proportions to 6 digits; near 1e308 the Dirichlet sums overflow
    beta: float = Field(gt=0, le=1e6, allow_inf_nan=False,
                        description="concentration; small = strong skew (at most 1e6: beyond, use iid)")
    min_size: int = Field(10, ge=1, le=MAX_COUNT, description="fewest samples any client may hold")

    def draw(self, class_sizes: np.ndarray, num_clients: int, rng: np.random.Generator) -> np.ndarray | None:
        """One draw of the C×K class counts, or None when a class had nowhere to go."""
        cap = class_sizes.sum() / num_clients
        q_all = rng.dirichlet(np.full(num_clients, self.beta), size=class_sizes.size)
        counts = np.zeros((class_sizes.size, num_clients), dtype=np.int64)
        held = np.zeros(num_clients, dtype=np.int64)
        for c, n_c in enumerate(class_sizes):
            if n_c == 0:
                continue
            q = np.where(held < cap, q_all[c], 0.0)
            total = q.sum()
            if not total > 0:  # tiny beta: every open client drew exactly 0 for this class
                return None
            cuts = np.minimum(np.floor(np.cumsum(q / total)[:-1] * n_c).astype(np.int64), n_c)
            counts[c] = np.diff(cuts, prepend=0, append=n_c)
            held += counts[c]
        return counts

    def assign(self, y: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        what = f"dirichlet(beta={self.beta}, min_size={self.min_size})"
        if num_clients * self.min_size > y.size:
            raise FedltError(f"{what}: {num_clients} clients × min_size {self.min_size} needs "
                             f"{num_clients * self.min_size} samples but there are {y.size}; "
                             "lower min_size or use fewer clients")
        class_sizes = np.bincount(y, minlength=num_classes)
        order = class_sorted_order(y, rng)
        best = 0
        for _ in range(MAX_DIRICHLET_DRAWS):
            counts = self.draw(class_sizes, num_clients, rng)
            if counts is None:
                continue
            smallest = int(counts.sum(axis=0).min())
            if smallest >= self.min_size:
                return owners_from_runs(order, np.tile(np.arange(num_clients), num_classes), counts.ravel())
            best = max(best, smallest)
        raise FedltError(f"{what} gave up after {MAX_DIRICHLET_DRAWS} draws: none gave all {num_clients} clients "
                         f"at least {self.min_size} of the {y.size} samples (best smallest client: {best}); "
                         "raise beta, lower min_size or use fewer clients")


@register("quantity")
class Quantity(Partitioner):
    """Quantity-based label skew Q(α) of SCALA / FedLC (SPEC §1 ``quantity``).

    Each class's shuffled samples are split into K·α/C equal portions (sizes differ by at most
    1; K·α must be a multiple of C); the K·α portions are shuffled and each client takes α of
    them, so a client holds at most α classes.
    """

    name = "quantity"
    alpha: int = Field(ge=1, le=MAX_COUNT, description="classes (portions) per client")

    def assign(self, y: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        alpha, what = self.alpha, f"quantity(alpha={self.alpha})"
        if alpha > num_classes:
            raise FedltError(f"{what}: alpha (classes per client) cannot exceed the {num_classes} classes")
        if num_clients * alpha % num_classes:
            step = num_classes // math.gcd(num_classes, alpha)
            lower, upper = num_clients // step * step, (num_clients // step + 1) * step
            hint = " or ".join(str(k) for k in (lower, upper) if k > 0)
            raise FedltError(f"{what} with {num_clients} clients: K·alpha = {num_clients * alpha} is not a multiple "
                             f"of the {num_classes} classes, so classes cannot be cut into equal portions; "
                             f"use {hint} clients or another alpha")
        portions = num_clients * alpha // num_classes
        class_sizes = np.bincount(y, minlength=num_classes)
        short = np.flatnonzero(class_sizes < portions)
        if short.size:
            c = int(short[0])
            raise FedltError(f"{what} with {num_clients} clients: class {c} has {class_sizes[c]} samples, fewer than "
                             f"the {portions} portions (K·alpha/C) it must be cut into; use fewer clients")
        sizes = np.stack([split_sizes(int(n), portions) for n in class_sizes])  # C × portions
        return owners_from_runs(class_sorted_order(y, rng), deal(num_clients * alpha, alpha, rng), sizes.ravel())


@register("shards")
class Shards(Partitioner):
    """McMahan et al.'s pathological split (SPEC §1 ``shards``).

    Sort by label (random order within a class), cut into K·s contiguous shards of equal size
    (±1), and give each client s random shards. A shard straddles two classes wherever a class
    count is not a multiple of the shard size, so a client holds at most s classes only when
    every class count is a multiple of N/(K·s), and at most 2s when shards are no larger than
    the smallest class.
    """

    name = "shards"
    shards_per_client: int = Field(ge=1, le=MAX_COUNT, description="shards s given to each client")

    def assign(self, y: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        s, shards = self.shards_per_client, num_clients * self.shards_per_client
        if y.size < shards:
            raise FedltError(f"shards(shards_per_client={s}) with {num_clients} clients needs at least {shards} "
                             f"samples (one per shard), there are {y.size}; use fewer clients or shards")
        return owners_from_runs(class_sorted_order(y, rng), deal(shards, s, rng), split_sizes(y.size, shards))


def long_tail_counts(class_sizes: np.ndarray, imbalance_factor: float) -> np.ndarray:
    """Samples kept per class: min(n_c, ⌊n_max·IF^(−c/(C−1))⌋), class 0 = head (Fed-GraB, LDAM)."""
    num_classes = class_sizes.size
    if num_classes == 1:
        return class_sizes.copy()
    target = class_sizes.max() * np.power(float(imbalance_factor), -np.arange(num_classes) / (num_classes - 1))
    # an exact integer such as n_max/IF must not floor to one less through rounding error
    target = np.floor(target * (1 + 1e-12)).astype(np.int64)
    return np.minimum(class_sizes, target)


@register("longtail")
class LongTail(Partitioner):
    """Global long tail, then another scheme (SPEC §1 ``longtail``; Fed-GraB: longtail → dirichlet).

    Keeps the first min(n_c, ⌊n_max·IF^(−c/(C−1))⌋) shuffled samples of class c (class 0 is the
    head, n_max the largest class count), then applies ``then`` to what is kept; the rest belongs
    to no client. ``then`` is written as a table, e.g. ``{"name": "dirichlet", "beta": 0.5}``.
    """

    name = "longtail"
    imbalance_factor: float = Field(ge=1, allow_inf_nan=False, description="IF = n_head / n_tail")
    then: Partitioner = Field(default_factory=IID, description="partitioner applied to the kept samples")

    @field_validator("then", mode="before")
    @classmethod
    def _build_then(cls, spec: Any) -> Partitioner:
        if isinstance(spec, Partitioner):
            return spec
        if isinstance(spec, str):
            spec = {"name": spec}
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError("must name a partitioner and its parameters, e.g. {'name': 'dirichlet', 'beta': 0.5}")
        inner = create_from_spec(REGISTRY, spec, "then")
        if not isinstance(inner, Partitioner):
            raise ValueError(f"{spec['name']!r} is not a Partitioner model and cannot follow longtail")
        return inner

    @field_serializer("then")
    def _dump_then(self, inner: Partitioner) -> dict[str, Any]:
        return {"name": inner.name, **inner.params()}

    def describe(self) -> str:
        return f"longtail(imbalance_factor={self.imbalance_factor}) → {self.then.describe()}"

    def assign(self, y: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        return self.assign_with_groups(y, None, num_clients, num_classes, rng)

    def assign_with_groups(self, y: np.ndarray, groups: np.ndarray | None, num_clients: int, num_classes: int,
                           rng: np.random.Generator) -> np.ndarray:
        class_sizes = np.bincount(y, minlength=num_classes)
        keep = long_tail_counts(class_sizes, self.imbalance_factor)
        emptied = np.flatnonzero((keep == 0) & (class_sizes > 0))
        if emptied.size:  # the tail n_max/IF fell below one sample: those classes would vanish silently
            raise FedltError(f"longtail(imbalance_factor={self.imbalance_factor:g}) keeps no sample of "
                             f"{emptied.size} class(es) (first: class {emptied[0]}); with a head class of "
                             f"{class_sizes.max()} samples the imbalance factor can be at most {class_sizes.max()}")
        order = class_sorted_order(y, rng)
        rank = np.arange(y.size) - np.repeat(np.cumsum(class_sizes) - class_sizes, class_sizes)  # position in class
        kept = np.sort(order[rank < np.repeat(keep, class_sizes)])
        owner = np.full(y.size, -1, dtype=np.int64)
        try:
            owner[kept] = self.then.assign_with_groups(y[kept], None if groups is None else groups[kept],
                                                       num_clients, num_classes, rng)
        except FedltError as exc:
            raise FedltError(f"longtail(imbalance_factor={self.imbalance_factor}) kept {kept.size} samples, "
                             f"then {exc}") from None
        return owner


@register("natural")
class Natural(Partitioner):
    """The dataset's natural clients: each group (writer, user, site; the dataset's
    ``groups_train``) goes whole to one client.

    With K clients and G ≥ K groups among the samples given: ``merge="size"`` takes the groups
    largest first (ties: lower group id) and gives each to the client holding the fewest samples
    so far (ties: lower client id), so K = G gives client k the k-th largest group and K < G
    balances the sizes; it does not depend on the seed. ``merge="random"`` shuffles the groups
    with the seed and gives each client ⌊G/K⌋ or ⌈G/K⌉ of them. K > G is an error. After
    ``longtail`` only the groups of the kept samples count.
    """

    name = "natural"
    merge: Literal["size", "random"] = Field(
        "size", description="how groups are merged into clients: size (balanced sizes, largest groups first; "
                            "seed-independent) or random (shuffled by the seed, equal group counts)")

    def assign(self, y: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        raise FedltError("natural needs each training sample's group id (writer, user, site), and this dataset has "
                         "none: give the arrays dataset a groups_train array (docs: Datasets)")

    def assign_with_groups(self, y: np.ndarray, groups: np.ndarray | None, num_clients: int, num_classes: int,
                           rng: np.random.Generator) -> np.ndarray:
        if groups is None:
            return self.assign(y, num_clients, num_classes, rng)
        present, codes = np.unique(groups, return_inverse=True)  # groups longtail emptied do not count
        codes = codes.reshape(-1)
        sizes = np.bincount(codes, minlength=present.size)
        if num_clients > present.size:
            raise FedltError(f"natural: the data has {present.size} groups, fewer than the {num_clients} clients; "
                             f"use at most {present.size} clients")
        client_of_group = np.empty(present.size, dtype=np.int64)
        if self.merge == "random":
            client_of_group[rng.permutation(present.size)] = np.arange(present.size) * num_clients // present.size
        else:
            held = [(0, k) for k in range(num_clients)]  # a heap of (samples held, client)
            for g in np.argsort(-sizes, kind="stable"):  # a loop over groups, never samples
                total, k = heapq.heappop(held)
                client_of_group[g] = k
                heapq.heappush(held, (total + int(sizes[g]), k))
        return client_of_group[codes]

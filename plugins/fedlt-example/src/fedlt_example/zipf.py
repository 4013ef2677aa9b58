"""A quantity-skew partitioner: client sizes follow a power law, labels are drawn at random."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from fedlt.plugin import FedltError, Partitioner


def zipf_sizes(total: int, num_clients: int, s: float) -> np.ndarray:
    """n_k ∝ (k + 1)^(−s), at least 1 each, summing to ``total`` (largest remainders round)."""
    if num_clients > total:
        raise FedltError(f"zipf: {num_clients} clients need at least {num_clients} samples, there are {total}")
    share = (np.arange(num_clients) + 1.0) ** -s
    raw = share / share.sum() * (total - num_clients)
    sizes = np.floor(raw).astype(np.int64)
    sizes[np.argsort(-(raw - sizes), kind="stable")[: total - num_clients - sizes.sum()]] += 1
    return sizes + 1


class Zipf(Partitioner):
    """Client k holds n_k ∝ (k + 1)^(−s) samples (a power law in client size, s = 1 by default),
    drawn at random without regard to their labels; every sample goes to one client."""

    name = "zipf"
    s: float = Field(1.0, ge=0, le=10, allow_inf_nan=False, description="power-law exponent (0: equal sizes)")

    def assign(self, y: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        sizes = zipf_sizes(y.size, num_clients, self.s)
        owner = np.empty(y.size, dtype=np.int64)
        owner[rng.permutation(y.size)] = np.repeat(np.arange(num_clients), sizes)
        return owner

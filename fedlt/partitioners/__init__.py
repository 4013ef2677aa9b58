"""Data partitioners (SPEC §1): ``create(name, **params)(labels, num_clients, seed) -> Partition``."""

from fedlt.registry import Registry

REGISTRY: Registry = Registry(
    "partitioner", product=lambda obj: None if callable(obj) else f"{type(obj).__name__}, not a callable "
    "partitioner(labels, num_clients, seed)")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

from fedlt.partitioners.base import Partition, Partitioner, partition_data  # noqa: E402
from fedlt.partitioners import schemes  # noqa: E402,F401  registers the built-ins
from fedlt.partitioners.schemes import IID, Dirichlet, LongTail, Natural, Quantity, Shards  # noqa: E402

__all__ = ["REGISTRY", "Partition", "Partitioner", "IID", "Dirichlet", "Quantity", "Shards", "LongTail", "Natural",
           "create", "get", "list", "partition_data", "register"]

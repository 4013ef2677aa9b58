"""Data partitioners (SPEC §1): ``create(name, **params)(labels, num_clients, seed) -> Partition``."""

from fedlt.registry import Registry

REGISTRY: Registry = Registry("partitioner")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

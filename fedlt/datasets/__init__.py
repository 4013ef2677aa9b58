"""Datasets held as in-memory tensors: ``create(name, root=..., download=False) -> InMemoryDataset``."""

from fedlt.registry import Registry

REGISTRY: Registry = Registry("dataset")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

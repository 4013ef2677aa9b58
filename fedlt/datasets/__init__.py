"""Datasets held as in-memory tensors: ``create(name, root=..., download=False) -> InMemoryDataset``."""

from fedlt.registry import Registry

REGISTRY: Registry = Registry("dataset")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

from fedlt.datasets.base import InMemoryDataset  # noqa: E402
from fedlt.datasets import mnist, torchvision_sets  # noqa: E402,F401  (register the built-ins)

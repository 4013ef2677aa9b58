"""Datasets held as in-memory tensors: ``create(name, root=..., download=False) -> InMemoryDataset``."""

from fedlt.registry import Registry

DATASET_FIELDS = ("x_train", "y_train", "x_test", "y_test", "num_classes")


def _dataset_check(obj) -> str | None:
    missing = [f for f in DATASET_FIELDS if not hasattr(obj, f)]
    return f"{type(obj).__name__} lacks {', '.join(missing)} (see InMemoryDataset)" if missing else None


REGISTRY: Registry = Registry("dataset", product=_dataset_check)
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

from fedlt.datasets.base import InMemoryDataset  # noqa: E402
from fedlt.datasets import arrays, mnist, torchvision_sets  # noqa: E402,F401  (register the built-ins)

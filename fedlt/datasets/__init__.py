"""Datasets: ``create(name, root=..., download=False, **params) -> InMemoryDataset``, or ``load(spec, ...)``
from a spec such as ``imagefolder(image_size=96)``. Images are in-memory tensors, or image sources
decoded on demand (``imagefolder``; fedlt.datasets.source)."""

import inspect

from fedlt.errors import FedltError
from fedlt.registry import Registry
from fedlt.spec import parse_spec

DATASET_FIELDS = ("x_train", "y_train", "x_test", "y_test", "num_classes")


def _dataset_check(obj) -> str | None:
    missing = [f for f in DATASET_FIELDS if not hasattr(obj, f)]
    return f"{type(obj).__name__} lacks {', '.join(missing)} (see InMemoryDataset)" if missing else None


REGISTRY: Registry = Registry("dataset", product=_dataset_check)
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

from fedlt.datasets.base import InMemoryDataset, fingerprint  # noqa: E402,F401
from fedlt.datasets import arrays, imagefolder, mnist, torchvision_sets  # noqa: E402,F401  (register the built-ins)


def parse(spec: str) -> tuple[str, dict]:
    """``"mnist"`` / ``"imagefolder(image_size=96, train_list=train.txt)"`` -> (name, params), the
    name registered and the parameter names checked against the dataset's signature (their values
    when it is created); the root and download come from their own settings, not the spec."""
    parsed = parse_spec(spec, "dataset")
    name = parsed.pop("name")
    fixed = sorted({"root", "download"} & set(parsed))
    if fixed:
        raise FedltError(f"dataset {spec!r}: {', '.join(fixed)} come(s) from --data-root / --download, not the spec")
    factory = get(name)
    try:
        inspect.signature(factory).bind(root=None, download=False, **parsed)
    except TypeError as exc:  # an unknown parameter
        raise FedltError(f"dataset {name!r}: {exc}") from None
    except ValueError:  # no signature to read: the dataset judges its parameters itself
        pass
    return name, parsed


def load(spec: str, root=None, download: bool = False) -> InMemoryDataset:
    """The dataset a spec names (``parse``), created with its parameters, ``root`` and ``download``."""
    name, params = parse(spec)
    return create(name, root=root, download=download, **params)

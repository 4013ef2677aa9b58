"""CIFAR-10/100, Fashion-MNIST and SVHN through torchvision, from ``root``; downloads only on request."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from fedlt.datasets import register
from fedlt.datasets.base import InMemoryDataset, normalise
from fedlt.errors import FedltError, first_line


class _Spec(NamedTuple):
    cls: str  # in torchvision.datasets
    labels: str  # the attribute holding the labels
    num_classes: int
    train: dict[str, Any]  # keyword arguments selecting the split
    test: dict[str, Any]
    files: str  # what torchvision expects under root, for the error message when it is missing
    mean: tuple[float, ...]
    std: tuple[float, ...]


SETS = {
    "cifar10": _Spec("CIFAR10", "targets", 10, {"train": True}, {"train": False},
                     "cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta; from cifar-10-python.tar.gz)",
                     (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": _Spec("CIFAR100", "targets", 100, {"train": True}, {"train": False},
                      "cifar-100-python/ (train, test, meta; from cifar-100-python.tar.gz)",
                      (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "fashion_mnist": _Spec("FashionMNIST", "targets", 10, {"train": True}, {"train": False},
                           "FashionMNIST/raw/ (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
                           "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte)",
                           (0.2860,), (0.3530,)),
    "svhn": _Spec("SVHN", "labels", 10, {"split": "train"}, {"split": "test"},
                  "train_32x32.mat and test_32x32.mat (needs scipy)",
                  (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}


def _open(name: str, factory, root: str | Path | None, download: bool, **kwargs):
    if root is None:
        raise FedltError(f"dataset {name} needs --data-root (a folder holding {SETS[name].files})")
    try:
        return factory(root=str(root), download=download, **kwargs)
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        raise FedltError(
            f"dataset {name} not found under {Path(root).resolve()}: put {SETS[name].files} there, "
            f"or pass --download to fetch it ({exc})"
        ) from None
    except (ValueError, EOFError, KeyError, IndexError, TypeError, pickle.UnpicklingError) as exc:
        raise FedltError(f"dataset {name} under {Path(root).resolve()}: a file is damaged or not in the format "
                         f"torchvision reads ({type(exc).__name__}: {first_line(exc)[:120]}); expected {SETS[name].files}"
                         ) from None


def _images(data) -> torch.Tensor:
    """torchvision keeps HWC numpy arrays (CIFAR), NHW tensors (FashionMNIST) or NCHW arrays (SVHN)."""
    x = torch.as_tensor(np.asarray(data))
    if x.ndim == 3:
        return x.unsqueeze(1)
    return x.permute(0, 3, 1, 2).contiguous() if x.shape[-1] in (1, 3) else x


def _make(name: str, train, test) -> InMemoryDataset:
    spec = SETS[name]
    return InMemoryDataset(
        name,
        normalise(_images(train.data), spec.mean, spec.std),
        torch.as_tensor(np.asarray(getattr(train, spec.labels)), dtype=torch.int64),
        normalise(_images(test.data), spec.mean, spec.std),
        torch.as_tensor(np.asarray(getattr(test, spec.labels)), dtype=torch.int64),
        spec.num_classes,
    )


def _loader(name: str):
    """The registered loader of ``name``, documented from its spec (`fedlt list`, the docs)."""
    def load(root: str | Path | None = None, download: bool = False) -> InMemoryDataset:
        import torchvision.datasets

        spec = SETS[name]
        factory = getattr(torchvision.datasets, spec.cls)
        return _make(name, _open(name, factory, root, download, **spec.train),
                     _open(name, factory, root, download, **spec.test))

    load.__name__ = load.__qualname__ = name
    spec = SETS[name]
    load.__doc__ = (f"torchvision's {spec.cls} ({spec.num_classes} classes), read from ``root`` "
                    f"(``--data-root``: {spec.files}), normalised per channel.")
    return load


for _name in SETS:
    register(_name)(_loader(_name))

"""CIFAR-10/100, Fashion-MNIST and SVHN through torchvision, from ``root``; downloads only on request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedlt.datasets import register
from fedlt.datasets.base import InMemoryDataset, normalise
from fedlt.errors import FedltError

# What torchvision expects under root, for the error message when it is missing.
EXPECTED_FILES = {
    "cifar10": "cifar-10-batches-py/ (data_batch_1..5, test_batch, batches.meta; from cifar-10-python.tar.gz)",
    "cifar100": "cifar-100-python/ (train, test, meta; from cifar-100-python.tar.gz)",
    "fashion_mnist": "FashionMNIST/raw/ (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte)",
    "svhn": "train_32x32.mat and test_32x32.mat (needs scipy)",
}
STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}


def _open(name: str, factory, root: str | Path | None, download: bool, **kwargs):
    if root is None:
        raise FedltError(f"dataset {name} needs --data-root (a folder holding {EXPECTED_FILES[name]})")
    try:
        return factory(root=str(root), download=download, **kwargs)
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        raise FedltError(
            f"dataset {name} not found under {Path(root).resolve()}: put {EXPECTED_FILES[name]} there, "
            f"or pass --download to fetch it ({exc})"
        ) from None


def _images(data) -> torch.Tensor:
    """torchvision keeps HWC numpy arrays (CIFAR), NHW tensors (FashionMNIST) or NCHW arrays (SVHN)."""
    x = torch.as_tensor(np.asarray(data))
    if x.ndim == 3:
        return x.unsqueeze(1)
    return x.permute(0, 3, 1, 2).contiguous() if x.shape[-1] in (1, 3) else x


def _make(name: str, train, test, labels_attr: str, num_classes: int) -> InMemoryDataset:
    mean, std = STATS[name]
    return InMemoryDataset(
        name,
        normalise(_images(train.data), mean, std),
        torch.as_tensor(np.asarray(getattr(train, labels_attr)), dtype=torch.int64),
        normalise(_images(test.data), mean, std),
        torch.as_tensor(np.asarray(getattr(test, labels_attr)), dtype=torch.int64),
        num_classes,
    )


@register("cifar10")
def cifar10(root: str | Path | None = None, download: bool = False) -> InMemoryDataset:
    from torchvision.datasets import CIFAR10

    return _make("cifar10", _open("cifar10", CIFAR10, root, download, train=True),
                 _open("cifar10", CIFAR10, root, download, train=False), "targets", 10)


@register("cifar100")
def cifar100(root: str | Path | None = None, download: bool = False) -> InMemoryDataset:
    from torchvision.datasets import CIFAR100

    return _make("cifar100", _open("cifar100", CIFAR100, root, download, train=True),
                 _open("cifar100", CIFAR100, root, download, train=False), "targets", 100)


@register("fashion_mnist")
def fashion_mnist(root: str | Path | None = None, download: bool = False) -> InMemoryDataset:
    from torchvision.datasets import FashionMNIST

    return _make("fashion_mnist", _open("fashion_mnist", FashionMNIST, root, download, train=True),
                 _open("fashion_mnist", FashionMNIST, root, download, train=False), "targets", 10)


@register("svhn")
def svhn(root: str | Path | None = None, download: bool = False) -> InMemoryDataset:
    from torchvision.datasets import SVHN

    return _make("svhn", _open("svhn", SVHN, root, download, split="train"),
                 _open("svhn", SVHN, root, download, split="test"), "labels", 10)

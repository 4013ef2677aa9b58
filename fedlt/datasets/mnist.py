"""MNIST read straight from the four standard idx ``.gz`` files shipped inside the package."""

from __future__ import annotations

import functools
import gzip
import struct
from pathlib import Path

import numpy as np
import torch

from fedlt.datasets import register
from fedlt.datasets.base import InMemoryDataset, normalise
from fedlt.errors import FedltError

PACKAGED_MNIST = Path(__file__).with_name("mnist")
MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}


def read_idx(path: Path) -> np.ndarray:
    """An idx file (gzip or raw): magic (0, 0, dtype=0x08 ubyte, ndim), big-endian dims, data."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise FedltError(f"{path} is not an unsigned-byte idx file")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise FedltError(f"{path} is truncated: expected {int(np.prod(dims))} values, found {data.size}")
    return data.reshape(dims)


@functools.lru_cache(maxsize=4)  # decoding takes seconds; datasets are never modified in place
def load_idx_dataset(name: str, folder: Path, mean: float, std: float) -> InMemoryDataset:
    missing = [f for f in MNIST_FILES.values() if not (folder / f).exists()]
    if missing:
        raise FedltError(f"{name}: missing {', '.join(missing)} in {folder}")
    arrays = {key: read_idx(folder / fname) for key, fname in MNIST_FILES.items()}
    images = {k: normalise(torch.from_numpy(arrays[k].copy()).unsqueeze(1), (mean,), (std,)) for k in ("x_train", "x_test")}
    labels = {k: torch.from_numpy(arrays[k].astype(np.int64)) for k in ("y_train", "y_test")}
    return InMemoryDataset(name, images["x_train"], labels["y_train"], images["x_test"], labels["y_test"], 10)


@register("mnist")
def mnist(root: str | Path | None = None, download: bool = False) -> InMemoryDataset:
    """MNIST (60k/10k, 1×28×28). Offline: read from the package unless ``root`` holds the files."""
    folder = Path(root) if root is not None and all((Path(root) / f).exists() for f in MNIST_FILES.values()) else PACKAGED_MNIST
    return load_idx_dataset("mnist", folder, 0.1307, 0.3081)

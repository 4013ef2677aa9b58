"""The in-memory dataset every run trains on: normalised float tensors and int64 labels."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fedlt.datasets.source import Images, images

# labels are class indices below this: a classifier head of 10^5 classes on 4096 features is 1.6 GB
# of float32 weights, and a C-long histogram per client is kept for every client (K×C counts)
MAX_CLASSES = 100_000
FULL_DIGEST_BYTES = 1 << 28  # a split up to 256 MiB is hashed whole (~0.2 s at sha256's 1.2 GB/s); beyond, sampled


@dataclass(frozen=True)
class InMemoryDataset:
    """Train and test splits: labels in memory, images as tensors (a round never touches a
    DataLoader or disk) or as image sources decoded on demand (``imagefolder``).

    ``x_*`` are float32 (N, C, H, W), already normalised — a tensor, or an ImageSource
    (fedlt.datasets.source) that decodes into such tensors; ``y_*`` are int64 (N,) tensors.
    ``groups_train`` (optional, int64 (N,), ids 0..G-1) names each training sample's natural
    group (writer, user, site), which the ``natural`` partitioner gives to one client;
    ``class_names`` (optional) names the classes 0..C-1.
    """

    name: str
    x_train: Images
    y_train: torch.Tensor
    x_test: Images
    y_test: torch.Tensor
    num_classes: int
    groups_train: torch.Tensor | None = None
    class_names: tuple[str, ...] | None = None

    @property
    def in_chans(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.x_train.shape[-1])

    def limit(self, train: int | None = None, test: int | None = None) -> "InMemoryDataset":
        """The first ``train`` / ``test`` samples (quick runs and tests); None keeps all."""
        return InMemoryDataset(
            self.name if train is None and test is None else f"{self.name}[:{train},:{test}]",
            images(self.x_train).subset(slice(None, train)), self.y_train[:train],
            images(self.x_test).subset(slice(None, test)), self.y_test[:test], self.num_classes,
            None if self.groups_train is None else self.groups_train[:train], self.class_names,
        )

    def fingerprint(self) -> str:
        """sha256 of what the run trains and evaluates on (see ``fingerprint``)."""
        return fingerprint(self)

    def loading(self, workers: int) -> "InMemoryDataset":
        """The dataset whose image sources decode with ``workers`` DataLoader processes
        (``--loader-workers``); tensors are already in memory and stay as they are."""
        return replace(self, x_train=images(self.x_train).loading(workers), x_test=images(self.x_test).loading(workers))


def normalise(images_uint8: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float32 standardised per channel, channels-last."""
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    # channels-last (what fedlt's conv models run fastest on; a no-op for one channel) first, then
    # standardised in place: the same operations on each value as ((x / 255) - m) / s, without a
    # temporary of the whole set (MNIST's 60k: 0.5 s and +314 MiB before)
    images = images_uint8.to(torch.float32).contiguous(memory_format=torch.channels_last)
    return images.div_(255.0).sub_(m).div_(s)


def npy_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) from an open ``.npy`` file, which is left at its data."""
    version = np.lib.format.read_magic(f)
    read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read is None:
        raise ValueError(f"unsupported .npy version {version}")
    return read(f)


def tensor_digest(x: torch.Tensor, h: Any) -> None:
    """Feed ``x``'s dtype, shape and values (in memory order: NHWC for channels-last images) to ``h``:
    every sample when the tensor holds up to ``FULL_DIGEST_BYTES``, else evenly spaced samples
    totalling about that much (a resume on other data changes far more than one sample)."""
    h.update(f"{x.dtype}{tuple(x.shape)}".encode())
    if x.ndim == 0 or len(x) == 0:
        h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return
    rows = torch.arange(len(x))
    if x.nbytes > FULL_DIGEST_BYTES:
        rows = torch.linspace(0, len(x) - 1, max(1, len(x) * FULL_DIGEST_BYTES // x.nbytes)).round().long().unique()
    if x.ndim == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        x = x.permute(0, 2, 3, 1)  # the memory's own order: no copy (fedlt's images are channels-last)
    for part in rows.split(4096):
        block = x[part] if len(rows) < len(x) else x[int(part[0]):int(part[-1]) + 1]
        h.update(block.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def fingerprint(data: Any) -> str:
    """sha256 of a dataset's training and test inputs and labels, its class count and group ids:
    what a resumed run must find unchanged. A tensor split is hashed by its values
    (``tensor_digest``); an image source by its own ``fingerprint()`` (``imagefolder``: the file
    list, sizes and modification times, as its cache is keyed, and how the files are decoded)."""
    h = hashlib.sha256(f"fedlt-data-1 {data.num_classes}".encode())
    for name in ("x_train", "y_train", "x_test", "y_test", "groups_train"):
        value = getattr(data, name, None)
        h.update(f"|{name}:".encode())
        if isinstance(value, torch.Tensor):
            tensor_digest(value, h)
        elif value is not None:
            own = getattr(value, "fingerprint", None)
            h.update((own() if callable(own) else f"{type(value).__name__}{tuple(value.shape)}").encode())
    h.update(repr(getattr(data, "class_names", None)).encode())
    return h.hexdigest()

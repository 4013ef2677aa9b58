"""The in-memory dataset every run trains on: normalised float tensors and int64 labels."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fedlt.datasets.source import Images, images

# labels are class indices below this: a classifier head of 10^5 classes on 4096 features is 1.6 GB
# of float32 weights, and a C-long histogram per client is kept for every client (K×C counts)
MAX_CLASSES = 100_000


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

    def loading(self, workers: int) -> "InMemoryDataset":
        """The dataset whose image sources decode with ``workers`` DataLoader processes
        (``--loader-workers``); tensors are already in memory and stay as they are."""
        return replace(self, x_train=images(self.x_train).loading(workers), x_test=images(self.x_test).loading(workers))


def normalise(images_uint8: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 (N, C, H, W) -> float32 standardised per channel, channels-last."""
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    images = (images_uint8.to(torch.float32).div_(255.0) - m).div_(s)
    return images.contiguous(memory_format=torch.channels_last)  # what fedlt's conv models run fastest on

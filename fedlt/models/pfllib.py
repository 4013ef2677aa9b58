"""PFLlib's 4-layer CNN for MNIST-like data, registered as ``pfllib_cnn``."""

from __future__ import annotations

import torch
from torch import nn

from fedlt.errors import FedltError
from fedlt.models import register


class FedAvgCNN(nn.Module):
    """PFLlib's ``FedAvgCNN`` (TsingZ0/PFLlib, ``system/flcore/trainmodel/models.py``), the CNN of
    its MNIST / Fashion-MNIST / CIFAR-10 FedAvg runs, layer for layer:

        conv 5×5, 32 → ReLU → max-pool 2 → conv 5×5, 64 → ReLU → max-pool 2 → flatten
        → fc (64·s², 512) → ReLU → fc (512, num_classes)

    with s = ((image_size − 4) / 2 − 4) / 2 (no padding): 4 on 28×28 images (PFLlib's ``dim=1024``),
    5 on 32×32 (``dim=1600``). PyTorch's default initialisation, as PFLlib. ``fc`` is the
    classifier (``get_classifier``)."""

    def __init__(self, in_chans: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2
        self.conv1 = nn.Sequential(nn.Conv2d(in_chans, 32, kernel_size=5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, kernel_size=5), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Linear(64 * side * side, 512), nn.ReLU(inplace=True))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc1(torch.flatten(self.conv2(self.conv1(x)), 1)))

    def get_classifier(self) -> nn.Linear:
        return self.fc


@register("pfllib_cnn")
def pfllib_cnn(in_chans: int = 1, num_classes: int = 10, image_size: int = 28) -> FedAvgCNN:
    """PFLlib's FedAvgCNN (conv 32 → conv 64 → fc 512 → classifier) for 28×28 or larger images."""
    if image_size < 16:
        raise FedltError(f"model pfllib_cnn needs images of at least 16x16, got image_size={image_size}")
    return FedAvgCNN(in_chans, num_classes, image_size)

"""The CIFAR ResNets of the long-tailed FL protocols (issue 33): 3×3 stem, no max-pool, basic
blocks, global average pooling, one linear classifier (``get_classifier()``).

- ``resnet8``: CReFF's ``ResNet_cifar(resnet_size=8, scaling=4)`` (shangxinyi/CReFF-FL,
  Model/Resnet8.py): three stages of one block, 64/128/256 channels, a 256-d representation;
  convolutions drawn from N(0, 2/(k²·out_channels)), BatchNorm weight 1 and bias 0, as there.
- ``resnet18_cifar`` / ``resnet34_cifar``: FedLoGe's ``ResNet18`` / ``ResNet34``
  (ZackZikaiXiao/FedLoGe, model/model_res.py): four stages of [2, 2, 2, 2] / [3, 4, 6, 3] blocks,
  64–512 channels, a 512-d representation, PyTorch's default initialisation. Its ``projection``
  layer, built but never called in ``forward``, is left out (it changes nothing computed).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedlt.errors import FedltError
from fedlt.models import register


class Block(nn.Module):
    """conv3×3 → BN → ReLU → conv3×3 → BN, plus the input (through conv1×1 → BN when the shape
    changes), then ReLU: the basic block of both codes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, widths: list[int], blocks: list[int], in_chans: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_chans, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        layers, cin = [], widths[0]
        for i, (width, n) in enumerate(zip(widths, blocks)):
            for j in range(n):
                layers.append(Block(cin, width, 2 if i > 0 and j == 0 else 1))
                cin = width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)  # AvgPool2d(8) in CReFF's code: the same on 32×32 images
        self.classifier = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.layers(self.stem(x))).flatten(1))

    def get_classifier(self) -> nn.Linear:
        return self.classifier


@register("resnet8")
def resnet8(in_chans: int = 3, num_classes: int = 10, image_size: int = 32, scaling: int = 4) -> CifarResNet:
    """CReFF's ResNet-8 (ResNet_cifar, resnet_size 8): stages of 16·``scaling``, 32·``scaling`` and
    64·``scaling`` channels.

    Args:
        scaling: their width factor (``ResNet_cifar(scaling=...)``): 4, theirs, gives 64/128/256
            channels and the 256-d representation; 1 is the smallest BatchNorm model (16/32/64)
    """
    if isinstance(scaling, bool) or not isinstance(scaling, int) or not 1 <= scaling <= 64:
        raise FedltError(f"model 'resnet8': scaling must be an integer in [1, 64], got {scaling!r}")
    model = CifarResNet([16 * scaling, 32 * scaling, 64 * scaling], [1, 1, 1], in_chans, num_classes)
    for m in model.modules():  # ResNetBase._weight_initialization
        if isinstance(m, nn.Conv2d):
            m.weight.data.normal_(0, math.sqrt(2.0 / (m.kernel_size[0] * m.kernel_size[1] * m.out_channels)))
        elif isinstance(m, nn.BatchNorm2d):
            m.weight.data.fill_(1)
            m.bias.data.zero_()
    return model


@register("resnet18_cifar")
def resnet18_cifar(in_chans: int = 3, num_classes: int = 10, image_size: int = 32) -> CifarResNet:
    """FedLoGe's CIFAR ResNet-18 (3×3 stem, no max-pool): 512-d representation."""
    return CifarResNet([64, 128, 256, 512], [2, 2, 2, 2], in_chans, num_classes)


@register("resnet34_cifar")
def resnet34_cifar(in_chans: int = 3, num_classes: int = 10, image_size: int = 32) -> CifarResNet:
    """FedLoGe's CIFAR ResNet-34 (its CIFAR-100 default): 512-d representation."""
    return CifarResNet([64, 128, 256, 512], [3, 4, 6, 3], in_chans, num_classes)

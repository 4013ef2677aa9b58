"""What the golden-fixture tests of the authors' local training share: the small stand-in for their
backbone and the schedule that replays their unshuffled batches."""

import dataclasses

import torch
from torch import nn

from fedlt.algorithms.base import LocalSchedule


class BodyHead(nn.Module):
    """The goldens' stand-in for the authors' ResNet: Linear(inputs, features) (+ BatchNorm1d with
    ``norm``) + ReLU, then the classifier (``get_classifier``, as their models name it)."""

    def __init__(self, inputs: int, features: int, classes: int, norm: bool = False):
        super().__init__()
        norms = [nn.BatchNorm1d(features)] if norm else []  # FEDIC's fixture: a BatchNorm between
        self.body = nn.Sequential(nn.Linear(inputs, features), *norms, nn.ReLU())
        self.classifier = nn.Linear(features, classes)

    def forward(self, x):
        return self.classifier(self.body(x))

    def get_classifier(self):
        return self.classifier


@dataclasses.dataclass(frozen=True)
class InOrder(LocalSchedule):
    """Their DataLoader with shuffling off: the batches in data order, each epoch."""

    def batches(self, n, generator, device=None):
        for _ in range(self.epochs):
            yield from torch.arange(n).split(self.batch)

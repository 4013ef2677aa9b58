"""A small CNN as a fedlt model: two 3×3 convolutions and a linear classifier. It needs no split
points of its own: fedlt's fx splitter finds its cuts (``fedlt splits tiny_cnn``)."""

from __future__ import annotations

from torch import nn

from fedlt.plugin import FedltError


class TinyCNN(nn.Module):
    def __init__(self, in_chans: int, num_classes: int, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_chans, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        return self.fc(self.dropout(self.features(x)))

    def get_classifier(self) -> nn.Linear:  # fedlt's hook for algorithms that read the classifier
        return self.fc


def tiny_cnn(in_chans: int = 1, num_classes: int = 10, image_size: int = 28, width: int = 16,
             dropout: float = 0.0) -> TinyCNN:
    """Two conv layers of ``width`` and ``2·width`` channels (default 16), global average pooling,
    dropout with probability ``dropout`` (default 0: none) and a linear classifier; any image size."""
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 1024:
        raise FedltError(f"model 'tiny_cnn': width must be an integer in [1, 1024], got {width!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise FedltError(f"model 'tiny_cnn': dropout must be a number in [0, 1), got {dropout!r}")
    return TinyCNN(in_chans, num_classes, width, float(dropout))

"""SCALA's 14-layer AlexNet (SPEC §3, paper appendix E) and the MLP of the FedVLS MNIST setting."""

from __future__ import annotations

from torch import nn

from fedlt.errors import FedltError

# Split point -> number of the 14 layers kept on the client (SPEC §3).
ALEXNET_SPLIT_POINTS: dict[str, int] = {"s1": 3, "s2": 6, "s3": 7, "s4": 11, "s5": 13}


class AlexNet(nn.Sequential):
    """Conv(Cin,32)-Pool-ReLU-Conv(32,64)-Pool-ReLU-Conv(64,128)-Conv(128,256)-Conv(256,256)-
    Pool(3,2)-ReLU-[flatten]-Linear(2304,1024)-Linear(1024,512)-Linear(512,C).

    Both 28×28 and 32×32 inputs end at 256×3×3. The flatten is fused into layer 12 so that the
    module indices 0..13 are exactly the paper's layers 1..14 and a split after layer L is
    ``self[:L]`` / ``self[L:]``. No nonlinearity between the linear layers, as in the paper.
    """

    def __init__(self, in_chans: int = 3, num_classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(in_chans, 32, 3, padding=1),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.Conv2d(128, 256, 3, padding=1),
            nn.Conv2d(256, 256, 3, padding=1),
            nn.MaxPool2d(3, stride=2),
            nn.ReLU(),
            nn.Sequential(nn.Flatten(), nn.Linear(256 * 3 * 3, 1024)),
            nn.Linear(1024, 512),
            nn.Linear(512, num_classes),
        )

    def get_classifier(self) -> nn.Linear:
        """The final linear layer (timm's convention; DPA reads its weight norms)."""
        return self[13]

    def split_points(self) -> list[str]:
        return list(ALEXNET_SPLIT_POINTS)

    def split(self, at: str) -> tuple[nn.Sequential, nn.Sequential]:
        """(client, server) sharing this model's modules: layers 1..L and L+1..14."""
        if at not in ALEXNET_SPLIT_POINTS:
            raise FedltError(
                f"split {at!r} is not a split point of alexnet (valid: {', '.join(ALEXNET_SPLIT_POINTS)})"
            )
        cut = ALEXNET_SPLIT_POINTS[at]
        layers = list(self)
        return nn.Sequential(*layers[:cut]), nn.Sequential(*layers[cut:])


class MLP(nn.Sequential):
    """Fully connected net, e.g. the 784-200-200-10 MLP of FedVLS's MNIST setting."""

    def __init__(self, in_features: int = 784, num_classes: int = 10, hidden: tuple[int, ...] = (200, 200)) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)

    def get_classifier(self) -> nn.Linear:
        return self[-1]

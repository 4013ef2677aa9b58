"""SCALA's AlexNet: every split point composes back to the full model; the parts partition it."""

from __future__ import annotations

import pytest
import torch

import fedlt.models
from fedlt.errors import FedltError
from fedlt.models.alexnet import ALEXNET_SPLIT_POINTS


@pytest.mark.parametrize("in_chans,size", [(1, 28), (3, 32)])
@pytest.mark.parametrize("at", list(ALEXNET_SPLIT_POINTS))
def test_split_composes_and_partitions_parameters(in_chans, size, at):
    torch.manual_seed(0)
    model = fedlt.models.build("alexnet", in_chans=in_chans, num_classes=10, image_size=size).eval()
    client, server = fedlt.models.split(model, at)
    x = torch.randn(5, in_chans, size, size)
    torch.testing.assert_close(server(client(x)), model(x), atol=0, rtol=0)
    ids = lambda m: {id(p) for p in m.parameters()}  # noqa: E731
    assert ids(client).isdisjoint(ids(server))
    assert ids(client) | ids(server) == ids(model)
    # the client holds exactly the paper's first L layers (of 14)
    cut = ALEXNET_SPLIT_POINTS[at]
    assert ids(client) == {id(p) for layer in list(model)[:cut] for p in layer.parameters()}


def test_alexnet_layers_and_default_split():
    model = fedlt.models.build("alexnet", in_chans=3, num_classes=100, image_size=32)
    assert model.get_classifier().out_features == 100
    client, _ = fedlt.models.split(model, "s2")
    # s2: 6 client layers (conv, pool, relu, conv, pool, relu) -> 64 channels at 8×8 for CIFAR
    assert client(torch.zeros(1, 3, 32, 32)).shape == (1, 64, 8, 8)


def test_bad_split_point_and_image_size_are_clear_errors():
    model = fedlt.models.build("alexnet", in_chans=1, num_classes=10, image_size=28)
    with pytest.raises(FedltError, match="s1.*s2.*s3.*s4.*s5"):
        fedlt.models.split(model, "s9")
    with pytest.raises(FedltError, match="28x28 or 32x32"):
        fedlt.models.build("alexnet", in_chans=3, num_classes=10, image_size=64)

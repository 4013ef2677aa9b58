"""Classifier heads (fedlt.models.heads): every registered head passes its contract, a broken
head fails naming the property, and a head spec is checked at the config boundary."""

import pytest
import torch
from torch import nn

import fedlt.models
from fedlt.algorithms.longtail import FedETF
from fedlt.errors import FedltError
from fedlt.models import heads
from fedlt.testing import ContractError, check_head


FAST = {"sse_c": {"steps": 20}}  # its 10 000 Adam steps are checked against the authors' in test_fedloge_golden


@pytest.mark.parametrize("name", heads.list())
def test_every_head_passes_its_contract(name):
    check_head(name, FAST.get(name))


class Unseeded(nn.Module):
    """A fixed classifier drawn from the global generator: each node would draw another."""

    def __init__(self, in_features, num_classes):
        super().__init__()
        self.register_buffer("fixed", torch.randn(num_classes, in_features))

    @property
    def weight(self):
        return self.fixed

    def forward(self, h):
        return h @ self.fixed.t()


class Drifting(Unseeded):
    """A 'fixed' part the training step moves (a buffer updated in forward)."""

    def __init__(self, in_features, num_classes):
        super().__init__(in_features, num_classes)
        self.fixed = torch.ones(num_classes, in_features)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, h):
        self.fixed.add_(0.1)
        return self.scale * (h @ self.fixed.t())


@pytest.mark.parametrize("head,prop", [(Unseeded, "same on every node"), (Drifting, "fixed part stays fixed")])
def test_broken_heads_fail_naming_the_property(head, prop):
    with pytest.raises(ContractError, match=rf"\[{prop}\]"):
        check_head(head)


def test_attach_replaces_the_classifier_and_keeps_the_model_working():
    model = heads.attach(fedlt.models.build("mlp", in_chans=1, num_classes=10, image_size=28), {"name": "etf"})
    assert isinstance(fedlt.models.classifier(model), heads.ETFHead)
    assert not [k for k in model.state_dict() if k.endswith(".proto")]  # fixed: rebuilt from its seed, never aggregated
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


@pytest.mark.parametrize("spec,message", [
    ({"name": "etf", "proj_dim": 3}, "proj_dim must be >= the number of classes 10"),
    ({"name": "etf", "scale": 0}, "scale must be a finite number > 0"),
    ({"name": "etf", "num_classes": 3}, "come(s) from the model"),
])
def test_bad_head_values_are_one_line_errors(spec, message):
    with pytest.raises(FedltError, match=message.replace("(", r"\(").replace(")", r"\)")):
        heads.attach(fedlt.models.build("mlp", in_chans=1, num_classes=10, image_size=28), spec)


def test_an_unknown_head_or_parameter_is_refused_at_the_config_boundary():
    with pytest.raises(ValueError, match="head"):
        FedETF(head="nope")
    with pytest.raises(ValueError, match="colour"):
        FedETF(head={"name": "etf", "colour": 1})

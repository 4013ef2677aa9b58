"""Models and their split into a client part and a server part (SPEC §3).

``build(spec, in_chans=, num_classes=, image_size=)`` makes a model for a dataset: a registered
name (``alexnet``, ``mlp``) or ``timm:<model>`` for any timm model (never pretrained), optionally
with parameters in the component-spec language (``my_net(width=64)``, ``timm:resnet18(drop_rate=0.1)``).
``split(model, at)`` returns ``(client, server)`` modules that share the model's parameters, with
``server(client(x)) == model(x)``. ``classifier(model)`` is the explicit hook for the final linear
layer: the model's ``get_classifier()`` (timm's convention, implemented by fedlt's own models).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fedlt import bounds
from fedlt.context import use_model_builder
from fedlt.errors import FedltError, first_line
from fedlt.models.alexnet import MLP, AlexNet
from fedlt.models.splitting import SPLITTERS, SplitPoint, cut_points, split, split_points  # noqa: F401
from fedlt.registry import Registry
from fedlt.spec import parse_spec

def _module_check(obj) -> str | None:
    return None if isinstance(obj, nn.Module) else f"{type(obj).__name__}, not a torch.nn.Module"


REGISTRY: Registry = Registry("model", product=_module_check)
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list


@register("alexnet")
def alexnet(in_chans: int = 3, num_classes: int = 10, image_size: int = 32) -> AlexNet:
    """SCALA's AlexNet (14 layers, cut points s1..s5) for 28×28 or 32×32 images."""
    if image_size not in (28, 32):
        raise FedltError(f"model alexnet needs 28x28 or 32x32 inputs, got image_size={image_size}")
    return AlexNet(in_chans, num_classes)


@register("mlp")
def mlp(in_chans: int = 1, num_classes: int = 10, image_size: int = 28) -> MLP:
    """FedVLS's MNIST MLP: the flattened image, two hidden layers of 200 with ReLU, a linear classifier."""
    return MLP(in_chans * image_size * image_size, num_classes)


DATASET_KEYS = ("in_chans", "num_classes", "image_size")  # what the dataset, not the spec, decides


def parse_model(spec: str) -> tuple[str, dict]:
    """``"mlp"`` / ``"timm:resnet18"`` / ``"my_net(width=64)"`` -> (name, params), checked: a
    parameter the dataset decides (in_chans, num_classes, image_size) is refused."""
    parsed = parse_spec(spec, "model")
    name, params = parsed.pop("name"), parsed
    fixed = sorted(set(params) & set(DATASET_KEYS))
    if fixed:
        raise FedltError(f"model {spec!r}: {', '.join(fixed)} come(s) from the dataset, not the model spec")
    return name, params


def build(spec: str, *, in_chans: int, num_classes: int, image_size: int) -> nn.Module:
    """A model for the dataset, in channels-last memory format (1.3x faster training and 1.6x
    faster evaluation of SCALA's AlexNet on this CPU; no effect on models without conv weights)."""
    name, params = parse_model(spec)
    if name.startswith("timm:"):
        from fedlt.models.timm_models import create_timm

        model = create_timm(name.removeprefix("timm:"), in_chans=in_chans, num_classes=num_classes,
                            image_size=image_size, **params)
    else:
        try:
            model = REGISTRY.create(name, in_chans=in_chans, num_classes=num_classes, image_size=image_size, **params)
        except TypeError as exc:  # an unknown parameter: one line naming the model
            raise FedltError(f"model {name!r}: {first_line(exc)}") from None
    return model.to(memory_format=torch.channels_last)


use_model_builder(build)  # ModelSpec.build (fedlt.context, the bottom layer) builds through it


# what check_fits passed in this process: every prepare asks again (each study cell, each Flower
# job on each node, each contract run) and a ResNet's meta build and forward is ~0.2 s of it. Keyed
# by what decides the answer: the spec, the data's shape, the tensor limit and the registered builder.
_FITS: set[tuple] = set()


def check_fits(spec: str, *, in_chans: int, num_classes: int, image_size: int) -> None:
    """``spec`` against the data before anything is allocated (issue 46): the input and the
    model's weights within fedlt.bounds' tensor limit, and a forward of one sample's shape on the
    meta device (no memory, no arithmetic) — a ViT's patch size against the image, a convolution's
    kernel against what is left of it — each a FedltError line naming the model and the input."""
    try:
        name = parse_model(spec)[0]
        # the builder itself, held: its id is never reused; a timm model (timm's own registry) is not kept
        key = None if name.startswith("timm:") else (spec, in_chans, num_classes, image_size, bounds.tensor_limit(),
                                                     REGISTRY.get(name))
        hash(key)
    except Exception:  # noqa: BLE001  (a bad spec: the check below says what is wrong, in its order)
        key = None
    if key is None or key not in _FITS:
        _check_fits(spec, in_chans=in_chans, num_classes=num_classes, image_size=image_size)
        if key is not None:
            _FITS.add(key)


def _check_fits(spec: str, *, in_chans: int, num_classes: int, image_size: int) -> None:
    size = f"{in_chans}x{image_size}x{image_size}"
    if min(in_chans, image_size, num_classes) < 1:
        raise FedltError(f"model {spec!r}: in_chans, image_size and num_classes must be >= 1, got {size} and "
                         f"{num_classes} classes")
    bounds.tensor_bytes(f"model {spec!r}", (1, in_chans, image_size, image_size), 4, f"one {size} input")
    with torch.device("meta"):
        model = build(spec, in_chans=in_chans, num_classes=num_classes, image_size=image_size)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if weights > bounds.tensor_limit():
        raise FedltError(f"model {spec!r}: {bounds.gib(weights)} of weights for {size} inputs, more than the "
                         f"{bounds.gib(bounds.tensor_limit())} allowed")
    try:
        with torch.no_grad(), eval_mode(model):
            model(torch.empty(1, in_chans, image_size, image_size, device="meta"))
    except NotImplementedError:  # an operation without a meta kernel: the real forward will tell
        return
    except Exception as exc:  # noqa: BLE001  (whatever the model raises on this shape: one line)
        if "meta" in str(exc):  # a value read on the meta device (.item()): the real forward will tell
            return
        raise FedltError(f"model {spec!r} does not take {size} inputs: {type(exc).__name__}: {first_line(exc)} "
                         "(another model, or a resize in --augment, fits the data)"[:400]) from None


def classifier(model: nn.Module) -> nn.Linear:
    get_classifier = getattr(model, "get_classifier", None)
    if get_classifier is None:
        raise FedltError(
            f"{type(model).__name__} has no get_classifier(); algorithms that read the classifier "
            "(e.g. fedgrab's DPA) need models to expose their final linear layer through it"
        )
    return get_classifier()


@contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Run modules in eval mode (BatchNorm uses, and does not update, its running statistics),
    then restore each one's mode."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


from fedlt.models import pfllib, resnet_cifar  # noqa: E402,F401  (register pfllib_cnn, the CIFAR ResNets)

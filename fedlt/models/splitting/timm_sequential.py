"""The ``timm_sequential`` splitter: timm CNNs whose ``forward_features`` is a chain of modules."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch import nn

from fedlt.errors import FedltError
from fedlt.models.splitting.base import SplitPart, _complement, _feature_modules


def _timm_classes(*paths: str) -> tuple[type, ...]:
    """timm classes by ``module:Class``, imported only if timm already is (so a model can be one)."""
    if "timm" not in sys.modules:
        return ()
    import importlib

    out = []
    for path in paths:
        module_name, cls = path.split(":")
        try:
            out.append(getattr(importlib.import_module(module_name), cls))
        except (ImportError, AttributeError):  # a timm version without this family
            continue
    return tuple(out)


# forward_features of these families is exactly this chain of children (timm 1.0).
TIMM_TRUNKS: dict[str, tuple[str, ...]] = {
    "timm.models.resnet:ResNet": ("conv1", "bn1", "act1", "maxpool", "layer1", "layer2", "layer3", "layer4"),
    "timm.models.efficientnet:EfficientNet": ("conv_stem", "bn1", "blocks", "conv_head", "bn2"),
    "timm.models.mobilenetv3:MobileNetV3": ("conv_stem", "bn1", "blocks"),
    "timm.models.convnext:ConvNeXt": ("stem", "stages", "norm_pre"),
    "timm.models.regnet:RegNet": ("stem", "s1", "s2", "s3", "s4", "final_conv"),
}


def _expand(model: nn.Module, trunk: Sequence[str], cut_module: str) -> tuple[list[str], list[str]]:
    """Split a chain of module paths after ``cut_module``, descending into the nn.Sequential
    containers on its path (``blocks`` -> ``blocks.0`` .. ``blocks.6`` for a cut at ``blocks.4``)."""
    for i, path in enumerate(trunk):
        if cut_module == path:
            return list(trunk[: i + 1]), list(trunk[i + 1 :])
        if cut_module.startswith(path + "."):
            container = model.get_submodule(path)
            if not isinstance(container, nn.Sequential):
                raise FedltError(
                    f"cannot cut inside {path!r} of {type(model).__name__} (not a sequential container)"
                )
            inner = [f"{path}.{name}" for name in container._modules]
            before, after = _expand(model, inner, cut_module)
            return list(trunk[:i]) + before, after + list(trunk[i + 1 :])
    raise FedltError(f"{cut_module!r} is not on the forward chain of {type(model).__name__}")


class TimmSequentialSplitter:
    """timm CNNs whose ``forward_features`` is a chain of modules; cut at ``feature_info``."""

    priority = 10

    def _trunk(self, model: nn.Module) -> tuple[str, ...] | None:
        for path, trunk in TIMM_TRUNKS.items():
            classes = _timm_classes(path)
            if classes and isinstance(model, classes):
                return trunk
        return None

    def applies(self, model: nn.Module) -> bool:
        return self._trunk(model) is not None and bool(_feature_modules(model))

    def cut_points(self, model: nn.Module) -> list[tuple[str, str]]:
        return [(m, m) for m in _feature_modules(model)]

    def split(self, model: nn.Module, index: int) -> tuple[nn.Module, nn.Module]:
        trunk = self._trunk(model)
        assert trunk is not None
        client_path, server_path = _expand(model, trunk, _feature_modules(model)[index])
        client = SplitPart(model, client_path, [model.get_submodule(p) for p in client_path])
        server = SplitPart(
            model,
            _complement(model, client_path),
            [model.get_submodule(p) for p in server_path],
            head_of=model,
        )
        return client, server

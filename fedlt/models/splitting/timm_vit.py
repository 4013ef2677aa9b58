"""The ``timm_vit`` splitter: timm ViT-style token models, cut between blocks."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedlt.models.splitting.base import SplitPart, _complement, _feature_modules
from fedlt.models.splitting.timm_sequential import _expand, _timm_classes


class TimmViTSplitter:
    """timm ViT-style token models (VisionTransformer and subclasses such as DeiT-distilled)."""

    priority = 10

    def applies(self, model: nn.Module) -> bool:
        classes = _timm_classes("timm.models.vision_transformer:VisionTransformer")
        return bool(classes) and isinstance(model, classes) and bool(_feature_modules(model))

    def cut_points(self, model: nn.Module) -> list[tuple[str, str]]:
        return [(m, m) for m in _feature_modules(model)]

    def split(self, model: nn.Module, index: int) -> tuple[nn.Module, nn.Module]:
        embed = ["patch_embed", "pos_drop", "patch_drop", "norm_pre"]
        blocks, rest = _expand(model, ["blocks"], _feature_modules(model)[index])
        # The model's own tensors (cls/reg/dist tokens, pos_embed) are what _pos_embed adds.
        tokens = [n for n, p in model._parameters.items() if p is not None]
        tokens += [n for n, b in model._buffers.items() if b is not None]
        m: Any = model
        client = SplitPart(
            model,
            embed + tokens + blocks,
            [m.patch_embed, m._pos_embed, m.patch_drop, m.norm_pre, *(model.get_submodule(b) for b in blocks)],
        )
        server = SplitPart(
            model,
            _complement(model, embed + tokens + blocks),
            [*(model.get_submodule(b) for b in rest), m.norm],
            head_of=model,
        )
        return client, server

"""Splitting a model into (client, server) parts that share its parameters."""

from __future__ import annotations

from torch import nn

from fedlt.errors import FedltError


def split(model: nn.Module, at: str | int) -> tuple[nn.Module, nn.Module]:
    own_split = getattr(model, "split", None)
    if callable(own_split):
        return own_split(at)
    raise FedltError(f"{type(model).__name__} cannot be split (no splitter for it)")

"""The ``own`` splitter: models that define their own cut points (fedlt's AlexNet)."""

from __future__ import annotations

from torch import nn

from fedlt.models.splitting.base import SplitPart, _qualname_of


class OwnSplitter:
    """A model that defines ``split(name)`` and ``split_points()`` (fedlt's AlexNet)."""

    priority = 0

    def applies(self, model: nn.Module) -> bool:
        return callable(getattr(model, "split", None)) and callable(getattr(model, "split_points", None))

    def cut_points(self, model: nn.Module) -> list[tuple[str, str]]:
        points = []
        for name in model.split_points():
            client, _ = model.split(name)
            last = list(client.children())[-1] if isinstance(client, nn.Sequential) and len(client) else None
            points.append((name, (_qualname_of(model, last) or "") if last is not None else ""))
        return points

    def split(self, model: nn.Module, index: int) -> tuple[nn.Module, nn.Module]:
        client, server = model.split(model.split_points()[index])
        return self._renamed(model, client), self._renamed(model, server)

    @staticmethod
    def _renamed(model: nn.Module, part: nn.Module) -> nn.Module:
        """``part`` re-registered under the model's names (AlexNet's server would otherwise call
        its first layer ``0``, clashing with the client's state_dict keys)."""
        if part._parameters or part._buffers:
            return part
        names = [_qualname_of(model, child) for child in part.children()]
        if any(n is None for n in names):
            return part  # the model built new modules; keep its own naming
        return SplitPart(model, names, [part])

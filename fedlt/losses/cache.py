"""Per-device copies of fixed per-class vectors (a leaf module: the fused path and the terms both use it)."""

from __future__ import annotations

import torch


class DeviceCache:
    """Per-(device, dtype) copies of a fixed per-class vector, made once instead of every step."""

    def __init__(self, vec: torch.Tensor) -> None:
        self.vec = vec
        self._copies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._copies:
            self._copies[key] = self.vec.to(device=device, dtype=dtype)
        return self._copies[key]

    def like(self, ref: torch.Tensor) -> torch.Tensor:
        return self.get(ref.device, ref.dtype)

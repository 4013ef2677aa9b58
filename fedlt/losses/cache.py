"""Per-device copies of fixed per-class vectors (a leaf module: the fused path and the terms both use it)."""

from __future__ import annotations

import torch


class DeviceCache:
    """Per-(device, dtype) copies of a fixed per-class vector, made once instead of every step."""

    def __init__(self, vec: torch.Tensor) -> None:
        self.vec = vec
        self._copies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._derived: dict[tuple, torch.Tensor] = {}

    def get(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._copies:
            self._copies[key] = self.vec.to(device=device, dtype=dtype)
        return self._copies[key]

    def like(self, ref: torch.Tensor) -> torch.Tensor:
        return self.get(ref.device, ref.dtype)

    def derived(self, key: tuple, make) -> torch.Tensor:
        """A tensor derived from this vector (``make()``, made once per ``key``), held here rather
        than in a module-level cache: whole-step graphs (fedlt.algorithms.graphs) copy each
        client's tensors into the ones a graph was captured with by walking the objective, and a
        copy only a cache held would keep the first client's values (and be freed on eviction
        while a graph still reads it). ``key``: numbers, strings, devices (no ids)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

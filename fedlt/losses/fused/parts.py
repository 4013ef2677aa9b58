"""What a fused objective computes, described as plain data: one record per logit-space term.

A covered loss term turns itself into parts (its weight, the per-class vectors fixed at
construction); a backend (:mod:`.cpu` or :mod:`.triton_kernels`) evaluates a tuple of parts in
one pass and returns the summed value and the summed gradient w.r.t. the logits. The vectors are
float64 on the CPU; backends move them once per (device, dtype) through the terms' caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedlt.losses.cache import DeviceCache


@dataclass(frozen=True)
class OffsetCE:
    """weight · CE(z + offset, y): ``ce`` (offset None), ``logit_adjust``, ``fedlc`` (code form;
    −inf entries drop a class from the softmax)."""

    weight: float
    offset: DeviceCache | None

    def finite_offset(self) -> bool:
        return self.offset is None or bool(torch.isfinite(self.offset.vec).all())


@dataclass(frozen=True)
class VacantKD:
    """weight · (T²/B)·Σ_i KL(softmax(t_i[O]/T) ‖ softmax(z_i[O]/T)), |O| ≥ 2 (``vacant_kd``)."""

    weight: float
    vacant: DeviceCache  # long indices O
    T: float


@dataclass(frozen=True)
class Suppression:
    """weight · FedVLS's logit suppression (both variants) as one column reduction:
    scale·Σ_c p_c·(logsumexp_i A[c,i] − log B) with A[c,i] = z_ic + shift_c off the target and, for
    ``reference``, an entry 0 at the target (``paper``: no entry; a class with none contributes 0)."""

    weight: float
    p: DeviceCache
    variant: str  # "reference" | "paper"

    @property
    def scale(self) -> float:
        return 0.005 if self.variant == "reference" else 1.0

    def shift(self, num_classes: int) -> torch.Tensor:
        """float64 per-class shift of A: −log(p_c + 1e-9) + log(1/C + 1e-9) (reference), 0 (paper)."""
        if self.variant == "reference":
            return -torch.log(self.p.vec + 1e-9) + math.log(1.0 / num_classes + 1e-9)
        return torch.zeros_like(self.p.vec)


Part = OffsetCE | VacantKD | Suppression


def kinds(parts: tuple[Part, ...]) -> str:
    """A short key naming what a tuple of parts computes (dispatch thresholds, benchmark rows)."""
    return "+".join(type(p).__name__ for p in parts)

"""An update transform, added without touching fedlt: random-k sparsification (Stich et al. 2018,
"Sparsified SGD with memory"; Konečný et al. 2016's random masks).

Each tensor keeps k = ⌈fraction·d⌉ coordinates drawn uniformly without replacement, scaled by d/k
so that the upload is unbiased (E[rand_k(v)] = v); sent as int32 indices and values, the form
top-k uses, so fedlt reads it back with no code of this plugin. The draws come from torch's global
generator, which during a client's upload is the client's own stream. With ``error_feedback`` the
unsent rest is carried to the next round (fedlt.plugin.Compressor). Registered through the entry
point ``fedlt.transforms: randk``; use it as ``--upload "randk(fraction=0.1)"``.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar

import torch
from pydantic import Field

from fedlt.plugin import Compressor


class RandK(Compressor):
    """Keeps ⌈fraction·d⌉ coordinates of each tensor drawn uniformly, scaled by d/k (unbiased)."""

    name: ClassVar[str] = "randk"
    fraction: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False,
                                     description="share of each tensor's coordinates sent")] = 0.1

    def quantise(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = tensor.reshape(-1)
        k = max(1, math.ceil(self.fraction * flat.numel()))
        idx = torch.randperm(flat.numel(), device=flat.device)[:k].sort().values
        return {"sparse": idx.to(torch.int32), "values": flat[idx] * (flat.numel() / k)}

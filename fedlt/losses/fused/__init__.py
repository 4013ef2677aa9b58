"""The fused loss path (docs/fused.md): every logit-space objective's value and gradient in one
pass over the logits — Triton kernels on CUDA, an analytic torch path elsewhere — behind the same
loss objects, chosen by their ``fused`` setting; the eager reference stays the ground truth."""

from fedlt.losses.fused.trust import FusedKernelWarning, KernelCheck
from fedlt.losses.fused.dispatch import (CPU_AUTO_RULES, CUDA_AUTO_RULES, MODES, FusedFallbackWarning, backend,
                                         check_mode, offset_ce_pair, pair_offsets)
from fedlt.losses.fused.parts import OffsetCE, Suppression, VacantKD

__all__ = ["MODES", "CPU_AUTO_RULES", "CUDA_AUTO_RULES", "FusedFallbackWarning", "FusedKernelWarning", "KernelCheck",
           "backend", "check_mode",
           "offset_ce_pair", "pair_offsets", "OffsetCE", "Suppression", "VacantKD"]

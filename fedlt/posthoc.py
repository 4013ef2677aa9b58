"""Post-hoc calibration of a trained model, applied at evaluation: ``tau_norm``.

Each entry is a function ``(model, **params) -> a new model`` that leaves its input untouched, so
an engine can report the calibrated model's accuracy next to the raw model's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import fedlt.models
from fedlt.errors import FedltError
from fedlt.registry import Registry

REGISTRY: Registry = Registry("posthoc", group="fedlt.posthoc")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list


@register("tau_norm")
def tau_norm(model: nn.Module, *, tau: float = 1.0, bias: str = "drop") -> nn.Module:
    """τ-normalisation (Kang et al., ICLR'20 "Decoupling"): a copy of ``model`` whose classifier
    rows are w̃_c = w_c / ‖w_c‖₂^tau (tau=0: unchanged; tau=1: unit rows). Default tau=1.

    ``bias="drop"`` (default, the authors' code: logits = f·W̃ᵀ with no bias term) sets the
    classifier's bias to 0; ``bias="keep"`` leaves it as trained (Fed-GraB's ``norm.py``). A row
    of norm 0 stays 0. The classifier is the one ``fedlt.models.classifier`` finds.

    Args:
        tau: the exponent of the row norms (0: unchanged; 1: unit rows).
        bias: ``drop`` (set the classifier's bias to 0) or ``keep`` it as trained.
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau == tau \
            or tau in (float("inf"), float("-inf")) or tau < 0:
        raise FedltError(f"tau_norm: tau must be a finite number >= 0, got {tau!r}")
    if bias not in ("drop", "keep"):
        raise FedltError(f"tau_norm: bias must be 'drop' or 'keep', got {bias!r}")
    out = copy.deepcopy(model)
    head = fedlt.models.classifier(out)
    with torch.no_grad():
        W = head.weight
        norms = torch.linalg.vector_norm(W, dim=1, keepdim=True)
        # A zero row divides by 1 (0^tau would give 0/0).
        W.div_(torch.where(norms > 0, norms, torch.ones_like(norms)).pow(tau))
        if bias == "drop" and head.bias is not None:
            head.bias.zero_()
    return out

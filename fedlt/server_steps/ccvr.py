"""CCVR (Luo et al., NeurIPS 2021): per-class feature statistics from every participant, pooled
on the server, virtual features sampled from the pooled Gaussians, the classifier re-trained on
them. No code from the paper's authors is public; FL-bench's ``src/{client,server}/ccvr.py``
(KarhouTam/FL-bench) is the reference implementation fedlt is held to (tests/golden/ccvr.json).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fedlt.server_steps import (Batches, Head, _positive, _positive_int, features, head_state, register,
                                retrain_classifier)


def class_stats(x: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """Per class c: n_c, μ_c (C×d) and the unbiased covariance Σ_c (C×d×d; 0 when n_c < 2), in
    float64 — the paper's eq. (3)–(4) read the clients' Σ_c,k as unbiased."""
    x = x.double()
    d = x.shape[1]
    counts = torch.bincount(y, minlength=num_classes)
    means, covs = torch.zeros(num_classes, d, dtype=x.dtype), torch.zeros(num_classes, d, d, dtype=x.dtype)
    for c in range(num_classes):
        xc = x[y == c]
        if len(xc):
            means[c] = xc.mean(0)
        if len(xc) > 1:
            centred = xc - means[c]
            covs[c] = centred.T @ centred / (len(xc) - 1)
    return {"counts": counts, "means": means, "covs": covs}


def pooled_class_stats(uploads: Sequence[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """(N_c, μ_c, Σ_c) over all uploads (the paper's eq. 3–4): μ_c = Σ_k (n_c,k / N_c) μ_c,k;
    Σ_c = Σ_k (n_c,k − 1)/(N_c − 1) Σ_c,k + Σ_k n_c,k/(N_c − 1) μ_c,k μ_c,kᵀ − N_c/(N_c − 1) μ_c μ_cᵀ,
    the unbiased covariance of the pooled features. Rows of classes with N_c < 2 are 0."""
    counts = torch.stack([u["counts"] for u in uploads]).double()  # K×C
    means = torch.stack([u["means"].double() for u in uploads])  # K×C×d
    covs = torch.stack([u["covs"].double() for u in uploads])  # K×C×d×d
    total = counts.sum(0)
    safe = total.clamp(min=1)
    mean = (counts[..., None] * means).sum(0) / safe[:, None]
    denom = (total - 1).clamp(min=1)[:, None, None]
    outer = means[..., :, None] * means[..., None, :]
    cov = (((counts - 1).clamp(min=0)[..., None, None] * covs + counts[..., None, None] * outer).sum(0)
           - total[:, None, None] * mean[:, :, None] * mean[:, None, :]) / denom
    cov[total < 2] = 0
    return total.long(), mean, cov


def sample_virtual(mean: torch.Tensor, cov: torch.Tensor, n: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` draws of N(mean, cov) in float64: mean + z·(V·√λ)ᵀ with cov = V diag(λ) Vᵀ (λ < 0 from
    rounding set to 0), so a singular covariance (fewer samples than dimensions) is fine."""
    lam, vec = torch.linalg.eigh(cov.double())
    root = vec * lam.clamp(min=0).sqrt()
    z = torch.randn(n, len(mean), generator=generator, dtype=torch.float64)
    return mean.double() + z @ root.T


@register("ccvr")
class CCVRStep:
    """CCVR's calibration (FL-bench's defaults): ``samples_per_class`` = 200 virtual features per
    class with N_c ≥ 2, then ``epochs`` = 1 pass of SGD (``lr`` = 0.01, ``batch_size`` = 32) over
    them from the aggregated classifier. It runs every ``every`` rounds and on the last, on the
    aggregated model's features (``fresh``: a second call to the participants)."""

    fresh = True

    def __init__(self, *, samples_per_class: int = 200, epochs: int = 1, batch_size: int = 32, lr: float = 0.01,
                 every: int = 1) -> None:
        self.samples_per_class = _positive_int("ccvr", "samples_per_class", samples_per_class)
        self.epochs = _positive_int("ccvr", "epochs", epochs)
        self.batch_size = _positive_int("ccvr", "batch_size", batch_size)
        self.lr = _positive("ccvr", "lr", lr)
        self.every = _positive_int("ccvr", "every", every)

    def setup(self, head: nn.Linear, generator: torch.Generator | None = None) -> None:
        pass

    def due(self, round_index: int, rounds: int) -> bool:
        return (round_index + 1) % self.every == 0 or round_index == rounds - 1

    def payload(self) -> dict[str, Any]:
        return {}

    def collect(self, model: nn.Module, batches: Batches, payload: dict[str, Any], num_classes: int,
                generator: torch.Generator | None = None) -> dict[str, Any]:
        x, y = features(model, batches)
        return class_stats(x, y, num_classes)

    def apply(self, head: nn.Linear, uploads: Sequence[dict[str, Any]],
              generator: torch.Generator | None = None) -> Head:
        total, mean, cov = pooled_class_stats(uploads)
        classes = [c for c in range(len(total)) if int(total[c]) >= 2]
        if not classes:
            return head_state(head)
        x = torch.cat([sample_virtual(mean[c], cov[c], self.samples_per_class, generator) for c in classes])
        y = torch.tensor(classes).repeat_interleave(self.samples_per_class)
        init = head_state(head)
        new = retrain_classifier(init, x, y, epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                                 generator=generator)
        return {k: v.to(init[k].dtype) for k, v in new.items()}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

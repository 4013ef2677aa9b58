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

from fedlt import bounds
from fedlt.datasets.source import to_device
from fedlt.server_steps import (Batches, Head, _positive, _positive_int, features, head_state, register,
                                retrain_classifier)


def class_stats(x: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """Per class c: n_c (C,), μ_c (C×d), and for the classes with n_c ≥ 2 (``cov_classes``) the
    unbiased covariance Σ_c (k×d×d), in float64 — the paper's eq. (3)–(4) read the clients' Σ_c,k
    as unbiased; only the classes a client holds travel (CIFAR-100 × 512-d: 2 MB a class)."""
    x = x.double()
    counts = torch.bincount(y, minlength=num_classes)
    means = x.new_zeros(num_classes, x.shape[1])  # on the features' device: found on a GPU (device_check)
    held = [c for c in range(num_classes) if counts[c] >= 2]
    covs = x.new_zeros(len(held), x.shape[1], x.shape[1])
    for c in range(num_classes):
        if counts[c]:
            means[c] = x[y == c].mean(0)
    for i, c in enumerate(held):
        centred = x[y == c] - means[c]
        covs[i] = centred.T @ centred / (len(centred) - 1)
    return {"counts": counts, "means": means, "cov_classes": to_device(torch.tensor(held, dtype=torch.long), x.device),
            "covs": covs}


def pooled_class_stats(uploads: Sequence[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                               dict[int, torch.Tensor]]:
    """(N_c, μ_c, {c: Σ_c for N_c ≥ 2}) over all uploads (the paper's eq. 3–4): μ_c = Σ_k (n_c,k/N_c) μ_c,k;
    Σ_c = Σ_k (n_c,k − 1)/(N_c − 1) Σ_c,k + Σ_k n_c,k/(N_c − 1) μ_c,k μ_c,kᵀ − N_c/(N_c − 1) μ_c μ_cᵀ,
    the unbiased covariance of the pooled features."""
    counts = torch.stack([u["counts"] for u in uploads]).double()  # K×C
    means = torch.stack([u["means"].double() for u in uploads])  # K×C×d
    total = counts.sum(0)
    mean = (counts[..., None] * means).sum(0) / total.clamp(min=1)[:, None]
    cov: dict[int, torch.Tensor] = {}
    for c in (int(c) for c in torch.nonzero(total >= 2).flatten()):
        acc = -total[c] * torch.outer(mean[c], mean[c])
        for k, u in enumerate(uploads):
            if counts[k, c]:
                acc += counts[k, c] * torch.outer(means[k, c], means[k, c])
        for u in uploads:
            for i, held in enumerate(u["cov_classes"].tolist()):
                if held == c:
                    acc += (u["counts"][c].double() - 1) * u["covs"][i].double()
        cov[c] = acc / (total[c] - 1)
    return total.long(), mean, cov


def sample_virtual(mean: torch.Tensor, cov: torch.Tensor, n: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` draws of N(mean, cov) in float64: mean + z·(V·√λ)ᵀ with cov = V diag(λ) Vᵀ, so a
    singular covariance (fewer samples than dimensions) is fine. Eigenvalues under numpy's rank
    tolerance (λ_max · d · eps) are rounding, not variance, and are set to 0: their square roots
    (~1e-8, of either sign depending on the LAPACK build) would push the draws off the subspace."""
    lam, vec = torch.linalg.eigh(cov.double())
    tolerance = lam.abs().max() * len(lam) * torch.finfo(torch.float64).eps
    root = vec * torch.where(lam > tolerance, lam, torch.zeros_like(lam)).sqrt()
    z = torch.randn(n, len(mean), generator=generator, dtype=torch.float64)
    return mean.double() + z @ root.T


@register("ccvr")
class CCVRStep:
    """CCVR's calibration (FL-bench's defaults): ``samples_per_class`` = 200 virtual features per
    class with N_c ≥ 2, then ``epochs`` = 1 pass of SGD (``lr`` = 0.01, ``batch_size`` = 32) over
    them from the aggregated classifier. It runs every ``every`` rounds and on the last, on the
    aggregated model's features (``fresh``: a second call to the participants).

    Args:
        samples_per_class: virtual features drawn per class (classes with at least 2 samples).
        epochs: passes of SGD over the virtual features.
        batch_size: minibatch size of the re-calibration.
        lr: learning rate of the re-calibration (plain SGD).
        every: calibrate every this many rounds (and always on the last).
    """

    fresh = True
    requires = frozenset({"linear"})  # re-trains h·Wᵀ + b on the classifier's input features

    def __init__(self, *, samples_per_class: int = 200, epochs: int = 1, batch_size: int = 32, lr: float = 0.01,
                 every: int = 1) -> None:
        self.samples_per_class = _positive_int("ccvr", "samples_per_class", samples_per_class, bounds.MAX_SAMPLES)
        self.epochs = _positive_int("ccvr", "epochs", epochs)
        self.batch_size = _positive_int("ccvr", "batch_size", batch_size, bounds.MAX_SAMPLES)
        self.lr = _positive("ccvr", "lr", lr)
        self.every = _positive_int("ccvr", "every", every, bounds.MAX_ROUNDS)

    def setup(self, head: nn.Linear, generator: torch.Generator | None = None) -> None:
        classes, d = head.weight.shape  # the virtual features of every class, float64, at once
        bounds.tensor_bytes("ccvr", (classes * self.samples_per_class, d), 8,
                            f"samples_per_class={self.samples_per_class} × {classes} classes on {d} features")

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
        classes = sorted(cov)
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

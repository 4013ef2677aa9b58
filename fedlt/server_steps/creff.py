"""CReFF (Shang et al., IJCAI 2022): clients upload per-class gradients of the classifier on
their real features; the server optimises federated features whose gradients match them
(gradient matching) and re-trains a classifier on those features for inference. Held to the
authors' code, github.com/shangxinyi/CReFF-FL (main.py, Dataset/Gradient_matching_loss.py), by
tests/golden/creff.json.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedlt import bounds
from fedlt.datasets.source import to_device
from fedlt.server_steps import (Batches, Head, _positive, _positive_int, features, register,
                                retrain_classifier)


def match_distance(g_syn: Sequence[torch.Tensor], g_real: Sequence[torch.Tensor]) -> torch.Tensor:
    """The authors' ``match_loss`` (``dis_metric='ours'``) for a linear classifier: Σ over rows of
    the weight gradient of 1 − cos(g_real, g_syn), plus 1 − cos over the whole bias gradient; the
    cosine's denominator is ‖a‖·‖b‖ + 1e-6."""
    total = g_syn[0].new_zeros(())
    for gs, gr in zip(g_syn, g_real):
        gs, gr = gs.reshape(1, -1) if gs.dim() == 1 else gs, gr.reshape(1, -1) if gr.dim() == 1 else gr
        cos = (gr * gs).sum(-1) / (gr.norm(dim=-1) * gs.norm(dim=-1) + 1e-6)
        total = total + (1 - cos).sum()
    return total


def class_gradients(head: Head, x: torch.Tensor, label: int) -> list[torch.Tensor]:
    """∂CE(x·Wᵀ + b, label)/∂(W, b), batch mean (the gradient the authors' clients upload)."""
    w, b = (head["weight"].detach().clone().requires_grad_(True), head["bias"].detach().clone().requires_grad_(True))
    loss = F.cross_entropy(F.linear(x.to(w.dtype), w, b), torch.full((len(x),), label, dtype=torch.long, device=x.device))
    return [g.detach() for g in torch.autograd.grad(loss, [w, b])]


def update_features(feats: torch.Tensor, head: Head, real: dict[int, list[torch.Tensor]], *, steps: int,
                    lr: float, per_class: int) -> torch.Tensor:
    """``steps`` SGD steps (lr ``lr``) on the federated features (class c in rows
    c·M … (c+1)·M − 1) of Σ_c match_distance(∂CE(features_c)/∂(W, b), real[c]) over the classes
    with a real gradient, (W, b) = ``head`` fixed (the authors' ``update_feature_syn``)."""
    feats = feats.detach().clone().requires_grad_(True)
    w, b = (head["weight"].detach().clone().to(feats.dtype).requires_grad_(True),
            head["bias"].detach().clone().to(feats.dtype).requires_grad_(True))
    optimiser = torch.optim.SGD([feats], lr=lr)
    for _ in range(steps):
        loss = feats.new_zeros(())
        for c in sorted(real):
            rows = feats[c * per_class:(c + 1) * per_class]
            ce = F.cross_entropy(F.linear(rows, w, b), torch.full((per_class,), c, dtype=torch.long, device=feats.device))
            g_syn = torch.autograd.grad(ce, [w, b], create_graph=True)
            loss = loss + match_distance(g_syn, [g.to(feats.dtype) for g in real[c]])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return feats.detach()


def average_gradients(uploads: Sequence[dict[str, torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    """Per class, the unweighted mean over the clients that hold it (the authors' 1/len)."""
    per_class: dict[int, list[list[torch.Tensor]]] = {}
    for u in uploads:
        for i, c in enumerate(u["classes"].tolist()):
            per_class.setdefault(c, []).append([u["grad_weight"][i].double(), u["grad_bias"][i].double()])
    return {c: [sum(g[j] for g in grads) / len(grads) for j in range(2)] for c, grads in per_class.items()}


def linear_init(out_features: int, in_features: int, generator: torch.Generator | None,
                dtype: torch.dtype = torch.float32) -> Head:
    """nn.Linear's default initialisation, U(±1/√d) for weight and bias, from ``generator``."""
    bound = 1 / math.sqrt(in_features)
    w = (torch.rand(out_features, in_features, generator=generator, dtype=dtype) * 2 - 1) * bound
    b = (torch.rand(out_features, generator=generator, dtype=dtype) * 2 - 1) * bound
    return {"weight": w, "bias": b}


@register("creff")
class CReFFStep:
    """CReFF with the authors' defaults (options.py): ``features_per_class`` = 100 federated
    features per class, ``match_epochs`` = 100 gradient-matching steps of lr ``lr_feature`` = 0.1
    per round, a classifier re-trained from scratch for ``retrain_epochs`` = 300 epochs (batch
    ``batch_size`` = 32, lr ``lr_net`` = 0.01); each client's gradient of a class is the mean over
    ``repeats`` = 10 draws of ``batch_real`` = 32 of its features of that class, under the
    classifier re-trained in the previous round (sent as payload).

    Args:
        features_per_class: federated features per class (M).
        match_epochs: gradient-matching steps on the federated features per round.
        retrain_epochs: epochs of re-training the classifier from scratch per round.
        batch_real: real features per class in each of a client's gradient draws.
        repeats: a client's draws per class, averaged.
        lr_feature: learning rate of the federated features (plain SGD).
        lr_net: learning rate of the classifier re-training (plain SGD).
        batch_size: minibatch size of the classifier re-training.
    """

    fresh = False
    requires = frozenset({"linear"})  # matches and re-trains h·Wᵀ + b on the classifier's input features

    def __init__(self, *, features_per_class: int = 100, match_epochs: int = 100, retrain_epochs: int = 300,
                 batch_real: int = 32, repeats: int = 10, lr_feature: float = 0.1, lr_net: float = 0.01,
                 batch_size: int = 32) -> None:
        self.per_class = _positive_int("creff", "features_per_class", features_per_class, bounds.MAX_SAMPLES)
        self.match_epochs = _positive_int("creff", "match_epochs", match_epochs)
        self.retrain_epochs = _positive_int("creff", "retrain_epochs", retrain_epochs)
        self.batch_real = _positive_int("creff", "batch_real", batch_real, bounds.MAX_SAMPLES)
        self.repeats = _positive_int("creff", "repeats", repeats)
        self.lr_feature = _positive("creff", "lr_feature", lr_feature)
        self.lr_net = _positive("creff", "lr_net", lr_net)
        self.batch_size = _positive_int("creff", "batch_size", batch_size, bounds.MAX_SAMPLES)
        self.features: torch.Tensor | None = None  # (C·M)×d, the federated features
        self.head: Head | None = None  # the classifier re-trained last (a random one before the first round)

    def setup(self, head: nn.Linear, generator: torch.Generator | None = None) -> None:
        classes, d = head.weight.shape
        bounds.tensor_bytes("creff", (classes * self.per_class, d), 8,
                            f"features_per_class={self.per_class} × {classes} classes on {d} features (float64)")
        # in the classifier's dtype: a float64 run's first gradients are not taken under a float32 head
        self.features = torch.randn(classes * self.per_class, d, generator=generator, dtype=head.weight.dtype)
        self.head = linear_init(classes, d, generator, head.weight.dtype)

    def due(self, round_index: int, rounds: int) -> bool:
        return True

    def payload(self) -> dict[str, Any]:
        return {"head": self.head}

    def collect(self, model: nn.Module, batches: Batches, payload: dict[str, Any], num_classes: int,
                generator: torch.Generator | None = None) -> dict[str, Any]:
        x, y = features(model, batches)
        head = {k: v.to(x.device) for k, v in payload["head"].items()}  # the server keeps it on the host
        classes = torch.unique(y).cpu().tolist()  # one host read per client (sorted)
        gw = head["weight"].new_zeros(len(classes), *head["weight"].shape)  # on the client's device
        gb = head["bias"].new_zeros(len(classes), *head["bias"].shape)
        for _ in range(self.repeats):
            for i, c in enumerate(classes):
                own = x[y == c]
                pick = to_device(torch.randperm(len(own), generator=generator)[:self.batch_real], own.device)
                g = class_gradients(head, own[pick], c)
                gw[i] += g[0] / self.repeats
                gb[i] += g[1] / self.repeats
        return {"classes": torch.tensor(classes, dtype=torch.long), "grad_weight": gw, "grad_bias": gb}

    def apply(self, head: nn.Linear, uploads: Sequence[dict[str, Any]],
              generator: torch.Generator | None = None) -> Head:
        real = average_gradients(uploads)
        feats = update_features(self.features.double(), self.head, real, steps=self.match_epochs,
                                lr=self.lr_feature, per_class=self.per_class)
        self.features = feats.to(self.features.dtype)
        classes = len(head.weight)
        labels = torch.arange(classes).repeat_interleave(self.per_class)
        init = linear_init(classes, feats.shape[1], generator, torch.float64)
        new = retrain_classifier(init, feats, labels, epochs=self.retrain_epochs, batch_size=self.batch_size,
                                 lr=self.lr_net, generator=generator)
        self.head = {k: v.to(head.weight.dtype) for k, v in new.items()}
        return {k: v.clone() for k, v in self.head.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"features": self.features, "head": self.head}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.features, self.head = state["features"], state["head"]

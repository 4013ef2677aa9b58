"""Classifier heads that replace a model's classifier: fixed (FedETF's simplex ETF) or partly
fixed classifiers, a kind of part of their own (issue 33).

A head is a registered factory ``head(in_features, num_classes, **params) -> nn.Module`` whose
module maps the representation h (B×d, the input of the model's classifier) to logits (B×C) and
exposes the class vectors it scores against as ``weight`` (C×d', what ``classifier_weight`` and
post-hoc steps read). ``attach(model, spec)`` swaps the model's classifier (found through
``get_classifier()``) for the head in place, so ``model(x)`` and ``get_classifier()`` go through
the head and every engine, split point and feature hook keeps working unchanged.

What a head fixes is a buffer, not a parameter (no optimiser, no aggregator moves it), built
from the head's own ``seed`` so every node builds the same one; the head's trainable parameters
are drawn under the same seed, so a node that builds the model alone (a Flower client) starts
from the same weights as the server.

What a head offers the parts that read it is declared, not discovered by an AttributeError
(issue 46): ``provides`` on the factory (and on its module class) names its capabilities from
``CAPABILITIES``; an algorithm, a server step or a personal model declares what it ``requires``,
and the run's configuration refuses a composition that lacks something before anything is
written (fedlt.algorithms.compatibility). A factory's ``check(**params)`` validates the
parameters' values without building anything (the config boundary).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedlt import bounds
from fedlt.errors import FedltError
from fedlt.registry import Registry

_HEAD_KEYS = ("in_features", "num_classes")  # what the model, not the spec, decides


# What a classifier can offer the parts that read it (docs/plugins.md, "Compatibility"):
CAPABILITIES: dict[str, str] = {
    "linear": "logits = h·Wᵀ + b over the classifier's input h, with ``weight`` (C×d) and ``bias`` (C) to read "
              "and write (what re-training server steps fit)",
    "prototypes": "``weight`` holds C×d class prototypes over the normalised input, a buffer the server moves "
                  "(FedNH's)",
    "etf": "FedETF's projection ``linear_proto`` and fixed simplex ETF ``proto`` (what FedETF's personalisation "
           "fine-tunes)",
    "in_features": "``in_features``: the width d of the representation it reads",
}
LINEAR = frozenset({"linear", "in_features"})  # what a model's own nn.Linear classifier provides


def provides(*capabilities: str):
    """Decorator: declares what a head (its factory or module class) provides, from CAPABILITIES."""
    unknown = sorted(set(capabilities) - set(CAPABILITIES))
    if unknown:
        raise ValueError(f"unknown head capabilities {unknown} (known: {', '.join(CAPABILITIES)})")

    def mark(obj):
        obj.provides = frozenset(capabilities)
        return obj

    return mark


def provided(name: str) -> frozenset[str]:
    """What the registered head ``name`` declares it provides (nothing when it declares nothing)."""
    return frozenset(getattr(REGISTRY.get(name), "provides", ()))


def classifier_provides(module: nn.Module) -> frozenset[str]:
    """What a built classifier provides: its declaration, or LINEAR for a plain nn.Linear."""
    return LINEAR if isinstance(module, nn.Linear) else frozenset(getattr(module, "provides", ()))


def _module_check(obj) -> str | None:
    return None if isinstance(obj, nn.Module) else f"{type(obj).__name__}, not a torch.nn.Module"


REGISTRY: Registry = Registry("head", product=_module_check)
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list


def simplex_etf(a: torch.Tensor) -> torch.Tensor:
    """FedETF's fixed classifier (d×C, columns unit-norm, pairwise cosine −1/(C−1)) from a d×C
    matrix ``a`` (d ≥ C): P = Q of a's QR decomposition, M = √(C/(C−1))·P·(I − 11ᵀ/C) — the
    authors' ``Proto_Classifier`` (models_dict/proto_classifiers.py), where ``a`` is uniform on
    [0, 1); computed in float64."""
    d, c = a.shape
    if c < 2 or d < c:
        raise FedltError(f"head 'etf': a simplex ETF of {c} classes needs 2 <= classes <= feature dimension {d}")
    p, _ = torch.linalg.qr(a.double())
    centre = torch.eye(c, dtype=torch.float64) - torch.full((c, c), 1.0 / c, dtype=torch.float64)
    return math.sqrt(c / (c - 1)) * p @ centre


def _check_positive(head: str, name: str, value: Any) -> float:
    return bounds.finite(f"head {head!r}", name, value, low=0, low_open=True)


def _check_seed(head: str, value: Any) -> int:
    return bounds.seed(f"head {head!r}", "seed", value)


@provides("etf", "in_features")
class ETFHead(nn.Module):
    """FedETF's head (Li et al., ICCV 2023, eq. 3–4; the authors' ``models_dict``):
    z = β · (u/‖u‖₂)ᵀ M with u = W_p h + b_p (the projection layer ``linear_proto``), ‖u‖ clamped
    at 1e-12 as in their code, M the fixed d'×C simplex ETF (a buffer) and β the learnable
    ``scaling_train``. ``weight`` is Mᵀ (C×d')."""

    def __init__(self, in_features: int, num_classes: int, proj_dim: int, scale: float, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the same projection and ETF on every node
            torch.manual_seed(seed)
            self.linear_proto = nn.Linear(in_features, proj_dim)
            a = torch.rand(proj_dim, num_classes, dtype=torch.float64)
        # fixed and rebuilt from the seed on every node: not in the state_dict, never aggregated
        # float32 as theirs (Proto_Classifier casts P with .float()), held in the default dtype
        self.register_buffer("proto", simplex_etf(a).float().to(torch.get_default_dtype()), persistent=False)
        self.scaling_train = nn.Parameter(torch.tensor(float(scale)))

    @property
    def weight(self) -> torch.Tensor:
        return self.proto.t()

    @property
    def in_features(self) -> int:
        return self.linear_proto.in_features

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return etf_logits(h.flatten(1), self.linear_proto.weight, self.linear_proto.bias, self.proto,
                          self.scaling_train)


def etf_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, proto: torch.Tensor,
               scale: torch.Tensor) -> torch.Tensor:
    """β · normalise(h Wᵀ + b) M: FedETF's logits (the normalisation divides by ‖u‖ clamped at 1e-12)."""
    u = F.linear(h, w, b)
    u = u / torch.linalg.vector_norm(u, dim=1, keepdim=True).clamp(min=1e-12)
    return scale * (u @ proto)


def _etf_check(proj_dim: int | None = None, scale: float = 1.0, seed: int = 0) -> None:
    if proj_dim is not None:
        bounds.integer("head 'etf'", "proj_dim", proj_dim, 1, bounds.MAX_DIM)
    _check_positive("etf", "scale", scale), _check_seed("etf", seed)


@register("etf")
@provides("etf", "in_features")
def etf(in_features: int, num_classes: int, proj_dim: int | None = None, scale: float = 1.0,
        seed: int = 0) -> ETFHead:
    """FedETF's fixed simplex-ETF classifier behind a learnable projection and temperature.

    Args:
        proj_dim: dimension d' of the projection (and of the ETF); default C, as the authors' ResNets
            (their CIFAR CNN uses 64); must be >= C
        scale: initial learnable temperature β (``scaling_train``: 1.0 for their ResNets, 10.0 for
            their CNN)
        seed: seed of the ETF's random orthogonal basis and the projection's initial weights
    """
    _etf_check(proj_dim, scale, seed)
    proj_dim = num_classes if proj_dim is None else proj_dim
    if proj_dim < num_classes:
        raise FedltError(f"head 'etf': proj_dim must be >= the number of classes {num_classes}, got {proj_dim}")
    # the projection (float32) and the QR of the proj_dim×C draw (float64) are the largest tensors
    bounds.tensor_bytes("head 'etf'", (proj_dim, in_features), 4, f"proj_dim={proj_dim} on {in_features} features")
    bounds.tensor_bytes("head 'etf'", (proj_dim, num_classes), 8, f"proj_dim={proj_dim} × {num_classes} classes")
    return ETFHead(in_features, num_classes, proj_dim, float(scale), seed)


etf.check = _etf_check


@provides("prototypes", "in_features")
class PrototypeHead(nn.Module):
    """FedNH's head (Dai et al., AAAI 2023; the authors' ``Conv2CifarNH``): z = s · (h/‖h‖₂) Pᵀ
    with ‖h‖ clamped at 1e-12, P the C×d class prototypes — fixed during local training (a buffer,
    moved only by the server's semantic infusion; used as stored, as their code does for frozen
    prototypes) — and s the learnable ``scaling``. ``weight`` is P."""

    def __init__(self, in_features: int, num_classes: int, scale: float, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the same prototypes on every node
            torch.manual_seed(seed)
            # FedUHClient._initialize_model's 'orthogonal' init: orthonormal rows when C <= d
            prototype = nn.init.orthogonal_(torch.rand(num_classes, in_features))
        self.register_buffer("prototype", prototype)
        self.scaling = nn.Parameter(torch.tensor([float(scale)]))

    @property
    def weight(self) -> torch.Tensor:
        return self.prototype

    @property
    def in_features(self) -> int:
        return self.prototype.shape[1]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return prototype_logits(h.flatten(1), self.prototype, self.scaling)


def prototype_logits(h: torch.Tensor, prototype: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """s · normalise(h) Pᵀ: FedNH's logits."""
    h = h / torch.linalg.vector_norm(h, dim=1, keepdim=True).clamp(min=1e-12)
    return scale * (h @ prototype.t())


def _prototypes_check(scale: float = 1.0, seed: int = 0) -> None:
    _check_positive("prototypes", "scale", scale), _check_seed("prototypes", seed)


@register("prototypes")
@provides("prototypes", "in_features")
def prototypes(in_features: int, num_classes: int, scale: float = 1.0, seed: int = 0) -> PrototypeHead:
    """FedNH's class prototypes: uniformly spread (orthogonal) unit vectors, fixed on the
    clients and moved by the server, behind a learnable scale.

    Args:
        scale: initial learnable scale s (``scaling``: 1.0 for the authors' Conv2Cifar, 20.0 for their ResNet)
        seed: seed of the prototypes' orthogonal initialisation
    """
    _prototypes_check(scale, seed)
    bounds.tensor_bytes("head 'prototypes'", (num_classes, in_features), 4, f"{num_classes} prototypes of {in_features}")
    return PrototypeHead(in_features, num_classes, float(scale), seed)


prototypes.check = _prototypes_check


def sparse_etf(feat_in: int, num_classes: int, rng: np.random.RandomState, beta: float = 0.6,
               steps: int = 10_000) -> torch.Tensor:
    """FedLoGe's static sparse equiangular classifier (d×C; the authors' ``ETF_Classifier`` and
    ``gen_sparse_ETF``, util/etf_methods.py): a simplex ETF from ``rng.random((d, C))`` (cast to
    float32, as theirs), ⌊β·d·C⌋ entries drawn by ``rng.choice`` set to 0, then ``steps`` Adam
    steps (lr 1e-4) on the non-zero entries of Σ_c(‖m_c‖ − 0.1)² − mean_c arccos(max_{c'≠c} cos(m_c, m_c'))
    (cosines clamped to ±0.99999), in float32 as theirs."""
    # their ETF_Classifier's arithmetic: numpy's QR, then float32 throughout
    p = torch.tensor(np.linalg.qr(rng.random(size=(feat_in, num_classes)))[0]).float()
    # float32 whatever the default dtype (a float64 default, as a replay sets, would mix dtypes)
    centre = (torch.eye(num_classes, dtype=torch.float32)
              - (1 / num_classes) * torch.ones(num_classes, num_classes, dtype=torch.float32))
    etf = np.sqrt(num_classes / (num_classes - 1)) * torch.matmul(p, centre)
    zero = rng.choice(feat_in * num_classes, int(beta * feat_in * num_classes), replace=False)
    flat = etf.flatten()
    flat[torch.from_numpy(zero)] = 0
    m = flat.reshape(feat_in, num_classes).clone().requires_grad_(True)
    mask = (m != 0).float()
    optimiser = torch.optim.Adam([m], lr=0.0001)
    for _ in range(steps):
        optimiser.zero_grad()
        norms = torch.norm(m, p=2, dim=0)  # their statements, in their order (float32 rounding alike)
        norm_loss = torch.sum((norms - 0.1) ** 2)
        unit = m / norms
        cos = torch.mm(unit.t(), unit)
        torch.diagonal(cos).fill_(-1)
        angle_loss = -torch.acos(cos.max(dim=1)[0].clamp(-0.99999, 0.99999)).mean()
        (norm_loss + angle_loss).backward()
        m.grad *= mask
        optimiser.step()
    return m.detach()


@functools.lru_cache(maxsize=8)
def _sparse_etf_cached(feat_in: int, num_classes: int, sparsity: float, steps: int, seed: int) -> torch.Tensor:
    """Once per process and setting: the 10 000 steps take ~20 s of CPU at d = 200, C = 10."""
    return sparse_etf(feat_in, num_classes, np.random.RandomState(seed), sparsity, steps)


@provides("linear", "in_features")
class SparseETFHead(nn.Module):
    """FedLoGe's global head ``g_head`` with the SSE-C (the authors' fedloge.py, ``cls_switch =
    "SSE-C"``): z = h Wᵀ + b with W = the sparse ETF's transpose (C×d) and b a linear layer's
    initial bias, both fixed (no optimiser of theirs holds ``g_head``): buffers here."""

    def __init__(self, in_features: int, num_classes: int, sparsity: float, steps: int, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            bias = nn.Linear(in_features, num_classes).bias.detach().clone()
        # generated in float32 as theirs, held in the model's dtype (the bias's: the default dtype)
        weight = _sparse_etf_cached(in_features, num_classes, sparsity, steps, seed).t().contiguous().to(bias.dtype)
        self.register_buffer("fixed_weight", weight, persistent=False)
        self.register_buffer("fixed_bias", bias, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.fixed_weight

    @property
    def bias(self) -> torch.Tensor:
        return self.fixed_bias

    @property
    def in_features(self) -> int:
        return self.fixed_weight.shape[1]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h.flatten(1), self.fixed_weight, self.fixed_bias)


def _sse_c_check(sparsity: float = 0.6, steps: int = 10_000, seed: int = 0) -> None:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise FedltError(f"head 'sse_c': sparsity must be in [0, 1), got {sparsity!r}")
    bounds.integer("head 'sse_c'", "steps", steps, 0, bounds.MAX_STEPS), _check_seed("sse_c", seed)


@register("sse_c")
@provides("linear", "in_features")
def sse_c(in_features: int, num_classes: int, sparsity: float = 0.6, steps: int = 10_000,
          seed: int = 0) -> SparseETFHead:
    """FedLoGe's static sparse equiangular classifier (SSE-C), fixed.

    Args:
        sparsity: fraction β of the ETF's entries set to 0 (the authors' beta=0.6)
        steps: Adam steps that re-spread the sparse vectors (the authors' 10 000)
        seed: seed of the ETF's basis, the zeroed entries and the fixed bias
    """
    _sse_c_check(sparsity, steps, seed)
    if num_classes < 2 or in_features < num_classes:
        raise FedltError(f"head 'sse_c': needs 2 <= classes <= the representation size {in_features}")
    bounds.tensor_bytes("head 'sse_c'", (in_features, num_classes), 8, f"{num_classes} classes on {in_features} features")
    return SparseETFHead(in_features, num_classes, float(sparsity), steps, seed)


sse_c.check = _sse_c_check


def check_params(spec: dict[str, Any]) -> None:
    """A head spec's parameter names (against its factory) and values (its ``check``, when it has
    one), with nothing built: a FedltError line otherwise."""
    params = dict(spec)
    name = params.pop("name", None)
    factory = REGISTRY.get(name)
    fixed = sorted(set(params) & set(_HEAD_KEYS))
    if fixed:
        raise FedltError(f"head {name!r}: {', '.join(fixed)} come(s) from the model, not the head spec")
    try:
        inspect.signature(factory).bind(in_features=1, num_classes=2, **params)
    except TypeError as exc:
        raise FedltError(f"head {name!r}: {exc}") from None
    check = getattr(factory, "check", None)
    if check is not None:
        check(**params)


# -- attaching a head ---------------------------------------------------------------------------
def _parent_of(model: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if child is target:
                return module, child_name
    raise FedltError(f"{type(model).__name__}.get_classifier() returns a module that is not one of its children")


def build_head(spec: dict[str, Any], in_features: int, num_classes: int) -> nn.Module:
    """The head of ``spec`` (``{"name": ..., **params}``) for a d→C classifier."""
    spec = dict(spec)
    name = spec.pop("name")
    fixed = sorted(set(spec) & set(_HEAD_KEYS))
    if fixed:
        raise FedltError(f"head {name!r}: {', '.join(fixed)} come(s) from the model, not the head spec")
    try:
        return REGISTRY.create(name, in_features=in_features, num_classes=num_classes, **spec)
    except TypeError as exc:
        raise FedltError(f"head {name!r}: {exc}") from None


def swap(model: nn.Module, module: nn.Module) -> nn.Module:
    """``model`` with its classifier (``get_classifier()``, a linear layer or a head) replaced by
    ``module`` in place (a personalised or re-aligned classifier); returns the model."""
    parent, name = _parent_of(model, model.get_classifier())
    setattr(parent, name, module)
    return model


def attach(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
    """``model`` with its classifier (``get_classifier()``, a d→C linear layer) replaced by the
    head of ``spec``, in place; returns the model."""
    get_classifier = getattr(model, "get_classifier", None)
    if get_classifier is None:
        raise FedltError(f"{type(model).__name__} has no get_classifier(); a classifier head replaces it")
    old = get_classifier()
    if not isinstance(old, nn.Linear):
        raise FedltError(f"{type(model).__name__}'s classifier is {type(old).__name__}, not a linear layer")
    parent, name = _parent_of(model, old)
    head = build_head(spec, old.in_features, old.out_features).to(old.weight.device)
    setattr(parent, name, head)
    return model


__all__ = ["REGISTRY", "register", "get", "create", "list", "attach", "CAPABILITIES", "LINEAR", "provides",
           "provided", "classifier_provides", "check_params", "swap", "build_head", "simplex_etf", "etf_logits",
           "ETFHead", "PrototypeHead", "prototype_logits", "SparseETFHead", "sparse_etf"]

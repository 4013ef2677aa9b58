"""Local loss terms (SPEC §2)."""

from fedlt.registry import Registry

REGISTRY: Registry = Registry("loss")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

# Importing the term modules registers the built-in terms.
from fedlt.losses.base import SETUP_KEYS, LossTerm  # noqa: E402
from fedlt.losses.compose import Composite, build, compose, parse, validate  # noqa: E402
from fedlt.losses.adjust import CE, FedLC, LogitAdjust  # noqa: E402
from fedlt.losses.fedvls import FedVLS, LogitSuppression, VacantKD  # noqa: E402
from fedlt.losses.fedgrab import SGB, FedGraB, dpa, phi  # noqa: E402
from fedlt.losses.prox import FedProx  # noqa: E402
from fedlt.losses.labelskew import FedIR, FedLMD, FedNTD, FedRS  # noqa: E402
from fedlt.losses.longtail import GCL, LDAM, EQLv2, BalancedSoftmax, Focal  # noqa: E402
from fedlt.losses.fused import check as _check  # noqa: E402,F401  (installs the fused kernels' checks)

__all__ = [
    "REGISTRY", "register", "get", "create", "list", "build", "compose", "parse", "validate",
    "LossTerm", "Composite", "SETUP_KEYS", "CE", "LogitAdjust", "FedLC", "VacantKD", "LogitSuppression",
    "FedVLS", "SGB", "FedGraB", "FedProx", "dpa", "phi", "FedRS", "FedNTD", "FedLMD", "FedIR",
    "LDAM", "BalancedSoftmax", "Focal", "EQLv2", "GCL",
]

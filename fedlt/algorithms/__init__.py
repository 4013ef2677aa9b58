"""Federated algorithms, each a registered composition of the library's parts."""

from fedlt.registry import Registry

REGISTRY: Registry = Registry("algorithm")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

from fedlt.algorithms import fedavg_family, split  # noqa: E402,F401  (register the built-ins)

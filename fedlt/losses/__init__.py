"""Local loss terms (SPEC §2)."""

from fedlt.registry import Registry

REGISTRY: Registry = Registry("loss")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

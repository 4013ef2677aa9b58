"""YAML read with its aliases bounded before they are expanded (a "billion laughs" is refused).

``yaml.safe_load`` already refuses tags that build Python objects, but an alias is a reference:
nine nested levels of ten aliases are a 300-byte file whose data holds 10^9 values once anything
walks it (merging a config, expanding a grid, writing JSON). ``load`` composes the document,
counts the values it would hold with every alias expanded (each shared node counted once per
use, in one pass over the node graph), and refuses it beyond ``MAX_VALUES`` or when an alias
refers to a node containing it, before anything is constructed. Imports: fedlt.errors (yaml lazily).
"""

from __future__ import annotations

from typing import Any

from fedlt.errors import FedltError

MAX_VALUES = 100_000  # a configuration or study holds hundreds; a grid of 10^5 values is already huge


def _children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def expanded_size(root: Any, limit: int = MAX_VALUES) -> int:
    """The number of values under ``root`` with every alias expanded; FedltError past ``limit``
    or on a cycle. Iterative (no recursion limit), memoised per node (linear in the file)."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            active.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > limit:
                raise FedltError(f"its YAML aliases expand to more than {limit} values (nested aliases, "
                                 "a 'billion laughs'?); write the values out")
            continue
        if key in sizes:
            continue
        if key in active:
            raise FedltError("a YAML alias refers to a node that contains it (a data structure without end)")
        active.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def load(text: str, limit: int = MAX_VALUES) -> Any:
    """``yaml.safe_load(text)``, refused (FedltError) when its aliases would expand past ``limit``
    values; yaml's own errors propagate as they would from ``safe_load``."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded_size(node, limit)
        return loader.construct_document(node)
    finally:
        loader.dispose()

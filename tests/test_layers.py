"""The house's layers, checked on the real import graph of fedlt/ (issue 31, STYLE.md "Layers").

The graph is drawn by this file's own ``ast`` walk (no third-party import-graph tool): every
``import`` / ``from … import`` statement of every module under fedlt/ (cli/ included), at any
depth — inside functions, methods and ``if`` blocks too — becomes an edge to the most specific
fedlt module it names (``from fedlt.losses import base`` is an edge to ``fedlt.losses.base``,
``from fedlt.losses import register`` one to ``fedlt.losses``). An edge from a module to its own
parent package (a component module importing its package's registry, which the package's
``__init__`` defines before importing its members) is left out, as import-linter does for a
package's own children; every other edge counts. Such an import inside a function still fails the
no-import-inside-a-function rule: the registry is defined before the package imports its members, so
the top of the module can import it (a lazy one only hides that).

Asserted: no cycle among fedlt's modules; no edge from a lower layer to a higher one (``LAYERS``
below; a new module must be placed in it, and a new upward import fails here); the two
transports never import each other; no ``from fedlt…`` inside a function outside cli/ except in the
modules listed in ``LAZY_ALLOWED`` (guards of optional heavy third-party packages, and the
ClientApp, a process per message on a SuperNode, which loads torch only for messages that train);
and no function in fedlt/
longer than ``MAX_FUNCTION_LINES`` (cli/ aside: typer's option declarations).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "fedlt"

# Layer of each module, by the longest matching dotted prefix. Imports run downward only:
# a module may import its own layer or a lower one.
LAYERS: dict[str, int] = {
    # 0 bottom: errors, registry, spec, io, wire, rundir, context, plots, process start-up
    "fedlt": 0, "fedlt.errors": 0, "fedlt.registry": 0, "fedlt.spec": 0, "fedlt.io": 0, "fedlt.wire": 0,
    "fedlt.rundir": 0, "fedlt.context": 0, "fedlt.plots": 0, "fedlt.start_method": 0, "fedlt.safe_yaml": 0,
    "fedlt.outputs": 0, "fedlt.bounds": 0,
    # 1 components and their registries
    "fedlt.datasets": 1, "fedlt.partitioners": 1, "fedlt.models": 1, "fedlt.losses": 1, "fedlt.aggregators": 1,
    "fedlt.augment": 1, "fedlt.availability": 1, "fedlt.posthoc": 1, "fedlt.metrics": 1, "fedlt.server_steps": 1,
    "fedlt.client_tests": 1, "fedlt.transforms": 1, "fedlt.privacy": 1,
    # 2 algorithms: message types, the runner protocol, the algorithms, the round policy
    "fedlt.algorithms": 2, "fedlt.faults": 2, "fedlt.uploads": 2,
    # 3 the run's configuration; engines known by name only
    "fedlt.config": 3,
    # 4 a run: its parts, loop, evaluation, checkpoint, signals
    "fedlt.run": 4,
    # 5 transports, side by side
    "fedlt.parallel": 5, "fedlt.flower": 5,
    # 6 doors
    "fedlt.engine": 6, "fedlt.components": 6, "fedlt.sweep": 6, "fedlt.report": 6, "fedlt.testing": 6,
    "fedlt.plugin": 6,
    "fedlt.cli": 7,
}
TRANSPORTS = ("fedlt.parallel", "fedlt.flower")
# modules whose imports inside functions load an optional heavy package (the exception)
LAZY_ALLOWED: set[str] = {
    "fedlt.losses.fused.dispatch",  # its Triton kernels import triton
    "fedlt.models",  # timm models import timm
    "fedlt.flower.simulation",  # the ClientApp and ServerApp import flwr (the engine must name what is missing)
    "fedlt.flower.client_app",  # a SuperNode's process per message answers the partition query without torch
}
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


PARENT_LAZY: list[str] = []  # imports of a module's own package inside a function (left out of GRAPH)


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported fedlt module, line, inside a function) for every import statement of ``module``."""
    tree = TREES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in child.names]
            for name in names:
                target = _target(name) if name.startswith("fedlt") else None
                if target and target != module and not module.startswith(target + "."):
                    found.append((target, child.lineno, in_function))
                elif target and target != module and in_function:  # its own package, inside a function:
                    PARENT_LAZY.append(f"{module} line {child.lineno} imports {target}")  # a circle in disguise
            visit(child, inner)

    visit(tree, False)
    return found


TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}  # parsed once, for every check
GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def layer(module: str) -> int:
    # "fedlt" (the package's own __init__) matches itself only: a new top-level module must be placed
    best = max((p for p in LAYERS if module == p or (p != "fedlt" and module.startswith(p + "."))), key=len,
               default=None)
    if best is None:
        raise AssertionError(f"{module} has no layer: add it to LAYERS in tests/test_layers.py")
    return LAYERS[best]


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def upward(graph: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    return [f"{m} (layer {layer(m)}) line {line} imports {t} (layer {layer(t)})"
            for m, edges in graph.items() for t, line, _ in edges if layer(t) > layer(m)]


def test_no_import_runs_upward():
    assert upward(GRAPH) == []


def test_the_transports_never_import_each_other():
    crossing = [f"{m} line {line} imports {t}" for m, edges in GRAPH.items() for t, line, _ in edges
                for a in TRANSPORTS for b in TRANSPORTS
                if a != b and (m == a or m.startswith(a + ".")) and (t == b or t.startswith(b + "."))]
    assert crossing == []


def test_no_import_circle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w, _, _ in GRAPH[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            connect(v)
    assert circles == []


def test_no_fedlt_import_inside_a_function():
    lazy = [f"{m} line {line} imports {t}" for m, edges in GRAPH.items() for t, line, inside in edges
            if inside and layer(m) < LAYERS["fedlt.cli"] and m not in LAZY_ALLOWED]
    lazy += [line for line in PARENT_LAZY if not line.startswith("fedlt.cli") and line.split()[0] not in LAZY_ALLOWED]
    assert lazy == []


def test_no_function_over_80_lines():
    long = []
    for module, path in MODULES.items():
        if layer(module) >= LAYERS["fedlt.cli"]:
            continue
        for node in ast.walk(TREES[module]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {length} lines")
    assert long == []


@pytest.mark.parametrize("edge", [("fedlt.config", "fedlt.engine"), ("fedlt.datasets.imagefolder", "fedlt.parallel"),
                                  ("fedlt.context", "fedlt.models")])
def test_the_rule_catches_an_upward_import(edge):
    """The check itself: the upward imports the issue found, put back (inside a function), fail it."""
    lower, higher = edge
    graph = {m: list(edges) for m, edges in GRAPH.items()}
    graph[lower].append((higher, 1, True))
    assert upward(graph) and upward(graph)[0].startswith(lower)

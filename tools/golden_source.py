"""Shared by the golden-fixture scripts of tools/*_golden: the authors' functions, read from their
repository at a fixed commit (a git directory, e.g. what fedlt's ``fetch`` tool mirrors) and
executed as they are, so no third-party code is committed here; and a DataLoader stand-in that
records the minibatch orders it draws, so fedlt can replay them."""

from __future__ import annotations

import ast
import subprocess
from typing import Any

import torch


def source(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def definitions(text: str, names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute the top-level functions ``names`` of ``text`` (``Class.method`` for a method, made a
    plain function of ``self``) verbatim in ``namespace``; returns them by name."""
    tree = ast.parse(text)
    found: dict[str, Any] = {}
    for node in tree.body:
        items = [(node.name, node)] if isinstance(node, ast.FunctionDef) else []
        if isinstance(node, ast.ClassDef):
            items = [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, ast.FunctionDef)]
        for name, fn in items:
            if name in names:
                fn = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
                exec(compile(fn, f"<{name}>", "exec"), namespace)
                found[name] = namespace[name.split(".")[-1]]
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"not found in the source: {sorted(missing)}")
    return found


class RecordingLoader:
    """``DataLoader(dataset, batch_size, shuffle=True)`` whose permutations come from ``generator``
    and are appended to ``orders``."""

    orders: list[list[int]] = []
    generator = torch.Generator().manual_seed(0)

    def __init__(self, dataset, batch_size: int, shuffle: bool = False) -> None:
        self.dataset, self.batch_size = dataset, batch_size

    def __iter__(self):
        perm = torch.randperm(len(self.dataset), generator=RecordingLoader.generator)
        RecordingLoader.orders.append(perm.tolist())
        for idx in perm.split(self.batch_size):
            items = [self.dataset[int(i)] for i in idx]
            yield tuple(torch.stack(col) for col in zip(*items))


def tolist(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): tolist(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [tolist(v) for v in value]
    return value

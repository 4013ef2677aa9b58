"""Load named top-level functions and classes from one file of an authors' repository, at a
given commit of a git snapshot (the directory the ``fetch`` tool prints), without importing the
rest of their project: the file's source is read with ``git show``, the named definitions are
cut out with ``ast`` unchanged and executed in a namespace holding the imports they need.

Nothing of the authors' code is committed to fedlt: the golden scripts run it offline and
commit only its outputs, with the repository URL, commit and file recorded beside them."""

from __future__ import annotations

import ast
import subprocess
from typing import Any


def source(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def load(git_dir: str, commit: str, path: str, names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """The definitions ``names`` of ``path`` at ``commit``, executed verbatim in ``namespace``."""
    text = source(git_dir, commit, path)
    tree = ast.parse(text)
    found = {node.name: ast.get_source_segment(text, node) for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names}
    missing = sorted(set(names) - set(found))
    if missing:
        raise SystemExit(f"{path}@{commit[:12]}: no top-level {', '.join(missing)}")
    for name in names:
        exec(compile(found[name], f"{path}:{name}", "exec"), namespace)
    return {name: namespace[name] for name in names}


def head_commit(git_dir: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()

"""Files fedlt writes for the user outside a run directory (report tables and figures, a saved
partition, its heatmap): never over a file fedlt did not create, never over an input.

Ownership is marked per folder: ``.fedlt-outputs.json`` lists the files fedlt wrote there, each
with the sha256 of what it wrote. Before any work, ``check(paths, ...)`` refuses

- a path that is an input of the same command (the study's ``study.json``, a ``--reference`` CSV,
  a base config, a run's files), even with ``--force``;
- an existing file fedlt did not write, or wrote and someone changed since (its digest differs),
  even with ``--force``; a link or special file in the way;
- an existing file fedlt wrote, unless ``force`` (``--force``: replace fedlt's own earlier output).

``write_bytes`` then writes atomically and records the file; ``record`` records files written by
another writer (``Partition.save``). Imports: fedlt.io, fedlt.errors, fedlt.rundir.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from fedlt import io
from fedlt.errors import FedltError
from fedlt.rundir import RUN_FILES

OWNED = ".fedlt-outputs.json"
FORMAT = "fedlt-outputs-1"
STUDY_MANIFEST = "study.json"  # fedlt.sweep.study.MANIFEST (a lower layer cannot import the sweep)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def owned(folder: Path) -> dict[str, str]:
    """The files fedlt wrote in ``folder`` (name -> sha256); a damaged list is refused, since
    writing it again would replace a file fedlt cannot vouch for."""
    path = Path(folder) / OWNED
    if not os.path.lexists(path):
        return {}
    if path.is_symlink() or not path.is_file():
        raise FedltError(f"{path} is not a regular file; fedlt keeps the list of its outputs there: remove it")
    data = io.read_json(path, "list of fedlt's outputs", dict)
    files = data.get("files")
    if data.get("format") != FORMAT or not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise FedltError(f"{path} is not fedlt's list of its outputs (expected format {FORMAT!r}): remove it")
    return files


def _same(path: Path, other: Path) -> bool:
    try:
        return os.path.samefile(path, other)
    except OSError:
        return Path(os.path.abspath(path)) == Path(os.path.abspath(other))


def _is_input(path: Path, inputs: Iterable[Path]) -> Path | None:
    for source in inputs:
        if _same(path, source):
            return source
    if path.name in RUN_FILES and any((path.parent / n).exists() for n in RUN_FILES):
        return path
    if path.name == STUDY_MANIFEST and path.exists():
        return path
    return None


def check(paths: Iterable[Path], what: str, *, force: bool = False, inputs: Iterable[Path] = (),
          force_flag: str | None = "--force") -> None:
    """A one-line FedltError naming the first of ``paths`` that must not be written (module
    docstring); nothing is written. ``force_flag``: the command's flag that replaces fedlt's own
    outputs (None where it has none)."""
    inputs = [Path(p) for p in inputs]
    for path in map(Path, paths):
        source = _is_input(path, inputs)
        if source is not None:
            raise FedltError(f"{what} {path} is an input this command reads ({source}); name another file")
        if not os.path.lexists(path):
            continue
        if path.is_symlink() or not path.is_file():
            raise FedltError(f"{what} {path} exists and is a link or not a regular file; name a new file")
        if owned(path.parent).get(path.name) != _sha256(path):
            raise FedltError(f"{what} {path} exists and was not written by fedlt (or was changed since); "
                             "fedlt never replaces it: name a new file or folder")
        if not force:
            hint = f"add {force_flag} to replace it" if force_flag else "remove it or name a new file"
            raise FedltError(f"{what} {path} exists (fedlt's earlier output); {hint}")


def record(paths: Iterable[Path]) -> None:
    """Mark ``paths`` (just written by fedlt) as fedlt's, in their folders' ``OWNED`` lists."""
    by_folder: dict[Path, list[Path]] = {}
    for path in map(Path, paths):
        by_folder.setdefault(path.parent, []).append(path)
    for folder, written in by_folder.items():
        files = owned(folder)
        files.update({p.name: _sha256(p) for p in written})
        data = {"format": FORMAT, "files": dict(sorted(files.items()))}
        io._atomic(folder / OWNED, lambda f: f.write((json.dumps(data, indent=2) + "\n").encode()))


def write_bytes(path: Path, data: bytes) -> Path:
    """``data`` into ``path`` atomically (a half-written file never replaces a good one), marked
    as fedlt's. ``check`` must have passed for ``path``."""
    path = Path(path)
    io._atomic(path, lambda f: f.write(data))
    record([path])
    return path

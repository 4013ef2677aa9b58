"""A study: a base configuration, axes whose product is the grid, and seeds; and its directory.

    study file (TOML / YAML / JSON)          study directory
      base = {...} or "run.toml"               study.json   the manifest: grid + one entry per run
      [axes] algorithm = [...]        ──►      runs/<run id>/  a run directory per cell and seed
      seeds = [0, 1, 2]                        (mlruns.db, tensorboard/ when tracked)
      include = [...], exclude = [...]

An axis is any setting, dotted (``optimiser.lr``), or a component spec string: ``partition =
["dirichlet(beta=0.05)", ...]`` overlays the base's partition as ``--partition`` does (the same
scheme keeps its other parameters), and ``algorithm = ["fedavg(loss=fedrs)", ...]`` sets the
algorithm and its parameters. A seed sets the data, model and sampling seeds at once, as
``fedlt run --seed``. Every run's configuration is resolved and validated before anything runs.

The manifest is written atomically; a run's status is read back from its directory
(``summary.json``: done; ``config.json`` + ``partition.npz``: resumable), so a study killed at
any instant continues where its runs' checkpoints stand.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedlt import io, rundir
from fedlt.config import RunConfig, merge, read_config_file
from fedlt.errors import FedltError, describe
from fedlt.spec import format_spec, overlay, parse_spec

MANIFEST = "study.json"
LOCK = rundir.LOCK_NAME  # held by the one sweep running in a study directory (fedlt.sweep.runner)
FORMAT = "fedlt-study-1"
# settings holding a component spec ({"name": ..., **params}): a string value is parsed as a spec
SPEC_AXES = ("partition", "algorithm_params.aggregator")
STUDY_KEYS = {"base", "axes", "seeds", "include", "exclude", "out"}
# settings the study sets itself, never a grid axis: each run's seeds (its seeds list) and out (runs/<id>)
OWNED_AXES = {"seeds": "the study's seeds list (seeds = [...] / --seeds) sets every run's seeds",
              "out": "each run's directory is runs/<run id> under the study directory (--out)"}
RUN_STATUSES = ("pending", "running", "done", "failed", "stopped")
_RUN_ID = re.compile(r"^[A-Za-z0-9.=+_-]+$")  # what run_id makes: a single safe path component


@dataclass(frozen=True)
class RunEntry:
    """One run of the grid: its cell (axis -> value as written), its seed and its settings."""

    id: str
    cell: dict[str, Any]
    seed: int
    config: dict[str, Any]  # the resolved RunConfig, as JSON (out included)

    def label(self) -> dict[str, str]:
        return {axis: display(value) for axis, value in self.cell.items()}


@dataclass
class Study:
    base: dict[str, Any]
    axes: dict[str, list[Any]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0])
    include: list[dict[str, Any]] = field(default_factory=list)
    exclude: list[dict[str, Any]] = field(default_factory=list)

    def definition(self) -> dict[str, Any]:
        return {"base": self.base, "axes": self.axes, "seeds": self.seeds, "include": self.include,
                "exclude": self.exclude}


def display(value: Any) -> str:
    """An axis value as a table shows it: specs as written (``dirichlet(beta=0.05)``)."""
    return format_spec(value) if isinstance(value, dict) and "name" in value else str(value)


# -- reading a study ----------------------------------------------------------------------------
def load_study(path: Path) -> tuple[Study, Path | None]:
    """A study file as a Study, and the ``out`` it names (relative to the current directory, as a
    run's ``out``), if any."""
    data = read_config_file(Path(path))
    unknown = sorted(set(data) - STUDY_KEYS)
    if unknown:
        raise FedltError(f"study file {path}: unknown key(s) {', '.join(unknown)} (a study holds "
                         f"{', '.join(sorted(STUDY_KEYS))}; run settings go under 'base')")
    base = data.get("base", {})
    if isinstance(base, str):  # a config file, relative to the study file
        base = read_config_file(Path(path).parent / base)
    if not isinstance(base, dict):
        raise FedltError(f"study file {path}: 'base' must be a table of run settings or a config file's path")
    axes = data.get("axes", {})
    if not isinstance(axes, dict) or not all(isinstance(v, list) and v for v in axes.values()):
        raise FedltError(f"study file {path}: 'axes' must map each setting to a non-empty list of values")
    out = data.get("out")
    if out is not None and (not isinstance(out, str) or not out.strip()):
        raise FedltError(f"study file {path}: 'out' must be a directory name (a string), got {out!r}")
    study = Study(base, dict(axes), check_seeds(data.get("seeds", [0]), f"study file {path}: seeds"),
                  _entries(data.get("include", []), f"study file {path}: include"),
                  _entries(data.get("exclude", []), f"study file {path}: exclude"))
    return study, (Path(out) if isinstance(out, str) else None)


def check_seeds(seeds: Any, what: str) -> list[int]:
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**63 for s in seeds)):
        raise FedltError(f"{what} must be a non-empty list of seeds (integers >= 0), got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise FedltError(f"{what} lists a seed twice: {seeds}")
    return list(seeds)


def _entries(value: Any, what: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(e, dict) and e for e in value):
        raise FedltError(f"{what} must be a list of tables (axis = value), got {value!r}")
    return list(value)


# -- from a cell to a RunConfig -----------------------------------------------------------------
def _get(data: dict[str, Any], path: list[str]) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value


def _overlay(base: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` over ``base`` as the CLI's ``--partition`` does (fedlt.spec.overlay)."""
    return overlay(base, spec) if isinstance(base, dict) else dict(spec)


def apply_axis(settings: dict[str, Any], axis: str, value: Any) -> dict[str, Any]:
    """``settings`` with one axis set to ``value``."""
    if axis == "algorithm":
        spec = parse_spec(value, "algorithm") if isinstance(value, str) else value
        if not isinstance(spec, dict) or "name" not in spec:
            raise FedltError(f"axis algorithm: {value!r} is not an algorithm spec, e.g. fedavg or 'fedavg(loss=fedrs)'")
        params = {k: v for k, v in spec.items() if k != "name"}
        if spec["name"] != settings.get("algorithm", "scala"):  # another algorithm's parameters would not fit
            settings = {k: v for k, v in settings.items() if k != "algorithm_params"}
        return merge(settings, {"algorithm": spec["name"], "algorithm_params": params})
    path = axis.split(".")
    if axis in SPEC_AXES or isinstance(_get(settings, path), dict) and "name" in _get(settings, path):
        if isinstance(value, str):
            value = parse_spec(value, axis)
        if isinstance(value, dict):
            value = _overlay(_get(settings, path) or {"name": None}, value)
            return _replace(settings, path, value)
    return merge(settings, _nest(path, value))


def _replace(settings: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    out = dict(settings)
    if len(path) == 1:
        out[path[0]] = value
    else:
        inner = out.get(path[0])
        out[path[0]] = _replace(inner if isinstance(inner, dict) else {}, path[1:], value)
    return out


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", display(value)).strip("_") or "x"


def run_id(cell: dict[str, Any], seed: int) -> str:
    """A run directory name from the cell's values (stable when axes are added to a grid)."""
    name = "__".join(_slug(v) for v in cell.values())
    if len(name) > 100:  # file systems cap a name at 255 bytes; keep ids readable and unique
        digest = hashlib.sha256(json.dumps(cell, sort_keys=True, default=str).encode()).hexdigest()[:10]
        name = f"{name[:88]}-{digest}"
    return f"{name}__seed{seed}" if name else f"seed{seed}"


def _matches(cell: dict[str, Any], entry: dict[str, Any]) -> bool:
    return all(axis in cell and display(cell[axis]) == display(value) for axis, value in entry.items())


def check_axes(axes: Any, what: str) -> None:
    """FedltError naming the first axis that is a setting the study sets itself (``OWNED_AXES``)."""
    for axis in axes:
        root = str(axis).split(".")[0]
        if root in OWNED_AXES:
            raise FedltError(f"{what} {axis}: not an axis a grid can vary; {OWNED_AXES[root]}")


def cells(study: Study) -> list[dict[str, Any]]:
    """The grid: the product of the axes in order, minus ``exclude``, plus ``include``."""
    check_axes(study.axes, "axis")
    for entry in study.include:
        check_axes(entry, "include")
    names = list(study.axes)
    grid = [dict(zip(names, values)) for values in itertools.product(*study.axes.values())]
    for entry in study.exclude:
        unknown = set(entry) - set(names)
        if unknown:
            raise FedltError(f"exclude {entry}: {', '.join(sorted(unknown))} is not an axis "
                             f"(axes: {', '.join(names) or 'none'})")
    grid = [cell for cell in grid if not any(_matches(cell, entry) for entry in study.exclude)]
    for entry in study.include:  # a cell beside the product (its axes may be a subset of them)
        if not any(_matches(cell, entry) and len(cell) == len(entry) for cell in grid):
            grid.append(dict(entry))
    return grid


def expand(study: Study, out: Path) -> list[RunEntry]:
    """Every run of the study, its settings resolved and validated (one line naming the run on
    a bad value); run directories ``out/runs/<id>``."""
    entries, seen, configs = [], set(), {}
    for cell in cells(study):
        settings = dict(study.base)
        for axis in sorted(cell, key=lambda a: a != "algorithm"):  # the algorithm first: it resets its params
            settings = apply_axis(settings, axis, cell[axis])
        for seed in study.seeds:
            rid = run_id(cell, seed)
            if rid in seen:
                raise FedltError(f"two runs of the grid would share the directory name {rid!r}; "
                                 "make the axis values distinct")
            seen.add(rid)
            resolved = merge(settings, {"seeds": {"data": seed, "model": seed, "sampling": seed},
                                        "out": str(out / "runs" / rid)})
            try:
                config = RunConfig.model_validate(resolved)
            except ValidationError as exc:
                raise FedltError(f"run {rid}: {describe(exc)}") from None
            entry = RunEntry(rid, cell, seed, config.model_dump(mode="json"))
            _refuse_twins(entry, configs)
            entries.append(entry)
    if not entries:
        raise FedltError("the study has no runs (every cell is excluded)")
    return entries


def _refuse_twins(entry: RunEntry, configs: dict[str, RunEntry]) -> None:
    """Two runs of one configuration (``2`` and ``2.0``, a spec written two ways) would run the same
    thing twice under two names: refused, naming both cells."""
    digest = _digest({k: v for k, v in entry.config.items() if k != "out"})
    twin = configs.setdefault(digest, entry)
    if twin is not entry:
        cells_text = " and ".join("{" + ", ".join(f"{a}={display(v)}" for a, v in c.items()) + "}"
                                  for c in (twin.cell, entry.cell))
        raise FedltError(f"runs {twin.id} and {entry.id} resolve to the same configuration (cells {cells_text}); "
                         "list each setting once")


# -- the study directory ------------------------------------------------------------------------
def status_on_disk(run_dir: Path) -> str:
    """``done`` (summary.json), ``resumable`` (config.json + partition.npz) or ``new``."""
    if (run_dir / "summary.json").is_file():
        return "done"
    if (run_dir / "config.json").is_file() and (run_dir / "partition.npz").is_file():
        return "resumable"
    return "new"


def clear_partial(run_dir: Path) -> None:
    """Remove what a run killed before its partition was saved left (fedlt's own files only), so
    it can start afresh."""
    for name in rundir.RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    rundir.remove_leftovers(run_dir)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def read_manifest(out: Path) -> dict[str, Any] | None:
    path = Path(out) / MANIFEST
    if not path.exists():
        return None
    manifest = io.read_json(path, "study manifest", dict)
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("runs"), list):
        raise FedltError(f"{path} is not a fedlt study manifest (expected format {FORMAT!r})")
    _check_definition(manifest.get("study"), path)
    for i, run in enumerate(manifest["runs"]):
        _check_run(run, f"{path} is a damaged study manifest: runs[{i}]")
    return manifest


def _check_definition(study: Any, path: Path) -> None:
    """The manifest's ``study``: what ``study_of_manifest`` rebuilds the grid from."""
    where = f"{path} is a damaged study manifest: study"
    if not isinstance(study, dict):
        raise FedltError(f"{where} is {'missing' if study is None else type(study).__name__}, not a table")
    if not isinstance(study.get("base"), dict):
        raise FedltError(f"{where}.base is {type(study.get('base')).__name__}, not a table of run settings")
    axes = study.get("axes")
    if not isinstance(axes, dict) or not all(isinstance(v, list) and v for v in axes.values()):
        raise FedltError(f"{where}.axes must map each setting to a non-empty list of values")
    check_seeds(study.get("seeds"), f"{where}.seeds")
    for key in ("include", "exclude"):
        _entries(study.get(key, []), f"{where}.{key}")


def _check_run(run: Any, where: str) -> None:
    """One run entry as ``plan`` writes it; its directory must be ``runs/<id>`` (nothing else is read)."""
    if not isinstance(run, dict):
        raise FedltError(f"{where} is {type(run).__name__}, not a table")
    rid = run.get("id")
    if not isinstance(rid, str) or not _RUN_ID.match(rid) or rid in (".", ".."):
        raise FedltError(f"{where}.id is {rid!r}, not a run id (letters, digits and . = + _ -)")
    label = run.get("label")
    if not isinstance(run.get("cell"), dict) or not isinstance(label, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in label.items()):
        raise FedltError(f"{where} ({rid}): 'cell' and 'label' must be tables (axis = value)")
    seed = run.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise FedltError(f"{where} ({rid}).seed is {seed!r}, not a seed (an integer >= 0)")
    if run.get("dir") != f"runs/{rid}":
        raise FedltError(f"{where} ({rid}).dir is {run.get('dir')!r}; a run's directory is 'runs/{rid}'")
    if run.get("status") not in RUN_STATUSES or not isinstance(run.get("digest"), str):
        raise FedltError(f"{where} ({rid}): 'status' must be one of {', '.join(RUN_STATUSES)} and 'digest' a string")
    if run.get("error") is not None and not isinstance(run.get("error"), str):
        raise FedltError(f"{where} ({rid}).error is {run['error']!r}, not a message")


def plan(study: Study, out: Path, *, extend: bool = False) -> dict[str, Any]:
    """The manifest for running ``study`` in ``out``: new, or the existing one (the same grid;
    with ``extend``, its runs plus the new cells'). A changed grid without ``extend``, or one
    that drops or changes a run, is refused with one line."""
    out = Path(out)
    entries = expand(study, out)
    runs = [{"id": e.id, "cell": e.cell, "label": e.label(), "seed": e.seed, "dir": f"runs/{e.id}",
             "digest": _digest({k: v for k, v in e.config.items() if k != "out"}), "status": "pending",
             "error": None} for e in entries]
    old = read_manifest(out)
    if old is None:
        if out.exists() and any(p.name != LOCK for p in out.iterdir()):
            raise FedltError(f"study directory {out} is not empty and holds no {MANIFEST}; use a new or empty one")
        return {"format": FORMAT, "study": study.definition(), "runs": runs}
    previous = {r["id"]: r for r in old["runs"]}
    current = {r["id"]: r for r in runs}
    changed = [rid for rid in previous.keys() & current.keys() if previous[rid]["digest"] != current[rid]["digest"]]
    dropped = sorted(previous.keys() - current.keys())
    added = [rid for rid in current if rid not in previous]
    if changed:
        raise FedltError(f"{out} holds a study whose run {sorted(changed)[0]} has other settings "
                         f"({len(changed)} changed run(s)); use a new study directory")
    if dropped:
        raise FedltError(f"{out} holds runs this grid drops ({', '.join(dropped[:3])}"
                         f"{', …' if len(dropped) > 3 else ''}); run the study as it was, or use a new directory")
    if added and not extend:
        raise FedltError(f"{out} holds a study with another grid ({len(added)} new run(s), e.g. {added[0]}); "
                         "add --extend to run the new cells too")
    for rid, run in current.items():  # keep what the manifest knew (a failure's message)
        if rid in previous:
            run["status"], run["error"] = previous[rid]["status"], previous[rid].get("error")
    ordered = [current[r["id"]] for r in old["runs"]] + [current[rid] for rid in added]
    return {"format": FORMAT, "study": study.definition() if added else old["study"], "runs": ordered}


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    io.write_json(Path(out) / MANIFEST, manifest)


def study_of_manifest(manifest: dict[str, Any]) -> Study:
    s = manifest["study"]
    return Study(s["base"], s["axes"], s["seeds"], s.get("include", []), s.get("exclude", []))

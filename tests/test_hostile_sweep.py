"""Hostile input to ``fedlt sweep`` (issue 35): YAML alias bombs, cells that are the same run,
axes fedlt sets itself, damaged study manifests, bad executor parameters, two sweeps into one
directory.

Every refusal: exit 2, one line on stderr naming the cause, no traceback, and nothing under the
test's folder created or changed. Nothing trains: each case is refused before a run starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from fedlt import rundir, safe_yaml
from fedlt.cli import main
from fedlt.errors import FedltError
from fedlt.sweep import Study
from fedlt.sweep.runner import claim_study
from fedlt.sweep.study import plan, write_manifest

BASE = dict(model="mlp", train_limit=300, test_limit=200, clients=4, participation=1.0, rounds=2, local_iters=2,
            server_batch=40, eval_every=1)
BASE_YAML = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in BASE.items())


def laughs(levels: int = 9, width: int = 9, indent: str = "") -> str:
    """The "billion laughs": ``levels`` nested lists of ``width`` aliases to the level below (a
    few hundred bytes, ``width ** levels`` values once expanded)."""
    lines = [f"{indent}l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


def fails_cleanly(argv: list, capsys, watch: Path) -> str:
    """exit 2 within seconds, one stderr line without a traceback, nothing under ``watch`` created or changed."""
    before, started = tree(watch), time.perf_counter()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "Traceback" not in err, err
    assert tree(watch) == before, err
    assert time.perf_counter() - started < 20, err  # refused before expanding anything
    return err


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- study files and flags ---------------------------------------------------------------------------
STUDY_FILES = {
    "laughs in base": (f"base:\n{laughs(indent='  ')}{BASE_YAML}axes:\n  algorithm: [fedavg]\n", "aliases expand"),
    "laughs in axes": (f"base:\n{BASE_YAML}axes:\n  algorithm: [fedavg]\n  x: &x [1]\nbomb:\n{laughs(indent='  ')}",
                       "aliases expand"),
    "laughs as an axis": (f"{laughs()}base:\n{BASE_YAML}axes:\n  optimiser.lr: *l8\n", "aliases expand"),
    "an alias into itself": (f"base:\n{BASE_YAML}axes:\n  optimiser.lr: &a [0.1, *a]\n", "contains it"),
    "seeds as an axis": (f"base:\n{BASE_YAML}axes:\n  seeds.data: [0, 1]\n", "seeds"),
    "out as an axis": (f"base:\n{BASE_YAML}axes:\n  out: [a, b]\n", "each run's directory"),
    "seeds as an include": (f"base:\n{BASE_YAML}axes:\n  local_iters: [1]\ninclude:\n  - seeds: 3\n", "seeds"),
    "a numeric out": (f"out: 3\nbase:\n{BASE_YAML}", "'out' must be a directory name"),
    "a list out": (f"out: [a]\nbase:\n{BASE_YAML}", "'out' must be a directory name"),
    "a python-tagged base": ("base: !!python/object/apply:os.system ['touch pwned']\n", "could not be parsed"),
    "a binary base": ("base: !!binary aGVsbG8=\n", "'base' must be a table"),
    "twin cells 1 and 1.0": (f"base:\n{BASE_YAML}axes:\n  participation: [1, 1.0]\n", "same configuration"),
}


@pytest.mark.parametrize("case", list(STUDY_FILES))
def test_a_hostile_study_file_is_refused_in_one_line_before_anything_is_created(tmp_path, capsys, case):
    text, words = STUDY_FILES[case]
    study = write(tmp_path / "study.yaml", text)
    err = fails_cleanly(["sweep", study, "--out", tmp_path / "s", "--jobs", "1"], capsys, tmp_path)
    assert words in err
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("flags, words", [
    (["--grid", "participation=1,1.0"], "resolve to the same configuration"),
    (["--grid", "optimiser.lr=0.1,0.10"], "share the directory name"),
    (["--grid", "seeds.model=0,1"], "seeds.model: not an axis"),
    (["--grid", "out=a,b"], "out: not an axis"),
    (["--include", "seeds.data=4"], "include seeds.data"),
    (["--executor-param", "workers=2"], "--executor-param workers: the local executor has no such parameter "
                                        "(its parameters: jobs)"),
    (["--executor-param", "jobs=many"], "--executor-param jobs='many': the local executor expects int"),
    (["--executor", "ray", "--executor-param", "address=3"], "expects str"),
    (["--executor", "slurm", "--executor-param", "poll_s=soon"], "expects float"),
    (["--jobs", "1", "--executor", "magic"], "unknown executor 'magic'"),
])
def test_hostile_grid_and_executor_flags_are_one_line_naming_the_cause(tmp_path, capsys, flags, words):
    base = write(tmp_path / "base.toml", "".join(f"{k} = {json.dumps(v)}\n" for k, v in BASE.items()))
    err = fails_cleanly(["sweep", "--base", base, "--out", tmp_path / "s", *flags], capsys, tmp_path)
    assert words in err


def test_bounded_yaml_keeps_ordinary_aliases_and_counts_in_one_pass():
    assert safe_yaml.load("a: &x {p: 1}\nb: *x\nc: {<<: *x, q: 2}\n") == {"a": {"p": 1}, "b": {"p": 1},
                                                                        "c": {"p": 1, "q": 2}}
    started = time.perf_counter()
    with pytest.raises(FedltError, match="expand to more than 100000"):
        safe_yaml.load(laughs(levels=30, width=30))  # 30^30 values: counted, never built
    assert time.perf_counter() - started < 2
    assert safe_yaml.load(laughs(levels=3, width=9)) is not None  # 9^3 values: an ordinary file


# -- damaged study manifests ---------------------------------------------------------------------
@pytest.fixture
def study_dir(tmp_path) -> Path:
    out = tmp_path / "s"
    write_manifest(out, plan(Study(dict(BASE), {"local_iters": [1, 2]}), out))
    return out


@pytest.mark.parametrize("damage, words", [
    (lambda m: m.pop("study"), "study is missing"),
    (lambda m: m["study"].pop("axes"), "study.axes"),
    (lambda m: m["study"].__setitem__("base", "!!python/object/apply:os.system ['touch pwned']"), "study.base"),
    (lambda m: m["study"].__setitem__("seeds", ["0"]), "seeds"),
    (lambda m: m["runs"][1].pop("id"), "runs[1].id"),
    (lambda m: m["runs"].__setitem__(0, ["not", "a", "run"]), "runs[0] is list"),
    (lambda m: m["runs"][0].pop("label"), "'label'"),
    (lambda m: m["runs"][0].__setitem__("seed", True), "seed"),
    (lambda m: m["runs"][0].__setitem__("id", "../../x"), "not a run id"),
    (lambda m: m["runs"][0].__setitem__("status", 7), "status"),
])
def test_a_damaged_study_manifest_is_refused_on_load(study_dir, tmp_path, capsys, damage, words):
    manifest = json.loads((study_dir / "study.json").read_text())
    damage(manifest)
    (study_dir / "study.json").write_text(json.dumps(manifest))
    for argv in (["sweep", study_dir], ["sweep", study_dir, "--dry-run"], ["report", study_dir]):
        err = fails_cleanly(argv, capsys, tmp_path)
        assert "study.json is a damaged study manifest" in err and words in err


# -- one sweep per study directory ---------------------------------------------------------------
def test_a_second_sweep_into_a_held_study_is_refused_naming_the_first(study_dir, tmp_path, capsys):
    fd = rundir._lock(study_dir)  # as a first sweep holds it (an flock, another open file: refused)
    try:
        err = fails_cleanly(["sweep", study_dir, "--jobs", "1"], capsys, tmp_path)
        assert f"in use by fedlt process {os.getpid()}" in err and "one fedlt sweep per study directory" in err
    finally:
        (study_dir / rundir.LOCK_NAME).unlink()
        os.close(fd)


def test_a_stale_lock_file_does_not_block_and_a_refusal_leaves_no_directory(tmp_path):
    out = tmp_path / "new"
    out.mkdir()
    (out / rundir.LOCK_NAME).write_text("999999\n")  # left by a SIGKILLed sweep: no process holds it
    plan(Study(dict(BASE), {"local_iters": [1]}), out)  # not "a directory holding foreign files"
    with claim_study(out):
        assert (out / rundir.LOCK_NAME).read_text().strip() == str(os.getpid())
        with pytest.raises(FedltError, match="one fedlt sweep per study directory"):
            with claim_study(out):
                pass
    assert not (out / rundir.LOCK_NAME).exists()
    fresh = tmp_path / "a" / "b"
    with claim_study(fresh):
        assert fresh.is_dir()
    assert not (tmp_path / "a").exists()  # created by the claim, left empty: removed

"""Hostile but realistic input (issue 18): every case exits 2 with exactly one line on stderr and
no traceback, and the files under the directory it aimed at are byte-identical afterwards.

Most cases run the CLI in-process (a subprocess costs seconds of imports); subprocesses only
where another process is the point: two processes on one run directory, and a SIGKILL between a
checkpoint's temporary file and its rename.
"""

from __future__ import annotations

import hashlib
import io as stdio
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedlt.engine
import fedlt.run.evaluation
import fedlt.run.parts
from fedlt import io, rundir
from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.errors import FedltError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
# a tiny run: the same flags in and out of process, so the files can be compared byte for byte
TINY = ["--algo", "fedavg", "--model", "mlp", "--partition", "iid", "--train-limit", "400", "--test-limit", "100",
        "--clients", "4", "--participation", "0.5", "--rounds", "2", "--local-iters", "1", "--server-batch", "32",
        "--eval-every", "1", "--quiet"]
UNSAFE_HINTS = ("weights_only", "allow_pickle", "pickle.load", "trusted source")


# -- helpers --------------------------------------------------------------------------------------
def tree(folder: Path) -> dict[str, str]:
    """sha256 of every file (hidden ones too) under ``folder``, and every directory, by relative path."""
    if not folder.exists():
        return {}
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        out[key] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def fails_cleanly(argv: list[str], capsys, watch: Path, code: int = 2) -> str:
    """Run the CLI in-process: exit ``code``, one line on stderr, no traceback, ``watch`` unchanged."""
    before, existed = tree(watch), watch.exists()
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert info.value.code == code, (argv, err, captured.out[-300:])
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and err.startswith(("error:", "stopped")), err
    assert watch.exists() == existed and tree(watch) == before, f"{watch} changed: {err}"
    return err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "run"
    main(["run", *TINY, "--rounds", "1", "--out", str(out)])
    return out


def copy_run(src: Path, dst: Path, keep_summary: bool = False) -> Path:
    shutil.copytree(src, dst)
    if not keep_summary:
        (dst / "summary.json").unlink()
    return dst


class System:
    """Unpickling this runs a shell command (here: creating a marker file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# -- one process per run directory (subprocesses) -----------------------------------------------
PAUSED_CHILD = """
import sys, time, pathlib
import fedlt.run.parts as engine  # where the loop looks sample_clients up
go, ready = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
real = engine.sample_clients
def paused(num_clients, participation, seed, round_index):
    if round_index == 1:  # round 1 is done and checkpointed: hold the directory until told to go on
        ready.touch()
        deadline = time.monotonic() + 120
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    return real(num_clients, participation, seed, round_index)
engine.sample_clients = paused
from fedlt.cli import main
main(sys.argv[3:])
"""


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the child never reached the point to test"
        time.sleep(0.02)


TIMINGS = ("train_s", "eval_s", "round_s")


def metrics_without_timings(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]


def same_run(a: Path, b: Path) -> None:
    """Two runs of the same settings ended with the same files (but timings and out)."""
    for name in ("partition.npz", "partition.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert metrics_without_timings(a) == metrics_without_timings(b)
    for name in ("summary.json", "config.json"):
        x, y = json.loads((a / name).read_text()), json.loads((b / name).read_text())
        for d in (x, y):
            d.pop("wall_time_s", None), d.pop("out", None)
        assert x == y, name
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())


def test_a_second_process_on_a_running_run_is_refused_naming_the_holder(tmp_path, capsys):
    out, go, ready = tmp_path / "run", tmp_path / "go", tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", PAUSED_CHILD, str(go), str(ready), "run", *TINY,
                               "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_for(ready, holder)
        assert (out / rundir.LOCK_NAME).read_text().strip() == str(holder.pid)
        # a new run with the same --out, and a resume of the running run: both refused, nothing touched
        for argv in (["run", *TINY, "--out", str(out)], ["run", "--resume", str(out), "--quiet"]):
            err = fails_cleanly(argv, capsys, out)
            assert f"in use by fedlt process {holder.pid}" in err, err
    finally:
        go.touch()
        _, err = holder.communicate(timeout=120)
    assert holder.returncode == 0, err
    assert not (out / rundir.LOCK_NAME).exists()
    main(["run", *TINY, "--out", str(tmp_path / "alone")])
    same_run(out, tmp_path / "alone")


KILLED_IN_WRITE_CHILD = """
import os, sys, time, pathlib
ready, real, seen = pathlib.Path(sys.argv[1]), os.replace, []
def replace(src, dst, **kw):
    if str(dst).endswith("checkpoint.pt"):
        seen.append(dst)
        if len(seen) == 2:  # the round-2 checkpoint is written to its temporary file: wait to be killed
            ready.touch()
            time.sleep(120)
    return real(src, dst, **kw)
os.replace = replace
from fedlt.cli import main
main(sys.argv[2:])
"""


def test_sigkill_between_temporary_file_and_rename_resumes_exactly_and_leaves_no_temporary(tmp_path, capsys):
    out, ready = tmp_path / "killed", tmp_path / "ready"
    victim = subprocess.Popen([sys.executable, "-c", KILLED_IN_WRITE_CHILD, str(ready), "run", *TINY,
                               "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    try:
        wait_for(ready, victim)
    finally:
        victim.kill()
        victim.communicate(timeout=60)
    assert [p.name.startswith(".checkpoint.pt.") for p in rundir.leftovers(out)] == [True]
    assert io.load_checkpoint(out / "checkpoint.pt")["round"] == 1  # the rename never happened
    assert (out / rundir.LOCK_NAME).exists()  # left by the kill: it must not block the resume
    main(["run", "--resume", str(out), "--quiet"])
    assert rundir.leftovers(out) == [] and not (out / rundir.LOCK_NAME).exists()
    main(["run", *TINY, "--out", str(tmp_path / "alone")])
    same_run(out, tmp_path / "alone")


def test_the_lock_is_exclusive_in_process_too_and_a_stale_lock_file_does_not_block(finished_run, tmp_path):
    out = copy_run(finished_run, tmp_path / "run")
    with rundir.claim(out, resume=True):
        with pytest.raises(FedltError, match=f"in use by fedlt process {os.getpid()}"):
            with rundir.claim(out, resume=True):
                pass
    assert not (out / rundir.LOCK_NAME).exists()
    (out / rundir.LOCK_NAME).write_text("999999999\n")  # a killed holder's file: flock is gone with it
    with rundir.claim(out, resume=True):
        assert (out / rundir.LOCK_NAME).read_text().strip() == str(os.getpid())


# -- --out: never into files fedlt did not write -----------------------------------------------
@pytest.mark.parametrize("setup", ["unrelated files", "out is the config's folder", "current directory"])
def test_out_into_a_directory_holding_other_files_is_refused(setup, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    (folder / "summary.json").write_text('{"mine": true}')  # a name fedlt also writes
    config = folder / "config.json"
    config.write_text(json.dumps({"algorithm": "fedavg", "model": "mlp", "rounds": 1}))
    argv = ["run", *TINY]
    if setup == "unrelated files":
        argv += ["--out", str(folder)]
    elif setup == "out is the config's folder":
        argv += ["--config", str(config), "--out", str(folder)]
    else:
        monkeypatch.chdir(folder)
        argv += ["--config", "config.json", "--out", "."]
    err = fails_cleanly(argv, capsys, tmp_path)
    assert "already holds a run" in err or "did not write" in err


def test_an_empty_out_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"out": ""}))
    assert "out" in fails_cleanly(["run", "--config", "config.json"], capsys, tmp_path)
    assert "out" in fails_cleanly(["run", *TINY, "--out", ""], capsys, tmp_path)


def test_a_new_run_into_an_empty_directory_is_fine_and_a_refused_one_leaves_no_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    main(["run", *TINY, "--rounds", "1", "--out", str(tmp_path / "empty")])
    assert (tmp_path / "empty" / "summary.json").exists()
    # a failure found by prepare (after the lock is taken) removes the directory it created
    fails_cleanly(["run", *TINY, "--partition", "quantity", "--alpha", "11", "--out", str(tmp_path / "a" / "b")],
                  capsys, tmp_path)


# -- output paths, checked before any work -------------------------------------------------------
def output_cases(tmp: Path) -> list[tuple[list[str], str]]:
    a_file = tmp / "file.txt"
    long_name = "x" * 300
    return [
        (["run", *TINY, "--out", str(a_file)], "is a file"),
        (["run", *TINY, "--out", str(a_file / "sub")], "not a directory"),
        (["run", *TINY, "--out", "/dev/null"], "not a directory"),
        (["run", *TINY, "--out", "/proc/fedlt-hostile"], "cannot write"),
        (["run", *TINY, "--out", "/sys/fedlt-hostile"], "cannot write"),
        (["run", *TINY, "--out", str(tmp / long_name)], "allows"),
        (["partition", "--save", str(tmp)], "end in .npz"),
        (["partition", "--save", str(tmp / "d.npz")], "is a directory"),
        (["partition", "--save", str(a_file / "p.npz")], "not a directory"),
        (["partition", "--save", "/proc/fedlt-hostile.npz"], "cannot write"),
        (["partition", "--save", str(tmp / (long_name + ".npz"))], "allows"),
        (["partition", "--plot", str(tmp / "d.xyz")], "cannot write '.xyz'"),
        (["partition", "--plot", str(tmp / "d.npz")], "is a directory"),
        (["partition", "--plot", str(tmp)], "is a directory"),
        (["partition", "--plot", "/dev/null/x.png"], "not a directory"),
        (["partition", "--plot", "/sys/heat.png"], "cannot write"),
        (["partition", "--plot", str(a_file / "heat.png")], "not a directory"),
        (["report", str(tmp / "run"), "--plot", str(a_file)], "is a file"),
        (["report", str(tmp / "run"), "--plot", "/dev/null"], "not a directory"),
        (["report", str(tmp / "run"), "--plot", "/proc/fedlt-hostile"], "cannot write"),
    ]


def test_bad_output_paths_are_one_line_before_any_work(finished_run, tmp_path, capsys, monkeypatch):
    (tmp_path / "file.txt").write_text("a file")
    (tmp_path / "d.npz").mkdir()
    shutil.copytree(finished_run, tmp_path / "run")
    loaded = []
    monkeypatch.setattr(fedlt.run.parts, "load_data", lambda config: loaded.append(1))
    for argv, words in output_cases(tmp_path):
        err = fails_cleanly(argv, capsys, tmp_path)
        assert words in err, (argv, err)
    assert not loaded


def test_a_read_only_directory_is_refused(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root ignores the mode bits: refuse as the OS would for anyone else
        real_mkdir = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if folder in self.parents:
                raise PermissionError(13, "Permission denied", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    try:
        assert "permission" in fails_cleanly(["run", *TINY, "--out", str(folder / "run")], capsys, tmp_path)
    finally:
        folder.chmod(0o755)


def test_partition_plot_reports_the_file_it_wrote(tmp_path, capsys):
    main(["partition", "--partition", "iid", "--clients", "4", "--max-rows", "1", "--plot", str(tmp_path / "heat")])
    assert f"plot {tmp_path / 'heat.png'}" in capsys.readouterr().out
    assert (tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"


def test_partition_save_never_overwrites_a_runs_files(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path / "run", keep_summary=True)
    err = fails_cleanly(["partition", "--save", str(out / "partition.npz")], capsys, tmp_path)
    assert "run" in err


# -- readers of a run directory: report ---------------------------------------------------------
def damage(out: Path, case: str) -> str:
    """Damage one file of a run; returns the file's name (which the message must name)."""
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    edits = {
        "summary list": ("summary.json", "[1, 2]"),
        "config list": ("config.json", "[]"),
        "checkpoint.json list": ("checkpoint.json", '["round"]'),
        "checkpoint.json round": ("checkpoint.json", '{"round": "three"}'),
        "summary rounds": ("summary.json", '{"rounds": "x"}'),
        "manifest counts": ("partition.json", '{"class_counts": [[1, "a"]]}'),
        "accuracy string": ("metrics.jsonl", json.dumps(row | {"accuracy": "high"}) + "\n"),
        "round missing": ("metrics.jsonl", json.dumps({k: v for k, v in row.items() if k != "round"}) + "\n"),
        "per class string": ("metrics.jsonl", json.dumps(row | {"per_class_accuracy": "x"}) + "\n"),
        "row not a table": ("metrics.jsonl", "[1]\n" + json.dumps(row) + "\n"),
        "binary metrics": ("metrics.jsonl", b"\xff\xfe\x00garbage\x80"),
        "binary config": ("config.json", b"\x80\x81"),
        "deep json": ("config.json", "[" * 100_000 + "]" * 100_000),
    }
    name, content = edits[case]
    (out / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return name


REPORT_DAMAGE = ["summary list", "config list", "checkpoint.json list", "checkpoint.json round", "summary rounds",
                 "manifest counts", "accuracy string", "round missing", "per class string", "row not a table",
                 "binary metrics", "binary config", "deep json"]


def test_report_names_the_damaged_file_and_still_reports_the_other_runs(finished_run, tmp_path, capsys):
    good = copy_run(finished_run, tmp_path / "good", keep_summary=True)
    for case in REPORT_DAMAGE:
        bad = copy_run(finished_run, tmp_path / case.replace(" ", "-"), keep_summary=True)
        name = damage(bad, case)
        err = fails_cleanly(["report", str(bad)], capsys, tmp_path)
        assert f"{bad / name}" in err, (case, err)
        # beside a readable run: the table shows it, the damaged one is named, and the exit code is 2
        before = tree(tmp_path)
        with pytest.raises(SystemExit) as info:
            main(["report", str(good), str(bad)])
        captured = capsys.readouterr()
        assert info.value.code == 2 and "good" in captured.out and bad.name not in captured.out
        assert captured.err.strip().splitlines() == [f"error: skipped {err.removeprefix('error: ')}"]
        assert tree(tmp_path) == before
    # every damaged run at once, with figures: the readable run is drawn, each damaged one named once
    damaged = [str(tmp_path / case.replace(" ", "-")) for case in REPORT_DAMAGE]
    with pytest.raises(SystemExit) as info:
        main(["report", str(good), *damaged, "--plot", str(tmp_path / "figures")])
    captured = capsys.readouterr()
    assert info.value.code == 2 and len(captured.err.strip().splitlines()) == len(REPORT_DAMAGE)
    assert (tmp_path / "figures" / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)


@FEW
@given(name=st.sampled_from(["summary.json", "config.json", "checkpoint.json", "partition.json", "metrics.jsonl"]),
       content=st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=40)),
       field=st.sampled_from(["round", "accuracy", "balanced_accuracy", "per_class_accuracy", "rounds",
                              "wall_time_s", "class_counts"]), value=JSON, whole=st.booleans())
def test_report_on_any_damage_is_a_table_or_one_line(finished_run, tmp_path_factory, capsys, name, content, field,
                                                    value, whole):
    out = copy_run(finished_run, tmp_path_factory.mktemp("fuzz") / "run", keep_summary=True)
    if whole:
        (out / name).write_bytes(content)
    else:  # one field of an otherwise valid file
        lines = (out / name).read_text().splitlines()
        row = json.loads(lines[-1]) if name == "metrics.jsonl" else json.loads("\n".join(lines))
        row[field] = value
        (out / name).write_text(json.dumps(row) + "\n")
    before = tree(out)
    try:
        main(["report", str(out)])
    except SystemExit as exc:
        err = capsys.readouterr().err.strip()
        assert exc.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert tree(out) == before


# -- readers of a run directory: --resume, checkpoints and partition files ------------------------
def resume_damage(out: Path, case: str, marker: Path) -> None:
    saved = io.load_checkpoint(out / "checkpoint.pt")
    if case == "config list":
        (out / "config.json").write_text("[1]")
    elif case == "config binary":
        (out / "config.json").write_bytes(b"\xff\x00")
    elif case == "partition random bytes":
        (out / "partition.npz").write_bytes(np.random.default_rng(0).bytes(3000))
    elif case == "partition pickle":
        (out / "partition.npz").write_bytes(pickle.dumps(System(marker)))
    elif case == "partition object array":
        buffer = stdio.BytesIO()
        np.savez(buffer, manifest=np.array([System(marker)], dtype=object), indices=np.zeros(1, np.int64),
                 offsets=np.zeros(2, np.int64))
        (out / "partition.npz").write_bytes(buffer.getvalue())
    elif case == "checkpoint runs os.system":
        buffer = stdio.BytesIO()
        torch.save(saved | {"algorithm": System(marker)}, buffer)
        (out / "checkpoint.pt").write_bytes(buffer.getvalue())
    elif case == "checkpoint raw pickle":
        (out / "checkpoint.pt").write_bytes(pickle.dumps(System(marker), protocol=0))
    elif case == "checkpoint metrics strings":
        torch.save(saved | {"metrics": ["a"]}, out / "checkpoint.pt")
    elif case == "checkpoint accuracy string":
        torch.save(saved | {"metrics": [saved["metrics"][0] | {"accuracy": "x"}]}, out / "checkpoint.pt")
    elif case == "checkpoint round bool":
        torch.save(saved | {"round": True}, out / "checkpoint.pt")
    elif case == "checkpoint truncated":
        data = (out / "checkpoint.pt").read_bytes()
        (out / "checkpoint.pt").write_bytes(data[: len(data) // 3])
    elif case == "checkpoint empty metrics":
        torch.save(saved | {"metrics": []}, out / "checkpoint.pt")
    elif case == "metrics empty, checkpoint without an evaluation":
        (out / "metrics.jsonl").write_text("")
        torch.save(saved | {"metrics": []}, out / "checkpoint.pt")


RESUME_DAMAGE = ["config list", "config binary", "partition random bytes", "partition pickle",
                 "partition object array", "checkpoint runs os.system", "checkpoint raw pickle",
                 "checkpoint metrics strings", "checkpoint accuracy string", "checkpoint round bool",
                 "checkpoint truncated", "checkpoint empty metrics", "metrics empty, checkpoint without an evaluation"]


def test_a_resume_that_cannot_proceed_changes_nothing_and_runs_no_code(finished_run, tmp_path, capsys):
    marker = tmp_path / "pwned"
    for case in RESUME_DAMAGE:
        out = copy_run(finished_run, tmp_path / case.replace(" ", "-").replace(",", ""))
        resume_damage(out, case, marker)
        (out / ".checkpoint.pt.abc123.tmp").write_bytes(b"left by a kill")  # kept when the resume is refused
        err = fails_cleanly(["run", "--resume", str(out), "--quiet"], capsys, out)
        assert not marker.exists(), case  # nothing in the file ran
        assert not any(hint in err for hint in UNSAFE_HINTS), err
        assert str(out) in err, (case, err)
        if "os.system" in case or "pickle" in case or "object" in case:
            assert "refused" in err and "code" in err, err
    # the payloads are real: plain unpickling does run them
    pickle.loads(pickle.dumps(System(marker)))
    assert marker.exists()


def test_a_partition_file_that_would_run_code_is_refused_for_a_new_run(tmp_path, capsys):
    evil, marker = tmp_path / "evil.npz", tmp_path / "pwned"
    evil.write_bytes(pickle.dumps(System(marker)))
    err = fails_cleanly(["run", *TINY, "--partition-file", str(evil), "--out", str(tmp_path / "run")], capsys,
                        tmp_path)
    assert "refused" in err and str(evil) in err and not any(h in err for h in UNSAFE_HINTS)
    assert not marker.exists()


# -- config files and extreme values ----------------------------------------------------------------
@FEW
@given(top=st.one_of(st.lists(st.integers(), max_size=3), st.integers(), st.floats(allow_nan=False),
                     st.text(alphabet="abc xyz", min_size=1, max_size=10), st.booleans()),
       kind=st.sampled_from(["json", "yaml"]))
def test_a_config_whose_top_level_is_not_a_table_is_one_line(tmp_path_factory, capsys, top, kind):
    import yaml

    folder = tmp_path_factory.mktemp("config")
    path = folder / f"config.{kind}"
    path.write_text(json.dumps(top) if kind == "json" else yaml.safe_dump(top))
    err = fails_cleanly(["run", "--config", str(path), "--out", str(folder / "run")], capsys, folder)
    assert "top level" in err


EXTREME = [
    (["--lr", "1e39"], "optimiser.lr"),
    (["--lr", "3.5e38"], "optimiser.lr"),
    (["--weight-decay", "1e308"], "optimiser.weight_decay"),
    (["--clip", "1e300"], "optimiser.clip"),
    (["--rounds", "1000000000"], "rounds"),
    (["--local-iters", "1000000000"], "local_iters"),
    (["--local-epochs", "1000000000"], "local_epochs"),
    (["--server-batch", "1000000000"], "server_batch"),
    (["--beta", "1e308"], "beta"),
    (["--partition", "longtail", "--imbalance-factor", "1e308"], "imbalance_factor"),
]


@pytest.mark.parametrize("flags, named", EXTREME, ids=[" ".join(f) for f, _ in EXTREME])
def test_extreme_values_are_refused_before_training(flags, named, tmp_path, capsys):
    err = fails_cleanly(["run", *TINY, *flags, "--out", str(tmp_path / "run")], capsys, tmp_path)
    assert named in err, err


def test_partition_with_an_imbalance_factor_beyond_the_data_is_one_line(tmp_path, capsys):
    err = fails_cleanly(["partition", "--imbalance-factor", "1e308", "--clients", "4"], capsys, tmp_path)
    assert "imbalance factor can be at most" in err


@FEW
@given(shape=st.sampled_from(["-{}ce", "({}ce{})", "ce{}"]), n=st.integers(min_value=70, max_value=20_000))
def test_long_or_deep_loss_expressions_are_one_line(tmp_path_factory, capsys, shape, n):
    # parentheses add no depth to the tree: beyond Python's 200 levels they are a syntax error
    expr = {"-{}ce": "-" * n + "ce", "({}ce{})": "(" * (n + 200) + "ce" + ")" * (n + 200), "ce{}": "ce" + "+ce" * n}[shape]
    folder = tmp_path_factory.mktemp("loss")
    err = fails_cleanly(["run", *TINY, "--loss", expr, "--out", str(folder / "run")], capsys, folder)
    assert "loss" in err and len(err) < 400


# -- signals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [1, 2])
def test_ctrl_c_once_finishes_the_round_twice_stops_at_once_each_in_one_line(tmp_path, capsys, monkeypatch, count):
    """One SIGINT in round 1: the round finishes, is checkpointed (on Flower the signal test below
    sends SIGTERM, which takes this path). Two in round 2: the run stops at once, round 1's
    checkpoint is kept. Either way one line, exit 130, the lock released."""
    real = fedlt.engine.sample_clients
    interrupted = 0 if count == 1 else 1  # the round (from 0) during whose sampling the signals come

    def interrupt(num_clients, participation, seed, round_index):
        if round_index == interrupted:
            for _ in range(count):  # the first asks to stop after the round, a second stops at once
                os.kill(os.getpid(), signal.SIGINT)
        return real(num_clients, participation, seed, round_index)

    monkeypatch.setattr(fedlt.run.parts, "sample_clients", interrupt)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["run", *TINY, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 130 and len(err.splitlines()) == 1, err
    assert err == (f"stopped after round 1 (signal {signal.SIGINT}); checkpoint saved; continue with: fedlt run "
                   f"--resume {out}" if count == 1 else
                   f"stopped at once; the last checkpoint (round 1) is kept in {out}; continue with: fedlt run --resume {out}")
    assert io.load_checkpoint(out / "checkpoint.pt")["round"] == 1
    assert not (out / rundir.LOCK_NAME).exists()


def test_config_api_refuses_what_the_cli_refuses(tmp_path):
    for settings_ in ({"out": ""}, {"optimiser": {"lr": 1e39}}, {"rounds": 10**9}):
        with pytest.raises(Exception) as info:
            RunConfig(**settings_)
        assert type(info.value).__name__ == "ValidationError"
    (tmp_path / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(FedltError, match="did not write"):
        run(RunConfig(algorithm="fedavg", model="mlp", out=tmp_path))
    assert tree(tmp_path) == before


# -- issue 26: specs, --set, config strings: bounded, one line, nothing created ----------------------
def chain(kind: str, n: int) -> str:
    """A value nested ``n`` levels deep (or ``n`` terms long) in one of the shapes that used to end
    in a RecursionError or MemoryError traceback."""
    return {"minus": "-" * n + "1", "plus": "1" + "+1" * n, "not": "not " * n + "1",
            "list": "[" * n + "]" * n, "call": "a(x=" * n + "1" + ")" * n}[kind]


SPEC_FLAGS = [  # (value, folder) -> argv
    lambda v, d: ["run", *TINY, "--partition", f"dirichlet(beta={v})", "--out", str(d / "run")],
    lambda v, d: ["run", *TINY, "--aggregator", f"fedadam(eta={v})", "--out", str(d / "run")],
    lambda v, d: ["run", *TINY, "--model", f"mlp(width={v})", "--out", str(d / "run")],
    lambda v, d: ["run", *TINY, "--partition", "longtail", "--then", f"dirichlet(beta={v})", "--out", str(d / "run")],
    lambda v, d: ["partition", "--partition", f"dirichlet(beta={v})", "--save", str(d / "p.npz")],
    lambda v, d: ["run", *TINY, "--set", f"eval_batch={v}", "--out", str(d / "run")],
]


@FEW
@given(flag=st.sampled_from(range(len(SPEC_FLAGS))), kind=st.sampled_from(["minus", "plus", "not", "list", "call"]),
       n=st.sampled_from([70, 1000, 5000, 20_000]))
def test_deep_or_long_specs_and_set_values_are_one_line(tmp_path_factory, capsys, flag, kind, n):
    folder = tmp_path_factory.mktemp("spec")
    err = fails_cleanly(SPEC_FLAGS[flag](chain(kind, n), folder), capsys, folder)
    assert len(err) < 400 and ("allowed" in err or "literal" in err or "syntax" in err or "eval_batch" in err), err


TYPE_CONFUSION = [
    (["--partition", "dirichlet(beta=b'1')"], "bytes"),
    (["--partition", "dirichlet(beta=True)"], "beta: expected a number, got a boolean"),
    (["--partition", "dirichlet(beta=0.5, min_size=False)"], "min_size: expected a number"),
    (["--partition", "dirichlet(beta=1j)"], "complex"),
    (["--partition", "dirichlet(beta={1})"], "literal"),
    (["--partition", "longtail(imbalance_factor=True)"], "imbalance_factor: expected a number"),
    (["--aggregator", "fedadam(eta=True)"], "eta: expected a number"),
    (["--set", "eval_batch=True"], "eval_batch: expected a number, got a boolean"),
    (["--set", "seeds.model=false"], "seeds: model: expected a number"),
    (["--set", "eval_batch=b'512'"], "eval_batch"),
    (["--set", "eval_batch={[1]:2}"], "eval_batch"),
    (["--set", "optimiser.lr=True"], "lr: expected a number"),
    (["--set", "x" + ".x" * 100 + "=1"], "--set"),
]


@pytest.mark.parametrize("flags, named", TYPE_CONFUSION, ids=[" ".join(f)[:40] for f, _ in TYPE_CONFUSION])
def test_booleans_bytes_and_odd_literals_where_numbers_belong_are_one_line(flags, named, tmp_path, capsys):
    err = fails_cleanly(["run", *TINY, *flags, "--out", str(tmp_path / "run")], capsys, tmp_path)
    assert named in err, err


def test_config_files_and_a_tampered_config_json_meet_the_same_limits(finished_run, tmp_path, capsys):
    deep = "dirichlet(beta=" + "-" * 1000 + "1)"
    cases = {
        "partition.toml": f'partition = "{deep}"\n',
        "model.toml": f'model = "mlp(width={"-" * 5000}1)"\n',
        "aggregator.toml": f'algorithm = "fedavg"\n[algorithm_params]\naggregator = "{deep}"\n',
        "then.toml": f'[partition]\nname = "longtail"\nimbalance_factor = 10\nthen = "{deep}"\n',
        "bool.toml": "eval_batch = true\n",
        "deep.json": json.dumps({"partition": json.loads('{"name": "longtail", "then": ' * 300 + '"iid"'
                                                         + "}" * 300)}),
        "bytes.yaml": "eval_batch: !!binary MTIz\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        err = fails_cleanly(["run", "--config", str(tmp_path / name), "--out", str(tmp_path / "run")], capsys,
                            tmp_path)
        assert len(err) < 400, (name, err)
    for field, value in [("model", "mlp(width=" + "-" * 1000 + "1)"), ("partition", deep), ("eval_batch", True)]:
        out = copy_run(finished_run, tmp_path / f"resume-{field}")
        saved = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(saved | {field: value}))
        fails_cleanly(["run", "--resume", str(out), "--quiet"], capsys, out)


def test_partition_in_a_config_file_may_be_a_spec_string_like_model_and_aggregator(tmp_path, resolved):
    path = tmp_path / "c.toml"
    path.write_text('algorithm = "fedavg"\npartition = "dirichlet(beta=0.5, min_size=2)"\n'
                    '[algorithm_params]\naggregator = "fedadam(eta=0.1)"\n')
    cfg = resolved("--config", str(path))
    assert cfg.partition == {"name": "dirichlet", "beta": 0.5, "min_size": 2}
    assert cfg.algorithm_params == {"aggregator": {"name": "fedadam", "eta": 0.1}}
    # the flags merge into it as into a table
    assert resolved("--config", str(path), "--beta", "0.1").partition == {"name": "dirichlet", "beta": 0.1,
                                                                          "min_size": 2}
    assert resolved("--config", str(path), "--server-lr", "0.2").algorithm_params["aggregator"] == \
        {"name": "fedadam", "eta": 0.2}
    path.write_text('partition = "longtail(imbalance_factor=10, then=dirichlet(beta=0.5))"\n')
    assert resolved("--config", str(path)).partition == {"name": "longtail", "imbalance_factor": 10,
                                                         "then": {"name": "dirichlet", "beta": 0.5}}


# -- issue 26: partition files that pass the hash but cannot work ------------------------------------
def saved_partition(path: Path, sizes: list[int]) -> Path:
    """A partition written by fedlt's own Partition.build(...).save (valid sha256) over TINY's 400
    training samples, with clients of the given sizes (0: an empty client)."""
    from fedlt.datasets import create
    from fedlt.partitioners import Partition

    labels = create("mnist").limit(400, 100).y_train.numpy()
    starts = np.cumsum([0, *sizes])
    indices = [np.arange(a, b, dtype=np.int64) for a, b in zip(starts[:-1], starts[1:])]
    Partition.build(indices, labels, 10, name="hand", params={}, seed=0, dataset_name="mnist").save(path)
    return path


def raw_member_partition(good: Path, path: Path) -> Path:
    """``good`` with its manifest stored as raw bytes (a zip member that is not .npy data)."""
    import zipfile

    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w") as dst:
        for item in src.namelist():
            data = src.read(item)
            dst.writestr("manifest" if item == "manifest.npy" else item, b"{}" if item == "manifest.npy" else data)
    return path


def test_partition_files_with_empty_clients_or_raw_members_are_refused_before_anything_is_written(
        finished_run, tmp_path, capsys):
    files = {"all empty": saved_partition(tmp_path / "all-empty.npz", [0, 0, 0, 0]),
             "one empty": saved_partition(tmp_path / "one-empty.npz", [100, 0, 150, 150]),
             "raw member": raw_member_partition(finished_run / "partition.npz", tmp_path / "raw.npz")}
    for case, path in files.items():
        err = fails_cleanly(["run", *TINY, "--partition-file", str(path), "--out", str(tmp_path / "run")], capsys,
                            tmp_path)
        assert str(path) in err and ("hold no sample" in err or "not a .npy array" in err), (case, err)
        out = copy_run(finished_run, tmp_path / case.replace(" ", "-"))
        shutil.copy(path, out / "partition.npz")
        err = fails_cleanly(["run", "--resume", str(out), "--quiet"], capsys, out)
        assert "partition.npz" in err, (case, err)


def test_a_first_round_that_fails_leaves_nothing_behind(tmp_path, capsys):
    # the settings pass validation; the first round's loss is not finite: exit 2, no directory
    err = fails_cleanly(["run", *TINY, "--lr", "1e30", "--out", str(tmp_path / "a" / "run")], capsys, tmp_path)
    assert "no checkpoint had been written" in err
    (tmp_path / "empty").mkdir()
    fails_cleanly(["run", *TINY, "--lr", "1e30", "--out", str(tmp_path / "empty")], capsys, tmp_path)


# -- issue 26: timm parameters ---------------------------------------------------------------------
def test_timm_parameters_that_load_files_or_are_not_the_architectures_are_one_line(tmp_path, capsys):
    pytest.importorskip("timm")
    weights = tmp_path / "some.pt"
    torch.save({"conv1.weight": torch.zeros(1)}, weights)
    cases = [(f"timm:resnet10t(checkpoint_path='{weights}')", "checkpoint_path would load"),
             (f"timm:resnet10t(checkpoint_path='{tmp_path / 'missing.pt'}')", "checkpoint_path would load"),
             ("timm:resnet10t(pretrained_cfg_overlay=none)", "pretrained_cfg_overlay would load"),
             ("timm:resnet10t(pretrained=False)", "pretrained would load"),
             ("timm:resnet10t(cache_dir='/tmp')", "cache_dir"),
             ("timm:resnet10t(features_only=True)", "features_only is not a parameter of ResNet"),
             ("timm:resnet10t(img_size=64)", "from the dataset"),
             ("timm:resnet10t(no_such=1)", "no_such is not a parameter of ResNet")]
    for model, needle in cases:
        err = fails_cleanly(["run", *TINY, "--model", model, "--out", str(tmp_path / "run")], capsys, tmp_path)
        assert needle in err, (model, err)
    # the architecture's own parameters pass through
    from fedlt.models import build

    vit = build("timm:vit_tiny_patch16_224(depth=2, drop_rate=0.1)", in_chans=1, num_classes=3, image_size=32)
    assert len(vit.blocks) == 2 and vit.head_drop.p == 0.1


# -- issue 26: signals on the Flower engine (subprocesses: each starts its own Ray) -----------------
FLOWER_RUN = ["--algo", "fedavg", "--model", "mlp", "--partition", "iid", "--train-limit", "400", "--test-limit",
              "100", "--clients", "2", "--participation", "1", "--local-iters", "1", "--server-batch", "32",
              "--eval-every", "1", "--quiet", "--engine", "flower"]


def handled() -> int:
    """How many stop signals this process's handler has taken (the run's TwoSignalStop, while installed)."""
    return getattr(getattr(signal.getsignal(signal.SIGINT), "__self__", None), "count", 0)


class Signaller:
    """A thread that, once ``out`` holds a checkpoint beyond round ``after``, sends ``signals`` to
    ``pid``, and meanwhile records the processes ``pid`` started. Sent to this process, each next
    signal waits until the handler has taken the one before: two SIGINTs that arrive before
    Python runs the handler are handled once (it keeps one flag a signal number, not a count)."""

    def __init__(self, pid: int, out: Path, signals: list[int], after: int = 0) -> None:
        import threading

        from fedlt.flower.processes import descendants, supported

        self.seen: dict[int, int] = {}
        self.sent = False
        before = set(descendants(pid)) if supported() else set()

        def checkpointed() -> int:
            try:
                return json.loads((out / "checkpoint.json").read_text())["round"]
            except (OSError, ValueError):
                return 0

        def work() -> None:
            deadline = time.monotonic() + 600
            while not self.sent and time.monotonic() < deadline:
                if supported():
                    self.seen.update(descendants(pid, before))
                if checkpointed() > after:
                    for k, sig in enumerate(signals):
                        taken = time.monotonic() + 10
                        while pid == os.getpid() and k and handled() < k and time.monotonic() < taken:
                            time.sleep(0.001)
                        os.kill(pid, sig)
                    self.sent = True
                time.sleep(0.1)

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def agent(name: str) -> bool:
    return "DashboardAgent" in name or "RuntimeEnvAgent" in name or "dashboard/agent.py" in name \
        or "runtime_env/agent" in name


def gone(processes: dict[int, int], seconds: float = 30) -> dict[int, int]:
    """Those of ``processes`` still alive after waiting up to ``seconds`` for them to exit."""
    from fedlt.flower.processes import alive

    deadline = time.monotonic() + seconds
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(processes)


@pytest.mark.xdist_group("ray")  # one Ray at a time (tests/conftest.py)
def test_signals_on_the_flower_engine_behave_as_on_the_local_engine_and_leave_no_ray_process(tmp_path, capfd,
                                                                                               monkeypatch):
    """First, in a process of its own, a run SIGKILLed once it has a checkpoint: nothing of its
    code runs, and its watchdog stops Ray's processes. Then in this process one run, signalled
    each time its checkpoint has moved on: SIGTERM (finish the round, checkpoint, exit 143: the
    signal whose handler ``ray.init`` replaces), resumed and SIGINT twice (stop at once, exit 130).
    A single SIGINT takes SIGTERM's path with its own exit code (``TwoSignalStop``; checked on the
    local engine and with workers: tests/test_parallel.py), so it costs no third Ray start here. Each ends
    with exactly one line on stderr — file descriptor 2, so Ray's own output would show: Flower's
    and Ray's lines went to flower.log — the lock released and no process it started alive."""
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    from fedlt.flower.processes import kill, supported

    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(Path(fedlt.engine.__file__).parents[1]),
                                                 ENV.get("PYTHONPATH", "")]), "FLWR_TELEMETRY_ENABLED": "0"}
    victim_out, out = tmp_path / "sigkill", tmp_path / "run"
    victim = subprocess.Popen([sys.executable, "-m", "fedlt.cli", "run", *FLOWER_RUN, "--rounds", "1000", "--out",
                               str(victim_out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    killer = Signaller(victim.pid, victim_out, [signal.SIGKILL])
    started: dict[int, int] = {}
    try:
        # one Ray starting at a time: Ray gives a node 30 s to register, which two starting at once
        # on a loaded machine can miss
        killer.thread.join(timeout=600)
        victim.communicate(timeout=120)
        assert killer.sent and victim.returncode == -signal.SIGKILL
        # after a SIGKILL the watchdog kills what the run had started; Ray's two agents, started
        # by the raylet moments before, may escape it (a known remainder, docs/flower.md); any
        # other survivor fails the test
        survivors = {pid: name for pid in gone(killer.seen) if not agent(name := command(pid))}
        assert survivors == {}, f"the SIGKILLed run's processes are still alive: {survivors}"
        real = fedlt.engine.sample_clients

        def slow(*args, **kwargs):  # in the loop's thread (this process): a round lasts while the signals land
            time.sleep(0.5)
            return real(*args, **kwargs)

        monkeypatch.setattr(fedlt.run.parts, "sample_clients", slow)
        done = 0
        for name, sigs in [("sigterm", [signal.SIGTERM]), ("sigint twice", [signal.SIGINT, signal.SIGINT])]:
            sender = Signaller(os.getpid(), out, sigs, after=done)
            argv = ["run", *FLOWER_RUN, "--rounds", "1000", "--out", str(out)] if not done else \
                ["run", "--resume", str(out), "--quiet"]
            with pytest.raises(SystemExit) as info:
                main(argv)
            err = capfd.readouterr().err
            assert sender.sent, name
            started |= sender.seen
            assert gone(sender.seen, 5) == {}, f"{name}: processes of the run are still alive"
            lines = err.strip().splitlines()
            previous, done = done, json.loads((out / "checkpoint.json").read_text())["round"]
            assert len(lines) == 1 and "Traceback" not in err and not (out / rundir.LOCK_NAME).exists(), (name, err)
            assert done > previous, (name, previous, done)
            rows = len((out / "metrics.jsonl").read_text().splitlines())
            # a second signal may land between a round's metrics line and its checkpoint; a resume
            # rewrites the lines from the checkpoint
            assert rows == done or (name == "sigint twice" and rows == done + 1), (name, rows, done)
            assert "run_simulation" in (out / "flower.log").read_text(), name  # Flower's deprecation warning
            if name == "sigint twice":
                assert info.value.code == 130, (name, err)
                assert lines[0] == (f"stopped at once; the last checkpoint (round {done}) is kept in {out}; "
                                    f"continue with: fedlt run --resume {out}"), (name, err)
            else:
                signum = signal.SIGTERM
                assert info.value.code == 128 + signum, (name, err)
                assert lines[0] == (f"stopped after round {done} (signal {signum}); checkpoint saved; continue "
                                    f"with: fedlt run --resume {out}"), (name, err)
        if supported():  # Ray's processes were there to be stopped
            assert len(killer.seen) > 3 and len(started) > 3, (killer.seen, started)
    finally:
        if victim.poll() is None:  # a run the test could not stop: by its own pid
            victim.kill()
            victim.communicate()
        kill(killer.seen | started, signal.SIGKILL)

"""Hardening of ``fedlt sweep --track`` and the sweep's outside connections (issue 35): a store
that cannot be used — an unknown tracker, a URI MLflow cannot use, a sqlite file that is not a
database or cannot be written, a server that does not answer (bounded by a timeout, its address
named), a Ray cluster that cannot be reached — is refused in one line (exit 2) before the study
directory exists, and leaves none behind; a read-only study directory is refused; runs that lost
their tracking do not end in a success. The CLI runs in-process."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from fedlt.cli import main
from fedlt.sweep import track

BASE = """algorithm = "fedavg"
model = "mlp"
clients = 2
rounds = 1
participation = 1.0
train_limit = 100
test_limit = 30
local_iters = 1
server_batch = 16
partition = "iid"
"""


@pytest.fixture
def base(tmp_path) -> Path:
    path = tmp_path / "base.toml"
    path.write_text(BASE)
    return path


@pytest.fixture(scope="module")
def silent_server():
    """A TCP port that accepts connections and never answers (a hung server)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield f"127.0.0.1:{server.getsockname()[1]}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def refused(argv: list[str], capsys, study: Path) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "Traceback" not in err, err
    assert not study.exists(), f"{study} was left behind: {sorted(p.name for p in study.iterdir())}"
    return err


def store_cases(tmp: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """--track flags -> the words the refusal must hold."""
    tmp.mkdir(exist_ok=True)
    garbage = tmp / "garbage.db"
    garbage.write_bytes(os.urandom(4096))
    (tmp / "a-directory.db").mkdir()
    return {
        "unknown tracker": (["--track", "mlfloww"], ("unknown tracker 'mlfloww'", "mlflow")),
        "not a URI MLflow uses": (["--track", "mlflow", "--tracking-uri", "garbage"], ("'garbage'", "sqlite:///")),
        "unknown scheme": (["--track", "mlflow", "--tracking-uri", "foo://bar"], ("'foo://bar'",)),
        "file store": (["--track", "mlflow", "--tracking-uri", f"file://{tmp}/mlruns"], ("file://",)),
        "unclosed IPv6": (["--track", "mlflow", "--tracking-uri", "http://[::1"], ("not a URI",)),
        "garbage sqlite file": (["--track", "mlflow", "--tracking-uri", f"sqlite:///{garbage}"],
                                ("garbage.db", "not a database")),
        "sqlite path is a directory": (["--track", "mlflow", "--tracking-uri", f"sqlite:///{tmp}/a-directory.db"],
                                       ("not a regular file",)),
        "read-only file system": (["--track", "mlflow", "--tracking-uri", "sqlite:////proc/mlflow.db"],
                                  ("/proc", "cannot write")),
        "refused connection": (["--track", "mlflow", "--tracking-uri", f"http://127.0.0.1:{closed_port()}"],
                               ("127.0.0.1", "no HTTP answer")),
        "tensorboard into /proc": (["--track", "tensorboard", "--tracking-uri", "/proc/fedlt-tb"], ("/proc",)),
    }


CASES = ["unknown tracker", "not a URI MLflow uses", "unknown scheme", "file store", "unclosed IPv6",
         "garbage sqlite file", "sqlite path is a directory", "read-only file system", "refused connection",
         "tensorboard into /proc"]


@pytest.mark.parametrize("case", CASES)
def test_a_store_that_cannot_be_used_is_one_line_and_leaves_no_study(tmp_path, base, capsys, case):
    pytest.importorskip("mlflow")
    cases = store_cases(tmp_path / "files")
    assert sorted(cases) == sorted(CASES)
    flags, words = cases[case]
    study = tmp_path / "studies" / "s"  # its parent does not exist either: nothing may be made
    err = refused(["sweep", "--base", str(base), "--out", str(study), "--quiet", *flags], capsys, tmp_path / "studies")
    assert all(w in err for w in words), err


def test_a_server_that_never_answers_is_refused_within_the_timeout(tmp_path, base, capsys, silent_server, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setattr(track, "TIMEOUT", 2.0)  # the check reads it when it runs; 10 s of waiting proves no more
    study = tmp_path / "s"
    started = time.monotonic()
    err = refused(["sweep", "--base", str(base), "--out", str(study), "--quiet", "--track", "mlflow",
                   "--tracking-uri", f"http://{silent_server}"], capsys, study)
    assert silent_server in err and f"within {track.TIMEOUT:g} s" in err, err
    assert time.monotonic() - started < track.TIMEOUT + 20  # MLflow alone waits 120 s per try, 7 tries


def test_a_ray_cluster_that_cannot_be_reached_is_one_line(tmp_path, base, capsys):
    study = tmp_path / "s"
    port = closed_port()
    err = refused(["sweep", "--base", str(base), "--out", str(study), "--quiet", "--executor", "ray",
                   "--executor-param", f"address=127.0.0.1:{port}"], capsys, study)
    assert f"127.0.0.1:{port}" in err and "cannot be reached" in err, err


def test_a_read_only_study_directory_is_refused(tmp_path, base, capsys, monkeypatch):
    study = tmp_path / "s"
    study.mkdir()
    study.chmod(0o555)
    if os.geteuid() == 0:  # root ignores the mode bits: refuse as the OS would for anyone else
        real = tempfile.mkstemp

        def mkstemp(*args, dir=None, **kwargs):
            if dir is not None and Path(dir) == study:
                raise PermissionError(13, "Permission denied", str(study))
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    try:
        with pytest.raises(SystemExit) as info:
            main(["sweep", "--base", str(base), "--out", str(study), "--quiet", "--track", "tensorboard"])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and len(err.splitlines()) == 1 and "cannot write" in err, err
        assert list(study.iterdir()) == []
    finally:
        study.chmod(0o755)


def test_runs_that_lost_their_tracking_are_not_a_success(tmp_path, base, capsys):
    pytest.importorskip("tensorboard")
    study, board = tmp_path / "s", tmp_path / "tb"
    main(["sweep", "--base", str(base), "--out", str(study), "--dry-run"])
    run_id = capsys.readouterr().out.split()[1]
    board.mkdir()
    (board / run_id).write_text("a file where the run's event directory goes")  # the writer fails in the run
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--base", str(base), "--out", str(study), "--quiet", "--jobs", "1", "--track", "tensorboard",
              "--tracking-uri", str(board)])
    err = capsys.readouterr().err
    assert info.value.code == 1, err
    assert f"tracking incomplete for 1 run(s) ({run_id})" in err and "tracking with tensorboard stopped" in err, err

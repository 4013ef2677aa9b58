"""Packaging: a wheel built from the tree holds every package of the source tree and the MNIST
files, installs offline into a fresh environment and runs there; ``fedlt --version``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from fedlt.cli import main

ROOT = Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def source_packages() -> set[str]:
    """Every package directory of the tree, as its path inside a wheel (cli/ installs as fedlt/cli)."""
    found = {"fedlt/cli"}
    for init in (ROOT / "fedlt").rglob("__init__.py"):
        relative = init.parent.relative_to(ROOT)
        if relative.parts[:2] != ("fedlt", "cli"):  # fedlt/cli is a development symlink to cli/
            found.add(relative.as_posix())
    return found


def test_fedlt_version_prints_the_installed_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    assert capsys.readouterr().out.strip() == f"fedlt {VERSION}"


def test_a_wheel_of_the_tree_installs_offline_into_a_fresh_environment_and_runs(tmp_path):
    # a copy, so the build's build/ and egg-info never land in the tree
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("fedlt", "cli"):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    # no PYTHONPATH: the tests may run the tree through it, and the wheel must stand alone
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", HTTP_PROXY="http://0.0.0.0:9",
               HTTPS_PROXY="http://0.0.0.0:9", OMP_NUM_THREADS="1", FLWR_TELEMETRY_ENABLED="0")

    def call(*argv: str | Path, timeout: float = 120) -> str:
        proc = subprocess.run([str(a) for a in argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"{argv[:3]}: {proc.stderr[-2000:]}"
        return proc.stdout

    call(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", source)
    (wheel,) = (tmp_path / "dist").glob("fedlt-*.whl")
    contents = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(p for p in source_packages() if f"{p}/__init__.py" not in contents)
    assert not missing, f"packages left out of the wheel: {missing}"
    assert "fedlt/datasets/mnist/train-images-idx3-ubyte.gz" in contents
    assert not any(name.startswith("cli/") for name in contents)  # cli/ installs only as fedlt.cli

    # torch and the rest come from this machine's site-packages; fedlt only from the wheel
    home = tmp_path / "venv"
    venv.create(home, system_site_packages=True, with_pip=False)
    python, fedlt = home / "bin" / "python", home / "bin" / "fedlt"
    call(python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel)
    # one interpreter for where fedlt imports from and the version its CLI prints (a process start and
    # fedlt's import: ~4.5 s saved); the console script itself runs the `fedlt run` below
    where, version = call(python, "-c", "import fedlt, fedlt.cli, fedlt.models.splitting as s\n"
                                        "print(fedlt.__file__, s.__file__)\nfedlt.cli.main(['--version'])").splitlines()
    assert all(Path(f).is_relative_to(home) for f in where.split()), where
    assert version == f"fedlt {VERSION}"

    run = tmp_path / "run"
    call(fedlt, "run", "--algo", "fedavg", "--model", "mlp", "--rounds", "1", "--clients", "5", "--participation", "1",
         "--local-iters", "2", "--train-limit", "300", "--test-limit", "100", "--threads", "1", "--quiet",
         "--out", run, timeout=300)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 1 and 0.0 <= summary["final"]["accuracy"] <= 1.0

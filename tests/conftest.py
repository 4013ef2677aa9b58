"""Fixtures and helpers shared by several test modules."""

import compileall
import json
import os
from pathlib import Path

# Triton kernels run on CPU tensors through the interpreter; it must be set before triton is
# first imported (``import timm`` imports it), so here, before any test module is collected.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI (which sets CI=true) replays the same examples on every run: a submission's CI must not be a coin
# toss over newly drawn inputs. Elsewhere hypothesis explores freely; an example it finds failing is
# kept as an ``@example`` on its test. ``HYPOTHESIS_PROFILE=ci`` picks the CI profile by hand.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "explore"))

# Under pytest-xdist (``-n 2``, the README's command) each worker is one test process on a 2-core
# machine: one torch thread each, or the workers' threads wait on each other (see one_thread).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# fedlt's sources, whose bytecode the session writes once (precompile)
SOURCES = [Path(__file__).resolve().parents[1] / part for part in ("fedlt", "cli", "plugins/fedlt-example/src")]


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs on one worker (--dist loadgroup)")
    config.addinivalue_line("markers", "slow: a sweep beyond the suite's time budget, run with FEDLT_SLOW=1 "
                            "(skipped otherwise, CI included)")
    if not hasattr(config, "workerinput"):  # once, in the process that starts the xdist workers
        precompile()


def precompile() -> None:
    """Write the bytecode of fedlt's sources. Where PYTHONDONTWRITEBYTECODE is set (this machine,
    CI) no process writes it, so every process the suite starts — the workers, CLI runs, ClientApps,
    Ray actors, sweep and loader processes — compiled fedlt's ~130 modules from source again (~0.5 s
    of CPU each); an installed wheel has them compiled by pip. Python reads a .pyc whatever that
    variable says and checks it against its source's size and time, so an edit is never missed."""
    for folder in SOURCES:
        if folder.is_dir():
            compileall.compile_dir(folder, quiet=2)


SLOW = os.environ.get("FEDLT_SLOW") == "1"  # the slow sweeps (e.g. --compile over the whole registry, inductor)


def pytest_runtest_setup(item):
    if item.get_closest_marker("slow") is not None and not SLOW:
        pytest.skip("slow: run with FEDLT_SLOW=1")


def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup``: a test using a module-scoped fixture of its own module runs on
    the worker that runs the rest of that module (the fixture is built once, not once per
    worker); a test marked ``xdist_group`` keeps its group ("ray": the tests that start Ray or a
    Flower simulation, one at a time; "loopback": the Flower deployments of tests/loopback.py)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        module = item.nodeid.split("::", 1)[0]
        if any(d[-1].scope == "module" and d[-1].baseid == module for d in defs.values() if d):
            item.add_marker(pytest.mark.xdist_group(module))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: on shared cores torch's default threads wait on each other (a tiny
    run took 40x longer with 2 threads than with 1 under load). Runs compared with each other use
    the same count: float reductions may be split differently by thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def without_timings(run_dir) -> list[dict]:
    """A run's metrics rows without their wall-clock fields (train_s, eval_s, round_s): what two
    runs of the same configuration must agree on exactly."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def resolved(monkeypatch, tmp_path):
    """``resolved(*argv) -> RunConfig``: what ``fedlt run`` would train, without training."""
    import fedlt.engine
    from fedlt.cli import main

    seen: list = []

    def fake_run(cfg, *, resume=False, on_round=None, on_start=None):
        seen.append(cfg)
        return {"final": {"accuracy": 0.0, "balanced_accuracy": 0.0}, "best": {"accuracy": 0.0, "round": 1},
                "rounds": cfg.rounds, "wall_time_s": 0.0}

    monkeypatch.setattr(fedlt.engine, "run", fake_run)

    def resolve(*argv: str):
        main(["run", "--out", str(tmp_path / "out"), "--quiet", *argv])
        return seen[-1]

    return resolve

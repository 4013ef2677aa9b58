"""``fedlt sweep`` and ``fedlt report STUDY_DIR``: the grid, identical results, resume after a
kill, failures, and the aggregation over seeds (docs/sweeps.md)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt.cli import main
from fedlt.cli.sweep_cmd import parse_grid, split_top
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.errors import FedltError
from fedlt.report import Cell, Run, aggregate, load_study, render_study
from fedlt.sweep import Study, expand, read_manifest
from fedlt.sweep.study import plan, write_manifest
from conftest import without_timings

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model="mlp", train_limit=300, test_limit=200, clients=4, participation=1.0, rounds=2,
            local_iters=2, server_batch=40, eval_every=1)


def cli(*argv: str) -> int:
    """``fedlt ARGV`` in this process: its exit code."""
    try:
        main(list(argv))
    except SystemExit as exc:
        return exc.code or 0
    return 0


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}


def study_file(tmp_path: Path, axes: str, seeds: str = "[0]", extra: str = "") -> Path:
    path = tmp_path / "study.toml"
    base = "\n".join(f"{k} = {json.dumps(v)}" for k, v in TINY.items() if v is not None)
    path.write_text(f"seeds = {seeds}\n{extra}\n[base]\n{base}\n[axes]\n{axes}\n")
    return path


# -- the grid (no training) -----------------------------------------------------------------------
def test_the_grid_is_the_product_of_the_axes_with_specs_overlaid_and_include_exclude(tmp_path):
    base = dict(TINY, partition={"name": "dirichlet", "beta": 0.5, "min_size": 3})
    study = Study(base, {"algorithm": ["fedavg", "fedavg(loss=fedrs)"], "partition": ["dirichlet(beta=0.1)", "iid"],
                         "optimiser.lr": [0.05]}, seeds=[0, 2],
                  exclude=[{"algorithm": "fedavg", "partition": "iid"}],
                  include=[{"algorithm": "fedlc", "partition": "iid", "optimiser.lr": 0.05}])
    entries = expand(study, tmp_path / "s")
    cells = [(e.label()["algorithm"], e.label()["partition"], e.seed) for e in entries]
    assert cells == [("fedavg", "dirichlet(beta=0.1)", 0), ("fedavg", "dirichlet(beta=0.1)", 2),
                     ("fedavg(loss=fedrs)", "dirichlet(beta=0.1)", 0), ("fedavg(loss=fedrs)", "dirichlet(beta=0.1)", 2),
                     ("fedavg(loss=fedrs)", "iid", 0), ("fedavg(loss=fedrs)", "iid", 2),
                     ("fedlc", "iid", 0), ("fedlc", "iid", 2)]
    first = entries[0].config
    # the same scheme keeps the base's other parameters (as --partition does); another replaces them
    assert first["partition"] == {"name": "dirichlet", "beta": 0.1, "min_size": 3}
    assert entries[4].config["partition"] == {"name": "iid"}
    assert entries[2].config["algorithm"] == "fedavg" and entries[2].config["algorithm_params"] == {"loss": "fedrs"}
    assert first["optimiser"]["lr"] == 0.05 and first["optimiser"]["momentum"] == 0.9
    assert entries[1].config["seeds"] == {"data": 2, "model": 2, "sampling": 2}
    assert len({e.id for e in entries}) == len(entries)
    assert all(Path(e.config["out"]).parent == tmp_path / "s" / "runs" for e in entries)


def test_cli_grid_values_split_outside_brackets_and_a_bad_value_names_its_run(tmp_path):
    assert split_top("dirichlet(beta=0.1, min_size=5),iid, 'a,b'", ",") == ["dirichlet(beta=0.1, min_size=5)", "iid",
                                                                            "'a,b'"]
    assert parse_grid(["optimiser.lr=0.1,1e-2", "partition=iid,dirichlet(beta=0.5)"]) == {
        "optimiser.lr": [0.1, 0.01], "partition": ["iid", "dirichlet(beta=0.5)"]}
    with pytest.raises(FedltError, match=r"run fedavg__-1__seed0: partition.*beta"):
        expand(Study(dict(TINY, partition={"name": "dirichlet"}), {"algorithm": ["fedavg"], "partition.beta": [-1]}),
               tmp_path)


def test_a_changed_grid_is_refused_unless_extend_adds_cells(tmp_path, capsys):
    out = tmp_path / "s"
    study = Study(dict(TINY), {"algorithm": ["fedavg", "fedlc"]}, seeds=[0, 1])
    write_manifest(out, plan(study, out))
    with pytest.raises(FedltError, match="another grid.*--extend"):
        plan(Study(dict(TINY), {"algorithm": ["fedavg", "fedlc", "fedprox"]}, seeds=[0, 1]), out)
    extended = plan(Study(dict(TINY), {"algorithm": ["fedavg", "fedlc", "fedprox"]}, seeds=[0, 1]), out, extend=True)
    assert [r["id"] for r in extended["runs"]][-2:] == ["fedprox__seed0", "fedprox__seed1"]
    with pytest.raises(FedltError, match="other settings"):
        plan(Study(dict(TINY, rounds=3), {"algorithm": ["fedavg", "fedlc"]}, seeds=[0, 1]), out, extend=True)
    with pytest.raises(FedltError, match="drops"):
        plan(Study(dict(TINY), {"algorithm": ["fedavg"]}, seeds=[0, 1]), out, extend=True)
    # the CLI: --dry-run lists what would happen, a bad flag is one line and exit 2
    assert cli("sweep", str(out), "--dry-run") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("run ") and "fedavg__seed0" in lines[0] and lines[-1] == f"4 runs in {out}"
    for argv, message in ((["--grid", "algorithm"], "expected SETTING=VALUE"), (["--seeds", "0,x"], "--seeds"),
                          (["--executor", "nope"], "unknown executor 'nope'"), (["--jobs", "0"], "--jobs")):
        assert cli("sweep", "--out", str(tmp_path / "x"), "--grid", "algorithm=fedavg", *argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# -- the aggregation, as mathematics --------------------------------------------------------------
accuracies = st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(accuracies, min_size=1, max_size=4), min_size=1, max_size=3))
def test_aggregate_is_the_float64_mean_and_sample_std_over_seeds(curves_per_cell):
    cells = []
    for i, curves in enumerate(curves_per_cell):
        runs = [Run(Path("x"), f"r{i}{s}", {}, [{"round": r + 1, "accuracy": a} for r, a in enumerate(curve)],
                    {"rounds": len(curve)}, None, None) for s, curve in enumerate(curves)]
        cells.append(Cell({"algorithm": f"a{i}"}, runs, list(range(len(curves))), {}, []))
    out = aggregate(cells, ["final_accuracy", "best_accuracy"])
    for entry, curves in zip(out, curves_per_cell):
        for metric, pick in (("final_accuracy", lambda c: c[-1]), ("best_accuracy", max)):
            values = [pick(c) for c in curves]
            stat = entry["metrics"][metric]
            assert stat["n"] == len(values)
            assert stat["mean"] == pytest.approx(statistics.fmean(values), abs=1e-12)
            if len(values) > 1:
                assert stat["std"] == pytest.approx(statistics.stdev(values), abs=1e-12)
            else:
                assert stat["std"] is None


# -- one study: identical results, a failure, the report --------------------------------------------
@pytest.mark.usefixtures("one_thread")
def test_a_sweep_run_equals_the_same_run_alone_and_a_failure_is_recorded(tmp_path, capsys):
    # quantity(alpha=2) over 4 clients fails at partition time: one run of the grid fails
    path = study_file(tmp_path, 'algorithm = ["fedavg", "fedlc"]\npartition = ["iid", "dirichlet(beta=0.5)"]',
                      seeds="[0, 1]", extra='include = [{algorithm = "fedavg", partition = "quantity(alpha=2)"}]')
    out = tmp_path / "study"
    # a failed run: the others went on, and the exit status says so
    assert cli("sweep", str(path), "--out", str(out), "--jobs", "2", "--threads", "1") == 1
    captured = capsys.readouterr()
    assert "10 runs: 8 done, 2 failed" in captured.out
    manifest = read_manifest(out)
    failed = [r for r in manifest["runs"] if r["status"] == "failed"]
    assert [r["id"] for r in failed] == ["fedavg__quantity_alpha=2__seed0", "fedavg__quantity_alpha=2__seed1"]
    assert all("K·alpha = 8 is not a multiple" in r["error"] and "\n" not in r["error"] for r in failed)

    alone = tmp_path / "alone"
    run(RunConfig(**(TINY | dict(algorithm="fedlc", partition={"name": "dirichlet", "beta": 0.5},
                                 seeds={"data": 1, "model": 1, "sampling": 1}, out=alone))))
    in_sweep = out / "runs" / "fedlc__dirichlet_beta=0.5__seed1"
    assert without_timings(in_sweep) == without_timings(alone)
    saved = json.loads((in_sweep / "config.json").read_text())
    assert saved | {"out": None} == json.loads((alone / "config.json").read_text()) | {"out": None}

    # the report: each cell's mean ± std against an independent reading of the run directories
    manifest, cells, problems = load_study(out)
    assert not problems
    table = json.loads(render_study(manifest, cells, "json", metrics=["final_accuracy", "best_balanced_accuracy"]))
    for entry in table["cells"]:
        label = entry["cell"]
        if label["partition"] == "quantity(alpha=2)":
            assert entry["n"] == 0 and len(entry["failed"]) == 2
            continue
        dirs = [out / r["dir"] for r in manifest["runs"] if r["label"] == label]
        evaluated = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in dirs]
        finals = [rows[-1]["accuracy"] for rows in evaluated]
        best_balanced = [max(r["balanced_accuracy"] for r in rows if "balanced_accuracy" in r) for rows in evaluated]
        for metric, values in (("final_accuracy", finals), ("best_balanced_accuracy", best_balanced)):
            assert entry["metrics"][metric]["mean"] == pytest.approx(statistics.fmean(values), abs=1e-12)
            assert entry["metrics"][metric]["std"] == pytest.approx(statistics.stdev(values), abs=1e-12)
    assert cli("report", str(out), "--rows", "algorithm", "--cols", "partition", "--metric", "final_accuracy") == 0
    text = capsys.readouterr().out
    fedlc_iid = next(e for e in table["cells"] if e["cell"] == {"algorithm": "fedlc", "partition": "iid"})
    mean, std = (100 * fedlc_iid["metrics"]["final_accuracy"][k] for k in ("mean", "std"))
    assert "| algorithm | iid | dirichlet(beta=0.5) | quantity(alpha=2) |" in text
    fedavg_row = next(line for line in text.splitlines() if line.startswith("| fedavg |"))
    assert fedavg_row.endswith("| failed |") and f"| fedlc | {mean:.2f} ± {std:.2f} |" in text
    assert "K·alpha = 8" in text  # the failures are listed under the table


# -- kill and resume -------------------------------------------------------------------------------
def _sweep(path: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedlt.cli", "sweep", str(path), "--out", str(out), "--jobs", "2",
                             "--threads", "1"], env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _done(out: Path) -> int:
    return len(list(out.glob("runs/*/summary.json")))


def _wait_until(proc: subprocess.Popen, out: Path, done: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while _done(out) < done and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the sweep ended before {done} runs were done: {proc.communicate()}"


def _sweep_stopped_by_sigterm(path: Path, out: Path, capsys, done: int) -> int:
    """``fedlt sweep PATH --out OUT --jobs 2`` in this process, sent SIGTERM once ``done`` runs
    are done: its exit code. A SIGTERM that came after the sweep (its handler put back) would land
    in a recording handler here, never in pytest's default one (it would kill the test process)."""
    late: list[int] = []
    finished = threading.Event()

    def stop_when_done() -> None:
        while not finished.is_set():
            if _done(out) >= done:
                os.kill(os.getpid(), signal.SIGTERM)  # handled in the main thread, by the sweep's handler
                return
            time.sleep(0.05)

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
    watcher = threading.Thread(target=stop_when_done, daemon=True)
    capsys.readouterr()
    try:
        watcher.start()
        code = cli("sweep", str(path), "--out", str(out), "--jobs", "2", "--threads", "1")
    finally:
        finished.set()
        watcher.join()
        signal.signal(signal.SIGTERM, previous)
    assert not late, "SIGTERM came after the sweep had ended"
    return code


def _report(out: Path) -> dict:
    manifest, cells, problems = load_study(out)
    assert not problems
    return json.loads(render_study(manifest, cells, "json"))


def test_a_study_stopped_by_sigterm_then_sigkilled_finishes_on_rerun_with_the_uninterrupted_table(tmp_path, capsys):
    """2 algorithms × 2 partitions × 3 seeds with --jobs 2: SIGTERM stops every worker after its
    round (exit 130, checkpoints kept), SIGKILL of the whole process group half-way leaves what it
    leaves; the rerun skips finished runs, resumes the others and gives the same table (and the
    same metrics, timing aside) as a study never interrupted. The study SIGKILLed runs as a
    ``fedlt sweep`` process group; the others run the same command in this process (no
    interpreter and fedlt import to start for them), SIGTERM sent to this process."""
    path = study_file(tmp_path, 'algorithm = ["fedavg", "fedlc"]\npartition = ["iid", "dirichlet(beta=0.5)"]',
                      seeds="[0, 1, 2]")
    killed, clean = tmp_path / "killed", tmp_path / "clean"

    assert _sweep_stopped_by_sigterm(path, killed, capsys, done=2) == 130
    assert "continue with: fedlt sweep" in capsys.readouterr().err
    statuses = {r["status"] for r in read_manifest(killed)["runs"]}
    assert "running" not in statuses and statuses <= {"done", "stopped", "pending"}
    stopped_at = _done(killed)
    assert 2 <= stopped_at < 12

    proc = _sweep(path, killed)
    _wait_until(proc, killed, stopped_at + 3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    time.sleep(0.5)  # the workers die with the coordinator (PR_SET_PDEATHSIG)
    assert _done(killed) < 12

    capsys.readouterr()
    assert cli("sweep", str(path), "--out", str(killed), "--jobs", "2", "--threads", "1") == 0
    assert "12 runs: 12 done" in capsys.readouterr().out
    assert cli("sweep", str(path), "--out", str(clean), "--jobs", "2", "--threads", "1") == 0

    assert _report(killed) == _report(clean)
    for run_dir in sorted((clean / "runs").iterdir()):
        assert without_timings(killed / "runs" / run_dir.name) == without_timings(run_dir), run_dir.name


def test_bad_study_files_and_report_options_are_one_line_each(tmp_path, capsys):
    out = tmp_path / "s"
    write_manifest(out, plan(Study(dict(TINY), {"algorithm": ["fedavg", "fedlc"]}), out))
    bad = tmp_path / "bad.toml"
    cases = [
        ("seeds = [0]\nrounds = 3\n", ["sweep", str(bad), "--dry-run"], "unknown key(s) rounds"),
        ("[axes]\nalgorithm = 'fedavg'\n", ["sweep", str(bad), "--dry-run"], "non-empty list of values"),
        ("seeds = [1, 1]\n", ["sweep", str(bad), "--dry-run"], "lists a seed twice"),
        ("", ["report", str(out), "--rows", "nope"], "'nope' is not an axis of the study"),
        ("", ["report", str(out), "--format", "html"], "choose one of markdown, csv, latex, json"),
        ("", ["report", str(out), "--metric", "final_accuracy", "--cols", "algorithm", "--rows", "algorithm"],
         "in both --rows and --cols"),
        ("", ["sweep", str(tmp_path)], "without a study.json"),
    ]
    for text, argv, message in cases:
        bad.write_text(text)
        assert cli(*argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
    # nothing has run yet: every cell reads '–' (n = 0), none is 'failed'
    assert cli("report", str(out)) == 0
    assert "| fedavg | 0 | – |" in capsys.readouterr().out


@pytest.mark.usefixtures("one_thread")
def test_a_failing_tracker_is_dropped_with_a_warning_and_the_run_goes_on(tmp_path):
    from fedlt.sweep import Job, run_job
    from fedlt.sweep.track import TRACKERS

    seen = []

    class Flaky:
        def __init__(self, **params):
            pass

        def start(self, run_id, config, done):
            seen.append(("start", run_id, done))

        def log_round(self, done, row):
            seen.append(("round", done))
            raise ConnectionError("store unreachable\nsecond line")

        def finish(self, status, run_dir):
            seen.append(("finish", status))

    config = RunConfig(**(TINY | dict(algorithm="fedavg", partition={"name": "iid"}, out=tmp_path / "r")))
    with TRACKERS.temporary("flaky", Flaky):
        outcome = run_job(Job("r", config.model_dump(mode="json"), resume=False, threads=1,
                              tracking=({"name": "flaky"},)))
    assert outcome.status == "done" and outcome.error is None and outcome.rounds == 2
    assert outcome.warnings == ["tracking with flaky stopped: ConnectionError: store unreachable"]
    assert seen == [("start", "r", 0), ("round", 1)]  # dropped after its failure: no round 2, no finish
    assert (tmp_path / "r" / "summary.json").is_file()


# -- the report's run-level metrics, published values and order (docs/sweeps.md) -------------------
def _fake_study(tmp_path: Path, runs: dict[tuple[str, str, int], tuple[list[float], float]]) -> Path:
    """A study directory of 2 algorithms × 2 partitions × 2 seeds whose finished runs are written
    by hand: (algorithm, partition, seed) -> (accuracy per evaluated round, wall time); every
    other run is unfinished."""
    out = tmp_path / "s"
    manifest = plan(Study(dict(TINY), {"algorithm": ["fedavg", "fedlc"], "partition": ["iid", "dirichlet(beta=0.5)"]},
                          seeds=[0, 1]), out)
    write_manifest(out, manifest)
    for entry in manifest["runs"]:
        key = (entry["label"]["algorithm"], entry["label"]["partition"], entry["seed"])
        if key not in runs:
            continue
        curve, wall = runs[key]
        run_dir = out / entry["dir"]
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps({"algorithm": key[0], "rounds": 2 * len(curve)}))
        # evaluated every other round: a round number is not a row index
        (run_dir / "metrics.jsonl").write_text("".join(
            json.dumps({"round": 2 * (i + 1), "accuracy": a, "balanced_accuracy": a / 2}) + "\n"
            for i, a in enumerate(curve)))
        (run_dir / "summary.json").write_text(json.dumps({"rounds": 2 * len(curve), "wall_time_s": wall}))
    return out


curve = st.lists(st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9]), min_size=1, max_size=6)  # few values: ties


@settings(max_examples=40, deadline=None)
@given(curve, curve, st.floats(0, 1e4), st.floats(0, 1e4))
def test_best_round_is_the_earliest_round_of_the_best_accuracy_and_wall_time_comes_from_the_summary(
        tmp_path_factory, first, second, wall0, wall1):
    out = _fake_study(tmp_path_factory.mktemp("s"), {("fedavg", "iid", 0): (first, wall0),
                                                     ("fedavg", "iid", 1): (second, wall1)})
    manifest, cells, problems = load_study(out)
    assert not problems
    table = json.loads(render_study(manifest, cells, "json", metrics=["best_round", "wall_time_s", "best_accuracy"]))
    entry = next(e for e in table["cells"] if e["cell"] == {"algorithm": "fedavg", "partition": "iid"})
    best_rounds = [2 * (c.index(max(c)) + 1) for c in (first, second)]  # list.index: the first maximum
    for metric, values in (("best_round", best_rounds), ("wall_time_s", [wall0, wall1])):
        stat = entry["metrics"][metric]
        assert stat["values"] == {"0": values[0], "1": values[1]}
        assert stat["mean"] == pytest.approx(statistics.fmean(values), abs=1e-9)
        assert stat["std"] == pytest.approx(statistics.stdev(values), abs=1e-9)
    assert table["study"]["seeds"] == [0, 1] and table["study"]["axes"]["algorithm"] == ["fedavg", "fedlc"]
    # neither is scaled as an accuracy: rounds and seconds with one decimal
    text = render_study(manifest, cells, metrics=["best_round", "wall_time_s"], rows=["algorithm", "partition"])
    mean, std = statistics.fmean(best_rounds), statistics.stdev(best_rounds)
    assert f"| fedavg | iid | 2 | {mean:.1f} ± {std:.1f} |" in text


REFERENCE = """# a paper's Table 2 (best of 50 rounds)
algorithm, paper %,note
fedavg,94.77,
fedlc,85.56,"tau 0.1, not 0.5"
"""


def test_reference_values_join_their_rows_in_every_format_and_sort_orders_by_a_mean(tmp_path, capsys):
    out = _fake_study(tmp_path, {("fedavg", "iid", 0): ([0.5, 0.8], 10.0), ("fedavg", "iid", 1): ([0.6, 0.7], 12.0),
                                 ("fedlc", "iid", 0): ([0.9, 0.95], 11.0),
                                 ("fedavg", "dirichlet(beta=0.5)", 0): ([0.2], 9.0)})
    reference = tmp_path / "paper.csv"
    reference.write_text(REFERENCE)
    args = ["report", str(out), "--rows", "algorithm", "--rows", "partition", "--metric", "final_accuracy",
            "--reference", str(reference)]
    assert cli(*args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "| algorithm | partition | n | final_accuracy | paper % | note |"
    assert "| fedavg | iid | 2 | 75.00 ± 7.07 | 94.77 | – |" in lines  # an empty reference value reads '–'
    assert "| fedlc | iid | 1 | 95.00 (n=1, 1 unfinished) | 85.56 | tau 0.1, not 0.5 |" in lines
    assert "| fedlc | dirichlet(beta=0.5) | 0 | – | 85.56 | tau 0.1, not 0.5 |" in lines  # keyed by algorithm only
    # --sort: highest mean first, a cell with no finished run last
    assert cli(*args, "--sort", "final_accuracy") == 0
    order = [line.split(" | ")[:2] for line in capsys.readouterr().out.splitlines()[3:]]
    assert order == [["| fedlc", "iid"], ["| fedavg", "iid"], ["| fedavg", "dirichlet(beta=0.5)"],
                     ["| fedlc", "dirichlet(beta=0.5)"]]
    # --seeds 0: seed 1's runs leave the table (a cell with only an unfinished seed 1 is no longer marked)
    assert cli(*args, "--seeds", "0") == 0
    lines = capsys.readouterr().out.splitlines()
    assert "| fedavg | iid | 1 | 80.00 | 94.77 | – |" in lines
    assert "| fedlc | iid | 1 | 95.00 | 85.56 | tau 0.1, not 0.5 |" in lines
    assert "| fedlc | dirichlet(beta=0.5) | 0 | – | 85.56 | tau 0.1, not 0.5 |" in lines
    # with --cols the reference still goes by row
    assert cli("report", str(out), "--rows", "algorithm", "--cols", "partition", "--metric", "final_accuracy",
               "--reference", str(reference)) == 0
    text = capsys.readouterr().out
    assert "| algorithm | iid | dirichlet(beta=0.5) | paper % | note |" in text
    assert "| fedavg | 75.00 ± 7.07 | 20.00 (n=1, 1 unfinished) | 94.77 | – |" in text
    # CSV and LaTeX carry the same values; JSON names them per cell
    manifest, cells, _ = load_study(out)
    csv_text = render_study(manifest, cells, "csv", metrics=["final_accuracy"], rows=["algorithm", "partition"],
                            reference=reference)
    assert csv_text.splitlines()[0].endswith("final_accuracy_mean,final_accuracy_std,paper %,note")
    assert csv_text.splitlines()[3] == 'fedlc,iid,1,0,1,0.95,,85.56,"tau 0.1, not 0.5"'
    latex = render_study(manifest, cells, "latex", metrics=["final_accuracy"], rows=["algorithm", "partition"],
                         reference=reference)
    assert r"algorithm & partition & n & final\_accuracy & paper \% & note \\" in latex
    table = json.loads(render_study(manifest, cells, "json", metrics=["final_accuracy"],
                                    rows=["algorithm", "partition"], reference=reference))
    by_cell = {(e["cell"]["algorithm"], e["cell"]["partition"]): e["reference"] for e in table["cells"]}
    assert by_cell[("fedavg", "iid")] == {"paper %": "94.77", "note": ""}
    assert by_cell[("fedlc", "dirichlet(beta=0.5)")] == {"paper %": "85.56", "note": "tau 0.1, not 0.5"}


def test_bad_references_and_sorts_are_one_line_naming_the_file_and_what_is_allowed(tmp_path, capsys):
    out = _fake_study(tmp_path, {("fedavg", "iid", 0): ([0.5], 1.0)})
    bad = tmp_path / "ref.csv"
    study_args = ["report", str(out), "--rows", "algorithm", "--rows", "partition", "--reference", str(bad)]
    cases = [
        ("algorithm,paper\nfedprox,90\n", study_args, "algorithm=fedprox matches no row of the table (values: "
                                                      "algorithm: fedavg, fedlc)"),
        ("algorithm,paper\nfedavg,90\nfedavg,91\n", study_args, "line 3: algorithm=fedavg is given twice"),
        ("algorithm,paper\nfedavg,90,1\n", study_args, "line 2: 3 fields, the header has 2"),
        ("paper,source\n90,x\n", study_args, "one column named after an axis of the study (algorithm, partition)"),
        ("algorithm,partition\nfedavg,iid\n", study_args, "and one value column"),
        ("algorithm,paper,paper\n", study_args, "an empty or repeated column name"),
        ("# only a comment\n", study_args, "is empty"),
        ('algorithm,paper\n"fedavg,90\n', study_args, "line 2: not CSV"),
        ("partition,paper\niid,90\n", ["report", str(out), "--rows", "algorithm", "--cols", "partition",
                                       "--reference", str(bad)], "column 'partition' is a --cols axis"),
        ("", ["report", str(out), "--sort", "loss"], "--sort loss: not one of the table's metrics"),
        ("", ["report", str(out), "--rows", "algorithm", "--cols", "partition", "--sort", "final_accuracy"],
         "--sort orders the rows of a table without --cols"),
        ("", ["report", str(out / "runs" / "fedavg__iid__seed0"), "--reference", str(bad)],
         "--reference, --seeds and --sort apply to a study directory"),
        ("", ["report", str(out), "--seeds", "0,5"], "--seeds 5: the study"),
        ("", ["report", str(out), "--seeds", "0,x"], "--seeds '0,x': expected integers"),
        ("", ["report", str(out), "--metric", "worst_round"], "prefix best_ or final_; or best_round, wall_time_s"),
    ]
    for text, argv, message in cases:
        bad.write_text(text)
        assert cli(*argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
    bad.write_bytes(b"algorithm,paper\nfedavg,\xff\n")
    assert cli(*study_args) == 2
    assert "not UTF-8 text (byte 23)" in capsys.readouterr().err
    bad.unlink()
    assert cli(*study_args) == 2
    assert f"--reference {bad} cannot be read" in capsys.readouterr().err


def test_the_benchmark_studies_expand_and_their_reference_values_land_on_their_rows(tmp_path):
    """benchmarks/studies/*.yaml resolve to valid runs (nothing trains), and each study's
    <name>_reference.csv names only cells of its grid, its values on the right rows."""
    from fedlt.sweep.study import load_study as load_study_file

    published = {}
    for path in sorted((ROOT / "benchmarks" / "studies").glob("*.yaml")):
        study, _ = load_study_file(path)
        out = tmp_path / path.stem
        write_manifest(out, plan(study, out))  # every run's RunConfig validated
        reference = path.with_name(f"{path.stem}_reference.csv")
        if not reference.exists():
            continue
        manifest, cells, _ = load_study(out)
        table = json.loads(render_study(manifest, cells, "json", metrics=["final_accuracy"], reference=reference))
        published |= {(path.stem, e["cell"]["algorithm"], e["cell"]["partition"]): (e["reference"] or {}).get(
            "paper (best of 50)") for e in table["cells"]}
    # the FedVLS paper's Table 1 (MNIST), as docs/benchmarks.md quotes it
    assert published == {
        ("paper_mnist", "fedavg", "dirichlet(beta=0.05)"): "94.77 ± 0.44",
        ("paper_mnist", "fedlc", "dirichlet(beta=0.05)"): "85.56 ± 0.18",
        ("paper_mnist", "fedvls", "dirichlet(beta=0.05)"): "95.56 ± 0.12",
        ("paper_mnist", "fedgrab", "dirichlet(beta=0.05)"): None,
        ("fedvls_beta", "fedavg", "dirichlet(beta=0.1)"): "96.69 ± 0.00",
        ("fedvls_beta", "fedavg", "dirichlet(beta=0.5)"): "98.96 ± 0.00",
        ("fedvls_beta", "fedvls", "dirichlet(beta=0.1)"): "97.24 ± 0.00",
        ("fedvls_beta", "fedvls", "dirichlet(beta=0.5)"): "99.23 ± 0.00",
    }

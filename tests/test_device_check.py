"""benchmarks/device_check.py --dry-run: the script a lent GPU runs, run here on the CPU at tiny
sizes (same code), so it cannot rot between GPU sessions."""

import importlib.util
import json
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_runs_every_section_on_the_cpu(tmp_path):
    cpu = time.process_time()
    result = _script().main(["--dry-run", "--out", str(tmp_path / "check.json")])
    # CPU time, not wall time: the shared test machine's load must not fail it (idle: ~15 s wall)
    assert time.process_time() - cpu < 40  # + the profile and ResNet-18 sections: ~8 s
    assert json.loads((tmp_path / "check.json").read_text())["sections"].keys() == result["sections"].keys()
    sections = result["sections"]
    assert set(sections) == {"doctor", "overheads", "kernels", "fused_vs_eager", "algorithms", "pfllib_mnist",
                             "graphs", "scala_s2", "bf16", "profile", "graphs_profile", "resnet18_cifar"}
    assert not [name for name, s in sections.items() if "error" in s]
    assert result["device"] == "cpu" and result["dry_run"]
    assert sections["kernels"]["all_passed"]  # the Triton kernels under the interpreter
    assert {r["dtype"] for r in sections["kernels"]["rows"]} == {"float32", "bfloat16"}
    assert sections["algorithms"]["largest_loss_gap"] == 0  # "device" is the CPU here: the same numbers
    timings = sections["pfllib_mnist"]
    assert all(timings[k]["seconds_per_round"] > 0 for k in ("device sequential", "device --cohort 10", "cpu sequential"))
    assert timings["cohort_fallback"] is None  # FedAvgCNN has no BatchNorm or dropout: the cohort runs
    assert "skipped" in timings["device --cohort 10 --compile"]  # inductor's compile: not in the suite's time
    graphs = sections["graphs"]  # the CPU stand-in's graphs: the same numbers as eager, steps replayed
    for fast in ("device sequential --graphs", "device --cohort 10 --graphs"):  # one client at a time, a cohort
        assert graphs["pfllib_mnist"][fast]["loss_gap"] == 0 and graphs["pfllib_mnist"][fast]["captured"]
    assert graphs["algorithms"]["largest_loss_gap"] == 0
    assert graphs["algorithms"]["replayed"] == ["fedavg", "fedavg (cohort 3)"]
    assert 0 <= sections["bf16"]["bf16"]["accuracy"] <= 1 and sections["scala_s2"]["seconds_per_round"] > 0
    assert {r["probe"] for r in sections["fused_vs_eager"]["per_probe"]} >= {"logit_adjust", "fedvls", "offset_ce_pair"}
    assert all(r["fused_ms"] > 0 for r in sections["overheads"]["per_call"].values() if "fused_ms" in r)
    assert sections["overheads"]["per_call"]["logit_adjust fwd+bwd 10x10 eager"]["wall_us"] > 0
    profiled = [("profile", t) for t in ("pfllib", "pfllib_cohort", "scala")] + \
        [("graphs_profile", t) for t in ("pfllib_graphs", "pfllib_cohort_graphs")]
    for section, task in profiled:  # the phases add up to the round (the rest is "other Python")
        found = sections[section]["tasks"][task]
        assert sum(p["cpu_s"] for p in found["phases"]) == pytest.approx(found["round_cpu_s"])
        assert found["operators"]["python_ops"] > 0
    assert sections["resnet18_cifar"]["seconds_per_round"] > 0
    written = {p.name for p in tmp_path.iterdir()}  # everything under --out's directory, nothing elsewhere
    assert {"check.json", "device_check_profile.json", "device_check_profile_pfllib.json"} <= written


def test_the_profile_times_the_cohorts_batched_loss_as_forward_and_loss(monkeypatch):
    """A cohort whose clients' losses are offset cross-entropies computes them in
    ``Cohort._offset_ce``, outside ``_forward`` and ``terms``: untimed, its time went to "other Python"."""
    from fedlt.algorithms import cohort
    from fedlt.run import loop

    spec = importlib.util.spec_from_file_location("profile_round", ROOT / "benchmarks" / "profile_round.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    phases = {}
    monkeypatch.setattr(module.PhaseTimer, "wrap",  # record what would be timed; wrap nothing
                        lambda self, owner, attr, phase, generator=False: phases.__setitem__((owner, attr), phase))
    monkeypatch.setattr(loop, "io", loop.io)  # instrument replaces it: restored after the test
    module.instrument(module.PhaseTimer())
    assert phases[(cohort.Cohort, "_forward")] == phases[(cohort.Cohort, "_offset_ce")] == "forward + loss"

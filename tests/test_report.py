"""What a run records (SPEC §5 metrics in metrics.jsonl and summary.json) and ``fedlt report``:
the comparison table and the PNG figures."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.metrics import class_groups, client_metrics
from fedlt.report import load_runs, rows


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


EVERY_ROUND = {"round", "train_loss", "participants", "sampled", "returned", "dropped", "train_s", "eval_s", "round_s",
               "bytes_up", "bytes_down"}  # the traffic of the round (issue 42, docs/transforms.md)
ROUND_KEYS = EVERY_ROUND | {"accuracy", "balanced_accuracy", "loss", "per_class_accuracy", "many_accuracy",
                            "medium_accuracy", "few_accuracy"}


def tiny(out: Path, **overrides) -> RunConfig:
    settings = dict(algorithm="fedavg", model="mlp", train_limit=800, test_limit=200, clients=5, participation=0.6,
                    rounds=3, local_iters=2, server_batch=40, eval_every=1,
                    partition={"name": "longtail", "imbalance_factor": 20, "then": {"name": "iid"}}, out=out)
    return RunConfig(**(settings | overrides))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("report")
    run(tiny(root / "fedavg-count"))
    run(tiny(root / "fedlc-share", algorithm="fedlc", groups={"rule": "share"}, client_eval=True, eval_every=2))
    return root / "fedavg-count", root / "fedlc-share"


def read_rows(out: Path) -> list[dict]:
    """The evaluated rounds' rows (every round has a row; those between evaluations hold only the
    round's training record)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(EVERY_ROUND <= set(r) for r in rows)
    return [r for r in rows if "accuracy" in r]


def test_each_evaluated_round_records_the_spec_metrics(two_runs):
    count_run, share_run = two_runs
    count_rows = read_rows(count_run)
    assert [r["round"] for r in count_rows] == [1, 2, 3]
    assert all(set(r) == ROUND_KEYS for r in count_rows)
    # eval_every=2 evaluates round 2 and the last round
    share_rows = read_rows(share_run)
    assert [r["round"] for r in share_rows] == [2, 3]
    assert all(set(r) == ROUND_KEYS | {"client_mean_accuracy", "client_min_accuracy", "client_std_accuracy"}
               for r in share_rows)
    for r in count_rows + share_rows:
        per_class = [a for a in r["per_class_accuracy"] if a is not None]
        assert abs(r["balanced_accuracy"] - np.mean(per_class)) < 1e-5
        assert 0 <= r["accuracy"] <= 1 and r["loss"] > 0


def test_summary_holds_final_best_and_the_class_groups_of_the_chosen_rule(two_runs):
    for out, rule in zip(two_runs, ("count", "share")):
        summary = json.loads((out / "summary.json").read_text())
        metrics = read_rows(out)
        final = metrics[-1]
        assert summary["rounds"] == 3 and summary["final"]["round"] == 3
        for key in ("accuracy", "balanced_accuracy", "loss", "many_accuracy", "medium_accuracy", "few_accuracy",
                    "per_class_accuracy"):
            assert summary["final"][key] == final[key]
        best = max(metrics, key=lambda r: r["accuracy"])
        assert summary["best"] == {"round": best["round"], "accuracy": best["accuracy"],
                                   "balanced_accuracy": best["balanced_accuracy"]}
        train_counts = np.asarray(json.loads((out / "partition.json").read_text())["class_counts"]).sum(0)
        expected = class_groups(train_counts, rule=rule)
        assert summary["groups"]["rule"] == rule
        assert {g: summary["groups"][g] for g in ("many", "medium", "few")} == {g: v.tolist() for g, v in expected.items()}
        per_class = np.array([np.nan if a is None else a for a in final["per_class_accuracy"]])
        for group, classes in expected.items():
            values = per_class[classes]
            values = values[~np.isnan(values)]
            want = float(values.mean()) if values.size else None
            assert (final[f"{group}_accuracy"] is None) if want is None else abs(final[f"{group}_accuracy"] - want) < 1e-5
    # a long tail with IF=20 over 800 samples has classes in more than one count group
    summary = json.loads((two_runs[0] / "summary.json").read_text())
    assert sum(bool(summary["groups"][g]) for g in ("many", "medium", "few")) >= 2


def test_client_accuracy_is_the_per_class_accuracy_under_each_clients_label_distribution():
    per_class = [1.0, 0.5, None, 0.0]  # class 2 is absent from the test set
    counts = np.array([[10, 0, 0, 0],      # only class 0: 1.0
                       [1, 1, 0, 2],       # (1·1 + 1·0.5 + 2·0) / 4 = 0.375
                       [0, 0, 5, 0],       # only the absent class: left out
                       [0, 3, 7, 1]])      # class 2 dropped: (3·0.5 + 1·0) / 4 = 0.375
    m = client_metrics(per_class, counts)
    scores = np.array([1.0, 0.375, 0.375])
    assert m["client_mean_accuracy"] == pytest.approx(scores.mean())
    assert m["client_min_accuracy"] == pytest.approx(0.375)
    assert m["client_std_accuracy"] == pytest.approx(scores.std())
    assert client_metrics([None, None], np.array([[1, 1]]))["client_mean_accuracy"] is None


def png_chunks(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    chunks, pos = [], 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]
        chunks.append(kind)
        pos += 12 + length
    return chunks


def test_report_lists_both_runs_and_writes_valid_pngs(two_runs, tmp_path, capsys):
    plots = tmp_path / "plots"
    main(["report", *map(str, two_runs), "--plot", str(plots)])
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if "fedavg-count" in line or "fedlc-share" in line]
    assert any("fedavg-count" in line and "fedavg" in line and "3/3" in line for line in table)
    assert any("fedlc-share" in line and "fedlc" in line for line in table)
    final = json.loads((two_runs[0] / "summary.json").read_text())["final"]["accuracy"]
    assert f"{100 * final:.2f}" in out
    expected = {"accuracy.png", "per_class.png", "partition-fedavg-count.png", "partition-fedlc-share.png"}
    assert {p.name for p in plots.iterdir()} == expected | {".fedlt-outputs.json"}  # fedlt's own files there
    for name in expected:
        chunks = png_chunks(plots / name)
        assert chunks[0] == b"IHDR" and b"IDAT" in chunks and chunks[-1] == b"IEND"
        assert (plots / name).stat().st_size > 5000  # drawn, not an empty canvas


def test_report_shows_an_unfinished_run_from_its_metrics(two_runs, tmp_path):
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    for name in ("config.json", "partition.json"):
        (stopped / name).write_bytes((two_runs[0] / name).read_bytes())
    lines = (two_runs[0] / "metrics.jsonl").read_text().splitlines()
    (stopped / "metrics.jsonl").write_text("\n".join(lines[:2]) + '\n{"round": 3, "acc')  # torn by a kill
    (stopped / "checkpoint.json").write_text(json.dumps({"round": 2}))
    [row] = rows(load_runs([stopped]))
    assert not row["finished"] and row["rounds"] == 2 and row["target_rounds"] == 3
    assert row["final_accuracy"] == json.loads(lines[1])["accuracy"] and row["wall_time_s"] is None


@pytest.mark.parametrize("setup", ["missing", "not a run", "bad json"])
def test_report_on_something_that_is_not_a_run_is_one_line_and_exit_2(setup, tmp_path, capsys):
    target = tmp_path / "x"
    if setup != "missing":
        target.mkdir()
    if setup == "bad json":
        (target / "config.json").write_text("{nope")
    with pytest.raises(SystemExit) as info:
        main(["report", str(target)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(target) in err

"""CLI end to end: a short run writes a valid run directory; bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest

from fedlt.cli import main
from fedlt.config import RunConfig

SMALL = ["--train-limit", "3000", "--test-limit", "500", "--clients", "10", "--participation", "0.5", "--quiet"]


def test_two_round_scala_run_writes_a_valid_run_directory(tmp_path, capsys):
    """Also: off a terminal (stdout is captured here, not a tty) every evaluated round is one plain
    line. In this process: the CLI's own path (argument parsing, run, summary), without a Python
    start importing torch and fedlt again (the process boundary is tests/test_hostile_inputs.py's)."""
    out = tmp_path / "run"
    main(["run", "--algo", "scala", "--split", "s2", "--rounds", "3", "--eval-every", "2",
          "--local-iters", "1", "--server-batch", "80",  # SCALA's T = 5 of B = 320 cost 9 s a round on a CPU
          "--out", str(out), *[a for a in SMALL if a != "--quiet"]])
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    assert "final accuracy" in printed.out
    assert [line.split()[1] for line in printed.out.splitlines() if line.startswith("round ")] == ["2/3", "3/3"]
    config = RunConfig.model_validate(json.loads((out / "config.json").read_text()))
    assert config.algorithm == "scala" and config.split == "s2" and config.rounds == 3 and config.local_iters == 1
    manifest = json.loads((out / "partition.json").read_text())
    assert len(manifest["class_counts"]) == 10 and len(manifest["sha256"]) == 64
    # quantity skew alpha=2 (the default): at most 2 classes per client
    assert all(sum(1 for c in row if c > 0) <= 2 for row in manifest["class_counts"])
    every = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in every] == [1, 2, 3]  # a row every round: train loss, timings, participants
    assert all(r["participants"] == 5 and r["round_s"] >= r["train_s"] > 0 and r["train_loss"] > 0 for r in every)
    rows = [r for r in every if "accuracy" in r]
    assert [r["round"] for r in rows] == [2, 3]
    assert all(0.0 <= r["accuracy"] <= 1.0 and len(r["per_class_accuracy"]) == 10 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3 and summary["final"]["accuracy"] == rows[-1]["accuracy"]
    assert summary["best"]["accuracy"] == max(r["accuracy"] for r in rows)
    assert summary["wall_time_s"] > 0


@pytest.mark.parametrize("argv,field", [
    (["run", "--participation", "1.5"], "participation"),
    (["run", "--participation", "0"], "participation"),
    (["run", "--algo", "scalla"], "scala"),
    (["run", "--rounds", "many"], "rounds"),
    (["run", "--rounds", "0"], "rounds"),
    (["run", "--beta", "-1"], "beta"),
    (["run", "--dataset", "imagenet"], "dataset"),
    (["run", "--lr", "-0.1"], "lr"),
    (["run", "--no-such-flag"], "no-such-flag"),
    (["run", "--loss", "ce +* oops"], "loss"),
    # the algorithm's own field is named, and pydantic's 'Value error, ' noise is not shown
    (["run", "--algo", "scala", "--client-loss", "nope"], "algorithm_params: scala: client_loss: unknown loss 'nope'"),
    (["run", "--algo", "fedavg", "--loss", "ce +"], "algorithm_params: fedavg: loss: loss expression"),
    (["run", "--beta", "-2"], "partition: dirichlet: beta: Input should be greater than 0"),
    (["list", "widgets"], "widgets"),
    # issue 42: the upload chain, the DP mechanism, delta, and secure aggregation where it cannot work
    (["run", "--upload", "topk(fraction=2)"], "upload: topk: fraction: Input should be less than or equal to 1"),
    (["run", "--upload", "clip +"], "upload"),
    (["run", "--privacy", "client_level(clip=0)"], "privacy: client_level: clip: Input should be greater than 0"),
    (["run", "--privacy", "gaussian"], "privacy: unknown mechanism 'gaussian'"),
    (["run", "--delta", "1.5"], "delta"),
    (["run", "--secure-aggregation", "--engine", "flower"],  # SCALA: a message per iteration, not one masked upload
     "secure_aggregation: algorithm 'scala' trains in split-learning sessions"),
    (["run", "--algo", "fedic", "--secure-aggregation"], "secure_aggregation: the server then sees only the participants'"),
    # a split point alexnet does not have, though fedavg never splits
    (["run", "--algo", "fedavg", "--split", "s7"], "split: 's7' is not a split point of alexnet (valid: s1, s2, s3"),
])
def test_bad_input_exits_2_with_one_line(argv, field, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path / "x")] if argv[0] == "run" else argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert field in err and "Traceback" not in err


def test_list_shows_registered_components(capsys):
    main(["list", "algorithms"])
    out = capsys.readouterr().out
    for name in ("scala", "fedavg", "fedlc", "fedvls", "fedgrab", "fedprox", "fedlogit"):
        assert name in out


def test_list_shows_the_splitters_as_a_kind(capsys):
    main(["list"])
    out = capsys.readouterr().out
    assert "splitters" in out and "timm_vit" in out
    main(["list", "splitters"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("own", "timm_sequential", "fx")) and "algorithms" not in out


def test_progress_shows_the_last_evaluated_accuracy_with_its_round():
    from fedlt.cli.run_cmd import ProgressStatus

    status = ProgressStatus()
    assert status({"round": 1, "train_loss": 2.25}) == "loss 2.2500  acc –"
    assert status({"round": 5, "train_loss": 1.5, "accuracy": 0.6512}) == "loss 1.5000  acc 0.651 (r5)"
    # a round that is not evaluated keeps showing the last accuracy and where it came from
    assert status({"round": 6, "train_loss": 1.25}) == "loss 1.2500  acc 0.651 (r5)"
    assert status({"round": 10, "train_loss": 1.0, "accuracy": 0.7}) == "loss 1.0000  acc 0.700 (r10)"


def test_list_shows_types_readably_and_marks_what_fedlt_supplies(capsys):
    """An unannotated parameter shows its default's type (or ``any``), never inspect's ``_empty``;
    a parameter fedlt fills in itself (a loss's ``class_counts`` and round fields) is marked
    ``supplied`` in the default column, listed after the ones a user sets, never as ``required``."""
    import fedlt.losses

    class Plain(fedlt.losses.LossTerm):
        """A term whose parameters carry no annotations."""

        name = "plain_term"

        def __init__(self, class_counts, rounds, weight=0.5, table=None, mode="a"):
            pass

    with fedlt.losses.REGISTRY.temporary("plain_term", Plain):
        main(["list", "losses", "plain_term"])
    rows = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.split("│")[1:-1]] for line in capsys.readouterr().out.splitlines() if "│" in line)
        if cells[0]}
    assert list(rows) == ["weight", "table", "mode", "class_counts", "rounds"]  # the user's first
    assert rows["weight"][:2] == ["0.5", "float"] and rows["table"][:2] == ["None", "any"]
    assert rows["mode"][:2] == ["'a'", "str"]
    for name in ("class_counts", "rounds"):
        assert rows[name][0] == "supplied" and rows[name][1] == "any" and rows[name][2].startswith("set by fedlt")
    main(["list", "models", "mlp"])  # annotated and supplied: the dataset's shape
    out = capsys.readouterr().out
    assert "_empty" not in out and all(f"│ {k}" in out for k in ("in_chans", "num_classes", "image_size"))
    assert "required" not in out and out.count("supplied") == 3

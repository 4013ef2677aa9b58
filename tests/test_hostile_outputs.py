"""Every number a run or a report prints says what really happened (issue 46, part B): a run that
trained no round says so (summary, final line, exit status 3); a per-client mode that evaluated no
client says why once; data fedlt refuses is refused without numpy's warnings first; a dead loader
process is named as such; a diverging fine-tune is the evaluation's; ``fedlt report`` prints no
terminal control characters and refuses accuracies outside [0, 1]; a spec's hint lists the field's
own values; an unknown device index is refused; the device check's dry run leaves the source tree
alone."""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fedlt.datasets.imagefolder as imagefolder
import fedlt.losses
from fedlt.algorithms.base import NonFiniteLoss
from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.errors import FedltError
from fedlt.losses.base import LossTerm

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--algo", "fedavg", "--model", "mlp", "--train-limit", "100", "--test-limit", "100", "--clients", "2",
        "--partition", "iid", "--local-iters", "1", "--quiet"]


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_hostile_outputs_a_run_that_trained_no_round_says_so_and_exits_3(tmp_path, capsys):
    out = tmp_path / "none"
    code, stdout, err = cli(["run", *TINY, "--rounds", "2", "--availability", "bernoulli(p=1e-9)",
                             "--on-failure", "drop", "--out", str(out)], capsys)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rounds"], summary["rounds_trained"], summary["rounds_skipped"]) == (2, 0, 2)
    assert code == 3 and "rounds 2 (0 trained, 2 skipped)" in stdout, (code, stdout)
    assert err.count("no round trained") == 1 and "Traceback" not in err, err
    assert summary["warnings"] == [line.removeprefix("warning: ") for line in err.splitlines()]


def test_hostile_outputs_a_sweep_records_a_run_that_trained_nothing_and_goes_on(tmp_path):
    from fedlt.sweep.executors import Job, run_job

    config = RunConfig(algorithm="fedavg", model="mlp", train_limit=100, test_limit=100, clients=2, rounds=1,
                       partition={"name": "iid"}, local_iters=1, availability="bernoulli(p=1e-9)",
                       faults={"on_failure": "drop"}, out=tmp_path / "cell")
    outcome = run_job(Job("cell", config.model_dump(mode="json"), resume=False, threads=1))
    assert outcome.status == "done" and outcome.rounds == 1 and outcome.error is None
    assert [w[:17] for w in outcome.warnings] == ["no round trained:"]


def test_hostile_outputs_a_mode_that_evaluated_no_client_says_why_once(tmp_path, capsys):
    out = tmp_path / "empty"  # one training sample per client: a holdout leaves each an empty test set
    code, stdout, err = cli(["run", *TINY[:4], "--train-limit", "10", "--test-limit", "100", "--clients", "5",
                             "--partition", "iid", "--rounds", "1", "--client-test", "holdout",
                             "--client-eval", "global_local", "--out", str(out)], capsys)
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and (summary["rounds_trained"], summary["rounds_skipped"]) == (1, 0)
    assert summary["per_client"]["global_local"]["final"]["mean"] is None
    assert err.count("global_local: no client evaluated") == 1 and "test set is empty" in err, err
    assert summary["warnings"] == [err.strip().removeprefix("warning: ")]


def test_hostile_outputs_huge_arrays_are_one_line_without_numpy_warnings(tmp_path, capsys):
    x = np.random.default_rng(0).random((40, 8, 8)) * 1.7e308  # finite, but their sum is not
    y = np.arange(40) % 2
    np.savez(tmp_path / "huge.npz", x_train=x, y_train=y, x_test=x[:10], y_test=y[:10])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = cli(["run", "--algo", "fedavg", "--model", "mlp", "--dataset", "arrays", "--data-root",
                            str(tmp_path / "huge.npz"), "--clients", "2", "--partition", "iid", "--rounds", "1",
                            "--quiet", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "x_train's values are too large" in err, err
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not (tmp_path / "out").exists()


class _Worker:
    """A loader process that is gone (SIGKILL) but, in the race the issue saw, first still looks alive."""

    pid, exitcode = 4242, -9

    def __init__(self, seen_alive: int) -> None:
        self.seen_alive = seen_alive

    def is_alive(self) -> bool:
        self.seen_alive -= 1
        return self.seen_alive >= 0


class _CutLoader:
    def __init__(self, worker: _Worker) -> None:
        self._iterator = SimpleNamespace(_workers=[worker], _shutdown_workers=lambda: None)

    def __iter__(self):
        raise ConnectionResetError(104, "Connection reset by peer")


@pytest.mark.parametrize("seen_alive, words", [(3, "pid 4242, killed by SIGKILL"),
                                                (10**9, "its connection to this process was cut")])
def test_hostile_outputs_a_loader_process_whose_connection_is_reset_is_named_dead(seen_alive, words, monkeypatch):
    loader = _CutLoader(_Worker(seen_alive))
    monkeypatch.setattr(imagefolder.FileImages, "_lend", lambda self: (loader, imagefolder._Feed()))
    images = imagefolder.FileImages(files=None, index=np.arange(4), mean=(0.5,), std=(0.25,), item_shape=(1, 2, 2),
                                    workers=1)
    with pytest.raises(FedltError) as info:
        list(images.batches(torch.zeros(4, dtype=torch.long), [torch.arange(2)]))
    assert "--loader-workers process decoding the images died" in str(info.value) and words in str(info.value)
    assert "Connection reset" not in str(info.value)


class NanLoss(LossTerm):
    name = "nan_loss"

    def __call__(self, logits, targets, *, teacher_logits=None, params=None):
        return logits.sum() * float("nan")


def test_hostile_outputs_a_diverging_finetune_is_named_an_evaluation_with_its_round(tmp_path):
    with fedlt.losses.REGISTRY.temporary("nan_loss", NanLoss), pytest.raises(NonFiniteLoss) as info:
        run(RunConfig(algorithm="fedavg", model="mlp", train_limit=100, test_limit=100, clients=2,
                      partition={"name": "iid"}, rounds=1, local_iters=1, client_test={"name": "holdout"},
                      client_eval=["finetune(loss=nan_loss)"], out=tmp_path / "ft"))
    assert str(info.value).startswith("round 1's finetune evaluation"), info.value


def fake_run(folder: Path, row: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"algorithm": "fedavg", "dataset": "mnist", "rounds": 1}))
    (folder / "metrics.jsonl").write_text(json.dumps({"round": 1, "accuracy": 0.5, "balanced_accuracy": 0.5} | row)
                                          + "\n")
    return folder


def test_hostile_outputs_report_escapes_control_characters(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "x\x1b[2J\x1b[31mred", {"dropped": {"1": "gone\x1b[2J"}, "sampled": [0, 1],
                                                          "returned": [0]})
    code, stdout, err = cli(["report", str(run_dir), str(tmp_path / "y\x1b]0;title\x07")], capsys)
    assert code == 2 and "\x1b" not in stdout + err and "\x07" not in err
    assert "x\\x1b[2J\\x1b[31mred" in stdout and "gone\\x1b[2J" in stdout and "y\\x1b]0;title\\x07" in err


@pytest.mark.parametrize("value", [float("nan"), 5, -1])
def test_hostile_outputs_report_refuses_per_client_means_out_of_range(value, tmp_path, capsys):
    run_dir = fake_run(tmp_path / "damaged", {"global_local_mean": value, "global_local_clients": 2})
    code, _, err = cli(["report", str(run_dir)], capsys)
    assert code == 2 and "'global_local_mean'" in err and "not a number in [0, 1]" in err, err


@pytest.mark.parametrize("flag, kind", [("--client-eval", "expected, global_local, personal, finetune"),
                                        ("--client-test", "holdout, matched")])
def test_hostile_outputs_a_bad_mode_is_answered_with_its_own_values(flag, kind, tmp_path, capsys):
    code, _, err = cli(["run", flag, "holdout(", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and f"(valid: {kind})" in err and "dirichlet" not in err, err


def test_hostile_outputs_an_unknown_device_index_is_refused(tmp_path, capsys):
    code, _, err = cli(["run", *TINY, "--device", "cpu:99", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "'cpu:99'" in err and not (tmp_path / "o").exists(), err


def test_hostile_outputs_the_device_checks_dry_run_leaves_the_source_tree_alone(capsys):
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    script.main(["--dry-run", "--only", "doctor"])
    written = Path(capsys.readouterr().out.splitlines()[-1].split()[1])
    assert written.is_file() and ROOT not in written.resolve().parents
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before
    shutil.rmtree(written.parent)  # the dry run's own temporary folder

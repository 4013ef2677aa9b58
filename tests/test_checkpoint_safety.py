"""Checkpoints are loaded without executing code, bad files give one clear line and change
nothing, writes are atomic, and a non-finite loss stops the run keeping the last good checkpoint."""

from __future__ import annotations

import io as stdio
import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

import fedlt.losses
from fedlt import io
from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.engine import run, sample_clients
from fedlt.errors import FedltError
from fedlt.losses import LossTerm


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Payload:
    """Unpickling this would create ``marker`` (a stand-in for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("safety") / "run"
    run(RunConfig(algorithm="fedavg", model="mlp", train_limit=600, test_limit=100, clients=4, participation=0.5,
                  rounds=1, local_iters=1, server_batch=32, partition={"name": "iid"}, out=out))
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    (dst / "summary.json").unlink()
    return dst


def resume_fails(out: Path, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(["run", "--resume", str(out), "--quiet"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def malicious_torch_file(marker: Path) -> bytes:
    buffer = stdio.BytesIO()
    torch.save({"format": "fedlt-checkpoint-1", "algorithm": Payload(marker)}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["torch zip", "raw pickle"])
def test_a_checkpoint_that_would_run_code_is_refused_and_nothing_runs(kind, finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path / "run")
    marker = tmp_path / "pwned"
    data = malicious_torch_file(marker) if kind == "torch zip" else pickle.dumps(Payload(marker))
    (out / "checkpoint.pt").write_bytes(data)
    before = snapshot(out)
    err = resume_fails(out, capsys)
    assert "checkpoint" in err
    assert not marker.exists()  # the payload never ran
    assert snapshot(out) == before
    # the payload is real: plain unpickling does run it, so the check above can fail
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "text", "bare state_dict", "missing key", "other config",
                                    "other model"])
def test_damaged_or_foreign_checkpoints_give_one_line_and_change_nothing(damage, finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path / "run")
    good = (out / "checkpoint.pt").read_bytes()
    saved = io.load_checkpoint(out / "checkpoint.pt")
    if damage == "truncated":
        (out / "checkpoint.pt").write_bytes(good[: len(good) // 2])
    elif damage == "text":
        (out / "checkpoint.pt").write_text("not a checkpoint\n")
    elif damage == "bare state_dict":
        torch.save(saved["algorithm"]["model"], out / "checkpoint.pt")
    elif damage == "missing key":
        torch.save({k: v for k, v in saved.items() if k != "metrics"}, out / "checkpoint.pt")
    elif damage == "other config":
        torch.save(saved | {"config_digest": "0" * 64}, out / "checkpoint.pt")
    else:  # the right format, but weights of another shape
        model = {k: torch.zeros(3) for k in saved["algorithm"]["model"]}
        torch.save(saved | {"algorithm": saved["algorithm"] | {"model": model}}, out / "checkpoint.pt")
    before = snapshot(out)
    err = resume_fails(out, capsys)
    assert "checkpoint" in err or "configuration" in err or "model" in err
    assert snapshot(out) == before


def test_a_foreign_partition_file_is_refused(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path / "run")
    (out / "partition.npz").write_bytes(b"PK\x03\x04 not really a zip")
    before = snapshot(out)
    resume_fails(out, capsys)
    assert snapshot(out) == before


def test_an_interrupted_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "summary.json"
    io.write_json(target, {"good": True})

    def crash(f):
        f.write(b'{"half": ')
        raise OSError("disk full")

    with pytest.raises(OSError):
        io._atomic(target, crash)
    assert json.loads(target.read_text()) == {"good": True}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    assert oct(target.stat().st_mode & 0o777) != oct(0o600)  # readable like any result file


class LateNaN(LossTerm):
    """0 for the first ``after`` calls in this process, NaN from then on."""

    name = "late_nan"
    calls = 0

    def __init__(self, after: int = 0) -> None:
        self.after = after

    def __call__(self, logits, targets, *, teacher_logits=None, params=None):
        LateNaN.calls += 1
        zero = logits.sum() * 0.0
        return zero + float("nan") if LateNaN.calls > self.after else zero


@pytest.mark.parametrize("algo, loss_flag, step", [("fedavg", "--loss", "local step 1"),
                                                   ("scala", "--client-loss", "local iteration 1")])
def test_a_nan_loss_stops_naming_round_client_and_loss_keeping_the_last_checkpoint(algo, loss_flag, step, tmp_path,
                                                                                   capsys):
    out = tmp_path / "run"
    # 3 of 10 clients, 2 local steps each: 6 client-loss calls per round, so round 2's first step is NaN
    argv = ["run", "--algo", algo, "--model", "mlp", loss_flag, "ce + late_nan(after=6)", "--partition", "iid",
            "--train-limit", "1000", "--test-limit", "100", "--clients", "10", "--participation", "0.3",
            "--rounds", "3", "--local-iters", "2", "--server-batch", "30", "--eval-every", "1", "--quiet",
            "--split", "1", "--out", str(out)]
    LateNaN.calls = 0
    with fedlt.losses.REGISTRY.temporary("late_nan", LateNaN), pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    first_client = sample_clients(10, 0.3, 0, 1)[0]  # named by its id, not its position among the sampled
    assert err.split(";")[0].count("round") == 1 and "round 2" in err and f"{step}, client {first_client}," in err, err
    assert "late_nan" in err and "nan" in err
    assert "last good checkpoint (round 1)" in err
    assert io.load_checkpoint(out / "checkpoint.pt")["round"] == 1
    assert not (out / "summary.json").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_diverging_learning_rate_is_caught_before_it_is_checkpointed(tmp_path):
    config = RunConfig(algorithm="fedavg", model="mlp", train_limit=600, test_limit=100, clients=4, participation=1.0,
                       rounds=3, local_iters=3, server_batch=64, partition={"name": "iid"}, eval_every=1,
                       optimiser={"lr": 1e8, "clip": None}, out=tmp_path / "run")
    with pytest.raises(FedltError, match=r"round \d+ .*non-finite") as info:
        run(config)
    failed_round = int(str(info.value).split()[1])
    if failed_round == 1:
        assert not (tmp_path / "run" / "checkpoint.pt").exists()
    else:
        saved = io.load_checkpoint(tmp_path / "run" / "checkpoint.pt")
        assert saved["round"] == failed_round - 1
        assert all(torch.isfinite(t).all() for t in saved["algorithm"]["model"].values())


def test_a_batchnorm_layer_starved_of_values_is_a_clear_error_not_a_torch_traceback(tmp_path):
    """B_k = 1 reaching a BatchNorm on a 1×1 map is what torch refuses in training; the run says
    what happened and what to change, naming the round."""
    import fedlt.models
    from torch import nn

    def pooled_bn(in_chans: int = 1, num_classes: int = 10, image_size: int = 28) -> nn.Module:
        return nn.Sequential(nn.Conv2d(in_chans, 4, 3), nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(4), nn.Flatten(),
                             nn.Linear(4, num_classes))

    with fedlt.models.REGISTRY.temporary("pooled_bn", pooled_bn), \
            pytest.raises(FedltError, match=r"round 1 .*BatchNorm.*one value per channel.*server_batch"):
        run(RunConfig(algorithm="fedavg", model="pooled_bn", train_limit=500, test_limit=100, clients=5,
                      participation=1.0, rounds=1, local_iters=1, server_batch=5, partition={"name": "iid"},
                      out=tmp_path / "run"))

"""The published long-tailed FL protocols as studies (issue 33): every cell of
benchmarks/studies/{creff,loge}_cifar{10,100}_lt.yaml expands to a valid run and starts — one tiny
round on a small fake CIFAR tree written in torchvision's on-disk format (no network)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import cheap
import fake_dataset_files
from fedlt.algorithms.base import ClientData
from fedlt.algorithms.protocol import ClientStates
from fedlt.config import RunConfig
from fedlt.datasets.source import images
from fedlt.engine import client_data, load_data, prepare, run, train_round
from fedlt.sweep.study import expand, load_study

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
STUDIES = Path(__file__).resolve().parents[1] / "benchmarks" / "studies"
NAMES = ["creff_cifar10_lt", "creff_cifar100_lt", "loge_cifar10_lt", "loge_cifar100_lt"]
# the sizes patched down for one tiny round; everything else (model, partition, optimiser, augmentation,
# algorithm and its parameters) as the study writes it
# (batch 2: a ResNet-34 step at batch 4 costs ~0.6 s of one core, at 2 ~0.4 s; BatchNorm still sees
# 2 x 4 x 4 values a channel at the last block)
TINY = dict(clients=4, participation=0.5, rounds=1, local_epochs=None, local_iters=1, batch_size=2,
            server_batch=8, test_limit=20, eval_every=1, checkpoint_every=1)
FEW = 8  # a started cell trains on this many of each participant's samples (see _few): one server batch


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    """Enough images that the head class holds >= 100 (imbalance factor 100 keeps one of the tail)."""
    root = tmp_path_factory.mktemp("cifar")
    with pytest.MonkeyPatch.context() as mp:
        for name, n in (("cifar10", 1500), ("cifar100", 11000)):
            mp.setattr(fake_dataset_files, "N_TRAIN", n)
            fake_dataset_files.write(name, root, mp)
        yield root


def _few(data: ClientData) -> ClientData:
    """A participant's first FEW samples, its class counts over its whole set (as the partition
    made them): the same client code on a few dozen forward passes instead of hundreds through the
    study's ResNet (CCVR and CReFF compute every sample's features; ~600 samples a client here)."""
    return dataclasses.replace(data, x=images(data.x).subset(slice(0, FEW)), y=data.y[:FEW])


def _published(name: str) -> dict:
    """What each study must say (its source comments cite them)."""
    return {"creff": dict(clients=20, participation=0.4, rounds=200, local_epochs=10, batch_size=32),
            "loge": dict(clients=40, participation=0.3, rounds=500, local_epochs=5, batch_size=8)}[name.split("_")[0]]


@pytest.mark.parametrize("name", NAMES)
def test_every_cell_of_the_published_protocols_expands_and_starts(name, cifar_root, tmp_path, monkeypatch):
    """Every cell is a valid RunConfig with the published settings; every algorithm of the study
    trains one round with the study's model, partition, augmentation and its own parameters (sizes
    patched down), on the study's data loaded once: the cells of one algorithm differ only in their
    seed. The whole run path (directory, evaluation, summary) runs for the study's first cell."""
    import torchvision.datasets.cifar

    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    study, _ = load_study(STUDIES / f"{name}.yaml")
    entries = expand(study, tmp_path / "study")
    assert len(entries) == len(study.seeds) * len(study.axes.get("partition", [None])) * len(study.axes["algorithm"])
    data, started = None, set()
    for entry in entries:
        config = RunConfig.model_validate(entry.config)
        for key, value in _published(name).items():
            assert getattr(config, key) == value, (entry.id, key)
        assert config.dataset == ("cifar100" if "cifar100" in name else "cifar10")
        key = (config.algorithm, repr(config.algorithm_params), repr(config.partition))
        if key in started:
            continue
        started.add(key)
        params = {**config.algorithm_params, **cheap.params(config.algorithm)}  # a step's or head's sizes
        tiny = RunConfig.model_validate(config.model_copy(update=dict(
            TINY, data_root=cifar_root, algorithm_params=params, out=tmp_path / "runs" / entry.id)).model_dump())
        if data is None:  # the first cell runs whole, as `fedlt sweep` would start it
            summary = run(tiny)
            assert summary["rounds"] == 1 and 0 <= summary["final"]["accuracy"] <= 1, entry.id
            data = load_data(tiny)
            continue
        prep = prepare(tiny, data=data)
        participants = [_few(client_data(prep, cid, torch.device("cpu"))) for cid in range(2)]
        metrics = train_round(prep.algorithm, prep.ctx, 1, participants, ClientStates())
        assert math.isfinite(metrics["train_loss"]), entry.id
    assert len(started) == len(entries) // len(study.seeds)  # every cell but its seed started once


def test_the_mnist_lt_study_expands_to_valid_runs_of_every_row(tmp_path):
    """benchmarks/studies/longtail_mnist.yaml: every cell is a valid run with the CReFF protocol's
    kept settings (imbalance factor 100 then Dirichlet 0.5, 20 clients, 8 a round, batch 32, lr 0.1),
    3 seeds, and one cell per (row, seed) for the issue's rows."""
    study, _ = load_study(STUDIES / "longtail_mnist.yaml")
    entries = expand(study, tmp_path / "study")
    rows = {"fedavg", "fedlogit", "fedlc", "fedvls", "fedgrab", "ccvr", "creff", "fedetf", "fedloge", "fednh", "fedlf",
            "fednpc", "fedproto", "fedgela", "fedrela", "fedyoyo", "fedic"}
    configs = [RunConfig.model_validate(e.config) for e in entries]
    assert {c.algorithm for c in configs} == rows and len(configs) == 3 * len(study.axes["algorithm"])
    assert {(c.algorithm, c.seeds.model) for c in configs} == {(a, s) for a in rows for s in (0, 1, 2)}
    for c in configs:
        assert (c.dataset, c.clients, c.participation, c.batch_size, c.optimiser.lr) == ("mnist", 20, 0.4, 32, 0.1)
        assert c.partition["name"] == "longtail" and c.partition["imbalance_factor"] == 100
        assert c.partition["then"] == {"name": "dirichlet", "beta": 0.5}

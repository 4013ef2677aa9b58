"""tools/fedvls_repro/export.py: the FedVLS authors' own client data replayed in fedlt (issue 25).

The authors' code is not in the suite (nor the network): a stand-in module with the same structure
as their ``data/generate_mnist.py`` (pool, normalise with (0.5, 0.5), ``train_test_split`` on numpy's
global stream, their Dirichlet loop with a minimum size, loaders of (image, label) tuples) is run
with the exporter's hooks. The checks are independent of the exporter's own bookkeeping: each
client loader the stand-in built must hold exactly the exported images of that client, the hooks
must not move any random stream, and the files must load in fedlt as the same clients.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import fedlt.datasets
import fedlt.engine
import fedlt.run.evaluation
import fedlt.run.parts
import fedlt.partitioners
from fedlt.config import RunConfig
from fedlt.errors import FedltError
from fedlt.partitioners import Partition

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "fedvls_repro"
K, C, SIDE = 5, 4, 28


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"fedvls_repro_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


export = load_tool("export")

# the authors' generate_mnist.py, cut down to what their MNIST path runs (names and calls kept, so
# the hooks meet the same globals); sklearn's train_test_split is mimicked: one permutation, the
# test part first, whatever the number of arrays
STAND_IN = '''
import numpy as np
import torch
from torch.utils.data import DataLoader

least_samples = 12

def train_test_split(*arrays, train_size, shuffle=True):
    n = len(arrays[0])
    n_train = int(np.floor(train_size * n))
    perm = np.random.permutation(n)
    test, train = perm[: n - n_train], perm[n - n_train:]
    return [part for a in arrays for part in (a[train], a[test])]

def split_data(X, y):
    X_train, X_test, y_train, y_test = train_test_split(X, y, train_size=0.75, shuffle=True)
    return [{"x": X_train, "y": y_train}], [{"x": X_test, "y": y_test}]

def generate_mnist(dir_path, num_classes, num_clients, niid, balance, partition, alpha):
    images = torch.from_numpy(POOLED).to(torch.float32).div(255).unsqueeze(1).sub_(0.5).div_(0.5)
    train_data, test_data = split_data(np.array(images.numpy()), np.array(LABELS))
    X, y, statistic = separate_data((train_data[0]["x"], train_data[0]["y"]), num_clients, num_classes, alpha,
                                    niid, balance, partition)
    loaders = {}
    for i in range(len(y)):
        use = [(a, b) for a, b in zip(torch.Tensor(X[i]).type(torch.float32), torch.Tensor(y[i]).type(torch.int64))]
        loaders[i] = DataLoader(use, batch_size=8, drop_last=True, shuffle=True)
    glob = [(a, b) for a, b in zip(torch.Tensor(train_data[0]["x"]), torch.Tensor(train_data[0]["y"]).type(torch.int64))]
    test = [(a, b) for a, b in zip(torch.Tensor(test_data[0]["x"]), torch.Tensor(test_data[0]["y"]).type(torch.int64))]
    return loaders, DataLoader(test, batch_size=8, drop_last=True, shuffle=True), DataLoader(glob, batch_size=8)

def separate_data(data, num_clients, num_classes, alpha, niid=False, balance=False, partition=None):
    X = [[] for _ in range(num_clients)]
    y = [[] for _ in range(num_clients)]
    dataset_content, dataset_label = data
    min_size, N = 0, len(dataset_label)
    while min_size < least_samples:
        idx_batch = [[] for _ in range(num_clients)]
        for k in range(num_classes):
            idx_k = np.where(dataset_label == k)[0]
            np.random.shuffle(idx_k)
            proportions = np.random.dirichlet(np.repeat(alpha, num_clients))
            proportions = np.array([p * (len(idx_j) < N / num_clients) for p, idx_j in zip(proportions, idx_batch)])
            proportions = proportions / proportions.sum()
            proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions))]
            min_size = min([len(idx_j) for idx_j in idx_batch])
    for client in range(num_clients):
        X[client] = dataset_content[idx_batch[client]]
        y[client] = dataset_label[idx_batch[client]]
    return X, y, None
'''


def pooled_mnist_like(n=400, seed=3):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, SIDE, SIDE), dtype=np.uint8), rng.integers(0, C, n).astype(np.int64)


def stand_in(pooled, labels):
    module = types.ModuleType("stand_in_generate_mnist")
    module.POOLED, module.LABELS = pooled, labels
    exec(compile(STAND_IN, "stand_in_generate_mnist.py", "exec"), module.__dict__)
    return module


def generate(module, seed=1):
    np.random.seed(seed)  # the authors' module seeds numpy at import
    torch.manual_seed(10)
    return module.generate_mnist("unused/", C, K, niid=True, balance=False, partition="noniid", alpha=0.5)


@pytest.fixture(scope="module")
def exported():
    pooled, labels = pooled_mnist_like()
    module = stand_in(pooled, labels)
    recorder = export.SplitRecorder()
    recorder.install(module)
    loaders = generate(module)
    arrays, partition = export.build_export(pooled, labels, recorder, C, {"alpha": 0.5, "numpy_seed": 1})
    return pooled, labels, recorder, loaders, arrays, partition


def stacked(loader):
    return torch.stack([x for x, _ in loader.dataset]), torch.stack([y for _, y in loader.dataset])


def test_each_client_holds_exactly_the_exported_images(exported):
    pooled, labels, recorder, (clients, held_out, _), arrays, partition = exported
    assert len(partition.client_indices) == K and sum(map(len, partition.client_indices)) == len(arrays["y_train"])
    for k, idx in enumerate(partition.client_indices):
        x, y = stacked(clients[k])  # what the stand-in's client k trains on, built by its own code path
        assert torch.equal(x, export.authors_normalise(arrays["x_train"][idx]))
        assert np.array_equal(y.numpy(), arrays["y_train"][idx])
        assert np.array_equal(arrays["groups_train"][idx], np.full(len(idx), k))
    x, y = stacked(held_out)
    assert torch.equal(x, export.authors_normalise(arrays["x_test"])) and np.array_equal(y.numpy(), arrays["y_test"])
    assert len(arrays["y_train"]) + len(arrays["y_test"]) == len(labels) and len(arrays["y_test"]) == 100
    export.check_loaders(recorder, clients, held_out, pooled, labels)  # the exporter's own check agrees


def test_the_hooks_change_no_random_draw():
    pooled, labels = pooled_mnist_like(seed=4)
    plain = stand_in(pooled, labels)
    clients, _, _ = generate(plain)
    after_plain = (np.random.get_state()[1].copy(), torch.get_rng_state())
    hooked = stand_in(pooled, labels)
    export.SplitRecorder().install(hooked)
    clients_hooked, _, _ = generate(hooked)
    assert np.array_equal(np.random.get_state()[1], after_plain[0])
    assert torch.equal(torch.get_rng_state(), after_plain[1])
    for k in range(K):
        assert torch.equal(stacked(clients[k])[0], stacked(clients_hooked[k])[0])


def test_files_load_in_fedlt_as_the_same_clients(exported, tmp_path):
    _, _, recorder, (clients, _, _), arrays, partition = exported
    info = export.write_export(tmp_path, arrays, partition, {"command": "stand-in"})
    loaded = Partition.load(tmp_path / "partition.npz")
    assert loaded.sha256 == partition.sha256 == recorder.sha256() == info["partition_sha256"]
    assert json.loads((tmp_path / "partition.json").read_text())["sha256"] == loaded.sha256
    counts = np.stack([np.bincount(stacked(clients[k])[1].numpy(), minlength=C) for k in range(K)])
    assert np.array_equal(loaded.class_counts, counts) and info["class_counts"] == counts.tolist()

    data = fedlt.datasets.create("arrays", root=tmp_path / "mnist-authors.npz")
    loaded.check_dataset(data.y_train.numpy(), data.name)
    config = RunConfig(dataset="arrays", data_root=tmp_path / "mnist-authors.npz", model="mlp", clients=K,
                       partition_file=tmp_path / "partition.npz", out=tmp_path / "run")
    made = fedlt.engine.make_partition(config, data)
    assert all(np.array_equal(a, b) for a, b in zip(made.client_indices, partition.client_indices))
    # the same clients again from the file's own group ids, by fedlt's natural partitioner
    natural = fedlt.partitioners.partition_data(fedlt.partitioners.create("natural"), data, K, 0)
    as_sets = lambda p: sorted(tuple(sorted(i.tolist())) for i in p.client_indices)  # noqa: E731
    assert as_sets(natural) == as_sets(partition)
    # fedlt standardises by the clients' pixels: recorded, and equal to numpy's float64 statistics
    pixels = arrays["x_train"].astype(np.float64) / 255
    assert info["normalisation"]["fedlt_arrays_mean_std"] == pytest.approx([pixels.mean(), pixels.std()], abs=1e-12)
    assert torch.allclose(data.x_train[:3], torch.from_numpy((pixels[:3, None] - pixels.mean()) / pixels.std()).float(),
                          atol=1e-5)


def test_a_wrong_position_is_caught(exported):
    pooled, labels, recorder, (clients, held_out, _), _, _ = exported
    bad = export.SplitRecorder()
    bad.__dict__.update(recorder.__dict__)
    bad.client_positions = [p.copy() for p in recorder.client_positions]
    bad.client_positions[0][0], bad.client_positions[1][0] = bad.client_positions[1][0], bad.client_positions[0][0]
    with pytest.raises(FedltError, match=r"^export: the authors' client 0 does not hold") as info:
        export.check_loaders(bad, clients, held_out, pooled, labels)
    assert "\n" not in str(info.value)
    other = pooled.copy()
    other[recorder.train_positions[0], 0, 0] ^= 1  # one pixel of one training image
    with pytest.raises(FedltError, match="pooled are not the raw MNIST files"):
        export.check_loaders(recorder, clients, held_out, other, labels)
    with pytest.raises(FedltError, match="did not call train_test_split"):
        export.check_loaders(export.SplitRecorder(), clients, held_out, pooled, labels)


def test_overlapping_or_missing_clients_are_refused(exported):
    pooled, labels, recorder, _, _, _ = exported
    overlap = export.SplitRecorder()
    overlap.__dict__.update(recorder.__dict__)
    overlap.client_positions = [*recorder.client_positions[:-1], np.concatenate([recorder.client_positions[-1],
                                                                                 recorder.client_positions[0][:1]])]
    with pytest.raises(FedltError, match=f"client {K - 1} shares samples"):
        export.build_export(pooled, labels, overlap, C, {})
    orphan = export.SplitRecorder()
    orphan.__dict__.update(recorder.__dict__)
    orphan.client_positions = [recorder.client_positions[0][1:], *recorder.client_positions[1:]]
    with pytest.raises(FedltError, match="^export: 1 training images belong to no client$"):
        export.build_export(pooled, labels, orphan, C, {})


def test_export_without_prepared_work_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # export() puts its own folder on the path
    with pytest.raises(SystemExit) as stop:
        export.main(["--work", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--work {tmp_path}" in err and "run prepare.sh first" in err


def test_run_fedlt_trains_on_the_export_and_authors_norm_is_their_transform(exported, tmp_path, monkeypatch,
                                                                            one_thread):
    """One round of run_fedlt.py on the exported files: the curve names the file's sha256, and
    --authors-norm hands the engine exactly the authors' (x/255 - 0.5)/0.5 of the same images."""
    _, _, _, _, arrays, partition = exported
    data_dir = tmp_path / "data"
    export.write_export(data_dir, arrays, partition, {})
    run_fedlt = load_tool("run_fedlt")
    real_run, seen = fedlt.engine.run, {}

    def run_and_keep(config, **kwargs):  # the local engine calls run again, with its runner
        seen.setdefault("data", fedlt.run.parts.load_data(config))  # what run_fedlt made the run load
        return real_run(config, **kwargs)

    monkeypatch.setattr(fedlt.engine, "run", run_and_keep)
    monkeypatch.setattr(fedlt.run.parts, "load_data", fedlt.run.parts.load_data)  # restored after --authors-norm
    monkeypatch.setattr(fedlt.run.evaluation, "evaluate", fedlt.run.evaluation.evaluate)  # run_fedlt wraps it: restored after the test
    base = ["run_fedlt.py", "--algo", "fedvls", "--dataset", "arrays", "--data-root", str(data_dir / "mnist-authors.npz"),
            "--partition-file", str(data_dir / "partition.npz"), "--rounds", "1", "--clients", str(K)]
    for flags, out in (([], "plain"), (["--authors-norm"], "authors")):
        argv = [*base, *flags, "--out", str(tmp_path / out)]
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(sys, "orig_argv", ["python", *argv])
        run_fedlt.main()
        curve = json.loads((tmp_path / out / "curve.json").read_text())
        assert curve["partition_sha256"] == partition.sha256 and curve["command"] == " ".join(argv)
        assert len(curve["test_acc"]) == len(curve["train_union_acc"]) == 1
        seen[out] = seen.pop("data")
    assert torch.equal(seen["authors"].x_train, export.authors_normalise(arrays["x_train"]))
    assert torch.equal(seen["authors"].x_test, export.authors_normalise(arrays["x_test"]))
    assert torch.equal(seen["authors"].y_train, seen["plain"].y_train)
    assert not torch.allclose(seen["authors"].x_train, seen["plain"].x_train)  # the ablation changes the inputs

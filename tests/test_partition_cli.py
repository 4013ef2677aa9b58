"""``fedlt partition``: the table, the summary, --plot and --save; bad input is one line, exit 2."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fedlt.cli.commands  # noqa: F401  (registers the commands on the app)
import fedlt.datasets
import fedlt.partitioners as P
from fedlt.cli import app, main
from fedlt.plots import partition_heatmap

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_dataset(name: str, per_class: int = 40, num_classes: int = 10):
    y = torch.from_numpy(np.random.default_rng(0).permutation(np.repeat(np.arange(num_classes), per_class)))
    return SimpleNamespace(name=name, y_train=y, num_classes=num_classes)


@pytest.fixture
def fake():
    data = fake_dataset("fake10")
    with fedlt.datasets.REGISTRY.temporary("fake10", lambda root=None, download=False: data):
        yield data


def invoke(*args: str):
    result = CliRunner().invoke(app, ["partition", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_prints_the_table_and_summary_and_writes_plot_and_file(fake, tmp_path):
    png, npz = tmp_path / "heat.png", tmp_path / "part.npz"
    out = invoke("--dataset", "fake10", "--partition", "dirichlet", "--beta", "0.5", "--min-size", "5",
                 "--clients", "6", "--plot", str(png), "--save", str(npz))
    part = P.Partition.load(npz)
    part.check_dataset(fake.y_train, "fake10")
    header = next(line for line in out.splitlines() if "client" in line and "samples" in line)
    assert header.split()[3:] == [str(c) for c in range(10)]  # one column per class
    for k, row in enumerate(part.class_counts):  # each client's row shows its counts
        line = next(line for line in out.splitlines() if line.split()[:2] == [str(k), str(row.sum())])
        assert [int(v) if v != "·" else 0 for v in line.split()[3:]] == row.tolist()
    assert "dirichlet(beta=0.5, min_size=5)" in out and part.sha256 in out
    assert "samples per client" in out and "global imbalance factor" in out
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 1000
    assert json.loads(npz.with_suffix(".json").read_text()) == part.manifest
    assert part.manifest["dataset"]["name"] == "fake10" and part.manifest["num_clients"] == 6


@pytest.mark.parametrize("args,name,params", [
    ([], "quantity", {"alpha": 2}),  # fedlt run's default partition
    (["--alpha", "5"], "quantity", {"alpha": 5}),
    (["--beta", "2"], "dirichlet", {"beta": 2.0, "min_size": 10}),
    (["--shards-per-client", "3"], "shards", {"shards_per_client": 3}),
    (["--partition", "iid"], "iid", {}),
    (["--imbalance-factor", "4", "--then", "quantity", "--alpha", "2"], "longtail",
     {"imbalance_factor": 4.0, "then": {"name": "quantity", "alpha": 2}}),
    (["--partition", "longtail", "--imbalance-factor", "2"], "longtail",
     {"imbalance_factor": 2.0, "then": {"name": "iid"}}),
])
def test_flags_choose_the_scheme(fake, tmp_path, args, name, params):
    npz = tmp_path / "p.npz"
    invoke("--dataset", "fake10", "--clients", "10", "--save", str(npz), *args)
    manifest = P.Partition.load(npz).manifest
    assert manifest["name"] == name and manifest["params"] == params


def test_many_classes_and_many_clients_stay_readable(tmp_path):
    data = fake_dataset("fake50", per_class=20, num_classes=50)
    with fedlt.datasets.REGISTRY.temporary("fake50", lambda root=None, download=False: data):
        out = invoke("--dataset", "fake50", "--partition", "iid", "--clients", "40", "--max-rows", "5")
    assert "largest classes" in out and "35 more clients" in out
    assert max(len(line) for line in out.splitlines()) < 200


@pytest.mark.parametrize("args,needle", [
    (["--beta", "0"], "beta"),
    (["--partition", "dirichlet", "--alpha", "2"], "--alpha does not apply to dirichlet"),
    (["--beta", "0.3", "--alpha", "2"], "choose one with --partition"),
    (["--partition", "dirichelt"], "did you mean 'dirichlet'"),
    (["--partition", "iid", "--then", "dirichlet"], "--then"),
    (["--imbalance-factor", "0.5"], "imbalance_factor"),
    (["--then", "dirichlet", "--beta", "-1", "--imbalance-factor", "3"], "beta"),
    (["--alpha", "3", "--clients", "7"], "not a multiple"),
    (["--beta", "0.01", "--clients", "30"], "raise beta"),
    (["--save", "part.json"], ".npz"),
    (["--clients", "0"], "clients"),
    (["--dataset", "imagenet"], "imagenet"),
])
def test_bad_input_exits_2_with_one_line(fake, capsys, args, needle):
    with pytest.raises(SystemExit) as info:
        main(["partition", "--dataset", "fake10", *args] if "--dataset" not in args else ["partition", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_heatmap_handles_large_matrices_and_other_formats(tmp_path):
    counts = np.random.default_rng(0).integers(0, 50, size=(300, 100))
    assert partition_heatmap(counts, tmp_path / "big.png").read_bytes().startswith(PNG_MAGIC)
    assert partition_heatmap(counts[:5, :10], tmp_path / "small.svg", title="t").read_text().lstrip().startswith("<?xml")


def test_real_mnist_end_to_end(tmp_path):
    """The real MNIST files through the command (in this process, as the tests above: a Python
    start importing fedlt again would add seconds and test nothing of ``fedlt partition``)."""
    png, npz = tmp_path / "mnist.png", tmp_path / "mnist.npz"
    out = invoke("--dataset", "mnist", "--partition", "dirichlet", "--beta", "0.1", "--clients", "20",
                 "--plot", str(png), "--save", str(npz))
    assert "class counts per client" in out and "sha256" in out
    assert png.read_bytes().startswith(PNG_MAGIC)
    manifest = P.Partition.load(npz).manifest
    assert manifest["dataset"]["name"] == "mnist" and manifest["dataset"]["size"] == 60000
    assert np.array(manifest["class_counts"]).sum() == 60000 and manifest["sha256"] in out

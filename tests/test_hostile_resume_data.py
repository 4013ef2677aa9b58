"""A resume on other training inputs is refused (issue 35): the checkpoint keeps the dataset's
fingerprint (fedlt.datasets.fingerprint: the array bytes of in-memory data; for ``imagefolder``
the file list, sizes and modification times its cache is keyed by), so changing one pixel while
the labels stay the same is one line and exit 2 with the run directory untouched — and the
same data resumes as before."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import fedlt.datasets
from fedlt.cli import main
from fedlt.datasets.base import FULL_DIGEST_BYTES, InMemoryDataset, fingerprint

from test_arrays_dataset import make_arrays
from test_hostile_inputs import fails_cleanly
from test_imagefolder import write_tree

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["--algo", "fedavg", "--model", "mlp", "--clients", "2", "--partition", "iid", "--rounds", "1",
       "--local-iters", "1", "--quiet"]


def arrays_folder(path: Path) -> Path:
    path.mkdir()
    for name, array in make_arrays(n_train=40, n_test=10).items():
        np.save(path / f"{name}.npy", array)
    return path


def flip_a_pixel(path: Path) -> None:
    x = np.load(path / "x_train.npy")
    x[7, 2, 3, 1] ^= 0x40
    np.save(path / "x_train.npy", x)


def touch(path: Path) -> None:
    stamp = path.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(stamp, stamp))


@pytest.mark.parametrize("dataset, change", [("arrays", flip_a_pixel),
                                             ("imagefolder(image_size=8)", lambda root: touch(root / "train/c1/001.png"))])
def test_a_resume_on_changed_training_inputs_is_refused_and_on_the_same_ones_goes_on(tmp_path, capsys, dataset, change):
    root = arrays_folder(tmp_path / "data") if dataset == "arrays" else tmp_path / "data"
    if dataset != "arrays":
        write_tree(root, n_train=12, n_test=6)
    out = tmp_path / "run"
    main(["run", "--dataset", dataset, "--data-root", str(root), *RUN, "--out", str(out)])
    labels_before = fedlt.datasets.load(dataset, root=root).y_train
    change(root)
    assert torch.equal(fedlt.datasets.load(dataset, root=root).y_train, labels_before)  # the labels did not change
    err = fails_cleanly(["run", "--resume", str(out), "--rounds", "2", "--quiet"], capsys, out)
    assert "was trained on other data" in err and f"the inputs of {dataset} differ" in err, err
    # the same data as the checkpoint's (undo the change on a copy of the run): resumes
    fresh = tmp_path / "data2"
    if dataset == "arrays":
        arrays_folder(fresh)
    else:
        write_tree(fresh, n_train=12, n_test=6)
    out2 = tmp_path / "run2"
    main(["run", "--dataset", dataset, "--data-root", str(fresh), *RUN, "--out", str(out2)])
    main(["run", "--resume", str(out2), "--rounds", "2", "--quiet"])
    assert "round" in (out2 / "summary.json").read_text()


def dataset_of(x: torch.Tensor, y: torch.Tensor) -> InMemoryDataset:
    return InMemoryDataset("d", x, y, x[:4], y[:4], 3)


def test_the_fingerprint_sees_one_value_and_nothing_but_the_values():
    x = torch.randn(20, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    y = torch.arange(20) % 3
    base = fingerprint(dataset_of(x, y))
    assert base == dataset_of(x.clone(), y.clone()).fingerprint() == fingerprint(dataset_of(x, y))
    changed = x.clone()
    changed[13, 1, 2, 4] = torch.nextafter(changed[13, 1, 2, 4], torch.tensor(10.0))  # one ulp
    assert fingerprint(dataset_of(changed, y)) != base
    assert fingerprint(dataset_of(x, (y + 1) % 3)) != base
    assert fingerprint(dataset_of(x.reshape(20, 3, 25, 1), y)) != base  # same bytes, another shape
    assert fingerprint(dataset_of(x.double(), y)) != base


def test_a_split_beyond_the_full_digest_bound_is_sampled_evenly(monkeypatch):
    """Beyond FULL_DIGEST_BYTES the digest reads evenly spaced samples: a sampled one's change is
    seen, the bound holds (a 4 KiB bound reads 4 KiB worth of samples, the first and the last)."""
    import fedlt.datasets.base as base_module

    monkeypatch.setattr(base_module, "FULL_DIGEST_BYTES", 4096)
    x = torch.randn(100, 1, 8, 8, generator=torch.Generator().manual_seed(1))  # 256 B each, 25.6 kB in all
    y = torch.arange(100) % 3
    base = fingerprint(dataset_of(x, y))
    for sampled in (0, 99):
        changed = x.clone()
        changed[sampled] += 1
        assert fingerprint(dataset_of(changed, y)) != base
    assert FULL_DIGEST_BYTES >= 1 << 28

"""The ``arrays`` dataset: a user's .npz / .npy files become the standardised tensors a run trains
on (checked against a float64 reference over every layout and dtype), ``.npy`` files are
memory-mapped, and every malformed file is one line naming the array (exit 2 on the CLI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedlt.datasets
from fedlt.cli import main
from fedlt.datasets.arrays import read_arrays
from fedlt.errors import FedltError


def make_arrays(n_train=40, n_test=10, shape=(6, 6, 3), dtype=np.uint8, classes=4, seed=0, **extra):
    rng = np.random.default_rng(seed)

    def images(n):
        if dtype == np.uint8:
            return rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        return (rng.normal(3.0, 2.0, (n, *shape))).astype(dtype)

    arrays = {"x_train": images(n_train), "y_train": rng.integers(0, classes, n_train),
              "x_test": images(n_test), "y_test": rng.integers(0, classes, n_test)}
    present = min(classes, n_train)
    arrays["y_train"][:present] = np.arange(present)  # every class present (given the room)
    return {**arrays, **extra}


def save_npz(path, arrays):
    np.savez(path, **arrays)
    return path


def reference(x_train: np.ndarray, x: np.ndarray, channels_last: bool) -> np.ndarray:
    """(x - mean) / std per channel, all in float64, the statistics over the whole training set."""
    def nchw(a):
        a = a.astype(np.float64) / (255.0 if a.dtype == np.uint8 else 1.0)
        a = a[:, None] if a.ndim == 3 else a
        return a.transpose(0, 3, 1, 2) if channels_last else a

    train = nchw(x_train)
    mean = train.mean(axis=(0, 2, 3), keepdims=True)
    std = train.std(axis=(0, 2, 3), keepdims=True)
    return (nchw(x) - mean) / np.where(std > 0, std, 1.0)


@settings(max_examples=25, deadline=None)
@given(layout=st.sampled_from([("hw", (5, 7)), ("chw", (3, 5, 7)), ("hwc", (5, 7, 3)), ("chw1", (1, 6, 6))]),
       dtype=st.sampled_from([np.uint8, np.float16, np.float32, np.float64]),
       n_train=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_images_are_standardised_by_the_training_statistics_in_any_layout(tmp_path_factory, layout, dtype, n_train,
                                                                           seed):
    kind, shape = layout
    arrays = make_arrays(n_train=n_train, shape=shape, dtype=dtype, classes=2 if n_train < 4 else 4, seed=seed)
    if n_train < 2:
        arrays["y_test"][:] = 1 - arrays["y_train"][0]  # two classes between the splits
    data = fedlt.datasets.create("arrays", root=save_npz(tmp_path_factory.mktemp("a") / "d.npz", arrays))
    for split in ("train", "test"):
        want = reference(arrays["x_train"], arrays[f"x_{split}"], kind == "hwc")
        got = getattr(data, f"x_{split}")
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(getattr(data, f"y_{split}"), torch.as_tensor(arrays[f"y_{split}"]))
    assert data.num_classes == int(max(arrays["y_train"].max(), arrays["y_test"].max())) + 1


def test_a_folder_of_npy_files_is_memory_mapped_and_equals_the_npz(tmp_path):
    arrays = make_arrays(groups_train=np.array([f"writer{i % 7}" for i in range(40)]),
                         class_names=np.array(["cat", "dog", "owl", "yak"]))
    folder = tmp_path / "folder"
    folder.mkdir()
    for key, value in arrays.items():
        np.save(folder / f"{key}.npy", value)
    assert all(isinstance(a, np.memmap) for a in read_arrays(folder).values())
    from_npz = fedlt.datasets.create("arrays", root=save_npz(tmp_path / "d.npz", arrays))
    from_npy = fedlt.datasets.create("arrays", root=folder)
    for field in ("x_train", "y_train", "x_test", "y_test", "groups_train"):
        assert torch.equal(getattr(from_npz, field), getattr(from_npy, field)), field
    assert from_npy.class_names == ("cat", "dog", "owl", "yak") and from_npy.num_classes == 4
    # writer ids become 0..G-1 in sorted order; limit() keeps them aligned with the samples
    assert from_npy.groups_train.tolist() == [i % 7 for i in range(40)]
    assert from_npy.limit(train=9).groups_train.tolist() == [i % 7 for i in range(9)]


def test_class_names_set_the_class_count_beyond_the_labels_seen(tmp_path):
    names = np.array([f"c{i}" for i in range(6)])
    data = fedlt.datasets.create("arrays", root=save_npz(tmp_path / "d.npz", make_arrays(class_names=names)))
    assert data.num_classes == 6


def _with(**changes):
    def change(arrays):
        arrays.update(changes)
        return arrays
    return change


def _drop(key):
    def change(arrays):
        del arrays[key]
        return arrays
    return change


def _nan(arrays):
    arrays["x_train"] = arrays["x_train"].astype(np.float32)
    arrays["x_train"][7, 0, 1, 2] = np.inf
    return arrays


BAD = [
    (_drop("y_test"), "lacks y_test"),
    (_with(X_train=np.zeros(3)), "unknown arrays ['X_train']"),
    (_with(x_train=np.zeros((40, 6), np.uint8)), "x_train has shape (40, 6)"),
    (_with(x_test=np.zeros((10, 6, 6, 3), np.int32)), "x_test has dtype int32"),
    (_with(x_test=np.zeros((10, 5, 5, 3), np.uint8)), "x_test images are (3, 5, 5)"),
    (_with(y_train=np.zeros(39, np.int64)), "y_train has shape (39,)"),
    (_with(y_train=np.zeros(40, np.float32)), "y_train has dtype float32"),
    (_with(y_test=np.full(10, -1)), "y_test holds label -1"),
    (_with(class_names=np.array(["a", "b", "c"])), "y_train holds label 3 but class_names names 3 classes"),
    (_with(class_names=np.array(["a", "b", "a", "c"])), "class_names repeats a name"),
    (_with(y_train=np.zeros(40, np.int64), y_test=np.zeros(10, np.int64)), "a single class"),
    (_with(groups_train=np.zeros(39, np.int64)), "groups_train has shape (39,)"),
    (_with(groups_train=np.zeros(40, np.float64)), "groups_train has dtype float64"),
    (_with(x_train=np.zeros((0, 6, 6, 3), np.uint8)), "x_train has shape (0, 6, 6, 3): it is empty"),
    (_nan, "x_train has non-finite values (NaN or inf) in 1 image(s) (first: image 7)"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_a_malformed_file_is_one_line_naming_the_array(tmp_path, change, message):
    path = save_npz(tmp_path / "d.npz", change(make_arrays()))
    with pytest.raises(FedltError) as info:
        fedlt.datasets.create("arrays", root=path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_pickles_and_foreign_files_are_refused_without_loading_them(tmp_path):
    arrays = make_arrays(class_names=np.array([{"a": 1}, 2, 3, 4], dtype=object))
    np.savez(tmp_path / "objects.npz", **arrays)
    (tmp_path / "text.npz").write_text("not an archive")
    np.save(tmp_path / "single.npy", np.zeros(3))
    cases = {"objects.npz": "holds Python objects (pickled), which fedlt never loads",
             "text.npz": "is not an .npz archive", "single.npy": "is a single array",
             "missing.npz": "no file or folder"}
    for name, message in cases.items():
        with pytest.raises(FedltError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
            fedlt.datasets.create("arrays", root=tmp_path / name)
        assert "allow_pickle" not in str(info.value)
    with pytest.raises(FedltError, match="needs --data-root"):
        fedlt.datasets.create("arrays")


def test_a_bad_file_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    path = save_npz(tmp_path / "d.npz", _with(y_test=np.full(10, -1))(make_arrays()))
    for argv in (["run", "--out", str(tmp_path / "run")], ["partition"]):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--dataset", "arrays", "--data-root", str(path), "--clients", "2"])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and "y_test holds label -1" in err and len(err.splitlines()) == 1

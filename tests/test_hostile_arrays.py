"""Hostile ``arrays`` files (issue 35): every case is exit 2, one line naming the file or array
and the real cause, nothing created — and every size is checked against the ``.npy`` header
before a byte is allocated (a shape of 10^12 elements, a zip bomb), so none ends in numpy's
allocation error, an OverflowError or ``'bytes' object has no attribute 'dtype'``."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

import fedlt.datasets
from fedlt.datasets import arrays as arrays_module
from fedlt.datasets.base import MAX_CLASSES
from fedlt.errors import FedltError

from test_arrays_dataset import make_arrays
from test_hostile_inputs import fails_cleanly

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["--algo", "fedavg", "--model", "mlp", "--clients", "2", "--partition", "iid", "--rounds", "1",
       "--local-iters", "1", "--quiet"]


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def header_only(shape: tuple[int, ...], dtype: str = "|u1", data: bytes = b"\0" * 64) -> bytes:
    """An .npy header declaring ``shape`` followed by a few bytes of data."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buffer.getvalue() + data


def zipped(path: Path, members: dict[str, bytes], compress: bool = False) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def good_members(**replace: bytes) -> dict[str, bytes]:
    members = {f"{k}.npy": npy_bytes(v) for k, v in make_arrays().items()}
    return {**members, **replace}


def folder(path: Path, **replace: bytes) -> Path:
    path.mkdir()
    for name, data in good_members(**replace).items():
        (path / name).write_bytes(data)
    return path


def npz_case(tmp: Path, case: str) -> tuple[Path, str]:
    """A damaged .npz, and the words the refusal must hold."""
    npz = tmp / "d.npz"
    if case == "raw member":
        members = good_members()
        members["x_train"] = members.pop("x_train.npy")[200:]
        return zipped(npz, members), "member 'x_train' is not a .npy array"
    if case == "nested npz":
        inner = zipped(tmp / "inner.npz", good_members()).read_bytes()
        return zipped(npz, good_members(**{"x_train.npy": inner})), "x_train.npy is a zip archive"
    if case == "shape of 10^12 elements":
        return zipped(npz, good_members(**{"x_train.npy": header_only((10**6, 1000, 1000))})), \
            "declares shape (1000000, 1000, 1000) of uint8 (1000000000000 bytes) but holds 64 bytes"
    if case == "shape of 8e9 elements":
        return zipped(npz, good_members(**{"x_train.npy": header_only((8 * 10**9,), "<f8")})), \
            "(64000000000 bytes) but holds 64 bytes"
    if case == "pickled member":
        return zipped(npz, good_members(**{"y_train.npy": pickle.dumps([1, 2, 3])})), "y_train.npy is a pickle"
    if case == "object member":
        buffer = io.BytesIO()
        np.save(buffer, np.array([{"a": 1}] * 40, dtype=object), allow_pickle=True)
        return zipped(npz, good_members(**{"y_train.npy": buffer.getvalue()})), "holds Python objects (pickled)"
    if case == "text member":
        return zipped(npz, good_members(**{"x_test.npy": b"hello, world\n"})), \
            "x_test.npy is not a .npy array (it starts with b'hello,')"
    if case == "member twice":
        with zipfile.ZipFile(npz, "w") as archive:
            for name, data in good_members().items():
                archive.writestr(name, data)
            with pytest.warns(UserWarning, match="Duplicate name"):
                archive.writestr("x_test.npy", npy_bytes(np.zeros((2, 6, 6, 3), np.uint8)))
        return npz, "holds 'x_test.npy' twice"
    labels = {"label 10^7": 10**7, "label of int64 max": np.iinfo(np.int64).max}
    if case in labels:
        arrays = make_arrays()
        arrays["y_train"][3] = labels[case]
        np.savez(npz, **arrays)
        return npz, f"y_train holds label {labels[case]}, beyond the {MAX_CLASSES} classes"
    if case == "label of uint64 max":
        arrays = make_arrays()
        arrays["y_train"] = arrays["y_train"].astype(np.uint64)
        arrays["y_train"][3] = np.iinfo(np.uint64).max
        np.savez(npz, **arrays)
        return npz, f"y_train holds label {np.iinfo(np.uint64).max}, beyond"
    if case == "class names not UTF-8":
        np.savez(npz, **make_arrays(class_names=np.array([b"\xff\xfe", b"b", b"c", b"d"])))
        return npz, "class_names holds bytes that are not UTF-8"
    if case == "too many class names":
        np.savez(npz, **make_arrays(class_names=np.arange(MAX_CLASSES + 1).astype(str)))
        return npz, f"expected 2..{MAX_CLASSES} strings"
    raise ValueError(case)


NPZ = ["raw member", "nested npz", "shape of 10^12 elements", "shape of 8e9 elements", "pickled member",
       "object member", "text member", "member twice", "label 10^7", "label of int64 max", "label of uint64 max",
       "class names not UTF-8", "too many class names"]


def folder_case(tmp: Path, case: str) -> tuple[Path, str]:
    """A damaged folder of .npy files, and the words the refusal must hold."""
    where = tmp / "arrays"
    if case == "npy that is a zip":
        inner = zipped(tmp / "inner.npz", good_members()).read_bytes()
        return folder(where, **{"x_train.npy": inner}), f"{where / 'x_train.npy'} is a zip archive"
    if case == "text saved as npy":
        return folder(where, **{"x_train.npy": b"just some text\n" * 10}), \
            f"{where / 'x_train.npy'} is not a .npy array (it starts with b'just s')"
    if case == "pickle saved as npy":
        return folder(where, **{"x_train.npy": pickle.dumps(np.zeros(3))}), "x_train.npy is a pickle"
    if case == "shape of 10^12 elements":
        return folder(where, **{"x_train.npy": header_only((10**6, 1000, 1000))}), \
            "declares shape (1000000, 1000, 1000) of uint8 (1000000000000 bytes) but holds 64 bytes"
    if case == "truncated":
        return folder(where, **{"x_test.npy": npy_bytes(make_arrays()["x_test"])[:-7]}), \
            "the file is damaged or truncated"
    if case == "empty file":
        return folder(where, **{"y_test.npy": b""}), f"{where / 'y_test.npy'} is empty"
    if case == "bad header":
        data = npy_bytes(make_arrays()["x_test"])
        return folder(where, **{"x_test.npy": data[:10] + b"{'descr': <<<" + data[23:]}), "has a damaged .npy header"
    if case == "unknown npy beside the arrays":
        return folder(where, **{"X_train.npy": npy_bytes(make_arrays()["x_train"])}), \
            "holds unknown arrays ['X_train']"
    raise ValueError(case)


FOLDER = ["npy that is a zip", "text saved as npy", "pickle saved as npy", "shape of 10^12 elements", "truncated",
          "empty file", "bad header", "unknown npy beside the arrays"]


def refused(tmp_path: Path, capsys, data: Path) -> str:
    work = tmp_path / "work"
    return fails_cleanly(["run", "--dataset", "arrays", "--data-root", str(data), *RUN, "--out", str(work / "run")],
                         capsys, work)


@pytest.mark.parametrize("case", NPZ)
def test_a_hostile_npz_is_one_line_naming_the_cause(tmp_path, capsys, case):
    path, words = npz_case(tmp_path, case)
    err = refused(tmp_path, capsys, path)
    assert words in err, err


@pytest.mark.parametrize("case", FOLDER)
def test_a_hostile_folder_is_one_line_naming_the_cause(tmp_path, capsys, case):
    path, words = folder_case(tmp_path, case)
    err = refused(tmp_path, capsys, path)
    assert words in err, err
    if case != "pickle saved as npy":
        assert "pickle" not in err, err  # a text file is not "pickled Python objects"


def test_both_forms_refuse_the_same_unknown_array(tmp_path):
    extra = npy_bytes(make_arrays()["x_train"])
    npz = zipped(tmp_path / "d.npz", good_members(**{"X_train.npy": extra}))
    where = folder(tmp_path / "arrays", **{"X_train.npy": extra})
    messages = []
    for path in (npz, where):
        with pytest.raises(FedltError) as info:
            fedlt.datasets.create("arrays", root=path)
        messages.append(str(info.value).replace(str(path), "<path>"))
    assert messages[0] == messages[1] and "unknown arrays ['X_train']" in messages[0]


@pytest.mark.parametrize("form", ["npz", "folder"])
def test_arrays_beyond_this_machines_memory_are_refused_before_they_are_read(tmp_path, capsys, monkeypatch, form):
    """A zip bomb (50 MB of zeros in ~50 kB) and a folder whose float32 copy cannot fit: refused
    from the headers (the machine's memory made small here), nothing decompressed or allocated."""
    monkeypatch.setattr(arrays_module, "_memory", lambda: 10**7)
    big = np.zeros((50_000, 32, 32), dtype=np.uint8)
    members = good_members(**{"x_train.npy": npy_bytes(big), "y_train.npy": npy_bytes(np.arange(50_000) % 4)})
    if form == "npz":
        path = zipped(tmp_path / "bomb.npz", members, compress=True)
        assert path.stat().st_size < 500_000
        monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", lambda *a: pytest.fail("a member was read"))
        words = "unpacks to 51200128 bytes, more than this machine's memory (10000000 bytes)"
    else:
        path = tmp_path / "arrays"
        path.mkdir()
        for name, data in members.items():
            (path / name).write_bytes(data)
        words = "needs 204804320 bytes in memory (x_train (50000, 32, 32), x_test (10, 6, 6, 3) as float32)"
    err = refused(tmp_path, capsys, path)
    assert words in err, err

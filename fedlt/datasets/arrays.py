"""The ``arrays`` dataset: a user's own NumPy arrays, from one ``.npz`` or a folder of ``.npy`` files.

Required arrays: ``x_train``, ``y_train``, ``x_test``, ``y_test``. Optional: ``groups_train`` (a
natural group id per training sample: integers or strings, e.g. FEMNIST writer ids) and
``class_names`` (strings, one per class). Everything is checked when loaded, and a problem is one
line naming the array. Nothing is ever unpickled (``allow_pickle=False``); ``.npy`` files are
memory-mapped, so only the normalised float32 copy the run trains on is held in memory.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from fedlt.datasets import register
from fedlt.datasets.base import InMemoryDataset
from fedlt.errors import FedltError, first_line

REQUIRED = ("x_train", "y_train", "x_test", "y_test")
OPTIONAL = ("groups_train", "class_names")
IMAGE_DTYPES = (np.uint8, np.float16, np.float32, np.float64)
CHUNK = 1024  # samples converted at a time: bounds the float64 temporaries (~25 MiB at 32×32×3)
LAYOUT_HELP = "(N, H, W), (N, C, H, W) or (N, H, W, C) with C in 1, 3, 4"
WHAT = (f"an .npz holding {', '.join(REQUIRED)} (optional {', '.join(OPTIONAL)}), or a folder of those "
        ".npy files")


def _refused(where: Path, exc: Exception) -> FedltError:
    """numpy's own text suggests allow_pickle=True, which an untrusted file must never get."""
    text = str(exc)
    if "pickle" in text or "Python objects" in text or "Object arrays" in text:
        return FedltError(f"{where} holds Python objects (pickled), which fedlt never loads; store plain numeric "
                          "or string arrays")
    return FedltError(f"{where} cannot be read as NumPy arrays: {first_line(exc)[:160]}")


def read_arrays(root: str | Path) -> dict[str, np.ndarray]:
    """The arrays under ``root`` (an ``.npz`` file, or a folder of ``<name>.npy``), by name."""
    path = Path(root)
    if path.is_dir():
        missing = [f"{k}.npy" for k in REQUIRED if not (path / f"{k}.npy").is_file()]
        if missing:
            raise FedltError(f"dataset arrays: {path} lacks {', '.join(missing)} (expected {WHAT})")
        arrays = {}
        for key in REQUIRED + OPTIONAL:
            file = path / f"{key}.npy"
            if file.is_file():
                try:
                    arrays[key] = np.load(file, mmap_mode="r", allow_pickle=False)
                except (ValueError, OSError, EOFError) as exc:
                    raise _refused(file, exc) from None
        return arrays
    if not path.is_file():
        raise FedltError(f"dataset arrays: no file or folder at {path} (expected {WHAT})")
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"\x93NUMPY"):
        raise FedltError(f"dataset arrays: {path} is a single array, not {WHAT}")
    if not head.startswith(b"PK\x03\x04"):
        raise FedltError(f"dataset arrays: {path} is not an .npz archive (expected {WHAT})")
    try:
        with np.load(path, allow_pickle=False) as npz:
            unknown = sorted(set(npz.files) - set(REQUIRED) - set(OPTIONAL))
            if unknown:
                raise FedltError(f"dataset arrays: {path} holds unknown arrays {unknown[:5]} (allowed: "
                                 f"{', '.join(REQUIRED + OPTIONAL)})")
            missing = [k for k in REQUIRED if k not in npz.files]
            if missing:
                raise FedltError(f"dataset arrays: {path} lacks {', '.join(missing)} (expected {WHAT})")
            return {key: npz[key] for key in npz.files}  # .npz members are compressed or zipped: read whole
    except FedltError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise _refused(path, exc) from None


def _check_images(name: str, x: np.ndarray) -> tuple[int, int, int, bool]:
    """(C, H, W, channels_last) of an image array, after checking its shape and dtype."""
    if x.dtype not in IMAGE_DTYPES:
        raise FedltError(f"dataset arrays: {name} has dtype {x.dtype}; expected uint8 (0..255) or float")
    if x.ndim == 3:
        n, h, w = x.shape
        channels, channels_last = 1, False
    elif x.ndim == 4:
        channels_last = x.shape[3] in (1, 3, 4) and x.shape[1] not in (1, 3, 4)
        n, channels, h, w = (x.shape[0], x.shape[3], x.shape[1], x.shape[2]) if channels_last else x.shape
    else:
        raise FedltError(f"dataset arrays: {name} has shape {tuple(x.shape)}; expected {LAYOUT_HELP}")
    if min(n, channels, h, w) == 0:
        raise FedltError(f"dataset arrays: {name} has shape {tuple(x.shape)}: it is empty")
    if x.dtype != np.uint8:
        bad, first = 0, None
        for start in range(0, n, CHUNK):
            finite = np.isfinite(x[start:start + CHUNK]).reshape(min(CHUNK, n - start), -1).all(axis=1)
            if not finite.all():
                bad += int((~finite).sum())
                first = start + int(np.flatnonzero(~finite)[0]) if first is None else first
        if bad:
            raise FedltError(f"dataset arrays: {name} has non-finite values (NaN or inf) in {bad} image(s) "
                             f"(first: image {first})")
    return channels, h, w, channels_last


def _check_labels(name: str, y: np.ndarray, size: int, num_classes: int | None) -> None:
    if y.ndim != 1 or y.shape[0] != size:
        raise FedltError(f"dataset arrays: {name} has shape {tuple(y.shape)}; expected ({size},), one label per image")
    if y.dtype == bool or not np.issubdtype(y.dtype, np.integer):
        raise FedltError(f"dataset arrays: {name} has dtype {y.dtype}; expected integer class indices")
    lo, hi = int(y.min()), int(y.max())
    if lo < 0:
        raise FedltError(f"dataset arrays: {name} holds label {lo}; labels are class indices 0..C-1")
    if num_classes is not None and hi >= num_classes:
        raise FedltError(f"dataset arrays: {name} holds label {hi} but class_names names {num_classes} classes")


def _labels(y: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(y, dtype=np.int64))  # a copy: a memory-mapped file is read-only


def _group_ids(groups: np.ndarray, size: int) -> torch.Tensor:
    """Group ids 0..G-1 in the sorted order of the file's ids (integers or strings)."""
    if groups.ndim != 1 or groups.shape[0] != size:
        raise FedltError(f"dataset arrays: groups_train has shape {tuple(groups.shape)}; expected ({size},), "
                         "one group id per training image")
    if groups.dtype == bool or groups.dtype.kind not in "iuUS":
        raise FedltError(f"dataset arrays: groups_train has dtype {groups.dtype}; expected integer or string ids")
    _, codes = np.unique(np.asarray(groups), return_inverse=True)
    return torch.from_numpy(codes.reshape(-1).astype(np.int64))


def _class_names(names: np.ndarray) -> tuple[str, ...]:
    if names.ndim != 1 or names.dtype.kind not in "US" or names.size < 2:
        raise FedltError(f"dataset arrays: class_names has shape {tuple(names.shape)} and dtype {names.dtype}; "
                         "expected at least 2 strings, one per class")
    decoded = [v.decode() if isinstance(v, bytes) else str(v) for v in names.tolist()]
    if len(set(decoded)) != len(decoded):
        raise FedltError("dataset arrays: class_names repeats a name")
    return tuple(decoded)


def _chunks(x: np.ndarray, channels_last: bool):
    """Consecutive (start, float64 (n, C, H, W) in [0, 1] for uint8) slices of ``x``."""
    for start in range(0, x.shape[0], CHUNK):
        block = np.asarray(x[start:start + CHUNK], dtype=np.float64)
        if x.dtype == np.uint8:
            block /= 255.0
        if block.ndim == 3:
            block = block[:, None]
        yield start, block.transpose(0, 3, 1, 2) if channels_last else block


def channel_statistics(x: np.ndarray, channels_last: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and (population) std of an image array, in float64, two passes in chunks."""
    total, count = 0.0, 0
    for _, block in _chunks(x, channels_last):
        total = total + block.sum(axis=(0, 2, 3))
        count += block.shape[0] * block.shape[2] * block.shape[3]
    mean = total / count
    squares = 0.0
    for _, block in _chunks(x, channels_last):
        squares = squares + ((block - mean[None, :, None, None]) ** 2).sum(axis=(0, 2, 3))
    std = np.sqrt(squares / count)
    return mean, np.where(std > 0, std, 1.0)  # a constant channel is centred, not divided by zero


def standardise(x: np.ndarray, channels_last: bool, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    """float32 (N, C, H, W) channels-last tensor of (x - mean) / std, filled chunk by chunk."""
    n = x.shape[0]
    _, block = next(_chunks(x[:1], channels_last))
    out = torch.empty((n, *block.shape[1:]), dtype=torch.float32, memory_format=torch.channels_last)
    for start, block in _chunks(x, channels_last):
        block = (block - mean[None, :, None, None]) / std[None, :, None, None]
        out[start:start + block.shape[0]] = torch.from_numpy(block.astype(np.float32))
    return out


def load_arrays(root: str | Path, name: str = "arrays") -> InMemoryDataset:
    """Read, check and standardise the arrays under ``root`` (see the module docstring)."""
    arrays = read_arrays(root)
    x_train, x_test = arrays["x_train"], arrays["x_test"]
    shape_train = _check_images("x_train", x_train)
    shape_test = _check_images("x_test", x_test)
    if shape_train[:3] != shape_test[:3]:
        raise FedltError(f"dataset arrays: x_train images are {shape_train[:3]} (C, H, W) but x_test images are "
                         f"{shape_test[:3]}")
    class_names = _class_names(arrays["class_names"]) if "class_names" in arrays else None
    declared = None if class_names is None else len(class_names)
    _check_labels("y_train", arrays["y_train"], x_train.shape[0], declared)
    _check_labels("y_test", arrays["y_test"], x_test.shape[0], declared)
    num_classes = declared or int(max(arrays["y_train"].max(), arrays["y_test"].max())) + 1
    if num_classes < 2:
        raise FedltError("dataset arrays: the labels name a single class (0); a classifier needs at least 2")
    groups = _group_ids(arrays["groups_train"], x_train.shape[0]) if "groups_train" in arrays else None
    mean, std = channel_statistics(x_train, shape_train[3])  # the test set is standardised like the training set
    return InMemoryDataset(
        name, standardise(x_train, shape_train[3], mean, std), _labels(arrays["y_train"]),
        standardise(x_test, shape_test[3], mean, std), _labels(arrays["y_test"]), num_classes, groups, class_names,
    )


@register("arrays")
def arrays(root: str | Path | None = None, download: bool = False) -> InMemoryDataset:
    """Your own NumPy arrays (``--data-root``: an ``.npz`` holding ``x_train``, ``y_train``,
    ``x_test``, ``y_test`` and optionally ``groups_train`` and ``class_names``, or a folder of
    those ``.npy`` files, memory-mapped). Images are uint8 or float, (N, H, W), (N, C, H, W) or
    (N, H, W, C); they are standardised per channel by the training set's mean and std."""
    if download:
        raise FedltError("dataset arrays reads your own files: --download does not apply")
    if root is None:
        raise FedltError(f"dataset arrays needs --data-root: {WHAT}")
    return load_arrays(root)

"""The ``arrays`` dataset: a user's own NumPy arrays, from one ``.npz`` or a folder of ``.npy`` files.

Required arrays: ``x_train``, ``y_train``, ``x_test``, ``y_test``. Optional: ``groups_train`` (a
natural group id per training sample: integers or strings, e.g. FEMNIST writer ids) and
``class_names`` (strings, one per class). Everything is checked when loaded, and a problem is one
line naming the array. Nothing is ever unpickled (``allow_pickle=False``); ``.npy`` files are
memory-mapped, so only the normalised float32 copy the run trains on is held in memory.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlt.datasets import register
from fedlt.datasets.base import MAX_CLASSES, InMemoryDataset, npy_header
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


def _memory() -> int:
    """This machine's physical memory in bytes (what a run's arrays must fit in)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: a bound no real file reaches
        return 1 << 50


def _header(stream: Any, where: str, stored: int) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from the header of a ``.npy`` stream holding ``stored`` bytes in all, checked
    before a byte of data is read: a plain .npy (not a zip, not a pickle, not text), no Python
    objects, and exactly as many data bytes as the shape declares (a shape of 10^12 elements
    in a small file, or a truncated file, is refused here, never allocated)."""
    head = stream.read(6)
    if head != b"\x93NUMPY":
        kind = ("a zip archive (an .npz inside?)" if head.startswith(b"PK") else
                "a pickle (Python objects)" if head[:1] == b"\x80" else
                "empty" if not head else f"not a .npy array (it starts with {head[:6]!r})")
        raise FedltError(f"dataset arrays: {where} is {kind}; expected a .npy array saved by numpy.save")
    stream.seek(0)
    try:
        shape, fortran, dtype = npy_header(stream)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as exc:
        raise FedltError(f"dataset arrays: {where} has a damaged .npy header: {first_line(exc)[:120]}") from None
    if dtype.hasobject:
        raise FedltError(f"dataset arrays: {where} holds Python objects (pickled), which fedlt never loads; store "
                         "plain numeric or string arrays")
    declared = math.prod(shape) * dtype.itemsize
    if declared != stored - stream.tell():
        raise FedltError(f"dataset arrays: {where} declares shape {tuple(shape)} of {dtype} ({declared} bytes) but "
                         f"holds {stored - stream.tell()} bytes of data: the file is damaged or truncated")
    return tuple(shape), dtype


def _npz_members(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each member's (shape, dtype) from its header; only .npy members, each at most what the
    machine's memory holds (a zip bomb declares its size in the archive's directory)."""
    members = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            key = info.filename.removesuffix(".npy")
            if key == info.filename:
                raise FedltError(f"dataset arrays: {path} member {info.filename!r} is not a .npy array (expected "
                                 f"{', '.join(f'{k}.npy' for k in REQUIRED)})")
            if key in members:
                raise FedltError(f"dataset arrays: {path} holds {info.filename!r} twice")
            if info.file_size > _memory():
                raise FedltError(f"dataset arrays: {path} member {info.filename} unpacks to {info.file_size} bytes, "
                                 f"more than this machine's memory ({_memory()} bytes)")
            with archive.open(info) as stream:
                members[key] = _header(stream, f"{path} member {info.filename}", info.file_size)
    return members


def _folder_members(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    members = {}
    for file in sorted(path.glob("*.npy")):
        if file.is_file():
            with open(file, "rb") as stream:
                members[file.stem] = _header(stream, str(file), os.fstat(stream.fileno()).st_size)
    return members


def _check_names(path: Path, names: set[str]) -> None:
    """The same rule for both forms: every required array, nothing unknown (``X_train`` is a typo)."""
    unknown = sorted(names - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise FedltError(f"dataset arrays: {path} holds unknown arrays {unknown[:5]} (allowed: "
                         f"{', '.join(REQUIRED + OPTIONAL)})")
    missing = [k for k in REQUIRED if k not in names]
    if missing:
        raise FedltError(f"dataset arrays: {path} lacks {', '.join(missing)} (expected {WHAT})")


def _check_room(path: Path, members: dict[str, tuple[tuple[int, ...], np.dtype]], held: bool) -> None:
    """The float32 copies of the images (and, for an .npz, the arrays read whole) must fit in memory."""
    need = sum(4 * math.prod(members[k][0]) for k in ("x_train", "x_test"))
    if held:
        need += sum(math.prod(shape) * dtype.itemsize for shape, dtype in members.values())
    if need > _memory():
        sizes = ", ".join(f"{k} {members[k][0]}" for k in ("x_train", "x_test"))
        raise FedltError(f"dataset arrays: {path} needs {need} bytes in memory ({sizes} as float32), more than this "
                         f"machine's {_memory()} bytes")


def read_arrays(root: str | Path) -> dict[str, np.ndarray]:
    """The arrays under ``root`` (an ``.npz`` file, or a folder of ``<name>.npy``), by name; every
    header is checked (names, kind, declared sizes against the bytes and the machine) before any
    array is read."""
    path = Path(root)
    if path.is_dir():
        members = _folder_members(path)
        _check_names(path, set(members))
        _check_room(path, members, held=False)
        arrays = {}
        for key in members:
            try:
                arrays[key] = np.load(path / f"{key}.npy", mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:
                raise _refused(path / f"{key}.npy", exc) from None
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
        members = _npz_members(path)
        _check_names(path, set(members))
        _check_room(path, members, held=True)
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}  # .npz members are compressed or zipped: read whole
    except FedltError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError) as exc:
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
    lo, hi = int(y.min()), int(y.max())  # Python ints: uint64's largest is not -1 here
    if lo < 0:
        raise FedltError(f"dataset arrays: {name} holds label {lo}; labels are class indices 0..C-1")
    if hi >= MAX_CLASSES:
        raise FedltError(f"dataset arrays: {name} holds label {hi}, beyond the {MAX_CLASSES} classes a fedlt model "
                         f"may have (labels 0..{MAX_CLASSES - 1})")
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
    if names.ndim != 1 or names.dtype.kind not in "US" or not 2 <= names.size <= MAX_CLASSES:
        raise FedltError(f"dataset arrays: class_names has shape {tuple(names.shape)} and dtype {names.dtype}; "
                         f"expected 2..{MAX_CLASSES} strings, one per class")
    try:
        decoded = [v.decode() if isinstance(v, bytes) else str(v) for v in names.tolist()]
    except UnicodeDecodeError as exc:
        raise FedltError(f"dataset arrays: class_names holds bytes that are not UTF-8 ({first_line(exc)[:100]})"
                         ) from None
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


def _too_large(name: str) -> FedltError:
    return FedltError(f"dataset arrays: {name}'s values are too large to standardise (their mean or spread "
                      "overflows float64); scale the images to a smaller range, e.g. [0, 1]")


def channel_statistics(x: np.ndarray, channels_last: bool, name: str = "x_train") -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and (population) std of an image array, in float64, two passes in chunks;
    values whose statistics overflow float64 are one FedltError (numpy's warnings silenced: this says it)."""
    total, count = 0.0, 0
    with np.errstate(over="ignore", invalid="ignore"):
        for _, block in _chunks(x, channels_last):
            total = total + block.sum(axis=(0, 2, 3))
            count += block.shape[0] * block.shape[2] * block.shape[3]
        mean = total / count
        squares = 0.0
        for _, block in _chunks(x, channels_last):
            squares = squares + ((block - mean[None, :, None, None]) ** 2).sum(axis=(0, 2, 3))
        std = np.sqrt(squares / count)
    if not (np.isfinite(mean).all() and np.isfinite(std).all()):
        raise _too_large(name)
    return mean, np.where(std > 0, std, 1.0)  # a constant channel is centred, not divided by zero


def standardise(x: np.ndarray, channels_last: bool, mean: np.ndarray, std: np.ndarray,
                name: str = "x_train") -> torch.Tensor:
    """float32 (N, C, H, W) channels-last tensor of (x - mean) / std, filled chunk by chunk; a value
    that leaves float32's range on the way (the test set far from the training set's statistics)
    is one FedltError naming the array."""
    n = x.shape[0]
    _, block = next(_chunks(x[:1], channels_last))
    out = torch.empty((n, *block.shape[1:]), dtype=torch.float32, memory_format=torch.channels_last)
    for start, block in _chunks(x, channels_last):
        with np.errstate(over="ignore", invalid="ignore"):
            block = ((block - mean[None, :, None, None]) / std[None, :, None, None]).astype(np.float32)
        if not np.isfinite(block).all():
            raise _too_large(name)
        out[start:start + block.shape[0]] = torch.from_numpy(block)
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
        standardise(x_test, shape_test[3], mean, std, "x_test"), _labels(arrays["y_test"]), num_classes, groups,
        class_names,
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

"""The ``imagefolder`` dataset: image files streamed from disk, decoded when a step needs them.

Two layouts, as torchvision and the long-tailed benchmarks ship them:

- **folders** (torchvision's ImageFolder): ``root/train/<class>/**/<image>`` and
  ``root/test/<class>/**/<image>``; the classes are the training folder names, sorted
  (torchvision's order), and a test folder must name one of them;
- **file lists** (ImageNet-LT, iNaturalist split files): ``train_list`` and ``test_list``, text
  files of ``<image path> <label>`` lines, paths relative to ``root``.

Only the paths (one compact byte array, no per-file Python object) and the labels are held in
memory. An image is decoded when a minibatch holding it is drawn (by the DataLoader workers of
``--loader-workers``, in the client's own batch order), converted to ``channels`` (RGB or grey),
resized, and standardised into the float32 channels-last tensor every fedlt model takes. With
``cache``, each decoded and resized image is also kept as uint8 in a ``.npy`` file under that
folder, keyed by the file list and the size, so a repeated run reads it instead of decoding.

Every file is checked when the dataset is opened (it exists, can be read, and starts like an
image); an image that fails to decode later stops the run with one line naming the file (and its
list line).
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from fedlt.datasets import register
from fedlt.datasets.base import InMemoryDataset, normalise
from fedlt.errors import FedltError, first_line
from fedlt.spec import shown
from fedlt.start_method import process_context

WHAT = "dataset imagefolder"
# torchvision's IMG_EXTENSIONS, and GIF; anything else in a class folder is skipped, as torchvision does
SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
# the first bytes of every format Pillow decodes for these suffixes
SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*",
              b"P1", b"P2", b"P3", b"P4", b"P5", b"P6")
FORMATS = "JPEG, PNG, GIF, BMP, WebP, TIFF, PPM/PGM"
STATS_IMAGES = 2048  # training images (evenly spaced) whose pixels give the default mean and std
MAX_IMAGE_SIZE = 4096
CACHE_FORMAT = 2  # part of the cache key: a change of the decoding below makes new cache files


# -- listing the files ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Listing:
    """One split's files: paths (bytes), labels, and where each was listed (for messages)."""

    paths: np.ndarray  # |S| bytes, one per image (no per-path Python object: cheap to fork and pickle)
    labels: np.ndarray  # int64
    lines: np.ndarray | None = None  # 1-based line of each image in ``listed_in``
    listed_in: str | None = None

    def where(self, position: int) -> str:
        path = os.fsdecode(self.paths[position])
        return path if self.lines is None else f"{path} ({self.listed_in} line {int(self.lines[position])})"


def _visible(name: str) -> bool:
    return not name.startswith(".")


def list_folders(root: Path, split: str, classes: list[str] | None = None) -> tuple[Listing, list[str]]:
    """``root/split/<class>/**/<image>``; ``classes`` (the training split's) fixes the indices."""
    folder = root / split
    if not folder.is_dir():
        raise FedltError(f"{WHAT}: no folder {folder} (expected {root}/train/<class>/<image> and "
                         f"{root}/test/<class>/<image>, or train_list and test_list files)")
    found = sorted(e.name for e in os.scandir(folder) if e.is_dir() and _visible(e.name))
    if classes is None:
        classes = found
        if len(classes) < 2:
            raise FedltError(f"{WHAT}: {folder} holds {len(classes)} class folder(s); a classifier needs at least 2")
    else:
        unknown = [c for c in found if c not in classes]
        if unknown:
            raise FedltError(f"{WHAT}: {folder / unknown[0]} is not a class of the training split "
                             f"(its classes: {', '.join(classes[:8])}{', ...' if len(classes) > 8 else ''})")
    index = {c: i for i, c in enumerate(classes)}
    paths, labels = [], []
    for name in found:
        files = []
        for parent, dirs, names in os.walk(folder / name, followlinks=True):
            dirs[:] = sorted(d for d in dirs if _visible(d))
            files += [os.path.join(parent, n) for n in sorted(names)
                      if _visible(n) and n.lower().endswith(SUFFIXES)]
        if not files and split == "train":
            raise FedltError(f"{WHAT}: {folder / name} holds no images ({', '.join(SUFFIXES)})")
        paths += files
        labels += [index[name]] * len(files)
    if not paths:
        raise FedltError(f"{WHAT}: {folder} holds no images ({', '.join(SUFFIXES)})")
    return Listing(np.array([os.fsencode(p) for p in paths]), np.array(labels, dtype=np.int64)), classes


def read_list(root: Path, list_file: str | Path, what: str) -> Listing:
    """A split file of ``<image path> <label>`` lines (blank lines skipped); paths under ``root``."""
    path = Path(list_file) if Path(list_file).is_absolute() else root / list_file
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FedltError(f"{WHAT}: {what}: no file at {path}") from None
    except UnicodeDecodeError as exc:
        raise FedltError(f"{WHAT}: {what} {path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise FedltError(f"{WHAT}: {what} {path} cannot be read: {exc.strerror or first_line(exc)}") from None
    paths, labels, lines = [], [], []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        parts = line.rsplit(None, 1)  # a path may hold spaces; the label is the last word
        if len(parts) != 2:
            raise FedltError(f"{WHAT}: {what} {path} line {number}: expected '<image path> <label>', got {shown(line)}")
        if not parts[1].isascii() or not parts[1].isdigit():
            raise FedltError(f"{WHAT}: {what} {path} line {number}: label {shown(parts[1])} is not a class index "
                             "(an integer 0, 1, 2, ...)")
        label = int(parts[1])
        if label > np.iinfo(np.int32).max:
            raise FedltError(f"{WHAT}: {what} {path} line {number}: label {label} is beyond any class count")
        image = Path(parts[0])
        paths.append(os.fsencode(image if image.is_absolute() else root / image))
        labels.append(label)
        lines.append(number)
    if not paths:
        raise FedltError(f"{WHAT}: {what} {path} lists no images")
    return Listing(np.array(paths), np.array(labels, dtype=np.int64), np.array(lines, dtype=np.int32), str(path))


def check_files(listing: Listing) -> np.ndarray:
    """Every file exists, can be read, and starts like an image; returns (size, mtime_ns) per file
    (the cache key). One line naming the first bad file (and its list line)."""
    stamps = np.empty((len(listing.paths), 2), dtype=np.int64)
    for i, raw in enumerate(listing.paths):
        try:
            with open(raw, "rb") as f:
                head = f.read(16)
                stat = os.fstat(f.fileno())
        except FileNotFoundError:
            raise FedltError(f"{WHAT}: no image at {listing.where(i)}") from None
        except IsADirectoryError:
            raise FedltError(f"{WHAT}: {listing.where(i)} is a folder, not an image") from None
        except OSError as exc:
            raise FedltError(f"{WHAT}: cannot read {listing.where(i)}: {exc.strerror or first_line(exc)}") from None
        if not (head.startswith(SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")):
            raise FedltError(f"{WHAT}: {listing.where(i)} is not an image ({FORMATS})"
                             + (": the file is empty" if not head else ""))
        stamps[i] = (stat.st_size, stat.st_mtime_ns)
    return stamps


# -- decoding -------------------------------------------------------------------------------------
def decode(path: bytes | str, size: int, channels: int, fit: str) -> np.ndarray:
    """One image as uint8 (size, size, C), channels last as Pillow gives it: Pillow's decoding, ``convert("RGB")`` (or ``"L"``), then
    torchvision's ``Resize(size)`` + ``CenterCrop(size)`` on the PIL image (``fit="crop"``: the
    shorter side to ``size``, bilinear with antialiasing, the centre kept) or ``Resize((size, size))``
    (``fit="stretch"``). Raises whatever Pillow raises on a damaged file."""
    from PIL import Image

    with Image.open(os.fsdecode(path)) as opened:
        image = opened.convert("RGB" if channels == 3 else "L")
    w, h = image.size
    if fit == "crop":
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(size * long / short)
        new = (size, new_long) if w <= h else (new_long, size)
        if new != (w, h):
            image = image.resize(new, Image.BILINEAR)
        top, left = int(round((new[1] - size) / 2.0)), int(round((new[0] - size) / 2.0))
        image = image.crop((left, top, left + size, top + size))
    elif (w, h) != (size, size):
        image = image.resize((size, size), Image.BILINEAR)
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels[:, :, None] if pixels.ndim == 2 else pixels


class Cache:
    """Decoded, resized images as uint8 in ``<key>.npy`` (N, S, S, C) beside ``<key>.filled`` (one
    byte per image, set once its row is written). Rows are read and written with ``pread`` /
    ``pwrite`` — safe from several processes at once, and no mapped page ever counts in a process's
    memory — and the ``.npy`` opens with ``np.load(mmap_mode="r")`` for anyone else."""

    def __init__(self, folder: Path, key: str, count: int, item: tuple[int, int, int]) -> None:
        self.npy, self.filled = folder / f"{key}.npy", folder / f"{key}.filled"
        self.row = int(np.prod(item))
        if not (self.npy.is_file() and self.filled.is_file()):
            folder.mkdir(parents=True, exist_ok=True)
            partial = self.npy.with_name(f"{key}.npy.{os.getpid()}.tmp")
            np.lib.format.open_memmap(partial, mode="w+", dtype=np.uint8, shape=(count, *item)).flush()
            self.filled.write_bytes(bytes(count))
            os.replace(partial, self.npy)
        with open(self.npy, "rb") as f:
            np.lib.format.read_magic(f)
            np.lib.format.read_array_header_1_0(f)
            self.offset = f.tell()
        self._fds: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": None}  # a file descriptor does not cross processes

    def _open(self) -> tuple[int, int]:
        if self._fds is None:
            self._fds = (os.open(self.npy, os.O_RDWR), os.open(self.filled, os.O_RDWR))
        return self._fds

    def get(self, position: int) -> np.ndarray | None:
        rows, flags = self._open()
        if os.pread(flags, 1, position) != b"\x01":
            return None
        return np.frombuffer(os.pread(rows, self.row, self.offset + position * self.row), dtype=np.uint8)

    def put(self, position: int, pixels: np.ndarray) -> None:
        rows, flags = self._open()
        os.pwrite(rows, np.ascontiguousarray(pixels).tobytes(), self.offset + position * self.row)
        os.pwrite(flags, b"\x01", position)  # after the row: a row marked filled is whole


@dataclass(frozen=True, eq=False)
class ImageFiles:
    """A split's files and how they are read: decoded, ``channels``, ``size``×``size``, uint8."""

    listing: Listing
    size: int
    channels: int
    fit: str
    cache: Cache | None = None
    # DataLoaders with persistent workers, kept per decoding (mean, std, transforms, workers, device)
    # and each lent to one stream at a time: a client's (or an evaluation's) stream reuses the worker
    # processes instead of starting its own (~0.1 s each); concurrent streams (split learning's
    # sessions) get one each. They live as long as these files (never pickled).
    kept: dict = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "kept": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def read(self, positions: np.ndarray) -> np.ndarray:
        """uint8 (n, S, S, C) of the files at ``positions`` (from the cache where it holds them)."""
        out = np.empty((len(positions), self.size, self.size, self.channels), dtype=np.uint8)
        for k, p in enumerate(positions.tolist()):  # one file per image: decoding is per file anyway
            cached = None if self.cache is None else self.cache.get(p)
            if cached is not None:
                out[k] = cached.reshape(out.shape[1:])
                continue
            try:
                out[k] = decode(self.listing.paths[p], self.size, self.channels, self.fit)
            except Exception as exc:  # noqa: BLE001  (Pillow raises many kinds on a damaged file)
                raise FedltError(f"{WHAT}: cannot decode {self.listing.where(p)}: "
                                 f"{type(exc).__name__}: {first_line(exc)[:160]}") from None
            if self.cache is not None:
                self.cache.put(p, out[k])
        return out


# -- the lazy source --------------------------------------------------------------------------------
def _positions(idx: torch.Tensor | slice | np.ndarray | list) -> np.ndarray | slice:
    if isinstance(idx, slice):
        return idx
    if isinstance(idx, torch.Tensor):
        return idx.detach().cpu().numpy()
    return np.asarray(idx, dtype=np.int64)


def _as_is(batch: Any) -> Any:
    return batch


def _decode(files: ImageFiles, positions: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...],
            transforms: tuple[Callable[[torch.Tensor], torch.Tensor], ...]) -> torch.Tensor:
    """The files at ``positions`` decoded, standardised (fedlt.datasets.base.normalise) and transformed.
    The pixels stay channels last: (N, H, W, C) seen as (N, C, H, W) is already the channels-last
    layout normalise produces, so it costs no copy."""
    x = normalise(torch.from_numpy(files.read(positions)).permute(0, 3, 1, 2), mean, std)
    for transform in transforms:
        x = transform(x)
    return x


class _Decoder(torch.utils.data.Dataset):
    """What a DataLoader worker runs: a whole batch of file positions decoded at once
    (``__getitems__``). A decoding error comes back as its one line (a worker's exception would
    arrive wrapped in its traceback)."""

    def __init__(self, files: ImageFiles, mean: tuple[float, ...], std: tuple[float, ...],
                 transforms: tuple[Callable[[torch.Tensor], torch.Tensor], ...]) -> None:
        self.files, self.mean, self.std, self.transforms = files, mean, std, transforms

    def __len__(self) -> int:
        return len(self.files.listing.paths)

    def __getitem__(self, i: int) -> torch.Tensor | str:
        return self.__getitems__([i])

    def __getitems__(self, positions: list[int]) -> torch.Tensor | str:
        try:
            return _decode(self.files, np.asarray(positions, dtype=np.int64), self.mean, self.std, self.transforms)
        except FedltError as exc:
            return str(exc)


class _Feed:
    """The batch sampler of a kept DataLoader: the current stream's batches (file positions); each
    ``iter(loader)`` starts the stream set last."""

    def __init__(self) -> None:
        self.batches: Iterator[list[int]] = iter(())

    def __iter__(self) -> Iterator[list[int]]:
        return self.batches


_KEPT_LOCK = threading.Lock()  # the evaluation may read (in a thread) while clients train


@dataclass(frozen=True, eq=False)
class FileImages:
    """An ImageSource (fedlt.datasets.source) over image files: ``index`` picks the split's files
    (a client's subset is the same files with a shorter index), decoded on demand into standardised
    float32 channels-last tensors, then through ``transforms`` (the test set's evaluation
    transforms), on ``device``. ``workers`` DataLoader processes decode ``batches`` and ``chunks``
    ahead of the consumer (none inside a daemonic process, which cannot start any: fedlt.parallel's
    workers decode their own clients' files)."""

    files: ImageFiles
    index: np.ndarray
    mean: tuple[float, ...]
    std: tuple[float, ...]
    item_shape: tuple[int, int, int]
    transforms: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    workers: int = 0

    dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.index), *self.item_shape))

    def __len__(self) -> int:
        return len(self.index)

    def __repr__(self) -> str:
        return f"FileImages({len(self)} images of {self.item_shape}, workers={self.workers})"

    def subset(self, idx: torch.Tensor | slice) -> "FileImages":
        return replace(self, index=self.index[_positions(idx)])

    def take(self, idx: torch.Tensor | slice) -> torch.Tensor:
        positions = np.atleast_1d(self.index[_positions(idx)])
        return _decode(self.files, positions, self.mean, self.std, self.transforms).to(self.device)

    def _lend(self) -> tuple[Any, _Feed]:
        """A kept DataLoader for this split's decoding (made on first need), lent to one stream."""
        key = (self.mean, self.std, self.transforms, self.workers, self.device.type)
        with _KEPT_LOCK:
            idle = self.files.kept.setdefault(key, [])
            if idle:
                return idle.pop()
        feed = _Feed()
        with warnings.catch_warnings():  # the number of workers is the user's choice (--loader-workers)
            warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
            loader = torch.utils.data.DataLoader(
                # a copy of the files without the kept loaders: no reference cycle, so the loaders (and
                # their processes) end as soon as the files are dropped, not at a garbage collection
                # whose order of finalisation can leave their workers unstopped for seconds
                _Decoder(replace(self.files, kept={}), self.mean, self.std, self.transforms), batch_sampler=feed,
                num_workers=self.workers, collate_fn=_as_is, pin_memory=self.device.type == "cuda",
                persistent_workers=True,
                # started by fedlt.start_method's fork server, never forked from this process: a loader may
                # start inside the evaluation thread, and a fork of a process whose other threads hold
                # locks can hang its child (seen with --workers: the overlapped evaluation's loader)
                multiprocessing_context=process_context(),
                generator=torch.Generator().manual_seed(0))  # a seed draw from torch's would shift the client's stream
        return loader, feed

    def _give_back(self, kept: tuple[Any, _Feed]) -> None:
        key = (self.mean, self.std, self.transforms, self.workers, self.device.type)
        with _KEPT_LOCK:
            self.files.kept.setdefault(key, []).append(kept)

    def _stream(self, index_batches: Iterable[Any]) -> Iterator[tuple[Any, torch.Tensor]]:
        """(idx, decoded images) for each index batch, in order."""
        if self.workers == 0 or multiprocessing.current_process().daemon:
            for idx in index_batches:
                yield idx, self.take(idx)
            return
        drawn: collections.deque = collections.deque()  # the loader reads ahead: labels pair up as batches return

        def positions() -> Iterator[list[int]]:
            for idx in index_batches:
                drawn.append(idx)
                yield np.atleast_1d(self.index[_positions(idx)]).tolist()

        loader, feed = kept = self._lend()
        feed.batches = positions()
        try:
            with warnings.catch_warnings():  # the number of workers is the user's choice (--loader-workers)
                warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
                batches = iter(loader)
            for x in batches:
                idx = drawn.popleft()
                if isinstance(x, str):
                    raise FedltError(x)
                yield idx, x.to(self.device, non_blocking=True)
        finally:  # a stream left half-read is drained by the next one's iter()
            feed.batches = iter(())
            self._give_back(kept)

    def batches(self, labels: torch.Tensor, index_batches: Iterable[torch.Tensor]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx, x in self._stream(index_batches):
            yield x, labels[idx]

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        n = len(self)
        for _, x in self._stream(torch.arange(s, min(s + size, n)) for s in range(0, n, size)):
            yield x

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, int, int]) -> "FileImages":
        return replace(self, transforms=(*self.transforms, fn), item_shape=tuple(shape))

    def to(self, device: torch.device | str) -> "FileImages":
        return replace(self, device=torch.device(device))

    def shared(self) -> "FileImages":
        return self  # paths only: each worker process opens the files itself

    def loading(self, workers: int) -> "FileImages":
        return replace(self, workers=int(workers))


# -- the dataset ----------------------------------------------------------------------------------
def cache_key(listing: Listing, stamps: np.ndarray, size: int, channels: int, fit: str) -> str:
    """sha256 of the files (paths, sizes, modification times) and how they are decoded."""
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT, size, channels, fit]).encode())
    digest.update(b"\0".join(listing.paths.tolist()))
    digest.update(np.ascontiguousarray(stamps).tobytes())
    return digest.hexdigest()[:32]


def pixel_statistics(files: ImageFiles, count: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std in [0, 1] units over ``STATS_IMAGES`` evenly spaced
    images (all of them when fewer), in float64, in one pass (each block's mean and squared
    deviations merged as Chan et al. do: no cancellation); a constant channel gets std 1."""
    positions = np.unique(np.linspace(0, count - 1, min(count, STATS_IMAGES)).round().astype(np.int64))
    n, mean, m2 = 0, 0.0, 0.0
    for start in range(0, len(positions), 256):
        block = files.read(positions[start:start + 256]).astype(np.float64) / 255.0
        k = block.shape[0] * block.shape[1] * block.shape[2]  # (n, S, S, C): per channel, the last axis
        block_mean = block.mean(axis=(0, 1, 2))
        block_m2 = ((block - block_mean) ** 2).sum(axis=(0, 1, 2))
        delta = block_mean - mean
        mean = mean + delta * k / (n + k)
        m2 = m2 + block_m2 + delta ** 2 * n * k / (n + k)
        n += k
    std = np.sqrt(m2 / n)
    return tuple(np.asarray(mean).tolist()), tuple(np.where(std > 0, std, 1.0).tolist())


def _channel_values(name: str, values: Any, channels: int, positive: bool) -> tuple[float, ...]:
    values = [values] if isinstance(values, (int, float)) else values
    ok = isinstance(values, (list, tuple)) and len(values) == channels and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) and (v > 0 or not positive)
        for v in values)
    if not ok:
        raise FedltError(f"{WHAT}: {name} must be {channels} finite number(s){' > 0' if positive else ''}, one per "
                         f"channel, got {values!r}")
    return tuple(float(v) for v in values)


def _whole(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FedltError(f"{WHAT}: {name} must be an integer in {lo}..{hi}, got {value!r}")
    return value


@register("imagefolder")
def imagefolder(root: str | Path | None = None, download: bool = False, image_size: int = 32, channels: int = 3,
                train_list: str | None = None, test_list: str | None = None, fit: str = "crop",
                mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None,
                cache: str | None = None) -> InMemoryDataset:
    """Image files streamed from disk (``--data-root``): torchvision's ImageFolder layout
    (``train/<class>/<image>``, ``test/<class>/<image>``) or ImageNet-LT / iNaturalist split files
    (``<image path> <label>`` per line), decoded on demand by ``--loader-workers`` processes.

    Each image is converted to ``channels``, resized to ``image_size``² as torchvision's
    ``Resize(image_size)`` + ``CenterCrop(image_size)`` do on PIL images (``fit="crop"``) or
    stretched (``fit="stretch"``), and standardised per channel: x = (pixel/255 − mean) / std,
    with the mean and std over 2048 evenly spaced training images unless given. Only paths and
    labels are held in memory.

    Args:
        image_size: height and width of every image after resizing (pixels).
        channels: 3 (RGB) or 1 (grey); images are converted as Pillow's convert does.
        train_list: file of '<image path> <label>' lines for the training split (relative paths:
            under root); with test_list, instead of the train/ and test/ folders.
        test_list: the same for the test split.
        fit: crop (shorter side to image_size, centre crop) or stretch (both sides to image_size).
        mean: per-channel mean in [0, 1] units (e.g. ImageNet's 0.485, 0.456, 0.406); default:
            computed from the training images.
        std: per-channel std, with mean; default: computed from the training images.
        cache: a folder keeping decoded, resized uint8 images (.npy, keyed by the file list and
            the size) for repeated runs; default: none.
    """
    if download:
        raise FedltError(f"{WHAT} reads your own files: --download does not apply")
    if root is None:
        raise FedltError(f"{WHAT} needs --data-root: a folder with train/<class>/<image> and test/<class>/<image>, "
                         "or the folder the train_list and test_list paths are relative to")
    root = Path(root)
    if not root.is_dir():
        raise FedltError(f"{WHAT}: --data-root {root} is not a folder")
    size = _whole("image_size", image_size, 1, MAX_IMAGE_SIZE)
    channels = _whole("channels", channels, 1, 3)
    if channels == 2:
        raise FedltError(f"{WHAT}: channels must be 1 (grey) or 3 (RGB), got 2")
    if fit not in ("crop", "stretch"):
        raise FedltError(f"{WHAT}: fit must be crop or stretch, got {fit!r}")
    if (mean is None) != (std is None):
        raise FedltError(f"{WHAT}: give both mean and std, or neither (then both are computed)")
    if (train_list is None) != (test_list is None):
        raise FedltError(f"{WHAT}: give both train_list and test_list, or neither (then root/train and root/test "
                         "hold one folder per class)")
    if train_list is not None:
        train, test = read_list(root, train_list, "train_list"), read_list(root, test_list, "test_list")
        num_classes = int(max(train.labels.max(), test.labels.max())) + 1
        if num_classes < 2:
            raise FedltError(f"{WHAT}: the lists name a single class (0); a classifier needs at least 2")
        class_names = None
    else:
        train, classes = list_folders(root, "train")
        test, _ = list_folders(root, "test", classes)
        num_classes, class_names = len(classes), tuple(classes)
    sources = []
    stats_file = None
    for listing in (train, test):
        stamps = check_files(listing)
        store = None
        if cache is not None:
            key = cache_key(listing, stamps, size, channels, fit)
            try:
                store = Cache(Path(cache), key, len(listing.paths), (size, size, channels))
            except OSError as exc:
                raise FedltError(f"{WHAT}: cache folder {cache} cannot be used: {exc.strerror or first_line(exc)}"
                                 ) from None
            stats_file = stats_file or Path(cache) / f"{key}.stats.json"  # the training split's
        sources.append(ImageFiles(listing, size, channels, fit, store))
    if mean is not None:
        stats = (_channel_values("mean", mean, channels, False), _channel_values("std", std, channels, True))
    elif stats_file is not None and stats_file.is_file():
        saved = json.loads(stats_file.read_text())
        stats = (tuple(saved["mean"]), tuple(saved["std"]))
    else:
        stats = pixel_statistics(sources[0], len(train.paths))
        if stats_file is not None:
            stats_file.write_text(json.dumps({"mean": stats[0], "std": stats[1]}))
    x_train, x_test = (FileImages(files, np.arange(len(files.listing.paths)), *stats, (channels, size, size))
                       for files in sources)
    return InMemoryDataset("imagefolder", x_train, torch.from_numpy(train.labels), x_test,
                           torch.from_numpy(test.labels), num_classes, class_names=class_names)

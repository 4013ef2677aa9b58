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
import stat
import threading
import time
import warnings
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from fedlt.datasets import register
from fedlt.datasets.base import MAX_CLASSES, InMemoryDataset, normalise, npy_header
from fedlt.errors import FedltError, first_line
from fedlt.spec import shown
from fedlt.start_method import exit_words, process_context

WHAT = "dataset imagefolder"
# torchvision's IMG_EXTENSIONS, and GIF; anything else in a class folder is skipped, as torchvision does
SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
# the first bytes of every format Pillow decodes for these suffixes
SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*",
              b"P1", b"P2", b"P3", b"P4", b"P5", b"P6")
FORMATS = "JPEG, PNG, GIF, BMP, WebP, TIFF, PPM/PGM"
STATS_IMAGES = 2048  # training images (evenly spaced) whose pixels give the default mean and std
MAX_IMAGE_SIZE = 4096
MAX_LIST_BYTES = 1 << 30  # 1 GiB: ImageNet-21k's 13 M lines take ~0.8 GiB; read whole, as Python strings
CACHE_FORMAT = 3  # 3: a CRC-32 per row; part of the cache key: a change of the decoding below makes new cache files


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


def _outside(real: str, bases: tuple[str, ...]) -> bool:
    return not any(real == b or real.startswith(b.rstrip(os.sep) + os.sep) for b in bases)


def _walk_images(top: Path, bases: tuple[str, ...], walked: set[tuple[int, int]]
                 ) -> list[tuple[str, tuple[int, int], bool]]:
    """(path, file id, reached through a link) of the image files under ``top``, depth first in
    sorted order (os.walk's). Links are followed only to places under ``bases`` (the data root),
    and a folder reached through a link is not walked if it already was (a loop: ``loop -> ..``),
    so the walk ends. Anything with an image suffix that is not a regular file (a FIFO, a device)
    is refused by name without being opened: reading it could block for ever."""
    found: list[tuple[str, tuple[int, int], bool]] = []
    stack = [(str(top), False)]
    while stack:
        folder, linked = stack.pop()
        try:
            info = os.stat(folder)
            if linked and (info.st_dev, info.st_ino) in walked:
                continue
            walked.add((info.st_dev, info.st_ino))
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            raise FedltError(f"{WHAT}: cannot read folder {folder}: {exc.strerror or first_line(exc)}") from None
        subfolders = []
        for entry in entries:
            if not _visible(entry.name):
                continue
            link = entry.is_symlink()
            if link and _outside(os.path.realpath(entry.path), bases):
                raise FedltError(f"{WHAT}: {entry.path} is a link to {os.path.realpath(entry.path)}, outside "
                                 f"--data-root; fedlt does not follow links out of it (list such images in "
                                 "train_list / test_list files instead)")
            try:
                info = entry.stat()  # follows a link (inside the root), never opens the file
            except OSError:  # a dangling link or a loop of links: torchvision skips it too
                continue
            if stat.S_ISDIR(info.st_mode):
                subfolders.append((entry.path, linked or link))
            elif entry.name.lower().endswith(SUFFIXES):
                if not stat.S_ISREG(info.st_mode):
                    raise FedltError(f"{WHAT}: {entry.path} is {_kind(info.st_mode)}, not an image file")
                found.append((entry.path, (info.st_dev, info.st_ino), linked or link))
        stack += reversed(subfolders)
    return found


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, words in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return words
    return "not a regular file"


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
    bases = (os.path.realpath(root), os.path.realpath(folder))  # a split folder may itself be a link
    # the split folder and every class folder: a link to one of them (a loop, or another class) is not walked
    walked = {(i.st_dev, i.st_ino) for i in map(os.stat, [folder, *(folder / n for n in found)])}
    walks = {}
    for name in found:
        if os.path.islink(folder / name) and _outside(os.path.realpath(folder / name), bases):
            raise FedltError(f"{WHAT}: {folder / name} is a link to {os.path.realpath(folder / name)}, outside "
                             "--data-root; fedlt does not follow links out of it")
        walks[name] = _walk_images(folder / name, bases, walked)
    # each real file once, in the class where it really is (a link to it elsewhere is a second path to it)
    owner: dict[tuple[int, int], tuple[str, bool]] = {}
    for name, files in walks.items():
        for path, file_id, linked in files:
            if file_id not in owner or (owner[file_id][1] and not linked):
                owner[file_id] = (path, linked)
    paths, labels = [], []
    for name, files in walks.items():
        kept = [path for path, file_id, _ in files if owner[file_id][0] == path]
        if not kept and split == "train":
            raise FedltError(f"{WHAT}: {folder / name} holds no images ({', '.join(SUFFIXES)})")
        paths += kept
        labels += [index[name]] * len(kept)
    if not paths:
        raise FedltError(f"{WHAT}: {folder} holds no images ({', '.join(SUFFIXES)})")
    return Listing(np.array([os.fsencode(p) for p in paths]), np.array(labels, dtype=np.int64)), classes


def _read_text(path: Path, what: str) -> str:
    """A list file's text: a regular file (a FIFO or device is refused by name before it is opened:
    reading it could block or never end) of at most ``MAX_LIST_BYTES``, UTF-8 (a byte-order mark
    dropped), without NUL bytes."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise FedltError(f"{WHAT}: {what} {path} is {_kind(info.st_mode)}, not a text file")
        if info.st_size > MAX_LIST_BYTES:
            raise FedltError(f"{WHAT}: {what} {path} is {info.st_size} bytes, beyond the {MAX_LIST_BYTES} a list "
                             "file may hold")
        with open(path, "rb") as f:
            raw = f.read(MAX_LIST_BYTES + 1)  # the file may have grown since stat
    except FileNotFoundError:
        raise FedltError(f"{WHAT}: {what}: no file at {path}") from None
    except OSError as exc:
        raise FedltError(f"{WHAT}: {what} {path} cannot be read: {exc.strerror or first_line(exc)}") from None
    if len(raw) > MAX_LIST_BYTES:
        raise FedltError(f"{WHAT}: {what} {path} is beyond the {MAX_LIST_BYTES} bytes a list file may hold")
    if b"\0" in raw:
        line = raw.count(b"\n", 0, raw.index(b"\0")) + 1
        raise FedltError(f"{WHAT}: {what} {path} line {line} holds a NUL byte: it is not a text file")
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not part of a path
    except UnicodeDecodeError as exc:
        raise FedltError(f"{WHAT}: {what} {path} is not UTF-8 text (byte {exc.start})") from None


def read_list(root: Path, list_file: str | Path, what: str) -> Listing:
    """A split file of ``<image path> <label>`` lines (blank lines skipped); paths under ``root``."""
    path = Path(list_file) if Path(list_file).is_absolute() else root / list_file
    text = _read_text(path, what)
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
        if len(parts[1]) > 12 or int(parts[1]) >= MAX_CLASSES:  # length first: int() of 10^6 digits is slow
            raise FedltError(f"{WHAT}: {what} {path} line {number}: label {shown(parts[1])} is beyond the "
                             f"{MAX_CLASSES} classes a fedlt model may have (labels 0..{MAX_CLASSES - 1})")
        label = int(parts[1])
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
            info = os.stat(raw)  # a FIFO or device is refused before it is opened: opening could block
            if not stat.S_ISREG(info.st_mode):
                raise FedltError(f"{WHAT}: {listing.where(i)} is {_kind(info.st_mode)}, not an image file")
            fd = os.open(raw, os.O_RDONLY | os.O_NONBLOCK)  # swapped for a FIFO since stat: still no block
            try:
                info = os.fstat(fd)
                head = os.read(fd, 16) if stat.S_ISREG(info.st_mode) else b""
            finally:
                os.close(fd)
            if not stat.S_ISREG(info.st_mode):
                raise FedltError(f"{WHAT}: {listing.where(i)} is {_kind(info.st_mode)}, not an image file")
        except FileNotFoundError:
            raise FedltError(f"{WHAT}: no image at {listing.where(i)}") from None
        except IsADirectoryError:
            raise FedltError(f"{WHAT}: {listing.where(i)} is a folder, not an image") from None
        except OSError as exc:
            raise FedltError(f"{WHAT}: cannot read {listing.where(i)}: {exc.strerror or first_line(exc)}") from None
        if not (head.startswith(SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")):
            raise FedltError(f"{WHAT}: {listing.where(i)} is not an image ({FORMATS})"
                             + (": the file is empty" if not head else ""))
        stamps[i] = (info.st_size, info.st_mtime_ns)
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
    """Decoded, resized images as uint8 in ``<key>.npy`` (N, S, S, C), beside ``<key>.sums`` (the
    CRC-32 of each row) and ``<key>.filled`` (one byte per image, set once its row and its sum are
    written). Rows are read and written with ``pread`` / ``pwrite`` — safe from several processes
    at once, and no mapped page ever counts in a process's memory — and the ``.npy`` opens with
    ``np.load(mmap_mode="r")`` for anyone else.

    Nothing is written before the first row is put (a run refused before it trains leaves no
    cache behind); then the three files are made, each by a link that never replaces what
    another process made first, and ``stats`` (the training split's statistics, when they were
    computed) are written beside them. A row is checked against its sum whenever it is read: a
    damaged row (a flipped pixel) reads as absent, so it is decoded and written again; files
    whose header, shape or size do not fit (truncated, a bad header) are removed when the
    dataset is opened and made anew."""

    def __init__(self, folder: Path, key: str, count: int, item: tuple[int, int, int],
                 stats: dict[str, Any] | None = None) -> None:
        self.folder, self.key, self.count, self.item = folder, key, count, item
        self.npy, self.filled, self.sums = (folder / f"{key}{end}" for end in (".npy", ".filled", ".sums"))
        self.stats_file = folder / f"{key}.stats.json"
        self.row = int(np.prod(item))
        self.stats = stats
        self.offset: int | None = None
        if not self._sound():  # damaged or half made (a kill between its files): made anew at the first put
            for path in (self.npy, self.filled, self.sums):
                path.unlink(missing_ok=True)
        self._fds: tuple[int, int, int] | None = None

    def _sound(self) -> bool:
        """Whether the files are absent (nothing to check) or fit this cache's shape and sizes."""
        if not self.npy.exists():
            return not (self.filled.exists() or self.sums.exists())
        try:
            with open(self.npy, "rb") as f:
                shape, fortran, dtype = npy_header(f)
                self.offset = f.tell()
            return (shape == (self.count, *self.item) and not fortran and dtype == np.uint8
                    and os.path.getsize(self.npy) == self.offset + self.count * self.row
                    and os.path.getsize(self.filled) == self.count and os.path.getsize(self.sums) == 4 * self.count)
        except (OSError, ValueError, EOFError, TypeError, SyntaxError):  # numpy's errors on a damaged header
            self.offset = None
            return False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": None}  # a file descriptor does not cross processes

    def _make(self) -> None:
        """The three files, each linked into place only if no other process made it first."""
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / f"{self.key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            for path, size in ((self.filled, self.count), (self.sums, 4 * self.count), (self.npy, None)):
                if size is None:
                    np.lib.format.open_memmap(partial, mode="w+", dtype=np.uint8, shape=(self.count, *self.item)).flush()
                else:
                    with open(partial, "wb") as f:
                        f.truncate(size)  # zeros: nothing filled
                try:
                    os.link(partial, path)
                except FileExistsError:
                    pass
                partial.unlink()
        finally:
            partial.unlink(missing_ok=True)

    def _open(self, make: bool) -> tuple[int, int, int] | None:
        if self._fds is not None:
            return self._fds
        if not make and not self.npy.exists():
            return None
        try:
            if not self.npy.exists():
                self._make()
            if self.stats is not None:  # computed by this run: written (atomically) once the cache exists
                write_stats(self.stats_file, self.key, **self.stats)
            self._fds = tuple(os.open(p, os.O_RDWR) for p in (self.npy, self.filled, self.sums))
            if self.offset is None:
                with open(self.npy, "rb") as f:
                    npy_header(f)
                    self.offset = f.tell()
        except (OSError, ValueError) as exc:  # a full disk, a folder made read-only, a header damaged meanwhile
            raise FedltError(f"{WHAT}: cache {self.npy} cannot be used: {exc.strerror or first_line(exc)}"
                             if isinstance(exc, OSError) else f"{WHAT}: cache {self.npy} is damaged: "
                             f"{first_line(exc)}; remove it") from None
        return self._fds

    def get(self, position: int) -> np.ndarray | None:
        fds = self._open(make=False)
        if fds is None:
            return None
        rows, flags, sums = fds
        if os.pread(flags, 1, position) != b"\x01":
            return None
        pixels = os.pread(rows, self.row, self.offset + position * self.row)
        if len(pixels) != self.row or zlib.crc32(pixels).to_bytes(4, "little") != os.pread(sums, 4, 4 * position):
            return None  # damaged since it was written: decoded (and written) again
        return np.frombuffer(pixels, dtype=np.uint8)

    def put(self, position: int, pixels: np.ndarray) -> None:
        rows, flags, sums = self._open(make=True)
        data = np.ascontiguousarray(pixels).tobytes()
        os.pwrite(rows, data, self.offset + position * self.row)
        os.pwrite(sums, zlib.crc32(data).to_bytes(4, "little"), 4 * position)
        os.pwrite(flags, b"\x01", position)  # last: a row marked filled is whole and has its sum


def stats_digest(key: str, mean: list[float], std: list[float]) -> str:
    return hashlib.sha256(json.dumps([CACHE_FORMAT, key, mean, std]).encode()).hexdigest()


def write_stats(path: Path, key: str, mean: list[float], std: list[float]) -> None:
    """The training split's statistics beside its cache, with their digest, written atomically."""
    body = json.dumps({"mean": mean, "std": std, "sha256": stats_digest(key, mean, std)})
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        partial.write_text(body)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def read_stats(path: Path, key: str, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The statistics saved beside a cache, or None when there are none or they are damaged (not
    JSON, a key missing, not ``channels`` finite numbers, a std not > 0, a digest that does not
    match): then they are computed again."""
    try:
        if not path.is_file() or path.stat().st_size > 1 << 16:
            return None
        saved = json.loads(path.read_text(encoding="utf-8"))
        mean, std = saved["mean"], saved["std"]
        numbers = all(isinstance(v, list) and len(v) == channels and all(
            type(x) in (int, float) and np.isfinite(x) for x in v) for v in (mean, std))
        if not numbers or min(std) <= 0 or saved["sha256"] != stats_digest(key, mean, std):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


@dataclass(frozen=True, eq=False)
class ImageFiles:
    """A split's files and how they are read: decoded, ``channels``, ``size``×``size``, uint8."""

    listing: Listing
    size: int
    channels: int
    fit: str
    cache: Cache | None = None
    stamps: np.ndarray | None = None  # (size, mtime_ns) per file when it was checked: the cache key and fingerprint
    # DataLoaders with persistent workers, kept per decoding (mean, std, transforms, workers, device)
    # and each lent to one stream at a time: a client's (or an evaluation's) stream reuses the worker
    # processes instead of starting its own (~0.1 s each); concurrent streams (split learning's
    # sessions) get one each. They live as long as these files (never pickled).
    kept: dict = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "kept": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def read(self, positions: np.ndarray, keep: bool = True) -> np.ndarray:
        """uint8 (n, S, S, C) of the files at ``positions`` (from the cache where it holds them;
        what is decoded goes into it with ``keep``)."""
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
            if self.cache is not None and keep:
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


def _dead_workers(loader: Any, wait_s: float = 0.0) -> str:
    """The loader's worker processes that are gone, in words ('' when all are alive); ``wait_s``:
    how long to wait for one to be seen gone (its connection closes while it is still exiting)."""
    workers = getattr(getattr(loader, "_iterator", None), "_workers", None) or []
    deadline = time.monotonic() + wait_s
    while True:
        gone = [f"pid {w.pid}, {exit_words(w.exitcode)}" for w in workers if not w.is_alive()]
        if gone or time.monotonic() >= deadline:
            return "; ".join(gone)
        time.sleep(0.02)


def _shut_down(loader: Any) -> None:
    """Stop a loader's remaining workers (torch's own shutdown; best effort: they may be gone)."""
    iterator = getattr(loader, "_iterator", None)
    try:
        if iterator is not None:
            iterator._shutdown_workers()
    except Exception:  # noqa: BLE001  (a worker killed mid-shutdown; nothing more to stop)
        pass


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
        broken = False
        try:
            with warnings.catch_warnings():  # the number of workers is the user's choice (--loader-workers)
                warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
                batches = iter(loader)
            for x in batches:
                idx = drawn.popleft()
                if isinstance(x, str):
                    raise FedltError(x)
                yield idx, x.to(self.device, non_blocking=True)
        except (RuntimeError, OSError, EOFError) as exc:  # a dead worker: "Connection reset by peer", "exited unexpectedly"
            cut = isinstance(exc, (ConnectionError, EOFError)) or "exited unexpectedly" in str(exc)
            dead = _dead_workers(loader, wait_s=1.0 if cut else 0.0)
            if not dead and not cut:
                raise
            dead = dead or "its connection to this process was cut; its exit status is unknown"
            broken = True
            raise FedltError(f"{WHAT}: a --loader-workers process decoding the images died ({dead}); the run "
                             "stopped before the round it was in could finish") from None
        finally:  # a stream left half-read is drained by the next one's iter()
            feed.batches = iter(())
            if broken:  # its other workers are stopped, not lent again
                _shut_down(loader)
            else:
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

    def fingerprint(self) -> str:
        """sha256 of the files (paths, sizes, modification times: the cache key), how they are
        decoded and standardised, and which of them this source holds. Evaluation transforms are
        not callables one can hash; they come from the run's settings, which a resume checks."""
        files = self.files
        stamps = files.stamps if files.stamps is not None else check_files(files.listing)
        h = hashlib.sha256(cache_key(files.listing, stamps, files.size, files.channels, files.fit).encode())
        h.update(json.dumps([self.mean, self.std, self.item_shape, len(self.transforms)]).encode())
        h.update(np.ascontiguousarray(self.index, dtype="<i8").tobytes())
        return h.hexdigest()


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
        # not kept in the cache: a run refused after the dataset is opened (a bad split for the model) writes nothing
        block = files.read(positions[start:start + 256], keep=False).astype(np.float64) / 255.0
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


def usable(folder: Path) -> None:
    """A cache folder that is a folder (or can become one) and can be written."""
    if folder.exists() and not folder.is_dir():
        raise FedltError(f"{WHAT}: cache {folder} is not a folder")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FedltError(f"{WHAT}: cache folder {folder} cannot be written ({existing} is read-only)")


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
    root, size, channels = _check_settings(root, download, image_size, channels, fit, mean, std, train_list,
                                           test_list)
    train, test, num_classes, class_names = _list_splits(root, train_list, test_list)
    given = None if mean is None else (_channel_values("mean", mean, channels, False),
                                       _channel_values("std", std, channels, True))
    sources = _image_files(train, test, size, channels, fit, cache)
    stats = _normalisation(sources[0], given, channels)
    x_train, x_test = (FileImages(files, np.arange(len(files.listing.paths)), *stats, (channels, size, size))
                       for files in sources)
    return InMemoryDataset("imagefolder", x_train, torch.from_numpy(train.labels), x_test,
                           torch.from_numpy(test.labels), num_classes, class_names=class_names)


# -- imagefolder's steps --------------------------------------------------------------------------
def _check_settings(root: str | Path | None, download: bool, image_size: int, channels: int, fit: str,
                    mean: Any, std: Any, train_list: str | None, test_list: str | None) -> tuple[Path, int, int]:
    """The root folder, image size and channel count, once every setting is known good: a bad
    one is refused before any file is listed (which walks every file of a large dataset)."""
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
    return root, size, channels


def _list_splits(root: Path, train_list: str | None, test_list: str | None
                 ) -> tuple[Listing, Listing, int, tuple[str, ...] | None]:
    """The train and test listings, the class count and the class names (the folders' names;
    none for file lists, whose labels are numbers): from the lists when given, else the folders."""
    if train_list is not None:
        train, test = read_list(root, train_list, "train_list"), read_list(root, test_list, "test_list")
        num_classes = int(max(train.labels.max(), test.labels.max())) + 1
        if num_classes < 2:
            raise FedltError(f"{WHAT}: the lists name a single class (0); a classifier needs at least 2")
        return train, test, num_classes, None
    train, classes = list_folders(root, "train")
    test, _ = list_folders(root, "test", classes)
    return train, test, len(classes), tuple(classes)


def _image_files(train: Listing, test: Listing, size: int, channels: int, fit: str,
                 cache: str | None) -> list[ImageFiles]:
    """The train and test image sources, each with its cache when one is asked for."""
    stamps = [check_files(listing) for listing in (train, test)]  # every file, before any cache is touched
    sources = [ImageFiles(listing, size, channels, fit, stamps=s) for listing, s in zip((train, test), stamps)]
    if cache is not None:
        usable(Path(cache))
        sources = [replace(files, cache=Cache(Path(cache), cache_key(files.listing, files.stamps, size, channels, fit),
                                              len(files.listing.paths), (size, size, channels))) for files in sources]
    return sources


def _normalisation(train: ImageFiles, given: tuple[tuple[float, ...], tuple[float, ...]] | None,
                   channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel mean and std: as given, else those the cache kept for these files, else
    computed over the training images (and handed to the cache, which writes them with the pixels)."""
    store = train.cache
    stats = given or (store and read_stats(store.stats_file, store.key, channels))
    if not stats:
        stats = pixel_statistics(train, len(train.listing.paths))
        if store is not None:  # written beside the pixels once the cache is made (when the run trains)
            store.stats = {"mean": [*stats[0]], "std": [*stats[1]]}
    return stats

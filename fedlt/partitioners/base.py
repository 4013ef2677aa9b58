"""What every partitioner shares: the ``Partitioner`` base model and the ``Partition`` it returns.

A partitioner decides, for each training sample, which client owns it (or none); everything
else — the index lists, the K×C class counts, the summary statistics, the dataset fingerprint,
the sha256, saving and loading — is computed here once, so a new scheme (built-in or plugin)
only writes ``assign``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from fedlt.errors import FedltError, first_line
from fedlt.spec import SpecModel

FORMAT = "fedlt-partition-1"
_FILE_KEYS = {"manifest", "indices", "offsets"}


# -- labels ---------------------------------------------------------------------------------------
def as_labels(labels: Any, num_classes: int | None = None) -> tuple[np.ndarray, int]:
    """Labels as a 1-D int64 array and the class count C (``num_classes`` or ``max(label) + 1``)."""
    if hasattr(labels, "detach"):  # a torch tensor, possibly on a GPU
        labels = labels.detach().cpu().numpy()
    y = np.asarray(labels)
    if y.ndim != 1:
        raise FedltError(f"labels must be a 1-D array of class indices, got shape {tuple(y.shape)}")
    if y.size == 0:
        raise FedltError("labels are empty: there is nothing to partition")
    if y.dtype == bool or not np.issubdtype(y.dtype, np.integer):
        raise FedltError(f"labels must be integers (class indices), got dtype {y.dtype}")
    y = y.astype(np.int64, copy=False)
    lo, hi = int(y.min()), int(y.max())
    if lo < 0:
        raise FedltError(f"labels must be non-negative class indices, found {lo}")
    if num_classes is None:
        return y, hi + 1
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise FedltError(f"num_classes must be a positive integer, got {num_classes!r}")
    if hi >= num_classes:
        raise FedltError(f"label {hi} is out of range for num_classes={num_classes}")
    return y, int(num_classes)


def as_groups(groups: Any, size: int) -> np.ndarray:
    """Per-sample group ids (writer, user, site: integers or strings) as int64 codes 0..G-1."""
    if hasattr(groups, "detach"):
        groups = groups.detach().cpu().numpy()
    g = np.asarray(groups)
    if g.shape != (size,):
        raise FedltError(f"groups must hold one id per training sample ({size}), got shape {tuple(g.shape)}")
    if g.dtype == bool or g.dtype.kind not in "iuUS":
        raise FedltError(f"groups must be integer or string ids, got dtype {g.dtype}")
    return np.unique(g, return_inverse=True)[1].reshape(-1).astype(np.int64)


def partition_data(partitioner: Any, data: Any, num_clients: int, seed: int) -> "Partition":
    """Partition ``data``'s training labels; its group ids (``groups_train``) go to a partitioner
    that takes a ``groups`` argument (every ``Partitioner`` model), so a plugin's plain function
    partitioner(labels, num_clients, seed, ...) keeps working."""
    kwargs: dict[str, Any] = {"num_classes": data.num_classes, "dataset_name": data.name}
    groups = getattr(data, "groups_train", None)
    if groups is not None and "groups" in inspect.signature(partitioner).parameters:
        kwargs["groups"] = groups
    return partitioner(data.y_train, num_clients, seed, **kwargs)


def label_histogram(y: np.ndarray, num_classes: int) -> np.ndarray:
    return np.bincount(y, minlength=num_classes).astype(np.int64)


def fingerprint(y: np.ndarray, num_classes: int, dataset_name: str) -> dict[str, Any]:
    """What identifies the training set a partition indexes into: name, size, label histogram."""
    return {"name": str(dataset_name), "size": int(y.size),
            "label_histogram": label_histogram(y, num_classes).tolist()}


# -- index lists ----------------------------------------------------------------------------------
def indices_sha256(client_indices: Sequence[np.ndarray]) -> str:
    """sha256 over K, then for each client its length and its indices, all as little-endian int64."""
    h = hashlib.sha256(np.int64(len(client_indices)).astype("<i8").tobytes())
    for idx in client_indices:
        h.update(np.int64(len(idx)).astype("<i8").tobytes())
        h.update(np.ascontiguousarray(idx, dtype="<i8").tobytes())
    return h.hexdigest()


def group_by_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Client k's indices (sorted) = positions where ``owner == k``; ``-1`` means unassigned."""
    order = np.argsort(owner, kind="stable")  # stable: each client's indices come out sorted
    sizes = np.bincount(owner[owner >= 0], minlength=num_clients)
    start = int(np.count_nonzero(owner < 0))
    return np.split(order[start:].astype(np.int64), np.cumsum(sizes)[:-1])


def class_counts_of(client_indices: Sequence[np.ndarray], y: np.ndarray, num_classes: int) -> np.ndarray:
    """The K×C matrix n[k, c] = number of samples of class c held by client k."""
    num_clients = len(client_indices)
    sizes = np.fromiter((len(i) for i in client_indices), dtype=np.int64, count=num_clients)
    owner = np.repeat(np.arange(num_clients, dtype=np.int64), sizes)
    flat = np.concatenate(client_indices) if num_clients else np.zeros(0, np.int64)
    counts = np.bincount(owner * num_classes + y[flat], minlength=num_clients * num_classes)
    return counts.reshape(num_clients, num_classes).astype(np.int64)


def _stats(values: np.ndarray) -> dict[str, float]:
    return {"min": int(values.min()), "median": float(np.median(values)), "max": int(values.max()),
            "mean": float(values.mean())}


def summarise(class_counts: np.ndarray) -> dict[str, Any]:
    """Samples, classes and vacant classes per client (min/median/max/mean); the global class
    totals of what was assigned and their imbalance factor max/min (over classes present)."""
    sizes = class_counts.sum(axis=1)
    present = (class_counts > 0).sum(axis=1)
    totals = class_counts.sum(axis=0)
    nonzero = totals[totals > 0]
    return {
        "assigned_samples": int(sizes.sum()),
        "samples_per_client": _stats(sizes),
        "classes_per_client": _stats(present),
        "vacant_classes_per_client": _stats(class_counts.shape[1] - present),
        "global_class_counts": totals.tolist(),
        "absent_classes": int((totals == 0).sum()),
        "global_imbalance_factor": float(nonzero.max() / nonzero.min()) if nonzero.size else None,
    }


# -- the result -----------------------------------------------------------------------------------
class Partition:
    """Index lists (one int64 array per client, into the training set) plus their manifest.

    ``manifest`` (JSON-serialisable): ``format``, ``name`` and ``params`` of the partitioner,
    ``seed``, ``num_clients``, ``num_classes``, ``dataset`` = {name, size, label_histogram},
    ``class_counts`` (K×C), ``summary`` (see ``summarise``) and ``sha256`` (``indices_sha256``).
    """

    def __init__(self, client_indices: list[np.ndarray], manifest: dict[str, Any]) -> None:
        self.client_indices = client_indices
        self.manifest = manifest
        self.class_counts = np.asarray(manifest["class_counts"], dtype=np.int64).reshape(len(client_indices), -1)

    @classmethod
    def build(cls, client_indices: list[np.ndarray], y: np.ndarray, num_classes: int, *, name: str,
              params: dict[str, Any], seed: int, dataset_name: str) -> "Partition":
        counts = class_counts_of(client_indices, y, num_classes)
        manifest = {
            "format": FORMAT, "name": name, "params": params, "seed": int(seed),
            "num_clients": len(client_indices), "num_classes": int(num_classes),
            "dataset": fingerprint(y, num_classes, dataset_name),
            "class_counts": counts.tolist(), "summary": summarise(counts),
            "sha256": indices_sha256(client_indices),
        }
        return cls(client_indices, manifest)

    @property
    def sha256(self) -> str:
        return self.manifest["sha256"]

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.manifest["params"].items())
        return (f"Partition({self.manifest['name']}({params}), clients={self.num_clients}, "
                f"dataset={self.manifest['dataset']['name']!r}, sha256={self.sha256[:12]}…)")

    # -- reuse ------------------------------------------------------------------------------------
    def check_dataset(self, labels: Any, dataset_name: str) -> None:
        """Refuse (FedltError) training labels other than those the partition was made from."""
        want = self.manifest["dataset"]
        y, _ = as_labels(labels)
        have = fingerprint(y, max(len(want["label_histogram"]), int(y.max()) + 1), dataset_name)
        for key in ("name", "size", "label_histogram"):
            if have[key] != want[key]:
                detail = "" if key == "label_histogram" else f": {want[key]!r} vs {have[key]!r}"
                raise FedltError(f"partition was made for dataset {want['name']!r} ({want['size']} samples) "
                                 f"but the dataset given is {dataset_name!r} ({y.size} samples); "
                                 f"the {key.replace('_', ' ')} differs{detail}")
        num_classes = len(want["label_histogram"])
        if not np.array_equal(class_counts_of(self.client_indices, y, num_classes), self.class_counts):
            raise FedltError("partition manifest's class_counts do not match its indices on this dataset "
                             "(the file was edited)")

    def save(self, path: str | Path) -> None:
        """Write one ``.npz`` (no pickle): ``indices`` (all clients, concatenated, int64),
        ``offsets`` (K+1, int64; client k is ``indices[offsets[k]:offsets[k+1]]``) and
        ``manifest`` (UTF-8 JSON as uint8). Written atomically (temp file + rename)."""
        path = Path(path)
        sizes = np.fromiter((len(i) for i in self.client_indices), dtype=np.int64, count=self.num_clients)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        indices = (np.concatenate(self.client_indices) if self.num_clients else np.zeros(0)).astype(np.int64)
        manifest = np.frombuffer(json.dumps(self.manifest).encode(), dtype=np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez_compressed(f, manifest=manifest, indices=indices, offsets=offsets)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; a partition file is meant to be shared
            os.replace(tmp, path)  # readers see the old file or the whole new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> "Partition":
        """Read a file written by ``save``; anything truncated, edited or foreign is a FedltError.

        Never unpickles (``allow_pickle=False``); checks the layout, then recomputes the sha256
        over the indices and compares it with the manifest's. The checks run in this order, so
        a file with several faults is named by the first: the archive, the manifest's bytes, the
        index layout, the manifest's fields, then the indices against the manifest.
        """
        path = Path(path)
        if not path.is_file():
            raise FedltError(f"no partition file at {path}")

        def bad(reason: str) -> FedltError:
            return FedltError(f"{path} is not a valid fedlt partition file ({reason})")

        _refuse_foreign_bytes(path, bad)
        arrays = _read_arrays(path, bad)
        manifest = _decode_manifest(arrays["manifest"], bad)
        client_indices = _split_clients(arrays["indices"], arrays["offsets"], bad)
        _check_manifest_fields(manifest, bad)
        _check_against_manifest(manifest, client_indices, arrays["indices"], bad)
        return cls(client_indices, manifest)


# -- reading a partition file (Partition.load's steps; ``bad(reason)`` makes each step's error) --
def _refuse_foreign_bytes(path: Path, bad) -> None:
    """Classify the file by its first bytes before numpy sees it: numpy's own errors suggest
    loading with allow_pickle, which an untrusted file must never get, so none of its text is
    relayed and a pickle is refused outright."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise bad(f"cannot be read: {exc.strerror or type(exc).__name__}") from None
    if head[:1] == b"\x80" or head[:1] in (b"(", b"c", b"]", b"}"):
        raise FedltError(f"{path} is refused: it is a Python pickle, which could run code when loaded; "
                         "a fedlt partition file is an .npz of plain arrays")
    if not head.startswith(b"PK\x03\x04"):
        kind = "a single .npy array" if head.startswith(b"\x93NUMPY") else "empty" if not head else "not a zip"
        raise bad(f"{kind}, not the .npz archive fedlt writes")


def _read_arrays(path: Path, bad) -> dict[str, np.ndarray]:
    """The archive's three members (``_FILE_KEYS``), each read whole (which checks its CRC) and
    each a .npy array; an archive that is damaged, pickled or has other members is refused."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            if set(npz.files) != _FILE_KEYS:
                raise bad(f"expected arrays {sorted(_FILE_KEYS)}, found {sorted(npz.files)[:5]}")
            arrays = {k: npz[k] for k in _FILE_KEYS}  # reading checks each member's CRC
    except FedltError:
        raise
    except ValueError as exc:
        if "pickle" in str(exc) or "Object arrays" in str(exc):
            raise FedltError(f"{path} is refused: an array in it holds pickled Python objects, which could "
                             "run code when loaded; a fedlt partition file holds only plain arrays") from None
        raise bad(f"a member is damaged ({type(exc).__name__})") from None
    except Exception as exc:  # truncated zip, bad CRC, ...: zipfile's words are safe to relay
        detail = first_line(exc)[:120] if isinstance(exc, zipfile.BadZipFile) else type(exc).__name__
        raise bad(f"truncated or damaged archive: {detail}") from None
    for key in sorted(_FILE_KEYS):  # numpy hands back a member that is not .npy data as raw bytes
        if not isinstance(arrays[key], np.ndarray):
            raise bad(f"member {key!r} is not a .npy array")
    return arrays


def _decode_manifest(raw: np.ndarray, bad) -> dict[str, Any]:
    """The manifest member (UTF-8 JSON stored as uint8) as a dict of this file format."""
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise bad("manifest is not UTF-8 bytes")
    try:
        manifest = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"manifest is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise bad(f"manifest format is not {FORMAT!r}")
    return manifest


def _split_clients(indices: np.ndarray, offsets: np.ndarray, bad) -> list[np.ndarray]:
    """Each client's indices: ``indices[offsets[k]:offsets[k+1]]``, once the offsets are known to
    delimit the indices and to give every client at least one sample."""
    if indices.dtype != np.int64 or offsets.dtype != np.int64 or indices.ndim != 1 or offsets.ndim != 1:
        raise bad("indices and offsets must be 1-D int64")
    if offsets.size < 2 or offsets[0] != 0 or offsets[-1] != indices.size or np.any(np.diff(offsets) < 0):
        raise bad("offsets do not delimit the indices")
    sizes = np.diff(offsets)
    if np.any(sizes == 0):  # what every partitioner guarantees; an empty client cannot train
        empty = np.flatnonzero(sizes == 0)
        raise bad(f"{empty.size} of {sizes.size} clients hold no sample (first: client {int(empty[0])}); "
                  "every client of a partition needs at least one")
    return np.split(indices, offsets[1:-1])


def _check_against_manifest(manifest: dict[str, Any], client_indices: list[np.ndarray], indices: np.ndarray,
                            bad) -> None:
    """The indices are those the manifest describes: its sha256, client count, class counts
    (a K×C table adding up to the clients' sizes) and dataset size; no sample held twice."""
    declared, num_clients = manifest["sha256"], manifest["num_clients"]
    size = manifest["dataset"]["size"]
    try:
        counts = np.asarray(manifest["class_counts"], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise bad("manifest field 'class_counts' is not a table of integers") from None
    if counts.ndim != 2 or counts.shape[1] != manifest["num_classes"] or (counts.size and counts.min() < 0):
        raise bad("manifest field 'class_counts' is not a K×C table of counts")
    if indices_sha256(client_indices) != declared:
        raise bad("sha256 of the indices does not match the manifest: the file was edited or corrupted")
    if num_clients != len(client_indices) or counts.ndim != 2 or counts.shape[0] != num_clients:
        raise bad("manifest's client count does not match the indices")
    sizes = np.fromiter((len(i) for i in client_indices), dtype=np.int64, count=len(client_indices))
    if not np.array_equal(counts.sum(axis=1), sizes):
        raise bad("manifest's class_counts do not add up to the clients' sizes")
    if indices.size and (indices.min() < 0 or indices.max() >= size):
        raise bad(f"indices outside the dataset's {size} samples")
    if np.unique(indices).size != indices.size:
        raise bad("a sample is assigned to more than one client")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_manifest_fields(manifest: dict[str, Any], bad) -> None:
    """The manifest fields a run reads, with their types (``bad(reason)`` makes the error)."""
    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise bad(f"manifest field {field!r} is missing or not {what}")

    need(isinstance(manifest.get("sha256"), str), "sha256", "a string")
    need(isinstance(manifest.get("name"), str), "name", "a string")
    need(isinstance(manifest.get("params"), dict), "params", "a table")
    need(_is_int(manifest.get("num_clients")) and manifest["num_clients"] >= 1, "num_clients", "a positive integer")
    need(_is_int(manifest.get("num_classes")) and manifest["num_classes"] >= 1, "num_classes", "a positive integer")
    dataset = manifest.get("dataset")
    need(isinstance(dataset, dict), "dataset", "a table")
    need(isinstance(dataset.get("name"), str), "dataset.name", "a string")
    need(_is_int(dataset.get("size")) and dataset["size"] >= 0, "dataset.size", "a non-negative integer")
    histogram = dataset.get("label_histogram")
    need(isinstance(histogram, list) and all(_is_int(n) and n >= 0 for n in histogram),
         "dataset.label_histogram", "a list of counts")


# -- the partitioner ------------------------------------------------------------------------------
class Partitioner(SpecModel):
    """A partition scheme: its parameters are the model's fields, validated at construction.

    ``partitioner(labels, num_clients, seed, *, num_classes=None, dataset_name="unknown")`` returns
    a ``Partition``. Subclasses set ``name`` and implement ``assign``; the RNG is always
    ``np.random.default_rng(seed)`` (no global state), so a seed fixes the partition.
    """

    name: ClassVar[str] = "partitioner"

    def assign(self, y: np.ndarray, num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        """The owner of each sample: an int64 array like ``y``, in ``[0, num_clients)`` or ``-1``."""
        raise NotImplementedError(f"{type(self).__name__} must implement assign()")

    def assign_with_groups(self, y: np.ndarray, groups: np.ndarray | None, num_clients: int, num_classes: int,
                           rng: np.random.Generator) -> np.ndarray:
        """``assign`` given each sample's natural group id too (int64 like ``y``; None when the
        dataset has none). Only schemes that use the groups (``natural``) or pass them on
        (``longtail``) override it; the others ignore them."""
        return self.assign(y, num_clients, num_classes, rng)

    def __call__(self, labels: Any, num_clients: int, seed: int, *, num_classes: int | None = None,
                 dataset_name: str = "unknown", groups: Any = None) -> Partition:
        y, num_classes = as_labels(labels, num_classes)
        groups = None if groups is None else as_groups(groups, y.size)
        if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
            raise FedltError(f"num_clients must be a positive integer, got {num_clients!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise FedltError(f"seed must be a non-negative integer, got {seed!r}")
        num_clients = int(num_clients)
        rng = np.random.default_rng(int(seed))
        owner = np.asarray(self.assign_with_groups(y, groups, num_clients, num_classes, rng), dtype=np.int64)
        if owner.shape != y.shape or owner.min() < -1 or owner.max() >= num_clients:
            raise FedltError(f"{self.describe()}.assign returned an invalid owner array")  # a plugin's bug
        client_indices = group_by_owner(owner, num_clients)
        empty = [k for k, idx in enumerate(client_indices) if idx.size == 0]
        if empty:
            raise FedltError(f"{self.describe()} left {len(empty)} of {num_clients} clients empty "
                             f"(first: client {empty[0]}); use fewer clients or more data")
        return Partition.build(client_indices, y, num_classes, name=self.name, params=self.params(),
                               seed=int(seed), dataset_name=dataset_name)

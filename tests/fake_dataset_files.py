"""Small synthetic copies of the files torchvision reads for CIFAR-10/100, Fashion-MNIST and SVHN,
in their on-disk formats, so the dataset contract runs fedlt's adapters on every registered
dataset offline. Pixels take two values with the frequencies that give each set's published
per-channel mean and std, so the contract's normalisation check is meaningful."""

from __future__ import annotations

import pickle
import sys
import types
from pathlib import Path

import numpy as np

from fedlt.datasets.torchvision_sets import SETS

N_TRAIN, N_TEST = 600, 200
NAMES = {*SETS, "arrays", "imagefolder"}  # the registered datasets that read files: written here


def _pixels(rng: np.random.Generator, n: int, channels: int, size: int, dataset: str) -> np.ndarray:
    """uint8 (n, channels, size, size): per channel 0 or v, P(v) = m²/(m² + s²), v = m/P(v) —
    mean m and std s (in 0..255) of the dataset's normalisation constants."""
    spec = SETS[dataset]
    out = np.empty((n, channels, size, size), dtype=np.uint8)
    for c, (m, s) in enumerate(zip(spec.mean, spec.std)):
        m, s = 255 * m, 255 * s
        p = m * m / (m * m + s * s)
        out[:, c] = np.where(rng.random((n, size, size)) < p, round(m / p), 0)
    return out


def _labels(rng: np.random.Generator, n: int, num_classes: int) -> list[int]:
    return [int(v) for v in rng.integers(0, num_classes, n)]


def _pickle(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj))


def _idx(path: Path, array: np.ndarray) -> None:
    dims = np.array(array.shape, dtype=">u4").tobytes()
    path.write_bytes(bytes([0, 0, 8, array.ndim]) + dims + array.astype(np.uint8).tobytes())


def write(dataset: str, root: Path, monkeypatch) -> None:
    """Write ``dataset``'s files under ``root``; torchvision's md5 checks (of the real archives)
    are switched off through ``monkeypatch``, and for SVHN its .mat reader (scipy, not a fedlt
    dependency) reads what was written here."""
    import torchvision.datasets.cifar
    import torchvision.datasets.svhn

    rng = np.random.default_rng(0)
    if dataset in ("cifar10", "cifar100"):
        monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
        folder, key, meta, names = (("cifar-10-batches-py", "labels", "batches.meta", "label_names")
                                    if dataset == "cifar10" else ("cifar-100-python", "fine_labels", "meta",
                                                                  "fine_label_names"))
        k = SETS[dataset].num_classes
        splits = ([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if dataset == "cifar10"
                  else ["train", "test"])
        for name in splits:
            n = N_TEST if "test" in name else N_TRAIN // (len(splits) - 1)  # CIFAR-10: five training batches
            _pickle(root / folder / name, {"data": _pixels(rng, n, 3, 32, dataset).reshape(n, -1),
                                           key: _labels(rng, n, k)})
        _pickle(root / folder / meta, {names: [f"class{i}" for i in range(k)]})
    elif dataset == "fashion_mnist":
        raw = root / "FashionMNIST" / "raw"
        raw.mkdir(parents=True)
        for prefix, n in (("train", N_TRAIN), ("t10k", N_TEST)):
            _idx(raw / f"{prefix}-images-idx3-ubyte", _pixels(rng, n, 1, 28, dataset)[:, 0])
            _idx(raw / f"{prefix}-labels-idx1-ubyte", np.array(_labels(rng, n, 10)))
    elif dataset == "svhn":
        monkeypatch.setattr(torchvision.datasets.svhn, "check_integrity", lambda *args, **kwargs: True)
        mats = {}
        for split, n in (("train", N_TRAIN), ("test", N_TEST)):
            (root / f"{split}_32x32.mat").write_bytes(b"")
            # SVHN's .mat layout: X is (32, 32, 3, N), y is (N, 1) with digit 0 stored as 10
            mats[f"{split}_32x32.mat"] = {"X": _pixels(rng, n, 3, 32, dataset).transpose(2, 3, 1, 0),
                                          "y": np.array(_labels(rng, n, 10)).reshape(-1, 1) + 1}
        scipy_io = types.SimpleNamespace(loadmat=lambda path: mats[Path(path).name])
        monkeypatch.setitem(sys.modules, "scipy", types.SimpleNamespace(io=scipy_io))
        monkeypatch.setitem(sys.modules, "scipy.io", scipy_io)
    elif dataset == "arrays":  # a folder of .npy files (the memory-mapped form), HWC uint8 with writer ids
        for split, n in (("train", N_TRAIN), ("test", N_TEST)):
            np.save(root / f"x_{split}.npy", rng.integers(0, 256, (n, 12, 12, 3), dtype=np.uint8))
            np.save(root / f"y_{split}.npy", np.array(_labels(rng, n, 10)))
        np.save(root / "groups_train.npy", rng.integers(0, 30, N_TRAIN))
    elif dataset == "imagefolder":  # torchvision's folder layout, PNG and JPEG files of several sizes
        from PIL import Image

        for split, n in (("train", N_TRAIN), ("test", N_TEST)):
            for i, label in enumerate(_labels(rng, n, 10)):
                folder = root / split / f"class{label}"
                folder.mkdir(parents=True, exist_ok=True)
                h, w = (int(v) for v in rng.integers(8, 40, 2))
                pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:04d}.{'png' if i % 2 else 'jpg'}")
    else:
        raise ValueError(f"no synthetic files for {dataset}")

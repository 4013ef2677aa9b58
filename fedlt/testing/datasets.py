"""The dataset contract: train/test images (in-memory tensors, or image sources decoded on demand)
of the documented shapes and dtypes, labels in range, inputs normalised per channel (the mean and
std of the training images ≈ 0 and 1), and a source's reads agreeing with each other."""

from __future__ import annotations

from typing import Any

import torch

import fedlt.datasets
from fedlt.datasets.source import images
from fedlt.testing.base import Contract, registered


def check_dataset(dataset: Any, params: dict[str, Any] | None = None, *, limit: int = 5000,
                  tolerance: float = 0.25) -> None:
    """Check a dataset, given by registered name or as its factory, created with ``params``
    (e.g. ``{"root": ...}``).

    Properties: [fields] (x_train, y_train, x_test, y_test, num_classes); [shapes] (x is
    (N, C, H, W), y is (N,), train and test images alike); [dtypes] (x float32, y int64);
    [label range] (0 ≤ y < num_classes, num_classes ≥ 2); [normalisation] (finite, and over the
    first ``limit`` training images each channel's mean within ±``tolerance`` of 0 and std within
    ±``tolerance`` of 1); [reads agree] (the same images, whichever way they are read — a batch
    at once, a subset, the minibatch stream, consecutive chunks — decode to the same values, of
    the declared shape).
    """
    with registered(fedlt.datasets.REGISTRY, dataset, "contract_dataset") as name:
        c = Contract(f"dataset {name!r}")
        with c.property("construction"):
            data = fedlt.datasets.create(name, **(params or {}))
        missing = [f for f in ("x_train", "y_train", "x_test", "y_test", "num_classes") if not hasattr(data, f)]
        c.check(not missing, "fields", f"lacks {', '.join(missing)}")
        c.check(isinstance(data.num_classes, int) and data.num_classes >= 2, "label range",
                f"num_classes is {data.num_classes!r}")
        for split in ("train", "test"):
            x, y = images(getattr(data, f"x_{split}")), getattr(data, f"y_{split}")
            c.check(len(getattr(x, "shape", ())) == 4, "shapes",
                    f"x_{split} has shape {tuple(getattr(x, 'shape', ()))}, expected (N, C, H, W)")
            c.check(isinstance(y, torch.Tensor) and tuple(y.shape) == (x.shape[0],), "shapes",
                    f"y_{split} has shape {tuple(getattr(y, 'shape', ()))}, expected ({x.shape[0]},)")
            c.check(x.shape[0] > 0, "shapes", f"the {split} split is empty")
            c.check(x.dtype == torch.float32, "dtypes", f"x_{split} is {x.dtype}, expected torch.float32")
            c.check(y.dtype == torch.int64, "dtypes", f"y_{split} is {y.dtype}, expected torch.int64")
            lo, hi = int(y.min()), int(y.max())
            c.check(lo >= 0 and hi < data.num_classes, "label range",
                    f"y_{split} spans [{lo}, {hi}] with num_classes={data.num_classes}")
        c.check(data.x_train.shape[1:] == data.x_test.shape[1:], "shapes",
                f"train images are {tuple(data.x_train.shape[1:])}, test images {tuple(data.x_test.shape[1:])}")
        for split in ("train", "test"):
            _reads_agree(c, split, images(getattr(data, f"x_{split}")), getattr(data, f"y_{split}"))
        sample = images(data.x_train).take(slice(0, limit)).double()
        c.check(bool(torch.isfinite(sample).all()), "normalisation", "non-finite pixel values")
        mean, std = sample.mean(dim=(0, 2, 3)), sample.std(dim=(0, 2, 3))
        c.check(bool(((mean.abs() <= tolerance) & ((std - 1).abs() <= tolerance)).all()), "normalisation",
                f"per-channel mean {[round(v, 3) for v in mean.tolist()]} and std "
                f"{[round(v, 3) for v in std.tolist()]} over {sample.shape[0]} training images; expected ≈ 0 and 1")


def _reads_agree(c: Contract, split: str, x: Any, y: torch.Tensor) -> None:
    """A few images read every way the engine reads them give the same values, of the declared shape."""
    n = len(x)
    idx = torch.randperm(min(n, 64), generator=torch.Generator().manual_seed(0))[:7]  # among the first 64
    with c.property("reads agree", f"x_{split}"):
        batch = x.take(idx)
        c.check(tuple(batch.shape) == (len(idx), *x.shape[1:]) and batch.dtype == torch.float32, "reads agree",
                f"x_{split}.take gave {tuple(batch.shape)} {batch.dtype}, declared ({len(idx)}, "
                f"{', '.join(map(str, x.shape[1:]))}) float32")
        one_by_one = torch.cat([x.take(idx[k:k + 1]) for k in range(len(idx))])
        via_subset = x.subset(idx)
        streamed = list(x.batches(y, [idx[:3], idx[3:]]))
        first = next(iter(x.chunks(max(int(idx.max()) + 1, 1))))
        ways = {"one at a time": one_by_one, "through subset": images(via_subset).take(slice(None)),
                "through batches": torch.cat([b for b, _ in streamed]), "through chunks": first[idx]}
        for way, values in ways.items():
            c.check(torch.equal(values, batch), "reads agree", f"x_{split}: images {idx.tolist()} read {way} differ "
                    "from the same batch read at once")
        c.check(torch.equal(torch.cat([labels for _, labels in streamed]), y[idx]), "reads agree",
                f"y_{split}: the minibatch stream paired images {idx.tolist()} with other labels")

"""How a run reads a split's images: one interface over in-memory tensors and images decoded on demand.

A dataset's ``x_train`` / ``x_test`` are either a float32 ``(N, C, H, W)`` tensor (every built-in
but ``imagefolder``) or an :class:`ImageSource`, which decodes into exactly such tensors when
asked. ``images(x)`` gives the ImageSource view of either, and every place the engine touches
images goes through it — a client's subset, a step's minibatches, the evaluation chunks, the
statistics of ``normalize()``, the test set's evaluation transforms, the hand-over to worker
processes — so no call site asks which kind it has. The view of a tensor does what the engine
did before on tensors, operation for operation (bit-identical, no extra copy).

``subset``, ``map``, ``to``, ``shared`` and ``loading`` return the same kind of storage they
were given (a tensor stays a tensor); ``take``, ``batches`` and ``chunks`` return tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, runtime_checkable

import torch

CHUNK = 1024  # samples transformed at a time when a whole tensor split is mapped (bounded temporaries)


@runtime_checkable
class ImageSource(Protocol):
    """A split's images, read on demand: ``len`` images of ``shape`` ``(N, C, H, W)`` and
    ``dtype`` float32, delivered on ``device``.

    - ``subset(idx)``: the images ``idx`` (an index tensor or a slice) as a source of their own
      (nothing decoded);
    - ``take(idx)``: those images decoded, a tensor;
    - ``batches(labels, index_batches)``: ``(images, labels[idx])`` for each ``idx`` of
      ``index_batches``, in that order (decoded ahead by the loader workers, if any);
    - ``chunks(size)``: the whole split decoded in consecutive chunks of ``size``;
    - ``map(fn, shape)``: the source with ``fn`` (a batch transform giving ``shape`` per image)
      applied after decoding (the test set's evaluation transforms);
    - ``to(device)``, ``shared()`` (fit to hand to worker processes), ``loading(workers)`` (with
      that many DataLoader worker processes).
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def __len__(self) -> int: ...
    def subset(self, idx: torch.Tensor | slice) -> "Images": ...
    def take(self, idx: torch.Tensor | slice) -> torch.Tensor: ...
    def batches(self, labels: torch.Tensor, index_batches: Iterable[torch.Tensor]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def chunks(self, size: int) -> Iterator[torch.Tensor]: ...
    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, int, int]) -> "Images": ...
    def to(self, device: torch.device | str) -> "Images": ...
    def shared(self) -> "Images": ...
    def loading(self, workers: int) -> "Images": ...


Images = torch.Tensor | ImageSource


INDEX_DTYPES = (torch.int64, torch.int32)


class TensorImages:
    """The ImageSource view of an in-memory tensor: indexing, ``split`` and ``cat``, as before."""

    __slots__ = ("x",)

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def __len__(self) -> int:
        return len(self.x)

    def subset(self, idx: torch.Tensor | slice) -> torch.Tensor:
        return self.x[idx]  # a slice stays a view; an index tensor copies (the client's own samples)

    def take(self, idx: torch.Tensor | slice) -> torch.Tensor:
        return self.x[idx]

    def batches(self, labels: torch.Tensor, index_batches: Iterable[torch.Tensor]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x = self.x
        for idx in index_batches:
            if isinstance(idx, torch.Tensor) and idx.dtype in INDEX_DTYPES:  # the loop's own minibatches
                # one gather each, without advanced indexing's argument parsing: 20 vs 41 µs a step
                # on the CPU (docs/benchmarks.md), the same values
                yield x.index_select(0, idx), labels.index_select(0, idx)
            else:
                yield x[idx], labels[idx]

    def chunks(self, size: int) -> Iterator[torch.Tensor]:
        return iter(self.x.split(size))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, int, int]) -> torch.Tensor:
        return torch.cat([fn(part) for part in self.x.split(CHUNK)])

    def to(self, device: torch.device | str) -> torch.Tensor:
        return self.x.to(device)

    def shared(self) -> torch.Tensor:
        x = self.x
        if x.untyped_storage().nbytes() > x.nbytes:  # a view of a larger set (train_limit): share only it
            x = x.clone()
        return x.share_memory_()

    def loading(self, workers: int) -> torch.Tensor:
        return self.x  # already in memory: nothing to decode


def to_device(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``t`` (a small host tensor: an index permutation, a batch's random draws) on ``device``:
    pinned and copied without blocking the host on CUDA (a pageable copy waits for the device)."""
    if device is None or device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def images(x: Images) -> ImageSource:
    """The ImageSource view of a split's images (a source is its own view)."""
    return TensorImages(x) if isinstance(x, torch.Tensor) else x

"""Training-time augmentation as a component spec: ``--augment "random_crop(padding=4) + hflip"``.

Each item is a registered transform written like any component spec (fedlt.spec), and ``+``
composes them left to right. A transform works on a whole minibatch of standardised float
tensors (B, C, H, W) at once — no per-sample PIL — and draws its randomness from torch's global
generator, which inside a client's work is the client's own stream (``client_rng``), so a
client's augmented batches depend on (sampling seed, round, client) only: the same on every
engine and in any order of the participants.

A transform has two faces: ``__call__`` (training: random) and ``eval`` (what the test set
sees: ``random_crop`` and the flips are the identity there, ``resize``, ``center_crop`` and
``normalize`` apply to both), and says what shape it returns (``output_shape``), so the model is
built for the augmented input and the test set is transformed to match once, before training.
"""

from __future__ import annotations

import functools
import math
from typing import Annotated, Any, ClassVar

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from fedlt.datasets.source import CHUNK, Images, images, to_device
from fedlt.errors import FedltError
from fedlt.registry import Registry, create_from_spec
from fedlt.spec import Params, format_spec, parse_spec

REGISTRY: Registry = Registry("augmentation", product=lambda obj: None if callable(getattr(obj, "eval", None)) else
                              f"{type(obj).__name__} lacks eval(x) (see fedlt.augment.Transform)")
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list

Shape = tuple[int, int, int]  # (C, H, W) of one sample
MAX_SIDE = 4096  # pixels: an image side fedlt's models take (imagefolder's image_size bound too)
MAX_CHANNELS = 64  # per-channel statistics given by hand


SEQUENCES = (tuple, type([]))  # ``list`` is this module's registry lookup (fedlt.augment.list)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:56]}…{text[-3:]}"


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic reads True as 1: a crop of padding=True is a typo, not 1 pixel
        raise ValueError(f"expected a number, got {value}")
    return value


def _size(value: Any) -> Any:
    """One side or (height, width), each an integer 1..MAX_SIDE (a side of 0 is an empty crop)."""
    sides = value if isinstance(value, SEQUENCES) else (value,)
    if value is None:
        return value
    if isinstance(value, SEQUENCES) and len(value) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SIDE for v in sides):
        raise ValueError(f"must be an integer 1..{MAX_SIDE} or two of them (height, width), got {_short(value)}")
    return value


def _statistics(value: Any) -> Any:
    """Per-channel values: 1..MAX_CHANNELS finite numbers (inf would make every input 0 or NaN)."""
    values = value if isinstance(value, SEQUENCES) else (value,)
    if value is None:
        return value
    if not 1 <= len(values) <= MAX_CHANNELS or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ValueError(f"must be 1..{MAX_CHANNELS} finite numbers, one per channel, got {_short(value)}")
    return tuple(values)


Size = Annotated[int | tuple[int, int], BeforeValidator(_size)]
Padding = Annotated[int, BeforeValidator(_no_bool), Field(ge=0, le=MAX_SIDE)]
Probability = Annotated[float, BeforeValidator(_no_bool), Field(ge=0, le=1, allow_inf_nan=False)]
Finite = Annotated[float, BeforeValidator(_no_bool), Field(allow_inf_nan=False)]
Statistics = Annotated[tuple[float, ...], BeforeValidator(_statistics)]


class Transform(Params):
    """A batched tensor transform: its parameters are the model's fields, validated at construction."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Training: (B, C, H, W) -> (B, C', H', W'), random draws from torch's global generator."""
        return self.eval(x)

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        """Evaluation: the deterministic counterpart (the identity by default)."""
        return x

    def output_shape(self, shape: Shape) -> Shape:
        return shape

    @property
    def changes_eval(self) -> bool:
        """Whether ``eval`` is not the identity (then the test set is transformed too)."""
        return False


@functools.lru_cache(maxsize=64)
def _channels(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-channel statistics as a (1, C, 1, 1) tensor on ``device``, made once (a tensor built from
    a Python list on a GPU is a blocking host-to-device copy: not once per step)."""
    return torch.tensor(values, dtype=dtype).view(1, -1, 1, 1).to(device)


def _square(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _fits(name: str, size: tuple[int, int], shape: Shape, padding: int = 0) -> None:
    h, w = shape[1] + 2 * padding, shape[2] + 2 * padding
    if size[0] > h or size[1] > w:
        raise FedltError(f"augment: {name} size {size[0]}×{size[1]} is larger than the {h}×{w} images it crops"
                         + (f" (after padding {padding})" if padding else ""))


def crop_at(x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Sample b's window of ``size`` starting at (top[b], left[b]), gathered for the whole batch."""
    b, c = x.shape[:2]
    rows = (top[:, None] + torch.arange(size[0], device=x.device))[:, None, :, None]
    cols = (left[:, None] + torch.arange(size[1], device=x.device))[:, None, None, :]
    return x[torch.arange(b, device=x.device)[:, None, None, None], torch.arange(c, device=x.device)[None, :, None, None],
             rows, cols]


def _center(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    # torchvision's offsets: round((H - h) / 2), Python's round (half to even) included
    top, left = int(round((x.shape[2] - size[0]) / 2.0)), int(round((x.shape[3] - size[1]) / 2.0))
    return x[:, :, top:top + size[0], left:left + size[1]]


@register("random_crop")
class RandomCrop(Transform):
    """Pad every side by ``padding`` with ``fill``, then crop a ``size`` window at a uniformly
    random position, drawn per sample (torchvision's RandomCrop; CIFAR: ``padding=4``). The
    images are already standardised, so ``fill=0`` pads with the channel mean. Evaluation: a
    centre crop of ``size`` (the identity when ``size`` is the image's)."""

    size: Size | None = Field(None, description=f"crop height and width, 1..{MAX_SIDE} (one int: square); "
                                                "default: the input's size")
    padding: Padding = Field(0, description="pixels added on every side before cropping (at most the image's side)")
    fill: Finite = Field(0.0, description="value of the padding (standardised units: 0 = mean)")

    def _size(self, x: torch.Tensor) -> tuple[int, int]:
        return _square(self.size) if self.size is not None else (x.shape[2], x.shape[3])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        size = self._size(x)
        if self.padding:
            x = torch.nn.functional.pad(x, [self.padding] * 4, value=self.fill)
        top = to_device(torch.randint(0, x.shape[2] - size[0] + 1, (x.shape[0],)), x.device)
        left = to_device(torch.randint(0, x.shape[3] - size[1] + 1, (x.shape[0],)), x.device)
        return crop_at(x, top, left, size)

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        return _center(x, self._size(x))

    def output_shape(self, shape: Shape) -> Shape:
        if self.padding > min(shape[1:]):  # beyond it a crop can be all padding, and the padded batch grows as p²
            raise FedltError(f"augment: random_crop padding {self.padding} is more than the {shape[1]}×{shape[2]} "
                             f"images' shorter side ({min(shape[1:])})")
        size = _square(self.size) if self.size is not None else shape[1:]
        _fits("random_crop", size, shape, self.padding)
        return (shape[0], *size)

    @property
    def changes_eval(self) -> bool:
        return self.size is not None


class _Flip(Transform):
    p: Probability = Field(0.5, description="probability of flipping each sample, 0..1")
    dim: ClassVar[int] = -1  # the axis flipped

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flip = to_device(torch.rand(x.shape[0]) < self.p, x.device)
        return torch.where(flip[:, None, None, None], x.flip(self.dim), x)


@register("hflip")
class HorizontalFlip(_Flip):
    """Mirror each sample left-right with probability ``p``, drawn per sample
    (torchvision's RandomHorizontalFlip). Evaluation: the identity."""


@register("vflip")
class VerticalFlip(_Flip):
    """Flip each sample upside down with probability ``p``, drawn per sample
    (torchvision's RandomVerticalFlip). Evaluation: the identity."""

    dim: ClassVar[int] = -2


@register("resize")
class Resize(Transform):
    """Resize to ``size`` by bilinear interpolation with antialiasing (torchvision's Resize on
    tensors); applied in training and evaluation alike."""

    size: Size = Field(description=f"output height and width, 1..{MAX_SIDE} (one int: square)")

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        size = _square(self.size)
        if tuple(x.shape[2:]) == size:
            return x
        return torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)

    def output_shape(self, shape: Shape) -> Shape:
        return (shape[0], *_square(self.size))

    @property
    def changes_eval(self) -> bool:
        return True


@register("center_crop")
class CenterCrop(Transform):
    """The central ``size`` window (torchvision's CenterCrop); training and evaluation alike."""

    size: Size = Field(description=f"crop height and width, 1..{MAX_SIDE} (one int: square)")

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        return _center(x, _square(self.size))

    def output_shape(self, shape: Shape) -> Shape:
        _fits("center_crop", _square(self.size), shape)
        return (shape[0], *_square(self.size))

    @property
    def changes_eval(self) -> bool:
        return True


@register("normalize")
class Normalize(Transform):
    """(x − mean) / std per channel, in training and evaluation alike. Without ``mean`` and
    ``std`` they are computed once before training over the whole training set as the
    transforms before this one leave it (their evaluation form), in float64."""

    mean: Statistics | None = Field(None, description="per-channel mean (finite); default: computed")
    std: Statistics | None = Field(None, description="per-channel std (finite, > 0); default: computed")

    @model_validator(mode="after")
    def _both_or_neither(self) -> "Normalize":
        if (self.mean is None) != (self.std is None):
            raise ValueError("give both mean and std, or neither (then both are computed)")
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"std must be positive, got {[*self.std]}")
        return self

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            raise FedltError("augment: normalize() has no statistics yet (fedlt.augment.fit computes them)")
        mean = _channels(tuple(self.mean), x.dtype, x.device)
        std = _channels(tuple(self.std), x.dtype, x.device)
        return (x - mean) / std

    def output_shape(self, shape: Shape) -> Shape:
        if self.mean is not None and len(self.mean) not in (1, shape[0]):
            raise FedltError(f"augment: normalize has {len(self.mean)} means for {shape[0]}-channel images")
        if self.std is not None and len(self.std) not in (1, shape[0]):
            raise FedltError(f"augment: normalize has {len(self.std)} stds for {shape[0]}-channel images")
        return shape

    @property
    def changes_eval(self) -> bool:
        return True


# -- specs and pipelines --------------------------------------------------------------------------------
def split_plus(text: str) -> list[str]:
    """``a(x=1) + b`` -> ``["a(x=1)", "b"]``: splits on ``+`` outside parentheses and quotes."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "+" and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


def parse_plus(text: str, what: str, example: str) -> list[dict[str, Any]]:
    """A chain of specs joined by ``+`` (augmentations, update transforms) -> one spec dict each;
    ``""`` or ``"none"`` -> ``[]``. ``example`` is shown when an item around a ``+`` is empty."""
    if not text.strip() or text.strip().lower() in ("none", "null"):
        return []
    items = split_plus(text)
    if any(not item.strip() for item in items):
        raise FedltError(f"{what} {text!r}: an empty item around '+'; e.g. {example!r}")
    return [parse_spec(item, what) for item in items]


def parse_augment(text: str, what: str = "--augment") -> list[dict[str, Any]]:
    """``"random_crop(padding=4) + hflip"`` -> ``[{"name": "random_crop", "padding": 4}, {"name": "hflip"}]``;
    ``""`` or ``"none"`` -> ``[]``."""
    return parse_plus(text, what, "random_crop(padding=4) + hflip")


def format_augment(specs: list[dict[str, Any]]) -> str:
    return " + ".join(format_spec(s) for s in specs) or "none"


class Pipeline:
    """Transforms applied in order; empty = the identity (and no random draws at all)."""

    def __init__(self, transforms: list[Transform]) -> None:
        self.transforms = transforms

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for t in self.transforms:
            x = t(x)
        return x

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        for t in self.transforms:
            x = t.eval(x)
        return x

    def output_shape(self, shape: Shape) -> Shape:
        for t in self.transforms:
            shape = t.output_shape(shape)
        return shape

    @property
    def changes_eval(self) -> bool:
        return any(t.changes_eval for t in self.transforms)

    def eval_all(self, x: Images) -> Images:
        """``eval`` over a whole split: a tensor ``CHUNK`` samples at a time (bounded temporaries),
        an image source as it decodes."""
        if not self.changes_eval:
            return x
        return images(x).map(self.eval, self.output_shape(tuple(x.shape[1:])))


def build(specs: Any) -> Pipeline:
    """The pipeline of a spec list (``[{"name": ..., **params}, ...]``), a spec string, or None."""
    if specs is None:
        return Pipeline([])
    if isinstance(specs, str):
        specs = parse_augment(specs)
    try:
        return Pipeline([create_from_spec(REGISTRY, dict(s), "augment") for s in specs])
    except ValueError as exc:  # create_from_spec's one line, for pydantic validators
        raise FedltError(f"augment: {exc}") from None


def _channel_statistics(pipeline: Pipeline, x: Images) -> tuple[list[float], list[float]]:
    total = squares = None
    count = 0
    for part in images(x).chunks(CHUNK):  # float64 sums in two passes: no cancellation in the variance
        part = pipeline.eval(part).double()
        total = part.sum(dim=(0, 2, 3)) if total is None else total + part.sum(dim=(0, 2, 3))
        count += part.shape[0] * part.shape[2] * part.shape[3]
    mean = total / count
    for part in images(x).chunks(CHUNK):
        part = pipeline.eval(part).double() - mean.view(1, -1, 1, 1)
        squares = (part * part).sum(dim=(0, 2, 3)) if squares is None else squares + (part * part).sum(dim=(0, 2, 3))
    std = (squares / count).sqrt()
    return mean.tolist(), torch.where(std > 0, std, torch.ones_like(std)).tolist()


def fit(specs: Any, x_train: Images) -> list[dict[str, Any]]:
    """The spec list with every ``normalize()`` given its statistics over ``x_train`` (as the
    transforms before it leave it), and the whole pipeline checked against the images' shape
    (a crop larger than the image is a one-line FedltError)."""
    specs = [dict(s) for s in (parse_augment(specs) if isinstance(specs, str) else specs or [])]
    for i, spec in enumerate(specs):
        if spec["name"] == "normalize" and spec.get("mean") is None and spec.get("std") is None:
            mean, std = _channel_statistics(build(specs[:i]), x_train)
            specs[i] = {**spec, "mean": mean, "std": std}
    build(specs).output_shape(tuple(x_train.shape[1:]))
    return specs

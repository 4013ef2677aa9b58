"""timm backbones sized for a dataset, never with pretrained weights (``--model timm:<name>``).

Only parameters of the architecture pass through: the keyword arguments of the model class's
constructor (``drop_rate``, ``depth``, ``embed_dim``, ...). ``timm.create_model``'s own arguments
that load files or weights (``checkpoint_path``, ``pretrained``, ``pretrained_cfg``,
``pretrained_cfg_overlay``, ``cache_dir``, ...) are refused in one line: the model seed alone
decides a run's initial weights, and its config digest covers everything that does.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fedlt.errors import FedltError, first_line

# timm.create_model / build_model_with_cfg arguments that fetch or load weights, or change what is
# built around the architecture: named in the refusal, so the message says why.
LOADS_WEIGHTS = ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path", "cache_dir",
                 "pretrained_strict", "pretrained_filter_fn", "pretrained_model_args")
# what fedlt sets from the dataset, or what only places the weights
SET_BY_FEDLT = ("in_chans", "num_classes", "img_size", "device", "dtype")


@contextmanager
def timm_logs_kept() -> Iterator[None]:
    """timm's log lines (e.g. 'Loading pretrained weights ...') kept off the terminal: an error is
    fedlt's one line, never timm's line above it."""
    logger = logging.getLogger("timm")
    saved = logger.handlers[:], logger.propagate
    logger.handlers[:] = [logging.NullHandler()]
    logger.propagate = False
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = saved


@functools.lru_cache(maxsize=64)
def architecture_parameters(name: str, fixed: tuple[tuple[str, object], ...]) -> tuple[str, tuple[str, ...]]:
    """The model class timm builds for ``name`` and the keyword parameters of its constructor,
    read from a model built on the meta device (no weights allocated, nothing loaded)."""
    import timm

    with timm_logs_kept(), torch.device("meta"):
        model = timm.create_model(name, pretrained=False, **dict(fixed))
    cls = type(model)
    params = inspect.signature(cls.__init__).parameters.values()
    names = tuple(p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return cls.__name__, names


def create_timm(name: str, *, in_chans: int, num_classes: int, image_size: int, **params) -> nn.Module:
    """``timm.create_model(name, pretrained=False, in_chans=, num_classes=, **params)``.

    Models whose pretrained config says ``fixed_input_size`` (ViTs, Swin, MLP-Mixer: their position
    embeddings or windows are sized at construction) also get ``img_size=image_size`` so that
    28×28 or 32×32 inputs work; convolutional models take any size and do not accept it.
    """
    import timm
    from timm.models import get_pretrained_cfg

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise FedltError(f"unknown timm model {name!r}{hint}")
    loads = sorted(set(params) & set(LOADS_WEIGHTS))
    if loads:
        raise FedltError(f"timm model {name!r}: {', '.join(loads)} would load weights or files; fedlt never does "
                         "(the model seed decides the initial weights)")
    fixed = sorted(set(params) & set(SET_BY_FEDLT))
    if fixed:
        raise FedltError(f"timm model {name!r}: {', '.join(fixed)} come(s) from the dataset, not the model spec")
    kwargs: dict = {"in_chans": in_chans, "num_classes": num_classes}
    cfg = get_pretrained_cfg(name)
    if cfg is not None and cfg.fixed_input_size:
        kwargs["img_size"] = image_size
    size = f" with {in_chans}x{image_size}x{image_size} inputs" if "img_size" in kwargs else ""
    try:
        if params:
            cls_name, allowed = architecture_parameters(name, tuple(sorted(kwargs.items())))
            unknown = sorted(set(params) - set(allowed) - set(SET_BY_FEDLT))
            if unknown:
                shown = ", ".join(p for p in allowed if p not in SET_BY_FEDLT)
                raise FedltError(f"timm model {name!r}: {', '.join(unknown)} is not a parameter of {cls_name} "
                                 f"(it takes: {shown})"[:400])
        with timm_logs_kept():
            return timm.create_model(name, pretrained=False, **kwargs, **params)
    except FedltError:
        raise
    except Exception as exc:  # whatever timm raises on a bad value: one line, with timm's first line
        raise FedltError(f"timm model {name!r} cannot be built{size}: {type(exc).__name__}: "
                         f"{first_line(exc)}"[:400]) from None

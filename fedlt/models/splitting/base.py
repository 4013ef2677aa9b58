"""What every splitter shares: the ``Splitter`` protocol and its registry, ``SplitPoint``, and
``SplitPart``, the module that re-registers a model's own tensors under their own names."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from fedlt.errors import FedltError
from fedlt.registry import Registry


class Splitter(Protocol):
    priority: int

    def applies(self, model: nn.Module) -> bool: ...

    def cut_points(self, model: nn.Module) -> list[tuple[str, str]]: ...

    def split(self, model: nn.Module, index: int) -> tuple[nn.Module, nn.Module]: ...


def _splitter_check(obj: Any) -> str | None:
    missing = [a for a in ("priority", "applies", "cut_points", "split") if not hasattr(obj, a)]
    return f"a splitter needs {', '.join(missing)}" if missing else None


SPLITTERS: Registry[Splitter] = Registry("splitter", entry=_splitter_check)


@dataclass(frozen=True)
class SplitPoint:
    """One valid cut: the client keeps everything up to and including ``module``."""

    index: int
    name: str
    module: str
    activation_shape: tuple[int, ...]  # what the client sends, without the batch dimension
    client_params: int
    server_params: int


# --------------------------------------------------------------------------------------------
# The two parts
# --------------------------------------------------------------------------------------------


class SplitPart(nn.Module):
    """One side of a split: the model's modules/tensors registered under their original names,
    run as a chain of ``steps`` and, on the server side, the owner's ``forward_head``."""

    def __init__(
        self,
        owner: nn.Module,
        names: Iterable[str],
        steps: Sequence[Callable[[Any], Any]],
        head_of: nn.Module | None = None,
    ) -> None:
        super().__init__()
        for name in names:
            _attach(self, owner, name)
        self.training = owner.training  # not .train(): that would reset the shared modules' own modes
        # A plain list: the modules in it are registered above under their names; the bound
        # methods in it (e.g. ViT's _pos_embed) read tensors this part also registers.
        self._steps = list(steps)
        # Not a submodule: its parameters are split between the parts; only its methods are used.
        object.__setattr__(self, "_head_of", head_of)

    def forward(self, x: Any) -> Any:
        for step in self._steps:
            x = step(x)
        if self._head_of is not None:
            # timm's forward_head reads the owner's own flag (F.dropout(training=self.training)),
            # which server.train()/eval() cannot reach because the owner is not a submodule.
            self._head_of.training = self.training
            x = self._head_of.forward_head(x)
        return x


def _attach(root: nn.Module, owner: nn.Module, qualname: str) -> None:
    """Register ``owner``'s module/parameter/buffer ``qualname`` on ``root`` under the same name,
    creating empty container modules for its parents."""
    *parents, leaf = qualname.split(".")
    src, dst = owner, root
    for part in parents:
        src = src._modules[part]
        if part not in dst._modules:
            dst.add_module(part, nn.Module())
        dst = dst._modules[part]
    if leaf in src._modules:
        dst.add_module(leaf, src._modules[leaf])
    elif leaf in src._parameters:
        dst.register_parameter(leaf, src._parameters[leaf])
    elif leaf in src._buffers:
        dst.register_buffer(leaf, src._buffers[leaf], persistent=leaf not in src._non_persistent_buffers_set)
    else:
        raise FedltError(f"{type(owner).__name__} has no module, parameter or buffer {qualname!r}")


def _complement(model: nn.Module, taken: Iterable[str]) -> list[str]:
    """The fewest names of modules/parameters/buffers that, with ``taken``, cover the model once."""
    taken = set(taken)
    out: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, value in [*module._parameters.items(), *module._buffers.items()]:
            if value is not None and prefix + name not in taken:
                out.append(prefix + name)
        for name, child in module._modules.items():
            qual = prefix + name
            if child is None or qual in taken:
                continue
            if any(t.startswith(qual + ".") for t in taken):
                walk(child, qual + ".")
            else:
                out.append(qual)

    walk(model, "")
    return out


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _qualname_of(model: nn.Module, module: nn.Module) -> str | None:
    return next((name for name, m in model.named_modules() if m is module), None)


def _feature_modules(model: nn.Module) -> list[str]:
    info = getattr(model, "feature_info", None) or []
    # A plain timm model keeps a list of dicts; a features_only wrapper keeps a FeatureInfo.
    if hasattr(info, "module_name"):
        return list(info.module_name())
    return [fi["module"] for fi in info if isinstance(fi, dict) and "module" in fi]

"""One registry type for every kind of component (partitioners, datasets, models, losses, ...).

A registry is a plain dict behind ``register`` / ``get`` / ``list`` / ``create``, like timm's
model registry, except that a duplicate name raises and third-party components are discovered
through the entry-point group ``fedlt.<kind>s``, loaded only when a lookup needs them. A
built-in name always wins over a plugin's (a ``temporary`` entry hides one only inside its block).

A broken plugin never breaks ``fedlt list`` or a run that does not use it: an entry point that
fails to import (any exception, ``SystemExit`` included; only ``KeyboardInterrupt`` passes), is not
what the kind registers (``entry`` check, e.g. not callable) or takes a name that exists is skipped
with one :class:`PluginWarning` line naming the entry point and its distribution; a plugin factory
that returns an object of the wrong kind (``product`` check) is a one-line FedltError when it is
created, naming the distribution too.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from fedlt.errors import FedltError, UnknownNameError, describe, first_line

T = TypeVar("T")
Check = Callable[[Any], "str | None"]  # a problem with the object, or None when it is fine


class PluginWarning(UserWarning):
    """A third-party plugin was skipped; the CLI prints it as one ``warning:`` line."""


def must_be_callable(obj: Any) -> str | None:
    return None if callable(obj) else f"{type(obj).__name__} object is not callable"


class Registry(Generic[T]):
    def __init__(self, kind: str, group: str | None = None, *, entry: Check = must_be_callable,
                 product: Check | None = None) -> None:
        """``entry`` checks what an entry point loads (default: callable, a factory or class);
        ``product`` checks what ``create`` returns (e.g. an ``nn.Module`` for models)."""
        self.kind = kind
        plural = f"{kind}es" if kind.endswith("s") else f"{kind}s"  # loss -> fedlt.losses
        self.group = group if group is not None else f"fedlt.{plural}"
        self.entry, self.product = entry, product
        self._entries: dict[str, T] = {}
        self._plugins_loaded = False
        self._plugin_names: set[str] = set()  # entries that came from entry points
        self._origin: dict[str, str] = {}  # plugin entry -> "plugin 'dist' (module:attr)"
        self._declared: dict[str, str] = {}  # built-ins known by name: name -> "module:attr"

    # -- registration -------------------------------------------------------------------------
    def register(self, name: str | None = None) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("dirichlet")``; the name defaults to ``__name__``."""

        def decorate(obj: T) -> T:
            self.add(name or getattr(obj, "__name__"), obj)
            return obj

        return decorate

    def declare(self, name: str, target: str) -> None:
        """A built-in known by name only (``"package.module:attr"``), imported on its first
        lookup as an entry point is: the registry's module need not import what it names."""
        if name in self._entries or name in self._declared:
            raise FedltError(f"{self.kind} {name!r} is already registered")
        self._declared[name] = target

    def _load_declared(self, name: str) -> None:
        module, _, attr = self._declared.pop(name).partition(":")
        self._entries[name] = getattr(importlib.import_module(module), attr)

    def add(self, name: str, obj: T) -> None:
        if name in self._entries or name in self._declared:
            raise FedltError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = obj

    @contextmanager
    def temporary(self, name: str, obj: T) -> Iterator[T]:
        """Register ``obj`` for the duration of a ``with`` block (tests, notebooks).

        It may hide a plugin of the same name (the plugin is back afterwards), never a built-in.
        """
        self._load_plugins()  # now, so that no plugin arrives during the block under this name
        hidden = self._entries.pop(name) if name in self._plugin_names and name in self._entries else None
        hidden_origin = self._origin.pop(name, None)
        try:
            self.add(name, obj)
        except FedltError:
            if hidden is not None:
                self._entries[name] = hidden
            raise
        try:
            yield obj
        finally:
            self._entries.pop(name, None)
            if hidden is not None:
                self._entries[name] = hidden
            if hidden_origin is not None:
                self._origin[name] = hidden_origin

    # -- lookup -------------------------------------------------------------------------------
    def get(self, name: str) -> T:
        if name in self._declared:
            self._load_declared(name)
        if name not in self._entries:
            self._load_plugins()
        try:
            return self._entries[name]
        except KeyError:
            valid = sorted([*self._entries, *self._declared])
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}{hint} (valid: {', '.join(valid) or 'none'})"
            ) from None

    def create(self, name: str, /, **params: Any) -> Any:
        """Look up ``name`` and call it with ``params`` (a class is instantiated); a plugin's
        result is checked by ``product``."""
        obj = self.get(name)(**params)  # type: ignore[operator]
        # plugins only: built-ins are held to their kind's contract by the tests (fedlt.testing)
        problem = self.product(obj) if self.product is not None and name in self._origin else None
        if problem is not None:
            raise FedltError(f"{self.kind} {name!r} from {self._origin[name]} returned the wrong kind of "
                             f"object: {problem}")
        return obj

    def origin(self, name: str) -> str:
        """Where an entry came from: ``built-in`` or ``plugin 'dist' (module:attr)``."""
        self.get(name)
        return self._origin.get(name, "built-in")

    def list(self, pattern: str = "*") -> list[str]:
        """Sorted registered names matching a shell-style ``pattern`` (e.g. ``"fed*"``)."""
        self._load_plugins()
        return sorted(n for n in [*self._entries, *self._declared] if fnmatch.fnmatchcase(n, pattern))

    def __contains__(self, name: object) -> bool:
        if name in self._declared:
            return True
        if name not in self._entries:
            self._load_plugins()
        return name in self._entries

    # -- plugins ------------------------------------------------------------------------------
    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=self.group):
            dist = ep.dist.name if ep.dist is not None else "unknown distribution"
            what = f"{self.kind} {ep.name!r} of plugin {dist!r} ({ep.value})"
            if ep.name in self._entries or ep.name in self._declared:
                holder = "another plugin" if ep.name in self._plugin_names else "a built-in component"
                _warn(f"{what} ignored: {holder} has that name")
                continue
            try:
                obj = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a broken plugin must not end every run
                _warn(f"{what} failed to load: {type(exc).__name__}: {first_line(exc)}")
                continue
            problem = self.entry(obj)
            if problem is not None:
                _warn(f"{what} ignored: {problem}")
                continue
            self._plugin_names.add(ep.name)
            self._origin[ep.name] = f"plugin {dist!r} ({ep.value})"
            self._entries[ep.name] = obj


def _warn(message: str) -> None:
    warnings.warn(f"fedlt: {message}", PluginWarning, stacklevel=4)


def create_from_spec(registry: Registry[Any], spec: dict[str, Any], what: str) -> Any:
    """The component a ``{"name": ..., **params}`` spec describes, for pydantic validators: every
    failure is a one-line ValueError (the CLI promises one line per error, whatever a component
    put in its message), invalid parameters as ``name: field: message``. ``what`` names the spec
    when it has no name."""
    if "name" not in spec:
        raise ValueError(f"{what} needs a 'name' (valid: {', '.join(registry.list())})")
    params = {k: v for k, v in spec.items() if k != "name"}
    try:
        return registry.create(spec["name"], **params)
    except ValidationError as exc:
        raise ValueError(f"{spec['name']}: {describe(exc)}") from None
    except (FedltError, TypeError) as exc:
        raise ValueError(" ".join(str(exc).split())) from None

"""Component specs: the one small language every ``--partition`` / ``--model`` / ``--aggregator``
flag (and a config file's string value) is written in.

    name                                        -> {"name": "name"}
    dirichlet(beta=0.1, min_size=10)            -> {"name": "dirichlet", "beta": 0.1, "min_size": 10}
    longtail(imbalance_factor=100, then=dirichlet(beta=0.5))
        -> {"name": "longtail", "imbalance_factor": 100, "then": {"name": "dirichlet", "beta": 0.5}}
    timm:resnet18                               -> {"name": "timm:resnet18"}

Parsed with :mod:`ast`, never ``eval`` (like the loss expressions of ``fedlt.losses.compose``):
keyword arguments only, each a literal (number, string, ``True``/``False``/``None``, a list or
tuple of literals), a bare word (a string: ``rule=share``; ``none``/``null`` mean ``None``,
``true``/``false`` the booleans, as in ``--set`` and TOML) or a nested spec. A name may contain ``:``, ``.``, ``-`` and ``/`` (``timm:vit_tiny_patch16_224``).

A spec (and a ``--set`` value) is at most ``MAX_TEXT_LENGTH`` characters and ``MAX_DEPTH`` levels
deep, the bounds of loss expressions: Python's parser and every walk over the tree stay far from
the recursion limit, and each refusal is one line. Numbers are numbers: ``b'1'``, ``1j`` and sets
are refused here, and ``numbers_are_numbers`` refuses a boolean where a model field wants a number.
"""

from __future__ import annotations

import ast
import re
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from fedlt.errors import FedltError

_NAME = re.compile(r"\s*([A-Za-z_][\w.:/-]*)\s*(?:\((.*)\))?\s*", re.DOTALL)
_EXAMPLE = "e.g. 'dirichlet(beta=0.1, min_size=10)' or 'longtail(imbalance_factor=100, then=dirichlet(beta=0.5))'"
_ANY_EXAMPLE = "e.g. 'name' or 'name(key=value, ...)'"


def _example(what: str) -> str:
    """The hint of a spec that does not parse: the partitioners' examples for a partition, a plain form else."""
    return _EXAMPLE if what.lstrip("-").split(".")[0] in ("partition", "then", "component") else _ANY_EXAMPLE
_NONE_WORDS = {"none", "null"}
# lower-case booleans as --set, TOML and JSON write them (``topk(error_feedback=true)``); a quoted
# 'true' stays a string, which a boolean parameter refuses
_BOOL_WORDS = {"true": True, "false": False}

# The bounds of loss expressions (fedlt.losses.compose): a real spec is a few dozen characters and
# three levels deep; a config file's tables are a handful of levels.
MAX_TEXT_LENGTH = 2000
MAX_DEPTH = 64

# The partition a run uses when none is given (also what `fedlt partition` shows without flags).
DEFAULT_PARTITION = {"name": "quantity", "alpha": 2}


def shown(text: str) -> str:
    """``text`` quoted for a message, cut to 80 characters."""
    return repr(text) if len(text) <= 80 else repr(text[:77] + "...")


def ast_depth(node: ast.AST) -> int:
    """Nesting depth of an AST, walked without recursion."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        current, level = stack.pop()
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in ast.iter_child_nodes(current))
    return deepest


def data_depth(value: Any) -> int:
    """Nesting depth of plain data (dicts and lists inside each other), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        current, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(current, dict):
            stack.extend((v, level + 1) for v in current.values())
        elif isinstance(current, (list, tuple)):
            stack.extend((v, level + 1) for v in current)
    return deepest


def parse_expression(text: str, what: str, written: str | None = None) -> ast.expr:
    """``text`` as a Python expression tree (never evaluated) within the bounds above; every
    failure of Python's parser (syntax, null bytes, nesting, memory) is one FedltError line naming
    ``what`` and quoting ``written`` (what the user wrote; ``text`` by default)."""
    written = text if written is None else written
    if len(text) > MAX_TEXT_LENGTH:
        raise FedltError(f"{what}: {len(written)} characters, more than the {MAX_TEXT_LENGTH} allowed")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        raise FedltError(f"{what} {shown(written)}: invalid syntax") from None
    depth = ast_depth(tree)
    if depth > MAX_DEPTH:
        raise FedltError(f"{what} {shown(written)}: nested {depth} levels deep, more than the {MAX_DEPTH} allowed")
    return tree


class NotALiteral(ValueError):
    """A node that is not one of the literals specs and ``--set`` accept."""


def literal(node: ast.AST, *, tables: bool = False) -> Any:
    """The plain value of a literal node: a number (with an optional sign), a string, True / False /
    None, a list or tuple of literals, and with ``tables`` a dict with string keys. Anything else —
    bytes, complex numbers, sets, names, calls, arithmetic — raises NotALiteral. The caller bounds
    the tree's depth (parse_expression), so the recursion here stays shallow."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (bool, int, float, str)):
            return node.value
        raise NotALiteral(f"{type(node.value).__name__} is not a value fedlt reads")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.List):
        return [literal(item, tables=tables) for item in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(literal(item, tables=tables) for item in node.elts)
    if tables and isinstance(node, ast.Dict):
        keys = [literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise NotALiteral("a table's keys must be strings")
        return {k: literal(v, tables=True) for k, v in zip(keys, node.values)}
    raise NotALiteral(f"{ast.unparse(node)[:60]!r} is not a literal")


def parse_spec(text: str, what: str = "component", example: str | None = None) -> dict[str, Any]:
    """``"name(k=v, ...)"`` as ``{"name": "name", **params}``; a one-line FedltError naming ``what``
    (the flag or field) when the text is not a spec, with ``example`` (default: one fitting ``what``)."""
    example = example or _example(what)
    if not isinstance(text, str) or not text.strip():
        raise FedltError(f"{what}: expected a component spec ({example}), got {text!r}"[:300])
    if len(text) > MAX_TEXT_LENGTH:
        raise FedltError(f"{what}: a spec of {len(text)} characters, more than the {MAX_TEXT_LENGTH} allowed")
    match = _NAME.fullmatch(text)
    if match is None:
        raise FedltError(f"{what} {shown(text)}: not a component spec; {example}")
    name, args = match.group(1), match.group(2)
    if args is None or not args.strip():
        return {"name": name}
    call = parse_expression(f"f({args})", what, text)
    # "a(x=1) + b(y=2)" also matches the pattern: only one call of the name is a spec
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "f"):
        raise FedltError(f"{what} {shown(text)}: invalid syntax in the parameters; {example}")
    return {"name": name, **_params(call, name, text, what)}


def _params(call: ast.Call, name: str, text: str, what: str) -> dict[str, Any]:
    if call.args:
        raise FedltError(f"{what} {shown(text)}: {name}(...) takes keyword arguments only, like {name}(k=1)")
    params: dict[str, Any] = {}
    for kw in call.keywords:
        if kw.arg is None:
            raise FedltError(f"{what} {shown(text)}: '**' is not allowed")
        if kw.arg in params:
            raise FedltError(f"{what} {shown(text)}: {kw.arg!r} is given twice")
        if kw.arg == "name":
            raise FedltError(f"{what} {shown(text)}: 'name' is the component's own; not a parameter")
        params[kw.arg] = _value(kw.value, f"{name}({kw.arg}=...)", text, what)
    return params


def _value(node: ast.AST, where: str, text: str, what: str) -> Any:
    if isinstance(node, ast.Name):  # a bare word: a string, None, or a lower-case boolean
        if node.id in _BOOL_WORDS:
            return _BOOL_WORDS[node.id]
        return None if node.id.lower() in _NONE_WORDS else node.id
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):  # a nested spec
        return {"name": node.func.id, **_params(node, node.func.id, text, what)}
    try:
        return literal(node)
    except NotALiteral as exc:
        raise FedltError(f"{what} {shown(text)}: {where} must be a literal (number, string, True/False/None, "
                         f"a list), a word or a nested spec ({exc})") from None


def parse_value(text: str, what: str) -> Any:
    """A ``--set`` value: a literal (number, string, true/false/none, list, table), else the text
    itself as a string (``--set dataset=cifar10``, ``--set out=runs/x``); too long or too deep is
    one FedltError line, like a spec."""
    raw = text.strip()
    words = {"none": None, "null": None, "true": True, "false": False}
    if raw.lower() in words:
        return words[raw.lower()]
    if len(raw) > MAX_TEXT_LENGTH:
        raise FedltError(f"{what}: a value of {len(raw)} characters, more than the {MAX_TEXT_LENGTH} allowed")
    try:
        tree = parse_expression(raw, what)
    except FedltError as exc:
        if "levels deep" in str(exc):
            raise
        return raw  # not Python syntax: a bare string
    try:
        return literal(tree, tables=True)
    except NotALiteral:
        if isinstance(tree, ast.Constant):  # bytes, complex, ...: a literal of a kind fedlt never reads
            raise FedltError(f"{what}: {shown(raw)} is not a number, string, true/false/none, list or table") \
                from None
        return raw


def format_spec(spec: str | dict[str, Any]) -> str:
    """The inverse of :func:`parse_spec` for what it produces: ``{"name": "a", "x": 1}`` -> ``a(x=1)``."""
    if isinstance(spec, str):
        return spec
    params = ", ".join(f"{k}={format_spec(v) if isinstance(v, dict) else repr(v)}"
                       for k, v in spec.items() if k != "name")
    return f"{spec['name']}({params})" if params else str(spec["name"])


# -- numbers are numbers ----------------------------------------------------------------------------
def _wants_number(annotation: Any) -> bool:
    """Whether a field's type is a number (int, float, or an optional / union of them, not bool)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) is not None else (annotation,)
    if typing.get_origin(annotation) is typing.Annotated:
        args = typing.get_args(annotation)[:1]
    return bool(args) and bool not in args and any(a in (int, float) for a in args)


def _wants_bool(annotation: Any) -> bool:
    """Whether a field's type is a boolean (``bool`` or ``bool | None``), with no text or number besides."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) is not None else (annotation,)
    return bool in args and not any(a in (str, int, float) for a in args)


def numbers_are_numbers(model: type, data: Any, *, strict: bool = False) -> Any:
    """For a pydantic ``model_validator(mode="before")``: refuse, naming the field, a boolean given
    to a field typed as a number and bytes given to any field (pydantic's lax mode would read
    ``True`` as 1, ``b'1'`` as 1.0 or as the string "1"). ``strict`` (a component's parameters,
    written in a spec or a table by hand): also a string given to a number field (``'50'``) and
    anything but true/false given to a boolean field (``'yes'``, ``1``)."""
    if not isinstance(data, dict):
        return data
    fields = getattr(model, "model_fields", {})
    for key, value in data.items():
        number = key in fields and _wants_number(fields[key].annotation)
        if isinstance(value, (bytes, bytearray)):
            raise ValueError(f"{key}: expected {'a number' if number else 'text or a number'}, got bytes "
                             f"({bytes(value)[:40]!r})")
        if isinstance(value, bool) and number:
            raise ValueError(f"{key}: expected a number, got a boolean ({value})")
        if strict and number and isinstance(value, str):
            raise ValueError(f"{key}: expected a number, got the text {value[:40]!r} (write it without quotes)")
        if strict and key in fields and _wants_bool(fields[key].annotation) and not isinstance(value, bool) \
                and value is not None:
            raise ValueError(f"{key}: expected True or False, got {str(value)[:40]!r}")
    return data


class Params(BaseModel):
    """The base of a component's parameters written by hand (a spec, a table): a number must be
    a number and a boolean a boolean (``numbers_are_numbers(strict=True)``), before pydantic's lax
    mode would read ``'0.5'`` as 0.5 or ``'yes'`` as True."""

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_numbers(cls, data: Any) -> Any:
        return numbers_are_numbers(cls, data, strict=True)


def overlay(base: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` over ``base``: the same component keeps ``base``'s parameters (nested specs alike),
    another component replaces them (they belong to a different one)."""
    if spec.get("name") != base.get("name"):
        return dict(spec)
    out = dict(base)
    for key, value in spec.items():
        old = out.get(key)
        nested = isinstance(value, dict) and isinstance(old, dict)
        out[key] = overlay(old, value) if nested else value
    return out


class SpecModel(Params):
    """The base of a component built from a spec (``name(key=value, ...)``): its parameters are the
    model's fields, validated at construction (unknown keys refused, a number given as a string
    refused: :func:`numbers_are_numbers`), frozen; ``params()`` gives them back as JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: ClassVar[str] = "component"

    def params(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def describe(self) -> str:
        """The component as a spec: ``name(key=value, ...)``."""
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.params().items())})"

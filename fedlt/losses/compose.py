"""Weighted sums of loss terms and the expression language behind ``--loss`` (SPEC §2, "Terms
compose").

``build("logit_adjust(tau=0.5) + 0.1*vacant_kd(T=2)", class_counts=n, ...)`` parses the string
with :mod:`ast` (never ``eval``): a sum or difference of registered term names, each optionally
called with keyword literals and multiplied or divided by numbers. Every term is created with
the setup values its constructor names (the client's ``class_counts``, ``global_params``,
``seed``, and any field of the round context: ``num_classes``, ``classifier_weight``,
``global_counts``, ``rounds``, ...) plus its own parameters from the string.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
from typing import Any

import torch

from fedlt.context import RoundContext
from fedlt.errors import FedltError
from fedlt.losses import REGISTRY  # defined before fedlt.losses imports this module
from fedlt.spec import ast_depth as _depth
from fedlt.spec import shown as _shown
from fedlt.losses.base import SETUP_KEYS, Composite, LossTerm, compose, describe_params
from fedlt.losses.fused import dispatch

_EXAMPLE = "e.g. 'logit_adjust(tau=0.5) + 0.1*vacant_kd(T=2)'"


# -- the expression language --------------------------------------------------------------------
def parse(expr: str) -> list[tuple[float, str, dict[str, Any]]]:
    """``"a(x=1) - 0.1*b"`` → ``[(1.0, "a", {"x": 1}), (-0.1, "b", {})]`` (no evaluation)."""
    if not isinstance(expr, str) or not expr.strip():
        raise FedltError(f"loss expression must be a non-empty string ({_EXAMPLE}), got {expr!r}")
    if len(expr) > MAX_EXPRESSION_LENGTH:
        raise FedltError(f"loss expression of {len(expr)} characters is longer than the {MAX_EXPRESSION_LENGTH} "
                         f"allowed; {_EXAMPLE}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError):  # Python's parser has its own nesting limits
        raise FedltError(
            f"loss expression {_shown(expr)}: invalid syntax; expected a weighted sum of "
            f"terms, {_EXAMPLE}"
        ) from None
    depth = _depth(tree.body)
    if depth > MAX_EXPRESSION_DEPTH:
        raise FedltError(f"loss expression {_shown(expr)} is nested {depth} levels deep, more than the "
                         f"{MAX_EXPRESSION_DEPTH} allowed; {_EXAMPLE}")
    return _terms(tree.body, 1.0, expr)


# Bounds that keep the recursive walk below far from Python's recursion limit; a real objective
# is a handful of terms (SPEC §2).
MAX_EXPRESSION_LENGTH = 2000
MAX_EXPRESSION_DEPTH = 64



_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.Div: operator.truediv}


def _number(node: ast.AST) -> float | None:
    """The value of a purely numeric sub-expression (``0.1``, ``-2``, ``1/4``), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _number(node.operand)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        a, b = _number(node.left), _number(node.right)
        if a is None or b is None or (isinstance(node.op, ast.Div) and b == 0):
            return None
        return _ARITH[type(node.op)](a, b)
    return None


def _terms(node: ast.AST, w: float, expr: str) -> list[tuple[float, str, dict[str, Any]]]:
    def bad(msg: str) -> FedltError:
        return FedltError(f"loss expression {expr!r}: {msg}; {_EXAMPLE}")

    if _number(node) is not None:
        raise bad(f"the number {ast.unparse(node)} is not attached to a term")
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        sign = 1.0 if isinstance(node.op, ast.Add) else -1.0
        return _terms(node.left, w, expr) + _terms(node.right, sign * w, expr)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        a, b = _number(node.left), _number(node.right)
        if a is not None:
            return _terms(node.right, w * a, expr)
        if b is not None:
            return _terms(node.left, w * b, expr)
        raise bad(f"{ast.unparse(node)!r} multiplies two terms; a term can only be scaled by a number")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        b = _number(node.right)
        if b is None or b == 0:
            raise bad(f"{ast.unparse(node)!r}: a term can only be divided by a non-zero number")
        return _terms(node.left, w / b, expr)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _terms(node.operand, -w if isinstance(node.op, ast.USub) else w, expr)
    if isinstance(node, ast.Name):
        return [(_finite(w, bad), node.id, {})]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        if node.args:
            raise bad(f"{name}(...) takes keyword arguments only, like {name}(tau=0.5)")
        params: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise bad(f"{name}(...): '**' is not allowed")
            try:
                params[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, SyntaxError, TypeError):
                raise bad(
                    f"{name}({kw.arg}=...) must be a literal (number, string, True/False/None), "
                    f"got {ast.unparse(kw.value)!r}"
                ) from None
        return [(_finite(w, bad), name, params)]
    raise bad(f"unexpected {ast.unparse(node)!r}")


def _finite(w: float, bad: Any) -> float:
    if not math.isfinite(w):
        raise bad(f"weight {w} is not finite")
    return w


# -- build ----------------------------------------------------------------------------------------
def build(expr: str | LossTerm | list, *, fused: str | None = None, context: RoundContext | None = None,
          **setup: Any) -> Composite:
    """Parse ``expr`` and create its terms from the round's setup values.

    ``context`` is the round (fedlt.context.RoundContext): a term's constructor may name any of
    its fields (``num_classes``, ``global_counts``, ``classifier_weight`` — the received global
    classifier, C×d, may be None —, ``round_index``, ``rounds``, ``participants``, ...). ``setup``
    adds the client's own values — ``class_counts`` (length C, over its whole local set),
    ``global_params`` (tensors of the received global model), ``seed`` (its terms' seed) — and
    may override a context field. Each term gets only those its constructor names, and a
    parameter written in the expression wins over a setup value of the same name. An
    already-built term is wrapped as it is. ``fused`` (``"auto"``, ``"on"``, ``"off"``; default the
    context's, else ``"auto"``) picks the implementation of the composite and of every term in it
    (docs/fused.md).
    """
    fused = fused if fused is not None else (context.fused if context is not None else "auto")
    dispatch.check_mode(fused)
    unknown = sorted(set(setup) - set(SETUP_KEYS))
    if unknown:
        raise FedltError(
            f"loss setup: unknown argument(s) {', '.join(unknown)} (allowed: {', '.join(SETUP_KEYS)})"
        )
    setup = (context.values() if context is not None else {}) | setup
    counts = setup.get("class_counts")
    if counts is not None:
        try:
            length = len(counts)
        except TypeError:
            raise FedltError(f"loss setup: class_counts must be a vector of length C, "
                             f"got {type(counts).__name__}") from None
        if setup.get("num_classes") is None:
            setup["num_classes"] = length
        elif length != setup["num_classes"]:
            raise FedltError(f"loss setup: class_counts has length {length} but num_classes is "
                             f"{setup['num_classes']}")
    if isinstance(expr, LossTerm):
        objective = compose(expr)
    else:
        parsed = expr if isinstance(expr, list) else parse(expr)  # a parsed expression is built without re-parsing
        objective = compose(*[(w, create_term(name, params, setup)) for w, name, params in parsed])
    objective.fused = fused
    return objective


def validate(expr: str | LossTerm) -> list[tuple[float, str, dict[str, Any]]]:
    """Check an expression before any data exists (config time): syntax, that every name is a
    registered loss term, and every parameter's name and value. Returns the parsed terms.

    Each term is built once with placeholder setup values (two classes, a one-feature
    classifier); setup-dependent problems (a missing ``classifier_weight``, a ``prior`` of the
    wrong length) surface in ``build``.
    """
    if isinstance(expr, LossTerm):
        return [(1.0, expr.name, {})]
    parsed = parse(expr)
    for _, name, params in parsed:
        # stand-ins for the round (two classes, a one-feature classifier) run every constructor's checks
        # (no num_classes: a per-class parameter's length is checked in build, against the data)
        create_term(name, params, RoundContext.placeholder().values()
                    | {"class_counts": [1.0, 1.0], "seed": 0, "global_params": [torch.zeros(1)], "num_classes": None})
    return parsed


def create_term(name: str, params: dict[str, Any], setup: dict[str, Any]) -> LossTerm:
    """Create registered ``name`` with ``params`` plus the setup values its signature accepts."""
    factory = REGISTRY.get(name)  # UnknownNameError (a FedltError) lists the valid names
    if getattr(factory, "loss_term", True) is False:
        terms = [n for n in REGISTRY.list() if getattr(REGISTRY.get(n), "loss_term", True)]
        raise FedltError(
            f"{name!r} is a registered helper, not a loss term (dpa feeds sgb's prior: use "
            f"'fedgrab'); loss terms: {', '.join(terms)}"
        )
    sig = inspect.signature(factory)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    kwargs = {k: v for k, v in setup.items() if takes_any or k in sig.parameters}
    kwargs.update(params)
    missing = [k for k, p in sig.parameters.items()
               if k in SETUP_KEYS and p.default is p.empty and k not in kwargs]
    if missing:
        raise FedltError(f"loss {name!r} needs the setup value(s) {', '.join(missing)}; pass "
                         f"them to build(...)")
    try:
        sig.bind(**kwargs)
    except TypeError as exc:
        raise FedltError(f"loss {name!r}: {exc} (parameters: {describe_params(factory)})") from None
    term = factory(**kwargs)
    if not isinstance(term, LossTerm):
        origin = REGISTRY.origin(name)
        raise FedltError(f"loss {name!r}{'' if origin == 'built-in' else ' from ' + origin}: the registered "
                         f"factory returned {type(term).__name__}, not a LossTerm")
    return term

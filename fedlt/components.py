"""What is registered, and what each component takes: its parameters with their defaults and its
docstring, read from the component itself (pydantic fields, else the call signature), so that
``fedlt list KIND NAME`` and the docs site cannot drift from the code.

A parameter's description is its pydantic ``Field(description=...)`` (a field redefined in a
subclass only to change its default keeps its base's), or, for a parameter of a call signature,
its entry in the docstring's ``Args:`` section (Google style: ``name: text`` indented under the
heading, longer text continued on more deeply indented lines). The section is shown as the
parameter table, so :func:`docstring` leaves it out."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import fedlt.aggregators
import fedlt.algorithms
import fedlt.augment
import fedlt.availability
import fedlt.client_tests
import fedlt.datasets
import fedlt.losses
import fedlt.models
import fedlt.models.heads
import fedlt.partitioners
import fedlt.posthoc
import fedlt.server_steps
import fedlt.transforms
from fedlt.algorithms import split_client, split_server
from fedlt.config import ENGINES
from fedlt.losses import SETUP_KEYS
from fedlt.models import DATASET_KEYS
from fedlt.models.splitting import SPLITTERS
from fedlt.registry import Registry


def registries() -> dict[str, Registry]:
    """Every kind's registry, by the plural name the CLI and the docs use."""
    return {"algorithms": fedlt.algorithms.REGISTRY, "datasets": fedlt.datasets.REGISTRY,
            "partitioners": fedlt.partitioners.REGISTRY, "models": fedlt.models.REGISTRY,
            "losses": fedlt.losses.REGISTRY, "aggregators": fedlt.aggregators.REGISTRY,
            "splitters": SPLITTERS, "split_clients": split_client.REGISTRY, "split_servers": split_server.REGISTRY,
            "engines": ENGINES, "posthoc": fedlt.posthoc.REGISTRY, "availability": fedlt.availability.REGISTRY,
            "augmentations": fedlt.augment.REGISTRY, "heads": fedlt.models.heads.REGISTRY,
            "server_steps": fedlt.server_steps.REGISTRY, "client_tests": fedlt.client_tests.REGISTRY,
            "transforms": fedlt.transforms.REGISTRY}


def supplied(kind: str) -> tuple[str, ...]:
    """Parameters fedlt fills in itself (from the dataset or the round), not the user."""
    engine = ("config", "resume", "on_round", "on_start", "options")  # what the run loop passes an engine
    return {"losses": SETUP_KEYS, "models": DATASET_KEYS, "datasets": ("root", "download"),
            "engines": engine, "posthoc": ("model",),
            "heads": ("in_features", "num_classes")}.get(kind, ())


@dataclass(frozen=True)
class Param:
    name: str
    default: str  # as written in a spec; "required" when there is none
    annotation: str
    description: str


def _text(value: Any) -> str:
    describe = getattr(value, "describe", None)
    return describe() if callable(describe) else repr(value)


def _pydantic(cls: type, instance: Any = None) -> list[Param]:
    out = []
    for name, field in cls.model_fields.items():
        if instance is not None:
            default = _text(getattr(instance, name))
        elif field.is_required():
            default = "required"
        elif field.default_factory is not None:
            default = _text(field.default_factory())
        else:
            default = _text(field.default)
        out.append(Param(name, default, type_text(field.annotation), _field_description(cls, name)))
    return out


def _field_description(cls: type, name: str) -> str:
    """The field's description, else that of the nearest base class defining the same field."""
    for klass in cls.__mro__:
        field = getattr(klass, "__pydantic_fields__", {}).get(name)
        if field is not None and field.description:
            return field.description
    return ""


def parameters(obj: Any) -> list[Param]:
    """The parameters ``obj`` (a registered class, factory or object) is created with."""
    if isinstance(obj, type) and hasattr(obj, "model_fields"):
        return _pydantic(obj)
    if not callable(obj):  # a registered object (a splitter): nothing to set
        return []
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    named = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not named and any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        # a preset factory (fedlt.algorithms.preset): its product's fields, with the preset's defaults
        try:
            instance = obj()
        except Exception:
            return []
        return _pydantic(type(instance), instance) if hasattr(type(instance), "model_fields") else []
    described = _args_section(_raw_docstring(obj))[1]
    out = []
    for p in named:
        default = "required" if p.default is p.empty else _text(p.default)
        out.append(Param(p.name, default, type_text(p.annotation, p.default), described.get(p.name, "")))
    return out


def type_text(annotation: Any, default: Any = inspect.Parameter.empty) -> str:
    """A parameter's type as a reader writes it (``float``, ``dict[str, int]``, ``int | None``);
    for an unannotated one, its default's type, else ``any``."""
    if annotation is inspect.Parameter.empty:
        return "any" if default is inspect.Parameter.empty or default is None else type(default).__name__
    if isinstance(annotation, str):  # postponed (``from __future__ import annotations``): as written
        return annotation
    if isinstance(annotation, type):  # a class: its own name, not its module path
        return annotation.__qualname__
    return inspect.formatannotation(annotation).replace("typing.", "")


ARGS_HEADING = "Args:"
_ARG_ENTRY = re.compile(r"^    (\w+)(?: \([^)]*\))?: (.*)$")  # "    name: text" or "    name (type): text"


def _args_section(doc: str) -> tuple[str, dict[str, str]]:
    """``doc`` without its ``Args:`` section, and the section's descriptions by parameter name."""
    lines = doc.splitlines()
    if ARGS_HEADING not in lines:
        return doc, {}
    start = lines.index(ARGS_HEADING)
    end = start + 1
    while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
        end += 1
    described: dict[str, str] = {}
    current = None
    for line in lines[start + 1:end]:
        entry = _ARG_ENTRY.match(line)
        if entry:
            current = entry.group(1)
            described[current] = entry.group(2).strip()
        elif line.strip() and current is not None:  # a continuation line
            described[current] += " " + line.strip()
    rest = lines[:start] + lines[end:]
    return "\n".join(rest).strip(), described


def _raw_docstring(obj: Any) -> str:
    doc = inspect.getdoc(obj) if callable(obj) or isinstance(obj, type) else inspect.getdoc(type(obj))
    return doc or ""


def docstring(obj: Any) -> str:
    """The component's docstring without its ``Args:`` section (shown as the parameter table)."""
    return _args_section(_raw_docstring(obj))[0]


# A sentence ends at a full stop before whitespace and a capital (or the paragraph's end), not
# after an abbreviation such as "et al." or "eq." (followed by a year or number anyway).
_SENTENCE_END = re.compile(r"(?<!\bal)(?<!\beq)(?<!\bAlg)(?<!\be\.g)(?<!\bi\.e)[.!?](?=\s+[A-Z`(])")


def summary_line(obj: Any) -> str:
    """The docstring's first sentence, on one line. A first paragraph that runs on into a list or
    a formula without ending its sentence gives its text before the last colon, as a sentence."""
    paragraph = " ".join(docstring(obj).split("\n\n")[0].split())
    if not paragraph:
        return ""
    end = _SENTENCE_END.search(paragraph)
    if end is not None:
        return paragraph[: end.end()]
    if paragraph[-1] in ".!?":
        return paragraph
    head = paragraph.rpartition(":")[0].strip()
    return f"{head}." if head else f"{paragraph}."

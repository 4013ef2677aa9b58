"""Flags shared by ``fedlt run`` and ``fedlt partition``, resolved by one function each, so the
two commands read every flag combination the same way (tests/test_cli_flags.py holds the table)."""

from __future__ import annotations

from typing import Any, Optional

import typer

from fedlt.errors import FedltError
from fedlt.spec import overlay, parse_spec

# The convenience flags are shorthands for a partitioner's parameters; a lone one names its scheme.
SCHEME_OF_FLAG = {"beta": "dirichlet", "min_size": "dirichlet", "alpha": "quantity",
                  "shards_per_client": "shards"}
LONGTAIL_FLAGS = ("imbalance_factor",)  # longtail's own; the other flags go to its inner scheme

# One declaration of each partition flag, used as the default of both commands' parameters.
PARTITION_OPTIONS = dict(
    partition=typer.Option(None, help="partitioner spec, e.g. 'dirichlet(beta=0.1, min_size=10)' or "
                           "'longtail(imbalance_factor=100, then=dirichlet(beta=0.5))' (fedlt list partitioners)"),
    alpha=typer.Option(None, help="quantity: classes per client (shorthand)"),
    beta=typer.Option(None, help="dirichlet: concentration (shorthand)"),
    min_size=typer.Option(None, help="dirichlet: minimum samples per client (shorthand)"),
    shards_per_client=typer.Option(None, help="shards: shards per client (shorthand)"),
    imbalance_factor=typer.Option(None, help="longtail: n_head / n_tail (shorthand; makes the partition long-tailed)"),
    then=typer.Option(None, help="longtail: the partitioner spec applied to what is kept (default iid)"),
)
PartitionFlag = Optional[str]

# torch's intra-op threads per process: beyond this torch (OpenMP) fails to create them, and past
# a long long it crashes the interpreter (--threads 99999999 was a segmentation fault)
MAX_THREADS = 1024  # fedlt.config.MAX_THREADS (not imported: the CLI starts without torch)


def check_threads(threads: int | None) -> None:
    """``--threads``: None (torch's default) or 1 .. MAX_THREADS, else one line."""
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        shown = threads if abs(threads) < 10**12 else f"about 1e{int(threads.bit_length() * 0.30103)}"
        raise FedltError(f"--threads must be from 1 to {MAX_THREADS}, got {shown}")


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _implied_scheme(given: dict[str, Any]) -> str | None:
    schemes = {SCHEME_OF_FLAG[k] for k in given if k in SCHEME_OF_FLAG}
    if len(schemes) > 1:
        raise FedltError(f"{', '.join(flag(k) for k in given)} belong to different partitioners; "
                         "choose one with --partition")
    return schemes.pop() if schemes else None


def _check_flags(name: str, given: dict[str, Any]) -> None:
    """Name a flag the scheme does not take (pydantic would only say 'extra input')."""
    import fedlt.partitioners

    fields = getattr(fedlt.partitioners.get(name), "model_fields", None)
    if fields is None:  # a plugin partitioner that is not a pydantic model: let it judge its params
        return
    for key in given:
        if key not in fields:
            takes = ", ".join(flag(f) for f in fields if f != "then" and f in {*SCHEME_OF_FLAG, *LONGTAIL_FLAGS})
            raise FedltError(f"{flag(key)} does not apply to {name} (its shorthand flags: {takes or 'none'}; "
                             f"give any parameter in --partition '{name}(...)')")


def resolve_partition(partition: str | None, then: str | None, flags: dict[str, Any],
                      current: dict[str, Any]) -> dict[str, Any] | None:
    """The partition spec the flags make of ``current`` (a config file's, or the default); None
    when no partition flag was given.

    The scheme is ``--partition``'s, else the one the flags imply: ``--imbalance-factor`` or
    ``--then`` make a ``longtail`` (inner ``iid`` by default), ``--beta``/``--min-size`` a
    ``dirichlet``, ``--alpha`` a ``quantity``, ``--shards-per-client`` a ``shards``; over a
    ``longtail`` they tune its inner scheme. The same scheme as ``current`` keeps its parameters
    and the spec's, then the flags', override them key by key; another scheme starts afresh.
    """
    given = {k: v for k, v in flags.items() if v is not None}
    if partition is None and then is None and not given:
        return None
    if isinstance(current, str):  # a config file's spec string, e.g. partition = "dirichlet(beta=0.5)"
        current = parse_spec(current, "partition")
    outer = {k: given.pop(k) for k in LONGTAIL_FLAGS if k in given}
    implied = _implied_scheme(given)
    if partition is not None:
        spec = parse_spec(partition, "--partition")
    elif outer or then is not None or current.get("name") == "longtail":
        spec = {"name": "longtail"}
    else:
        spec = {"name": implied or current.get("name", "quantity")}
    resolved = overlay(current, spec)
    if spec["name"] != "longtail":
        if then is not None:
            raise FedltError("--then is only meaningful with a longtail partition")
        _check_flags(spec["name"], {**outer, **given})
        return {**resolved, **given}
    inner = resolved.get("then", {"name": "iid"})
    inner = {"name": inner} if isinstance(inner, str) else dict(inner)
    if then is not None:
        inner = overlay(inner, parse_spec(then, "--then"))
    elif implied is not None and implied != inner["name"]:
        inner = {"name": implied}  # over a longtail, --beta alone means a dirichlet inner scheme
    _check_flags(inner["name"], given)
    return {**resolved, **outer, "then": {**inner, **given}}


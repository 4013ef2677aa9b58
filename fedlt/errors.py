"""User-facing errors: one line, naming what is wrong and what is allowed."""

from __future__ import annotations

import re

from pydantic import ValidationError

# control characters (C0 but newline and tab, DEL, C1) and the bidirectional overrides: what could move
# the cursor, clear the screen or reorder the text a terminal shows
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


class FedltError(Exception):
    """An error caused by the user's input; the CLI prints it on one line and exits with code 2
    (``exit_code``)."""

    exit_code = 2


class ProcessLost(FedltError):
    """A process fedlt started (a worker, its fork server) died — killed, out of memory — and
    the run could not go on: one line naming what died, exit code 1 (not the user's input, not
    a stop asked by a signal). The last checkpoint stands."""

    exit_code = 1


class UnknownNameError(FedltError, KeyError):
    """A registry lookup for a name that is not registered."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


def terminal_safe(text: str) -> str:
    """``text`` with every control character written as its escape (``\\x1b``): names fedlt prints
    (a run directory, a client's reason) come from files and folders anyone may have named."""
    return _UNSAFE.sub(lambda m: repr(m.group())[1:-1], text)


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe(exc: ValidationError) -> str:
    """A pydantic error as one line: 'field.path: message' for each problem.

    List indices are dropped from nested paths (``partition.then``, not ``partition.0.then``);
    pydantic's 'Value error, ' prefix is dropped because the message already says what is wrong.
    """
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not isinstance(p, int) or len(err["loc"]) == 1)
        msg = " ".join(err["msg"].removeprefix("Value error, ").split())
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)

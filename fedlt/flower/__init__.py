"""fedlt on Flower (docs/flower.md): the same algorithms, their client work in a ClientApp on
each SuperNode and the run loop in a ServerApp.

The only package of fedlt that imports ``flwr`` (the ``flower`` extra). ``require()`` turns its
absence into one line naming the install command.
"""

from __future__ import annotations

import os
import re

from fedlt.errors import FedltError, first_line

INSTALL = 'pip install -e ".[flower]"'

# Flower reports usage unless told not to; fedlt never sends anything anywhere.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # no GPUs: silences Ray's warning about them


def require() -> None:
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise FedltError(f"--engine flower needs Flower, which is not installed: {INSTALL}") from None


def error_line(reason: str) -> str:
    """The client's own error out of a node's error report (Ray wraps it in its traceback, with
    terminal colours): the last ``SomeError: message`` line, else the report's first line."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", reason)
    found = re.findall(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception|Fault|Loss)): (.+)$", plain, re.M)
    return f"{found[-1][0]}: {found[-1][1].strip()}" if found else first_line(plain)

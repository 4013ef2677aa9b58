"""User-facing errors: one line, naming what is wrong and what is allowed."""

from __future__ import annotations


class FedltError(Exception):
    """An error caused by the user's input; the CLI prints it on one line and exits with code 2."""


class UnknownNameError(FedltError, KeyError):
    """A registry lookup for a name that is not registered."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""

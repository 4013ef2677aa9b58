"""fedlt's command line (importable as ``fedlt.cli``)."""

from fedlt.cli.app import app, main

__all__ = ["app", "main"]

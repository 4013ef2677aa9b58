"""The Typer app. Commands live one per module and only parse, call fedlt, and print."""

from __future__ import annotations

import sys
import warnings

import click
import typer

try:  # typer 0.29 runs on its own vendored copy of click; older typers use click itself
    from typer._click import exceptions as typer_click
except ImportError:  # pragma: no cover
    from click import exceptions as typer_click
from pydantic import ValidationError

from fedlt.errors import FedltError, describe, first_line, terminal_safe
from fedlt.registry import PluginWarning

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated learning under label skew.")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"fedlt {version('fedlt')}")
        except PackageNotFoundError:  # imported from a source tree that was never installed
            raise FedltError("fedlt is not installed (no package metadata); install it with pip install -e .") from None
        raise typer.Exit()


@app.callback()
def options(show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                              help="Print fedlt's installed version and exit.")) -> None:
    """Options taken before the command (``fedlt --version``); the app's help stays the one above."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line on stderr and exit code 2; a skipped
    plugin is one ``warning:`` line."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", PluginWarning)
        shown = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if issubclass(category, PluginWarning):
                print(f"warning: {first_line(message)}", file=sys.stderr)
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        _main(argv)


def _main(argv: list[str] | None) -> None:
    from fedlt.cli import commands  # noqa: F401  (registers the commands on `app`)

    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="fedlt", standalone_mode=False)
    except (click.exceptions.Exit, typer.Exit) as exc:
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, typer.Abort, KeyboardInterrupt) as exc:
        print(f"stopped: {exc}" if str(exc) else "stopped", file=sys.stderr)
        sys.exit(130)
    except getattr(typer_click, "NoArgsIsHelpError", ()) as exc:
        print(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(0)
    except (click.UsageError, typer_click.UsageError) as exc:
        print(terminal_safe(f"error: {exc.format_message()}".replace("\n", " ")), file=sys.stderr)
        sys.exit(2)
    except ValidationError as exc:
        print(terminal_safe(f"error: {describe(exc)}"), file=sys.stderr)
        sys.exit(2)
    except FedltError as exc:  # the user's input: 2; a process fedlt started that died (ProcessLost): 1
        print(terminal_safe(f"error: {first_line(exc)}"), file=sys.stderr)  # it may name a user's path
        sys.exit(exc.exit_code)
    except OSError as exc:  # paths are checked up front; this is the disk filling or a folder vanishing mid-run
        from fedlt.rundir import reason

        where = f"{exc.filename}: " if exc.filename else ""
        print(terminal_safe(f"error: {where}{reason(exc)}"), file=sys.stderr)
        sys.exit(2)
    if isinstance(code, int) and code:  # typer returns (not raises) Exit codes, e.g. 130 on Ctrl-C
        sys.exit(code)

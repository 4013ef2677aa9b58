"""``fedlt doctor``: what this machine can run — versions, the device, and each fused Triton
kernel's check on it with its speed against the reference (docs/fused.md)."""

from __future__ import annotations

import os
import platform
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from fedlt.cli.app import app
from fedlt.errors import FedltError

DTYPES = ("float32", "bfloat16", "float16")


def versions() -> str:
    import torch

    from fedlt.losses.fused.dispatch import triton_backend

    try:
        import triton

        triton_version = triton.__version__ if triton_backend() is not None else f"{triton.__version__} (its kernels do not import)"
    except ImportError:
        triton_version = "not installed"
    from importlib.metadata import PackageNotFoundError, version

    try:
        fedlt_version = version("fedlt")
    except PackageNotFoundError:
        fedlt_version = "not installed"
    return (f"fedlt {fedlt_version}  torch {torch.__version__}  triton {triton_version}  "
            f"python {platform.python_version()}  cpus {os.cpu_count()}")


@app.command("doctor")
def doctor(device: Optional[str] = typer.Option(None, help="device to check the kernels on (default: cuda when "
                                                "there is one); cpu runs them through the Triton interpreter "
                                                "when TRITON_INTERPRET=1"),
           dtype: Optional[list[str]] = typer.Option(None, "--dtype", help="float32, bfloat16, float16 (repeatable; "
                                                     "default float32 and bfloat16)"),
           size: str = typer.Option("4096x1000", help="B x C of the speed measurement"),
           reps: int = typer.Option(20, help="repetitions of the speed measurement")) -> None:
    """Print versions, the device, and each fused kernel's check and speed on it."""
    import torch

    from fedlt.losses.fused.check import report

    for name in dtype or []:
        if name not in DTYPES:
            raise FedltError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    try:
        B, C = (int(v) for v in size.lower().split("x"))
        if B < 1 or C < 2 or reps < 1:
            raise ValueError
    except ValueError:
        raise FedltError(f"--size {size!r} / --reps {reps}: expected BxC with B >= 1 and C >= 2 (e.g. 4096x1000), "
                         "and reps >= 1") from None
    cuda = torch.cuda.is_available()
    target = device or ("cuda" if cuda else "cpu")
    try:
        where = torch.device(target)
    except RuntimeError:
        raise FedltError(f"--device {target!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    typer.echo(versions())
    if where.type == "cuda":
        if not cuda:
            raise FedltError(f"--device {target}: no CUDA device is available here")
        typer.echo(f"device: {where} ({torch.cuda.get_device_name(where)}, CUDA {torch.version.cuda})")
    else:
        typer.echo(f"device: {where} ({platform.processor() or platform.machine()}), "
                   f"{'a CUDA device is present' if cuda else 'no CUDA device'}")
    # only when asked for: a CPU-only machine's default answer does not run the interpreter
    interpreted = device is not None and where.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if where.type != "cuda" and not interpreted:
        typer.echo("no GPU kernel is checked: the Triton kernels run on CUDA devices (fused='auto' runs the "
                   "analytic torch path on the CPU where it was measured faster; docs/fused.md)")
        return
    if interpreted:
        typer.echo("TRITON_INTERPRET=1: checking the kernels on the CPU through the Triton interpreter "
                   "(what the tests do; speeds are the interpreter's)")
    rows = report(where, tuple(getattr(torch, name) for name in dtype or ("float32", "bfloat16")), (B, C), reps)
    table = Table("kernel", "dtype", "check", "detail", "fused ms", "reference ms", "speed-up",
                  title=f"fused kernels on {where} (speed: forward+backward, B={B}, C={C})")
    for r in rows:
        timed = "fused_ms" in r
        table.add_row(r["kernel"], r["dtype"], "passed" if r["passed"] else "FAILED: not used", r["detail"],
                      f"{r['fused_ms']:.3f}" if timed else "–", f"{r['reference_ms']:.3f}" if timed else "–",
                      f"{r['reference_ms'] / r['fused_ms']:.3g}x" if timed else "–")
    Console(width=160).print(table)

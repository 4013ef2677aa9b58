"""``fedlt sweep``: a study file and/or flags -> fedlt.sweep.sweep, with a live view of the grid."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from fedlt.cli.app import app
from fedlt.cli.run_cmd import set_value
from fedlt.cli.flags import check_threads
from fedlt.errors import FedltError


def split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets and quotes: ``dirichlet(beta=0.1, min_size=5),iid``
    is two values."""
    parts, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == sep and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    parts.append("".join(current).strip())
    return parts


def parse_assignment(text: str, flag: str) -> tuple[str, str]:
    axis, sep, values = text.partition("=")
    if not sep or not axis.strip() or not all(p.isidentifier() for p in axis.strip().split(".")):
        raise FedltError(f"{flag} {text!r}: expected SETTING=VALUE, e.g. 'partition=dirichlet(beta=0.1)'")
    return axis.strip(), values


def value_of(axis: str, raw: str, flag: str) -> Any:
    """One value as ``--set`` reads it: a literal (number, true/false, none, list) or a string
    (a word, or a component spec such as ``dirichlet(beta=0.1)``)."""
    if not raw.strip():
        raise FedltError(f"{flag} {axis}: an empty value")
    return set_value(f"{axis}={raw}")[1]


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """``--grid AXIS=V1,V2`` (repeatable) as ordered axes."""
    axes: dict[str, list[Any]] = {}
    for item in items:
        axis, values = parse_assignment(item, "--grid")
        if axis in axes:
            raise FedltError(f"--grid {axis} is given twice; list all its values in one --grid")
        axes[axis] = [value_of(axis, v, "--grid") for v in split_top(values, ",")]
    return axes


def parse_cells(items: list[str], flag: str) -> list[dict[str, Any]]:
    """``--include`` / ``--exclude 'algorithm=fedlc; partition=iid'``: one cell each."""
    cells = []
    for item in items:
        cell = {}
        for part in split_top(item, ";"):
            axis, value = parse_assignment(part, flag)
            cell[axis] = value_of(axis, value, flag)
        cells.append(cell)
    return cells


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise FedltError(f"--seeds {text!r}: expected integers separated by commas, e.g. 0,1,2") from None
    from fedlt.sweep.study import check_seeds

    return check_seeds(seeds, "--seeds")


def outcome_line(done: int, total: int, run_id: str, outcome: Any) -> str:
    """One finished run as a plain line: ``[3/12] done fedavg__iid__seed0  final 91.20  best 91.50 (r2)  4.9s``."""
    head = f"[{done}/{total}] {outcome.status} {run_id}"
    if outcome.status == "done":
        return (f"{head}  final {100 * outcome.final_accuracy:.2f}  best {100 * outcome.best_accuracy:.2f} "
                f"(r{outcome.best_round})  {outcome.seconds:.1f}s")
    return f"{head}: {outcome.error}"


@app.command("sweep")
def sweep(
    study: Optional[Path] = typer.Argument(None, help="a study file (TOML / YAML / JSON: base, axes, seeds, include, "
                                           "exclude) or a study directory to continue"),
    base: Optional[Path] = typer.Option(None, "--base", help="the runs' base config file (as fedlt run --config)"),
    grid: Optional[list[str]] = typer.Option(None, "--grid", help="an axis: SETTING=V1,V2,... (any setting, dotted, "
                                             "or a component spec: 'partition=dirichlet(beta=0.05),iid'); repeatable"),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="seeds, e.g. 0,1,2 (each sets the data, model and "
                                        "sampling seeds; default 0)"),
    include: Optional[list[str]] = typer.Option(None, "--include", help="an extra cell: 'axis=value; axis=value' "
                                                "(repeatable)"),
    exclude: Optional[list[str]] = typer.Option(None, "--exclude", help="leave out the cells matching "
                                                "'axis=value; ...' (repeatable)"),
    out: Optional[Path] = typer.Option(None, "--out", help="study directory (default: the study file's 'out', "
                                       "else studies/<file name>)"),
    extend: bool = typer.Option(False, "--extend", help="run the new cells of a changed grid in an existing study"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the runs and what would happen to each; run nothing"),
    executor: str = typer.Option("local", "--executor", help="local (worker processes), ray or slurm (submitit)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", help="local: runs at once (default: the number of cores)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per run (local default: "
                                          "cores // jobs; ray, slurm: 1)"),
    executor_param: Optional[list[str]] = typer.Option(None, "--executor-param", help="KEY=VALUE for the executor, "
                                                       "e.g. address=auto (ray), slurm_partition=gpu, timeout_min=60, "
                                                       "cluster=local (slurm); repeatable"),
    track: Optional[list[str]] = typer.Option(None, "--track", help="mlflow or tensorboard (repeatable; "
                                              "pip install -e '.[track]')"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow store (default "
                                               "sqlite:///<study>/mlflow.db)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress view or lines"),
) -> None:
    """Run a grid of runs (a study) in parallel, resumably; then `fedlt report STUDY_DIR`."""
    from fedlt.sweep import study as studies
    from fedlt.sweep.executors import EXECUTORS, check_params

    named_out = None
    if study is not None and study.is_dir():
        manifest = studies.read_manifest(study)
        if manifest is None:
            raise FedltError(f"{study} is a directory without a {studies.MANIFEST}: not a study to continue")
        the_study, named_out = studies.study_of_manifest(manifest), study
    elif study is not None:
        the_study, named_out = studies.load_study(study)
        named_out = named_out or Path("studies") / study.stem
    else:
        if not grid and not seeds and base is None:
            raise FedltError("give a study file, a study directory, or --base / --grid / --seeds")
        the_study = studies.Study({})
    if base is not None:
        from fedlt.config import read_config_file

        the_study.base = read_config_file(base)
    if grid:
        the_study.axes = the_study.axes | parse_grid(grid)
    if seeds is not None:
        the_study.seeds = parse_seeds(seeds)
    if include:
        the_study.include = the_study.include + parse_cells(include, "--include")
    if exclude:
        the_study.exclude = the_study.exclude + parse_cells(exclude, "--exclude")
    out = out or named_out
    if out is None:
        raise FedltError("name the study directory with --out")
    check_threads(threads)
    EXECUTORS.get(executor)  # first: an unknown executor is named before any of its options
    params: dict[str, Any] = {}
    for item in executor_param or []:
        path, value = set_value(item)
        params[".".join(path)] = value
    if jobs is not None:
        if executor != "local":
            raise FedltError(f"--jobs is the local executor's; --executor {executor} takes its parallelism from "
                             "the cluster")
        params["jobs"] = jobs
    check_params(executor, params)  # an unknown or ill-typed --executor-param, in one line
    if dry_run:
        _dry_run(the_study, out, extend)
        return
    _run(the_study, out, executor, params, extend, threads, tuple(track or ()), tracking_uri, quiet)


def _dry_run(the_study: Any, out: Path, extend: bool) -> None:
    from fedlt.sweep.study import plan, status_on_disk

    manifest = plan(the_study, out, extend=extend)
    actions = {"done": "skip (done)", "resumable": "resume", "new": "run"}
    for run in manifest["runs"]:
        cell = "  ".join(f"{k}={v}" for k, v in run["label"].items())
        typer.echo(f"{actions[status_on_disk(out / run['dir'])]:<12} {run['id']}  {cell}  seed={run['seed']}")
    typer.echo(f"{len(manifest['runs'])} runs in {out}")


def _run(the_study: Any, out: Path, executor: str, params: dict[str, Any], extend: bool, threads: int | None,
         track_with: tuple[str, ...], tracking_uri: str | None, quiet: bool) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from fedlt.sweep.runner import sweep as run_sweep

    console = Console(stderr=True)
    plain = not quiet and not sys.stdout.isatty()
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("eta"),
                        TimeRemainingColumn(), console=console, disable=quiet or plain, transient=True)
    counts = {"done": 0, "running": 0, "failed": 0, "stopped": 0}
    state: dict[str, Any] = {}

    def status() -> str:
        return "  ".join(f"{k} {v}" for k, v in counts.items() if v or k in ("done", "running"))

    def on_plan(manifest: dict, jobs: list) -> None:
        state["total"] = len(manifest["runs"])
        counts["done"] = state["total"] - len(jobs)
        state["task"] = progress.add_task(f"study {out.name}", total=state["total"], completed=counts["done"],
                                          status=status())
        progress.start()

    def on_event(kind: str, run_id: str, outcome: Any) -> None:
        if kind == "started":
            counts["running"] += 1
        else:
            counts["running"] -= 1
            counts[outcome.status] += 1
            for warning in outcome.warnings:
                progress.console.print(f"warning: {run_id}: {warning}", highlight=False, markup=False)
            if plain:
                finished = counts["done"] + counts["failed"] + counts["stopped"]
                typer.echo(outcome_line(finished, state["total"], run_id, outcome))
        progress.update(state["task"], completed=counts["done"] + counts["failed"], status=status())

    try:
        result = run_sweep(the_study, out, executor=executor, executor_params=params, extend=extend,
                           threads=threads, track_with=track_with, tracking_uri=tracking_uri, on_plan=on_plan,
                           on_event=on_event)
    finally:
        progress.stop()
    skipped = f" ({result.skipped} done before)" if result.skipped else ""
    typer.echo(f"{result.total} runs: {result.count('done') + result.skipped} done{skipped}, {result.failed} failed, "
               f"{result.count('stopped')} stopped -> {out}; table: fedlt report {out}")
    for run_id, outcome in result.outcomes.items():
        if outcome.status == "failed":
            typer.echo(f"failed {run_id}: {outcome.error}", err=True)
    if result.stop_signal is not None or result.count("stopped"):
        typer.echo(f"stopped; continue with: fedlt sweep {out}", err=True)
        raise typer.Exit(130)
    untracked = sorted(run_id for run_id, outcome in result.outcomes.items()
                       if any(w.startswith("tracking with") for w in outcome.warnings))  # not a run's own warning
    if untracked:  # tracking was asked for: runs that lost it are not a success
        typer.echo(f"tracking incomplete for {len(untracked)} run(s) ({', '.join(untracked[:5])}"
                   f"{', ...' if len(untracked) > 5 else ''}): see the warnings above", err=True)
    if result.failed or untracked:
        raise typer.Exit(1)

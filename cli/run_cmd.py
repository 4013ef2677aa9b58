"""``fedlt run``: flags (and an optional config file) -> RunConfig -> fedlt.engine.run."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedlt.cli.app import app
from fedlt.cli.flags import PARTITION_OPTIONS, PartitionFlag, check_threads, overlay, resolve_partition
from fedlt.errors import FedltError, ProcessLost, first_line
from fedlt.spec import MAX_DEPTH, parse_spec, parse_value, shown


def round_line(row: dict[str, Any], rounds: int) -> str:
    """One evaluated round as a plain line: ``round 5/25  loss 0.4312  acc 0.6510  balanced 0.6400  round 4.1s``."""
    loss = row.get("train_loss")
    loss_text = f"  loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
    modes = "".join(f"  {mode} {row[f'{mode}_mean']:.4f}" for mode in PER_CLIENT_MODES
                    if isinstance(row.get(f"{mode}_mean"), (int, float)))
    return (f"round {row['round']}/{rounds}{loss_text}  acc {row['accuracy']:.4f}  "
            f"balanced {row['balanced_accuracy']:.4f}{modes}  round {row.get('round_s', 0):.1f}s")


PER_CLIENT_MODES = ("global_local", "personal", "finetune")  # fedlt.algorithms.personal.EVAL_MODES (not imported: start-up)


NOTHING_TRAINED = 3  # the exit status of a run that finished without training a round (docs/runs.md)


def rounds_text(summary: dict[str, Any]) -> str:
    """``rounds 5``, or ``rounds 5 (3 trained, 2 skipped)`` when short rounds were skipped."""
    skipped = summary.get("rounds_skipped", 0)
    return f"rounds {summary['rounds']}" + (f" ({summary['rounds_trained']} trained, {skipped} skipped)" if skipped else "")


def per_client_line(summary: dict[str, Any]) -> str:
    """Each per-client mode's mean accuracy over clients, last and best: ``finetune mean 0.2586
    (best 0.2586, round 2; min 0.1364, worst10 0.1364)``; one line per mode."""
    lines = []
    for mode, numbers in summary.get("per_client", {}).items():
        final, best = numbers["final"], numbers["best"].get("mean")
        fmt = lambda v: "–" if v is None else f"{v:.4f}"  # noqa: E731
        best_text = f" (best {best['value']:.4f}, round {best['round']})" if best else ""
        lines.append(f"{mode}: mean {fmt(final.get('mean'))}{best_text}  weighted {fmt(final.get('mean_weighted'))}  "
                     f"min {fmt(final.get('min'))}  worst10 {fmt(final.get('worst10'))}  std {fmt(final.get('std'))}")
    return "\n".join(lines)


class ProgressStatus:
    """The progress bar's status after a round: its training loss and the last evaluated accuracy
    with its round (rounds between evaluations have no accuracy of their own), e.g.
    ``loss 0.4312  acc 0.651 (r15)``; ``acc –`` before the first evaluation."""

    def __init__(self) -> None:
        self.accuracy: float | None = None
        self.round: int | None = None

    def __call__(self, row: dict[str, Any]) -> str:
        if "accuracy" in row:
            self.accuracy, self.round = row["accuracy"], row.get("round")
        acc = "acc –" if self.accuracy is None else f"acc {self.accuracy:.3f} (r{self.round})"
        loss = row.get("train_loss")
        return f"loss {loss:.4f}  {acc}" if isinstance(loss, (int, float)) else acc


def check_loss_flags(algorithm: str, given: dict[str, str]) -> None:
    """--loss is the FedAvg family's objective, --client-loss / --server-loss the split engines':
    name the right flags instead of pydantic's 'extra inputs are not permitted'."""
    import fedlt.algorithms

    fields = getattr(type(fedlt.algorithms.create(algorithm)), "model_fields", None)
    if fields is None:  # not a pydantic algorithm: let the config validation speak
        return
    takes = [f"--{name.replace('_', '-')}" for name in ("loss", "client_loss", "server_loss") if name in fields]
    for name in given:
        if name not in fields:
            raise FedltError(f"--{name.replace('_', '-')}: algorithm {algorithm!r} takes "
                             f"{' / '.join(takes) if takes else 'no loss flag'} instead")


def aggregator_spec(text: str | None, server_lr: float | None, current: Any) -> dict[str, Any]:
    """``--aggregator SPEC`` / ``--server-lr`` over the config file's aggregator: the same aggregator
    keeps its parameters and the spec's override them, another starts from its spec alone;
    ``--server-lr`` sets its ``eta``."""
    current = parse_spec(current, "aggregator") if isinstance(current, str) else dict(current or {"name": "fedavg"})
    spec = current if text is None else overlay(current, parse_spec(text, "--aggregator"))
    if server_lr is not None:
        spec["eta"] = server_lr
    return spec


def kept_checkpoint(out: Path) -> str:
    """What a stopped run left: its last checkpoint's round (from checkpoint.json), or nothing."""
    try:
        done = json.loads((out / "checkpoint.json").read_text())["round"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no checkpoint had been written in {out}"
    return f"the last checkpoint (round {done}) is kept in {out}; continue with: fedlt run --resume {out}"


def set_value(text: str) -> tuple[list[str], Any]:
    """``--set KEY=VALUE``: a dotted path into the config and a literal value (a number, a string,
    true/false, none, a list), e.g. ``groups.many_above=50`` or ``eval_batch=512``; bounded like a
    spec (fedlt.spec.parse_value)."""
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(p.strip().isidentifier() for p in path) or len(path) > MAX_DEPTH:
        raise FedltError(f"--set {shown(text)}: expected KEY=VALUE with a dotted KEY, e.g. groups.many_above=50")
    return [p.strip() for p in path], parse_value(raw, f"--set {key.strip()}")


def number(text: str, flag: str) -> int | float:
    """An integer, else a decimal, from a flag's text; anything else is one line naming the flag."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise FedltError(f"{flag}: expected a number, got {text!r}")


def client_eval_flags(given: list[str], off: bool) -> bool | list[str]:
    """``--client-eval`` (repeatable) / ``--no-client-eval`` as the ``client_eval`` setting:
    true / false, or the modes given (validated by the config)."""
    if off:
        if given:
            raise FedltError("--no-client-eval and --client-eval contradict each other: give one")
        return False
    words = {"true": True, "false": False}
    if len(given) == 1 and given[0].strip().lower() in words:
        return words[given[0].strip().lower()]
    if any(g.strip().lower() in words for g in given):
        raise FedltError("--client-eval: true / false stand alone; give modes (expected, global_local, personal, "
                         "finetune(epochs=E)) to combine several")
    return given


def nest(path: list[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for key in reversed(path):
        out = {key: out}
    return out


def unsettable(text: str | None) -> Any:
    """An optional setting's flag: ``none`` unsets it, anything else goes to the config's validation."""
    return None if text is not None and text.strip().lower() in ("none", "null") else text


@app.command("run")
def run(
    algo: Optional[str] = typer.Option(None, "--algo", help="algorithm (fedlt list algorithms)"),
    split: Optional[str] = typer.Option(None, help="cut point of split algorithms: s1..s5 for alexnet, a stage "
                                        "index for timm; none for no default cut"),
    model: Optional[str] = typer.Option(None, help="model spec: alexnet, mlp, timm:<name>, or name(k=v, ...) "
                                        "(fedlt list models)"),
    dataset: Optional[str] = typer.Option(None, help="mnist (offline), cifar10, cifar100, fashion_mnist, svhn, arrays, "
                                          "or imagefolder(image_size=..., ...) (fedlt list datasets)"),
    data_root: Optional[str] = typer.Option(None, help="folder holding the dataset's files (none: unset)"),
    download: Optional[bool] = typer.Option(None, "--download/--no-download",
                                            help="let torchvision download a missing dataset"),
    partition: PartitionFlag = PARTITION_OPTIONS["partition"],
    alpha: Optional[int] = PARTITION_OPTIONS["alpha"],
    beta: Optional[float] = PARTITION_OPTIONS["beta"],
    min_size: Optional[int] = PARTITION_OPTIONS["min_size"],
    shards_per_client: Optional[int] = PARTITION_OPTIONS["shards_per_client"],
    imbalance_factor: Optional[float] = PARTITION_OPTIONS["imbalance_factor"],
    then: PartitionFlag = PARTITION_OPTIONS["then"],
    partition_file: Optional[str] = typer.Option(None, help="reuse a saved partition (partition.npz; none: unset)"),
    clients: Optional[int] = typer.Option(None, help="number of clients K"),
    new_clients: Optional[int] = typer.Option(None, "--new-clients", help="clients held out of training, evaluated "
                                              "apart (the partition has K + N parts; docs/evaluation.md)"),
    participation: Optional[float] = typer.Option(None, help="fraction of clients per round, in (0, 1]"),
    rounds: Optional[int] = typer.Option(None, help="communication rounds"),
    server_batch: Optional[int] = typer.Option(None, help="SCALA's server batch B"),
    local_iters: Optional[int] = typer.Option(None, help="local iterations T per round"),
    local_epochs: Optional[str] = typer.Option(None, help="epoch-based local training (FedAvg family; none: "
                                               "iteration-based)"),
    batch_size: Optional[int] = typer.Option(None, help="batch size of epoch-based local training"),
    drop_last: Optional[bool] = typer.Option(None, "--drop-last/--no-drop-last",
                                             help="epoch-based training: leave out each epoch's last partial batch"),
    preset: Optional[str] = typer.Option(None, "--preset", help="authors: the algorithm's authors' training settings "
                                         "for every setting not given (fedlt list algorithms NAME shows them)"),
    lr: Optional[float] = typer.Option(None, help="SGD learning rate"),
    momentum: Optional[float] = typer.Option(None),
    weight_decay: Optional[float] = typer.Option(None),
    clip: Optional[str] = typer.Option(None, help="total gradient-norm clipping per side; none turns it off"),
    loss: Optional[str] = typer.Option(None, help="local objective, e.g. 'logit_adjust + 0.1*vacant_kd'"),
    client_loss: Optional[str] = typer.Option(None, help="split algorithms: the clients' loss expression"),
    server_loss: Optional[str] = typer.Option(None, help="split algorithms: the server's loss expression"),
    aggregator: Optional[str] = typer.Option(None, help="aggregator spec, e.g. mean or 'fedadam(eta=0.01)' "
                                             "(fedlt list aggregators; SPEC §4)"),
    server_lr: Optional[float] = typer.Option(None, help="the server optimiser's learning rate eta"),
    seed: Optional[int] = typer.Option(None, help="sets the data, model and sampling seeds at once"),
    data_seed: Optional[int] = typer.Option(None),
    model_seed: Optional[int] = typer.Option(None),
    sampling_seed: Optional[int] = typer.Option(None),
    train_limit: Optional[str] = typer.Option(None, help="use only the first N training samples (none: all)"),
    test_limit: Optional[str] = typer.Option(None, help="use only the first N test samples (none: all)"),
    augment: Optional[str] = typer.Option(None, help="training-time augmentation, e.g. 'random_crop(padding=4) + hflip' "
                                          "(none: off; fedlt list augmentations; docs/augmentation.md)"),
    eval_every: Optional[int] = typer.Option(None),
    groups: Optional[str] = typer.Option(None, help="many/medium/few rule: count (>100 / 20-100 / <20) or share (75% / 95%)"),
    posthoc: Optional[list[str]] = typer.Option(None, "--posthoc", help="post-hoc calibration evaluated beside the model (tau_norm); repeatable"),
    client_test: Optional[str] = typer.Option(None, "--client-test", help="each client's own test set: matched, "
                                              "'matched(size=50)' or 'holdout(fraction=0.25)' (none: unset; "
                                              "docs/evaluation.md)"),
    client_eval: Optional[list[str]] = typer.Option(None, "--client-eval", help="per-client evaluation: true (each "
                                                    "client's expected accuracy), or a mode: expected, global_local, "
                                                    "personal, 'finetune(epochs=1)' (repeatable; docs/evaluation.md)"),
    no_client_eval: bool = typer.Option(False, "--no-client-eval", help="no per-client evaluation"),
    client_eval_fraction: Optional[float] = typer.Option(None, "--client-eval-fraction",
                                                         help="share of the clients the modes evaluate (a fixed "
                                                              "sample per seed)"),
    checkpoint_every: Optional[int] = typer.Option(None),
    device: Optional[str] = typer.Option(None),
    fused: Optional[str] = typer.Option(None, "--fused", help="fused loss path: auto, on, off (docs/fused.md)"),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32 (default) or bf16: autocast forward, "
                                            "float32 weights and aggregation (docs/gpu.md)"),
    cohort: Optional[int] = typer.Option(None, "--cohort", help="FedAvg family: train N clients' steps together "
                                         "in one vmapped step (default 1: one after another; docs/gpu.md)"),
    compile_: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="FedAvg family: each local step's "
                                            "forward and backward through torch.compile (CUDA graphs on CUDA; "
                                            "docs/gpu.md#compiled-steps)"),
    graphs: Optional[bool] = typer.Option(None, "--graphs/--no-graphs", help="FedAvg family on CUDA: each client's "
                                          "whole local step captured as a CUDA graph and replayed "
                                          "(docs/gpu.md#whole-step-cuda-graphs)"),
    workers: Optional[str] = typer.Option(None, help="worker processes training the clients: N or auto (the cores); "
                                          "results are identical to 1 (docs/parallel.md)"),
    loader_workers: Optional[int] = typer.Option(None, help="DataLoader processes decoding images read from files "
                                                 "(imagefolder) ahead of use; 0: none (docs/datasets.md)"),
    threads: Optional[int] = typer.Option(None, help="torch intra-op threads of the run (default: the process's, "
                                          "recorded in config.json); 1 when several runs share the cores (docs/runs.md)"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="any setting as KEY=VALUE, e.g. groups.many_above=50 "
                                             "(repeatable; VALUE none unsets)"),
    engine: Optional[str] = typer.Option(None, help="local (default) or flower: Flower's simulation runtime, "
                                                    "a SuperNode per client (docs/flower.md)"),
    availability: Optional[str] = typer.Option(None, help="client availability spec: always, 'bernoulli(p=0.7)', "
                                               "'markov(p_on=0.8, p_off=0.3)', 'straggler(fraction=0.2)' (docs/faults.md)"),
    min_results: Optional[str] = typer.Option(None, help="sampled clients that must return: a count (an integer, "
                                              "e.g. 3) or a share (a decimal, e.g. 0.5; 1.0 = all)"),
    round_timeout: Optional[float] = typer.Option(None, help="deadline of a round in seconds (late clients drop)"),
    on_failure: Optional[str] = typer.Option(None, help="a failed or late client: stop the run, or drop it"),
    on_short: Optional[str] = typer.Option(None, help="a round below --min-results: skip it (the model stays as "
                                           "it was; default) or stop the run"),
    upload: Optional[str] = typer.Option(None, "--upload", help="update transforms of every client's upload, e.g. "
                                         "'clip(norm=1.0) + topk(fraction=0.01, error_feedback=true)' (none: off; "
                                         "fedlt list transforms; docs/transforms.md)"),
    privacy: Optional[str] = typer.Option(None, "--privacy", help="differential privacy: 'client_level(clip=1.0, "
                                          "noise_multiplier=1.1)', 'local(...)' or 'sample_level(clip=1.0, "
                                          "noise_multiplier=1.0)' (DP-SGD; none: off; docs/privacy.md)"),
    delta: Optional[float] = typer.Option(None, "--delta", help="δ of the reported ε (default K^-1.1)"),
    target_epsilon: Optional[float] = typer.Option(None, "--target-epsilon", help="calibrate the noise multiplier "
                                                   "so that ε after all rounds is at most this"),
    stop_at_epsilon: Optional[float] = typer.Option(None, "--stop-at-epsilon", help="stop before the round whose ε "
                                                    "would exceed this budget (docs/privacy.md)"),
    secure_aggregation: Optional[bool] = typer.Option(None, "--secure-aggregation/--no-secure-aggregation",
                                                      help="pairwise masked uploads: the server reads only their sum; "
                                                           "on --engine flower, Flower's SecAgg+ (docs/privacy.md)"),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML / YAML / JSON file; flags override it"),
    out: Optional[Path] = typer.Option(None, "--out", help="run directory (default runs/<algo>-<time>)"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue the run in this directory"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
) -> None:
    """Run a federated experiment and write its run directory."""
    import fedlt.availability
    from fedlt.algorithms.authors import differences_line
    from fedlt.algorithms.protocol import InjectedFault
    from fedlt.config import DEFAULT_PARTITION, RunConfig, merge, read_config_file
    from fedlt.engine import RunStopped
    from fedlt.engine import run as run_experiment

    check_threads(threads)
    if resume is not None:
        if config is not None:
            raise FedltError("--resume continues a run with the settings in its config.json; drop --config")
        if not (resume / "config.json").exists():
            raise FedltError(f"--resume {resume}: no config.json there (not a run directory)")
        config = resume / "config.json"
    base = read_config_file(config) if config is not None else {}
    overrides: dict[str, Any] = {}
    scalars = dict(algorithm=algo, model=model, dataset=dataset, clients=clients, new_clients=new_clients,
                   participation=participation,
                   rounds=rounds, server_batch=server_batch, local_iters=local_iters, batch_size=batch_size,
                   eval_every=eval_every, checkpoint_every=checkpoint_every, device=device, fused=fused,
                   client_eval_fraction=client_eval_fraction, precision=precision, cohort=cohort, compile=compile_,
                   graphs=graphs,
                   download=download, engine=engine, workers=workers, loader_workers=loader_workers, threads=threads,
                   out=resume or out, drop_last=drop_last, preset=preset, upload=upload, privacy=privacy, delta=delta,
                   target_epsilon=target_epsilon, stop_at_epsilon=stop_at_epsilon,
                   secure_aggregation=secure_aggregation)
    overrides.update({k: str(v) if isinstance(v, Path) else v for k, v in scalars.items() if v is not None})
    if posthoc:
        overrides["posthoc"] = list(posthoc)
    if client_eval or no_client_eval:
        overrides["client_eval"] = client_eval_flags(client_eval or [], no_client_eval)
    if client_test is not None:
        overrides["client_test"] = unsettable(client_test)
    optional = dict(split=split, data_root=data_root, partition_file=partition_file, local_epochs=local_epochs,
                    train_limit=train_limit, test_limit=test_limit)
    overrides.update({k: unsettable(v) for k, v in optional.items() if v is not None})
    if groups is not None:
        overrides["groups"] = {"rule": groups}
    if availability is not None:
        overrides["availability"] = availability
    if augment is not None:
        overrides["augment"] = augment
    faults = {k: v for k, v in dict(round_timeout=round_timeout, on_failure=on_failure, on_short=on_short).items()
              if v is not None}
    if min_results is not None:  # an integer is a count, a decimal a share of the sampled clients
        faults["min_results"] = number(min_results, "--min-results")
    if faults:
        overrides["faults"] = faults
    optimiser = {k: v for k, v in dict(lr=lr, momentum=momentum, weight_decay=weight_decay).items() if v is not None}
    if clip is not None:
        optimiser["clip"] = unsettable(clip)
    if optimiser:
        overrides["optimiser"] = optimiser
    seeds = {k: v for k, v in dict(data=data_seed, model=model_seed, sampling=sampling_seed).items() if v is not None}
    if seed is not None:
        seeds = {"data": seed, "model": seed, "sampling": seed} | seeds
    if seeds:
        overrides["seeds"] = seeds
    algo_params: dict[str, Any] = {k: v for k, v in dict(loss=loss, client_loss=client_loss,
                                                         server_loss=server_loss).items() if v is not None}
    if algo_params:
        check_loss_flags(algo or base.get("algorithm", "scala"), algo_params)
    if aggregator is not None or server_lr is not None:
        algo_params["aggregator"] = aggregator_spec(aggregator, server_lr,
                                                    base.get("algorithm_params", {}).get("aggregator"))
    if algo_params:
        overrides["algorithm_params"] = algo_params
    if algo is not None and algo != base.get("algorithm") and "algorithm_params" in base and not algo_params:
        overrides["algorithm_params"] = {}  # another algorithm's parameters would not fit this one
    flags = dict(alpha=alpha, beta=beta, min_size=min_size, shards_per_client=shards_per_client,
                 imbalance_factor=imbalance_factor)
    new_partition = resolve_partition(partition, then, flags, base.get("partition", DEFAULT_PARTITION))
    if new_partition is not None:
        base = {k: v for k, v in base.items() if k != "partition"}
        overrides["partition"] = new_partition
    for item in set_ or []:
        path, value = set_value(item)
        overrides = merge(overrides, nest(path, value))
    if "out" not in overrides and "out" not in base:
        overrides["out"] = f"runs/{overrides.get('algorithm', base.get('algorithm', 'scala'))}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = RunConfig.model_validate(merge(base, overrides))
    if resume is None:  # a new run: a scripted fault past its last round is a typo (issue 35)
        fedlt.availability.create(cfg.availability["name"], **{k: v for k, v in cfg.availability.items()
                                                              if k != "name"}).check_run(cfg.clients, cfg.rounds)
    # said once, at the start (STYLE.md), when the run has passed its checks (on_start): a refused run's
    # stderr stays its error's one line; config.json records the settings themselves
    note = differences_line(cfg.algorithm, cfg.model_dump(mode="json")) if resume is None else None
    if cfg.engine == "flower":
        from fedlt.flower import require

        require()  # before anything runs: one line naming the install command

    console = Console(stderr=True)
    # not on a terminal (CI, a pipe into tee): a plain line per evaluated round on stdout instead
    # of a bar nobody sees
    plain = not quiet and not sys.stdout.isatty()
    # transient, and shown only once the run has passed its checks: stderr then holds nothing but
    # an error's one line when something is wrong
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console,
                        disable=quiet or plain, transient=True)
    task = progress.add_task(f"{cfg.algorithm} on {cfg.dataset}", total=cfg.rounds, status="")

    def on_start(done: int) -> None:
        if note:
            typer.echo(note, err=True)
        progress.update(task, completed=done)
        progress.start()

    status = ProgressStatus()

    def on_round(done: int, row: dict) -> None:
        progress.update(task, completed=done, status=status(row))
        if plain and "accuracy" in row:
            typer.echo(round_line(row, cfg.rounds))

    try:
        summary = run_experiment(cfg, resume=resume is not None, on_round=on_round, on_start=on_start)
    except RunStopped as stop:
        progress.stop()
        typer.echo(f"stopped after round {stop.round} (signal {stop.signum}); checkpoint saved; "
                   f"continue with: fedlt run --resume {stop.out}", err=True)
        raise typer.Exit(128 + stop.signum) from None
    except InjectedFault as exc:  # the failure the availability scripted, not a bug: one line, no traceback
        raise FedltError(f"{first_line(exc)}, as the scripted availability asked; under on_failure=stop a failed "
                         f"client ends the run (--on-failure drop leaves it out of the round); "
                         f"{kept_checkpoint(Path(cfg.out))}") from None
    except ProcessLost as exc:  # a worker (or its fork server) died twice: say what is on disk, exit 1
        raise ProcessLost(f"{first_line(exc)}; {kept_checkpoint(Path(cfg.out))}") from None
    except KeyboardInterrupt as exc:  # a second signal, or a Ctrl-C before the first round: say what is on disk
        progress.stop()
        typer.echo(f"stopped at once; {kept_checkpoint(Path(cfg.out))}", err=True)
        raise typer.Exit(128 + getattr(exc, "signum", signal.SIGINT)) from None
    finally:
        progress.stop()
    final = summary["final"]
    typer.echo(f"final accuracy {final['accuracy']:.4f}  balanced {final['balanced_accuracy']:.4f}  "
               f"best {summary['best']['accuracy']:.4f} (round {summary['best']['round']})  "
               f"{rounds_text(summary)}  wall {summary['wall_time_s']:.1f}s  -> {cfg.out}")
    if summary.get("per_client"):
        typer.echo(per_client_line(summary))
    for warning in summary.get("warnings", []):
        typer.echo(f"warning: {warning}", err=True)
    if summary.get("rounds_trained") == 0:  # finished, with its summary, but nothing was learnt: not a success
        raise typer.Exit(NOTHING_TRAINED)


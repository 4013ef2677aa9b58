"""MkDocs hook: the reference pages are generated at build time from what fedlt registers, so they
cannot drift from the code. One page per registry in ``fedlt.components.registries()`` — a new kind
of component gets its page and its place in the navigation without an edit here — listing every
built-in: its docstring (the formula, defaults and source paper or SPEC section) and its parameters
with defaults and descriptions; a parameter without a description fails the build. The
command-line reference comes from the Typer app's own help."""

from __future__ import annotations

import contextlib
import io
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # anything importing timm imports triton; no GPU here

from mkdocs.exceptions import PluginError  # noqa: E402
from mkdocs.structure.files import File  # noqa: E402

# Titles and introductions of the kinds known today; a kind without one still gets a page.
KIND_TITLES = {"algorithms": "Algorithms", "partitioners": "Partitioners", "losses": "Loss terms",
               "models": "Models", "splitters": "Splitters", "aggregators": "Aggregators", "datasets": "Datasets",
               "augmentations": "Augmentations", "heads": "Classifier heads", "client_tests": "Client test sets",
               "transforms": "Update transforms"}
KIND_INTRO = {
    "transforms": "What each client does to its update before uploading it (`--upload`, composed with `+`, e.g. "
                  "`clip(norm=1.0) + topk(fraction=0.01, error_feedback=true)`; see [Update transforms]"
                  "(../transforms.md) and [Privacy](../privacy.md)).",
    "algorithms": "Registered compositions of the library's parts (`--algo`). Parameters go in "
                  "`algorithm_params` (or `--loss`, `--client-loss`, `--server-loss`, `--aggregator`); the "
                  "defaults shown are the preset's.",
    "partitioners": "How the training set is split among clients (`--partition`, a component spec such as "
                    "`dirichlet(beta=0.1, min_size=10)`).",
    "losses": "Local loss terms, composed into objectives by expressions such as "
              "`logit_adjust + 0.1*vacant_kd` (`--loss`, `--client-loss`, `--server-loss`). Parameters marked "
              "*set by fedlt* come from the round (the client's class counts, the global model).",
    "models": "Registered models (`--model`); any timm model is also available as `timm:<name>`. The "
              "input channels, classes and image size come from the dataset.",
    "splitters": "Strategies that cut a model into a client part and a server part, tried by ascending "
                 "priority (see [Models and splitting](../models.md)).",
    "aggregators": "Server-side aggregation of the clients' models (`--aggregator`).",
    "augmentations": "Training-time transforms (`--augment`, e.g. `random_crop(padding=4) + hflip`), batched on "
                     "tensors, drawing from each client's own random stream (see [Augmentation](../augmentation.md)).",
    "heads": "Classifier heads that replace a model's linear classifier (an algorithm's `head` parameter, e.g. "
             "FedETF's fixed simplex ETF, FedNH's class prototypes, FedLoGe's SSE-C); the representation size and the classes come "
             "from the model (see [Algorithms](../algorithms.md#long-tail-methods-after-fed-grab-issue-33)).",
    "client_tests": "Each client's own test set for personalised numbers (SPEC §7): `matched` draws held-out test "
                    "samples following the client's training labels (FedRoD, FedBABU), `holdout` carves them out of "
                    "its own data (PFLlib, FL-bench). The per-client summary: `fedlt.metrics.per_client_summary`.",
    "datasets": "Datasets (`--dataset`, a name or a spec such as `imagefolder(image_size=96)`); MNIST ships inside "
                "the package, the torchvision sets are read from `--data-root`, `arrays` reads your own NumPy files "
                "and `imagefolder` streams image files from disk (see [Datasets](../datasets.md)).",
}


def kinds() -> list[str]:
    from fedlt.components import registries

    return list(registries())


def title(kind: str) -> str:
    return KIND_TITLES.get(kind, kind.replace("_", " ").capitalize())


def undescribed() -> list[str]:
    """``kind/name: parameter`` for every built-in parameter the user sets that has no description."""
    from fedlt.components import parameters, registries, supplied

    missing = []
    for kind, reg in registries().items():
        for name in reg.list():
            if reg.origin(name) == "built-in":
                missing += [f"{kind}/{name}: {p.name}" for p in parameters(reg.get(name))
                            if not p.description and p.name not in supplied(kind)]
    return missing


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or " "


def kind_page(kind: str) -> str:
    from markdown.extensions.toc import slugify

    from fedlt.components import docstring, parameters, registries, summary_line, supplied

    reg = registries()[kind]
    names = [n for n in reg.list() if reg.origin(n) == "built-in"]  # installed plugins vary by machine
    intro = KIND_INTRO.get(kind, f"Registered {title(kind).lower()} (`fedlt list {kind}`).")
    lines = [f"# {title(kind)}", "", "*Generated from the registry and the docstrings by `docs/hooks.py`.*",
             "", intro, "", "| name | summary |", "|---|---|"]
    for name in names:
        lines.append(f"| [`{name}`](#{slugify(name, '-')}) | {_cell(summary_line(reg.get(name)))} |")
    auto = supplied(kind)
    for name in names:
        obj = reg.get(name)
        lines += ["", f"## {name}", ""]
        doc = docstring(obj)
        if doc:
            lines += ["```text", doc, "```", ""]
        params = parameters(obj)
        if params:
            lines += ["| parameter | default | type | description |", "|---|---|---|---|"]
            for p in params:
                description = p.description or ("*set by fedlt*" if p.name in auto else "")
                lines.append(f"| `{p.name}` | `{_cell(p.default)}` | {_cell(p.annotation)} | {_cell(description)} |")
        else:
            lines.append("No parameters.")
    return "\n".join(lines) + "\n"


def _help(command, ctx) -> str:
    """A command's help as the terminal shows it (typer prints it with rich, to stdout)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        text = command.get_help(ctx)
    return (text or buffer.getvalue()).rstrip()


def cli_page() -> str:
    import click
    import typer

    import fedlt.cli.commands  # noqa: F401  (registers the commands on the app)
    from fedlt.cli import app

    os.environ["COLUMNS"] = "100"  # rich sizes the help to the terminal; a fixed width for the page
    group = typer.main.get_command(app)
    lines = ["# Command line", "", "*Generated from the Typer app's own help by `docs/hooks.py`.*", ""]
    with click.Context(group, info_name="fedlt") as ctx:
        lines += ["```text", _help(group, ctx), "```"]
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            with click.Context(command, info_name=f"fedlt {name}") as sub:
                lines += ["", f"## fedlt {name}", "", "```text", _help(command, sub), "```"]
    return "\n".join(lines) + "\n"


def on_config(config):
    """The navigation's Reference section: a page per registry, then the command line."""
    missing = undescribed()
    if missing:
        raise PluginError("docs/hooks.py: parameters without a description (a pydantic Field description, or "
                          f"an entry in the docstring's Args: section): {', '.join(missing)}")
    reference = [{title(kind): f"reference/{kind}.md"} for kind in kinds()] + [{"Command line": "reference/cli.md"}]
    for i, entry in enumerate(config.nav or []):
        if isinstance(entry, dict) and "Reference" in entry:
            config.nav[i] = {"Reference": reference}
    return config


def on_files(files, config):
    for kind in kinds():
        files.append(File.generated(config, f"reference/{kind}.md", content=kind_page(kind)))
    files.append(File.generated(config, "reference/cli.md", content=cli_page()))
    return files

"""The example plugin package (plugins/fedlt-example), installed by the README's dev command: its
components come through entry points only, are listed by `fedlt list` and work together in a
one-round run from the CLI; what plugins import has one public path, `fedlt.plugin`, listed in
docs/plugins.md; a client variant chooses what it uploads with one hook. (Its own contract
tests live in plugins/fedlt-example/tests.)"""

from __future__ import annotations

import ast
import json
import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import fedlt.cli.commands  # noqa: F401  (registers the commands on the app)
import fedlt.losses
import fedlt.models
import fedlt.partitioners
from fedlt.cli import app, main
from fedlt.components import registries

COMPONENTS = [("losses", "poly1"), ("partitioners", "zipf"), ("models", "tiny_cnn"), ("algorithms", "example_fedcm"),
              ("algorithms", "example_feddc"), ("aggregators", "lookahead"), ("split_servers", "grouped"),
              ("transforms", "randk")]
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plugin_is_installed_and_declares_its_entry_points():
    try:
        dist = distribution("fedlt-example")
    except PackageNotFoundError:
        pytest.fail("the example plugin is not installed: run the README's test set-up command")
    declared = {(ep.group, ep.name) for ep in dist.entry_points}
    assert declared == {(f"fedlt.{kind}", name) for kind, name in COMPONENTS}


def test_fedlt_list_shows_every_component_with_its_origin():
    listed = CliRunner().invoke(app, ["list"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    rows = {tuple(c.strip() for c in line.split("│")[1:3]) for line in listed.output.splitlines() if "│" in line}
    assert set(COMPONENTS) <= rows
    for kind, name in COMPONENTS:
        shown = CliRunner().invoke(app, ["list", kind, name], env={"COLUMNS": "200"})
        assert shown.exit_code == 0 and "plugin 'fedlt-example'" in shown.output, shown.output
    for kind, name in COMPONENTS:
        assert registries()[kind].get(name).__module__.startswith("fedlt_example")


def test_a_one_round_cli_run_uses_all_three(tmp_path, capsys):
    out = tmp_path / "run"
    main(["run", "--algo", "fedavg", "--loss", "poly1(epsilon=2)", "--partition", "zipf(s=1.2)",
          "--model", "tiny_cnn(width=4)", "--rounds", "1", "--clients", "5", "--participation", "1",
          "--train-limit", "300", "--test-limit", "100", "--local-iters", "2", "--quiet", "--threads", "1",
          "--out", str(out)])
    assert "final accuracy" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == "tiny_cnn(width=4)" and config["partition"] == {"name": "zipf", "s": 1.2}
    assert config["algorithm_params"] == {"loss": "poly1(epsilon=2)"}
    manifest = json.loads((out / "partition.json").read_text())
    sizes = [sum(row) for row in manifest["class_counts"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1]  # the power law, not iid sizes
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_fedlt_plugin_is_the_one_public_path_and_plugins_md_lists_it():
    """Every name of fedlt.plugin imports, is listed in docs/plugins.md's table (and nothing else
    is), and the example plugin's modules import fedlt's parts from there only."""
    import fedlt.plugin

    assert all(hasattr(fedlt.plugin, n) for n in fedlt.plugin.__all__)
    page = (ROOT / "docs" / "plugins.md").read_text()
    table = page.split("## What a plugin imports")[1].split("\n## ")[0]
    assert set(re.findall(r"^\| `(\w+)` \|", table, re.M)) == set(fedlt.plugin.__all__)
    for needed in ("effective_steps", "AggregatorSpec", "NonFiniteLoss", "ClientUpdate", "trainable_names"):
        assert needed in fedlt.plugin.__all__
    for path in (ROOT / "plugins" / "fedlt-example" / "src" / "fedlt_example").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            if module.startswith("fedlt") and not module.startswith("fedlt_example"):
                assert module == "fedlt.plugin", (path.name, module)


def test_a_client_variant_chooses_what_it_uploads(tmp_path):
    """``ClientUpdate.upload`` is what the strategy aggregates: clients that upload their trained
    weights halved give a global model of half FedAvg's (fedavg's weights sum to 1), in one
    round, with nothing else overridden."""
    from dataclasses import dataclass

    import fedlt.algorithms
    from fedlt import io
    from fedlt.config import RunConfig
    from fedlt.engine import run
    from fedlt.plugin import ClientUpdate, FedAvgFamily

    @dataclass(frozen=True)
    class HalfUpload(ClientUpdate):
        def upload(self, local, task, model, state):
            sent = super().upload(local, task, model, state)
            return {k: v / 2 if v.is_floating_point() else v for k, v in sent.items()}

    class Halved(FedAvgFamily):
        def client_fn(self):
            return HalfUpload()

    common = dict(model="mlp", clients=4, participation=1.0, rounds=1, train_limit=200, local_iters=2,
                  partition={"name": "iid"})
    run(RunConfig(**common, algorithm="fedavg", out=tmp_path / "fedavg"))
    with fedlt.algorithms.REGISTRY.temporary("halved_upload", Halved):
        run(RunConfig(**common, algorithm="halved_upload", out=tmp_path / "halved"))
    plain, halved = (io.load_checkpoint(tmp_path / d / "checkpoint.pt")["algorithm"]["model"]
                     for d in ("fedavg", "halved"))
    for name, value in plain.items():
        torch.testing.assert_close(halved[name].double(), value.double() / 2, rtol=0, atol=1e-6)

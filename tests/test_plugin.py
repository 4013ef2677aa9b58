"""The example plugin package (plugins/fedlt-example), installed by the README's dev command: its
three components come through entry points only, are listed by `fedlt list` and work together in
a one-round run from the CLI. (Its own contract tests live in plugins/fedlt-example/tests.)"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from typer.testing import CliRunner

import fedlt.cli.commands  # noqa: F401  (registers the commands on the app)
import fedlt.losses
import fedlt.models
import fedlt.partitioners
from fedlt.cli import app, main
from fedlt.components import registries

COMPONENTS = {"losses": "poly1", "partitioners": "zipf", "models": "tiny_cnn", "algorithms": "example_fedcm",
              "aggregators": "lookahead", "split_servers": "grouped"}

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plugin_is_installed_and_declares_its_entry_points():
    try:
        dist = distribution("fedlt-example")
    except PackageNotFoundError:
        pytest.fail("the example plugin is not installed: run the README's test set-up command")
    declared = {(ep.group, ep.name) for ep in dist.entry_points}
    assert declared == {(f"fedlt.{kind}", name) for kind, name in COMPONENTS.items()}


def test_fedlt_list_shows_every_component_with_its_origin():
    listed = CliRunner().invoke(app, ["list"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    rows = {tuple(c.strip() for c in line.split("│")[1:3]) for line in listed.output.splitlines() if "│" in line}
    assert set(COMPONENTS.items()) <= rows
    for kind, name in COMPONENTS.items():
        shown = CliRunner().invoke(app, ["list", kind, name], env={"COLUMNS": "200"})
        assert shown.exit_code == 0 and "plugin 'fedlt-example'" in shown.output, shown.output
    for kind, name in COMPONENTS.items():
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

"""Registry contract: lookup errors, duplicates, patterns, temporary entries, entry-point plugins."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from fedlt.errors import FedltError, UnknownNameError
from fedlt.registry import PluginWarning, Registry


def make_registry(group: str = "fedlt.tests-nothing") -> Registry:
    reg = Registry("widget", group=group)

    @reg.register("dirichlet")
    def dirichlet(beta: float = 1.0):
        return ("dirichlet", beta)

    @reg.register()
    def quantity(alpha: int = 2):
        return ("quantity", alpha)

    return reg


def test_create_get_and_default_name():
    reg = make_registry()
    assert reg.create("dirichlet", beta=0.5) == ("dirichlet", 0.5)
    assert reg.get("quantity")(alpha=3) == ("quantity", 3)
    assert "quantity" in reg and "nothing" not in reg


def test_unknown_name_lists_valid_names_and_suggests_close_match():
    reg = make_registry()
    with pytest.raises(UnknownNameError) as info:
        reg.get("dirichlt")
    message = str(info.value)
    assert "did you mean 'dirichlet'" in message
    assert "dirichlet, quantity" in message
    assert isinstance(info.value, FedltError) and isinstance(info.value, KeyError)


def test_duplicate_raises():
    reg = make_registry()
    with pytest.raises(FedltError, match="already registered"):
        reg.add("dirichlet", lambda: None)


def test_list_with_patterns_is_sorted():
    reg = make_registry()
    reg.add("fedavg", object())
    assert reg.list() == ["dirichlet", "fedavg", "quantity"]
    assert reg.list("*q*") == ["quantity"]
    assert reg.list("fed*") == ["fedavg"]
    assert reg.list("zzz*") == []


def test_temporary_registration_is_removed_even_on_error():
    reg = make_registry()
    with pytest.raises(RuntimeError):
        with reg.temporary("tmp", 42):
            assert reg.get("tmp") == 42
            raise RuntimeError
    assert "tmp" not in reg


@pytest.fixture
def fake_distributions(tmp_path, monkeypatch):
    """Two installed distributions on sys.path: a working plugin and a broken one."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "good_plugin.py").write_text("def shards(n=4):\n    return ('shards', n)\n\ndef dirichlet():\n    return 'impostor'\n")
    (site / "bad_plugin.py").write_text("raise ImportError('needs a library that is not installed')\n")
    for dist, entries in {
        "good_dist": "shards = good_plugin:shards\ndirichlet = good_plugin:dirichlet\n",
        "bad_dist": "broken = bad_plugin:thing\n",
    }.items():
        info = site / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text("[fedlt.tests-widgets]\n" + textwrap.dedent(entries))
    monkeypatch.syspath_prepend(str(site))
    yield
    for mod in ("good_plugin", "bad_plugin"):
        sys.modules.pop(mod, None)


def test_entry_point_plugins_load_lazily_builtin_wins_broken_warns(fake_distributions):
    reg = make_registry(group="fedlt.tests-widgets")
    # A built-in lookup does not import plugins.
    assert reg.create("dirichlet", beta=2.0) == ("dirichlet", 2.0)
    assert "good_plugin" not in sys.modules
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert reg.create("shards", n=7) == ("shards", 7)
    messages = [str(w.message) for w in caught]
    assert any("bad_dist" in m and "broken" in m and "ImportError" in m for m in messages), messages
    assert any("good_dist" in m and "built-in" in m for m in messages), messages
    assert reg.create("dirichlet") == ("dirichlet", 1.0)  # the built-in still wins
    assert "broken" not in reg.list()
    assert reg.list() == ["dirichlet", "quantity", "shards"]


@pytest.mark.parametrize("load_before", [False, True])
def test_a_temporary_entry_hides_a_plugin_only_inside_its_block(fake_distributions, load_before):
    reg = make_registry(group="fedlt.tests-widgets")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if load_before:
            assert reg.create("shards", n=2) == ("shards", 2)
        with reg.temporary("shards", "temporary") as obj:
            assert obj == "temporary"
            assert reg.list() == ["dirichlet", "quantity", "shards"]  # loads the plugins if not yet
            assert reg.get("shards") == "temporary"
        assert reg.create("shards", n=3) == ("shards", 3)  # the plugin is back
    messages = [str(w.message) for w in caught]
    assert not any("'shards'" in m for m in messages), messages
    assert any("'dirichlet'" in m and "built-in" in m for m in messages), messages  # built-ins still win
    with pytest.raises(FedltError, match="already registered"):
        with reg.temporary("dirichlet", "temporary"):
            pass
    assert reg.create("dirichlet") == ("dirichlet", 1.0)


def test_entry_point_group_of_each_builtin_kind():
    import fedlt.aggregators
    import fedlt.algorithms
    import fedlt.datasets
    import fedlt.losses
    import fedlt.models
    import fedlt.partitioners

    groups = {m.REGISTRY.group for m in (fedlt.partitioners, fedlt.datasets, fedlt.models, fedlt.losses,
                                         fedlt.aggregators, fedlt.algorithms)} | {fedlt.models.SPLITTERS.group}
    assert groups == {"fedlt.partitioners", "fedlt.datasets", "fedlt.models", "fedlt.losses",
                      "fedlt.aggregators", "fedlt.algorithms", "fedlt.splitters"}


@pytest.fixture
def broken_distributions(tmp_path, monkeypatch):
    """One distribution per way a plugin can be broken, each in the test group."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "exits_plugin.py").write_text("raise SystemExit('plugin calls exit() at import')\n")
    (site / "base_plugin.py").write_text("raise GeneratorExit('odd')\n")
    (site / "value_plugin.py").write_text("THING = 42\n\ndef wrong_kind(**params):\n    return 'not a widget'\n")
    (site / "ok_plugin.py").write_text("def fine(n=1):\n    return ('fine', n)\n")
    entries = {"exits_dist": "exits = exits_plugin:thing", "base_dist": "base = base_plugin:thing",
               "value_dist": "value = value_plugin:THING\nwrong = value_plugin:wrong_kind",
               "missing_dist": "missing = value_plugin:nothing_here", "ok_dist": "fine = ok_plugin:fine"}
    for dist, lines in entries.items():
        info = site / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[fedlt.tests-broken]\n{lines}\n")
    monkeypatch.syspath_prepend(str(site))
    yield site
    for mod in ("exits_plugin", "base_plugin", "value_plugin", "ok_plugin"):
        sys.modules.pop(mod, None)


def test_each_broken_plugin_is_one_warning_naming_it_and_its_distribution(broken_distributions):
    reg = Registry("widget", group="fedlt.tests-broken",
                   product=lambda obj: None if isinstance(obj, tuple) else f"{type(obj).__name__}, not a widget")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert reg.list() == ["fine", "wrong"]  # listing still works, the broken ones are skipped
    messages = sorted(str(w.message) for w in caught)
    assert all(w.category is PluginWarning and "\n" not in str(w.message) for w in caught), messages
    expected = [("base_dist", "'base'", "GeneratorExit"), ("exits_dist", "'exits'", "SystemExit: plugin calls exit()"),
                ("missing_dist", "'missing'", "AttributeError"), ("value_dist", "'value'", "int object is not callable")]
    assert len(messages) == len(expected), messages
    for message, (dist, name, needle) in zip(messages, expected):
        assert dist in message and name in message and needle in message, message
    assert reg.create("fine", n=2) == ("fine", 2)
    assert reg.origin("fine") == "plugin 'ok_dist' (ok_plugin:fine)"
    with pytest.raises(FedltError, match=r"widget 'wrong' from plugin 'value_dist' \(value_plugin:wrong_kind\) "
                                         r"returned the wrong kind of object: str, not a widget"):
        reg.create("wrong")


def test_keyboard_interrupt_while_loading_a_plugin_is_not_swallowed(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "ki_dist-1.0.dist-info").mkdir(parents=True)
    (site / "ki_plugin.py").write_text("raise KeyboardInterrupt\n")
    (site / "ki_dist-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ki_dist\nVersion: 1.0\n")
    (site / "ki_dist-1.0.dist-info" / "entry_points.txt").write_text("[fedlt.tests-ki]\nki = ki_plugin:x\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        with pytest.raises(KeyboardInterrupt):
            Registry("widget", group="fedlt.tests-ki").list()
    finally:
        sys.modules.pop("ki_plugin", None)


def test_the_cli_lists_and_runs_with_broken_plugins_and_says_so_in_one_line_each(tmp_path):
    """Real entry-point groups, in a fresh process: `fedlt list` works and each broken plugin is
    one `warning:` line; a plugin model that is not a module fails only the run that selects it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "bad_models.py").write_text("import sys\nsys.exit(3)\n")
    (site / "odd_models.py").write_text("def not_a_module(in_chans=1, num_classes=10, image_size=28):\n    return 7\n")
    (site / "odd_losses.py").write_text("ce = 'a string'\n")
    for dist, text in {"badm": "[fedlt.models]\nbroken = bad_models:x\n",
                       "oddm": "[fedlt.models]\nseven = odd_models:not_a_module\nmlp = odd_models:not_a_module\n",
                       "oddl": "[fedlt.losses]\nfancy = odd_losses:ce\n"}.items():
        info = site / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(text)
    env = {**os.environ, "PYTHONPATH": str(site), "FLWR_TELEMETRY_ENABLED": "0"}
    # `fedlt list models` then `fedlt run` in one fresh interpreter (one start and fedlt import, ~4.5 s,
    # instead of two): each command's exit code and output apart, split at a marker line
    script = textwrap.dedent(f"""
        import sys
        from fedlt.cli import main
        def command(argv):
            try:
                main(argv)
            except SystemExit as exc:
                return 0 if exc.code is None else exc.code
            return 0
        listed = command(["list", "models"])
        print(f"--- listed {{listed}}", flush=True)
        print("---", file=sys.stderr, flush=True)
        sys.exit(command(["run", "--algo", "fedavg", "--model", "seven", "--rounds", "1", "--train-limit", "200",
                          "--test-limit", "50", "--clients", "2", "--partition", "iid", "--quiet",
                          "--out", {str(tmp_path / "r")!r}, "--threads", "1"]))
        """)
    both = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    listed_out, _, _ = both.stdout.partition("--- listed ")
    listed_err, _, run_err = both.stderr.partition("---\n")
    assert both.stdout.rstrip().endswith("--- listed 0"), both.stderr  # `fedlt list` exited 0
    assert "seven" in listed_out and "alexnet" in listed_out and "broken" not in listed_out
    lines = listed_err.strip().splitlines()
    assert len(lines) == 2, lines
    assert any("'broken' of plugin 'badm'" in ln and "SystemExit: 3" in ln for ln in lines), lines
    assert any("'mlp' of plugin 'oddm'" in ln and "built-in" in ln for ln in lines), lines
    assert all(ln.startswith("warning: fedlt: ") for ln in lines), lines
    errors = [ln for ln in run_err.splitlines() if ln.startswith("error:")]
    assert both.returncode == 2 and len(errors) == 1, both.stderr
    assert "model 'seven' from plugin 'oddm'" in errors[0] and "int, not a torch.nn.Module" in errors[0]

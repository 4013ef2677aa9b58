"""Registry contract: lookup errors, duplicates, patterns, temporary entries, entry-point plugins."""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest

from fedlt.errors import FedltError, UnknownNameError
from fedlt.registry import Registry


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

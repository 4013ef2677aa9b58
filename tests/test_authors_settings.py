"""The authors' settings (issue 41): ``drop_last`` as a run setting, ``--preset authors``, the
differences a run names at its start and ``fedlt list algorithms NAME`` shows."""

from __future__ import annotations

import re

import pytest
import torch

import fedlt.algorithms
from fedlt.algorithms.authors import AUTHORS, differences, differences_line, lookup
from fedlt.algorithms.base import LocalSchedule
from fedlt.cli import main
from fedlt.config import RunConfig

SOURCE = re.compile(r"^github\.com/[\w.-]+/[\w.-]+@[0-9a-f]{40}:[\w./-]+:\d+$")
# where the authors published no code: the paper and the place in it
PAPER = re.compile(r"^paper: [^:]+:(§[\d.]+|App\. [A-Z], Algorithm \d+|Algorithm \d+)( [\w ]+)?$")


@pytest.mark.parametrize("name", sorted(AUTHORS))
def test_every_declaration_names_a_registered_algorithm_and_applies(name):
    """Each declared setting has a pinned source line, and the preset sets exactly it."""
    assert name in fedlt.algorithms.list()
    settings = AUTHORS[name]
    cfg = RunConfig.model_validate({"algorithm": name, "preset": "authors"})
    effective = cfg.model_dump(mode="json")
    for s in settings.settings:
        assert (PAPER if settings.code.startswith("paper: ") else SOURCE).match(s.source), s.source
        assert lookup(effective, s.key) == (True, s.value), s.key
        assert cfg.preset_settings[s.key] == {"value": s.value, "source": s.source}
    assert differences(name, effective) == [] and differences_line(name, effective) is None
    if settings.fedlt_defaults:  # SCALA's: fedlt's defaults are theirs, so no run is told otherwise
        defaults = RunConfig(algorithm=name).model_dump(mode="json")
        assert all(lookup(defaults, s.key) == (True, s.value) for s in settings.settings)


def test_explicit_values_win_and_the_record_survives_a_reload():
    data = {"algorithm": "fedgrab", "preset": "authors", "optimiser": {"lr": 0.1}, "batch_size": 32}
    cfg = RunConfig.model_validate(data)
    assert cfg.optimiser.lr == 0.1 and cfg.batch_size == 32  # the user's
    assert cfg.optimiser.momentum == 0.5 and cfg.optimiser.clip is None and cfg.local_epochs == 5  # theirs
    assert "optimiser.lr" not in cfg.preset_settings and "batch_size" not in cfg.preset_settings
    reloaded = RunConfig.model_validate(cfg.model_dump(mode="json"))  # a run's config.json read back (resume)
    assert reloaded == cfg
    line = differences_line("fedgrab", cfg.model_dump(mode="json"))
    assert "lr 0.1 (theirs 0.03)" in line and "batch_size 32 (theirs 5)" in line and "momentum" not in line


def test_the_default_run_names_what_differs_from_the_authors():
    line = differences_line("fedetf", RunConfig(algorithm="fedetf").model_dump(mode="json"))
    assert line.count("\n") == 0 and "momentum" not in line  # fedlt's 0.9 is theirs
    assert "lr 0.01 (theirs 0.04)" in line and "clip 10 (theirs none)" in line and "--preset authors" in line
    assert differences_line("fedavg", RunConfig(algorithm="fedavg").model_dump(mode="json")) is None  # none declared
    # a method constant the run leaves at fedlt's default is named too (MOON's mu: fedlt 1, their command 5)
    assert "mu 1 (theirs 5)" in differences_line("moon", RunConfig(algorithm="moon").model_dump(mode="json"))


def test_every_registered_algorithm_declares_its_authors_settings_or_says_why_not():
    """Issue 41's Done-when (a preset for every algorithm whose authors published settings): a
    built-in algorithm added without either fails here."""
    from fedlt.algorithms.authors import WHY_NONE

    built_in = [n for n in fedlt.algorithms.list() if fedlt.algorithms.REGISTRY.origin(n) == "built-in"]
    assert len(built_in) >= 39
    for name in built_in:
        assert (name in AUTHORS) != (name in WHY_NONE), name


def test_a_preset_for_an_algorithm_without_settings_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--algo", "splitfed_v1", "--preset", "authors", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "preset" in err and "fedgrab" in err
    assert "trains with Adam" in err  # why: fedlt's run optimiser cannot express theirs
    assert not (tmp_path / "o").exists()


def test_list_shows_the_authors_settings_beside_fedlt_defaults(capsys):
    main(["list", "algorithms", "fedrep"])
    out = capsys.readouterr().out
    assert "TsingZ0/PFLlib@d832e76f6a23" in out and "differs" in out and "drop_last" in out


def _sizes(schedule: LocalSchedule, n: int) -> list[int]:
    return [len(b) for b in schedule.batches(n, torch.Generator().manual_seed(3))]


def test_drop_last_leaves_out_each_epochs_partial_batch_and_draws_the_same_orders():
    keep, drop = LocalSchedule(4, epochs=2), LocalSchedule(4, epochs=2, drop_last=True)
    assert _sizes(keep, 10) == [4, 4, 2, 4, 4, 2] and _sizes(drop, 10) == [4, 4, 4, 4]
    kept = list(keep.batches(10, torch.Generator().manual_seed(3)))
    dropped = list(drop.batches(10, torch.Generator().manual_seed(3)))
    assert all(torch.equal(a, b) for a, b in zip(kept[:2] + kept[3:5], dropped))  # the same permutations
    assert _sizes(drop, 8) == [4, 4, 4, 4] and _sizes(drop, 3) == [3, 3]  # a client under one batch keeps it
    assert _sizes(LocalSchedule(4, iters=3, drop_last=True), 10) == [4, 4, 4]  # iterations: full batches anyway


def test_drop_last_reaches_the_schedule_of_a_run():
    from fedlt.run.parts import run_context

    cfg = RunConfig(algorithm="fedrep", preset="authors", model="mlp")
    spec = type("Spec", (), {"num_classes": 10, "build": None})()
    ctx = run_context(cfg, spec, (1, 28, 28), torch.ones(2, 10, dtype=torch.int64), [])
    schedule = ctx.schedule(10)
    assert schedule.drop_last and schedule.batch == 10 and schedule.epochs == 1 and schedule.momentum == 0.0


class _Started(Exception):
    """Raised once the run has passed its checks and started (on_start): nothing has trained."""


@pytest.mark.parametrize("preset", [False, True])
def test_a_run_says_once_at_its_start_when_its_settings_are_not_its_authors(preset, capsys, monkeypatch, tmp_path):
    """The CLI's note (cli/run_cmd.py), said when the run starts and stopped before anything
    trains: one stderr line naming the differences and the way to the authors' settings; under
    ``--preset authors`` none — except for a setting the user gave, named as such. (A refused run
    says only its error: tests/test_hostile_compose.py.)"""
    import fedlt.engine

    def started(config, *, on_start, **kwargs):
        on_start(0)
        raise _Started()

    monkeypatch.setattr(fedlt.engine, "run", started)  # run_cmd imports it when it runs
    args = ["run", "--algo", "fedrep", "--model", "mlp", "--out", str(tmp_path / "o"), "--quiet"]
    with pytest.raises(_Started):
        main(args + (["--preset", "authors"] if preset else []))
    err = capsys.readouterr().err.strip().splitlines()
    if preset:
        assert err == []
        with pytest.raises(_Started):
            main(args + ["--preset", "authors", "--lr", "0.1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["note: fedrep runs its authors' settings (github.com/TsingZ0/PFLlib@"
                       "d832e76f6a23b833038949ec1e4fdefe63a4d350) except lr 0.1 (theirs 0.005), as set"]
    else:
        assert len(err) == 1 and err[0].startswith("note: fedrep runs with fedlt's settings, not its authors' (")
        assert "momentum 0.9 (theirs 0)" in err[0] and "drop_last false (theirs true)" in err[0]
        assert err[0].endswith("--preset authors runs theirs")

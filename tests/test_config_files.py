"""Config files and flags: a valid file is read in each format, flags override it (nested tables
key by key, the partition by the rule of docs/configuration.md), and a file that cannot be read
is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedlt.cli import main
from fedlt.config import RunConfig


SETTINGS = {
    "algorithm": "fedavg",
    "model": "mlp",
    "clients": 20,
    "rounds": 7,
    "partition": {"name": "dirichlet", "beta": 0.5, "min_size": 3},
    "optimiser": {"lr": 0.05, "momentum": 0.8},
    "seeds": {"data": 1, "model": 2, "sampling": 3},
}


def write(tmp_path: Path, settings: dict, kind: str) -> Path:
    path = tmp_path / f"experiment.{kind}"
    if kind == "json":
        path.write_text(json.dumps(settings))
    elif kind == "yaml":
        import yaml

        path.write_text(yaml.safe_dump(settings))
    else:
        lines = [f"{k} = {json.dumps(v)}" for k, v in settings.items() if not isinstance(v, dict)]
        for table, values in ((k, v) for k, v in settings.items() if isinstance(v, dict)):
            lines += [f"[{table}]", *(f"{k} = {json.dumps(v)}" for k, v in values.items())]
        path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("kind", ["toml", "yaml", "json"])
def test_a_valid_file_is_read_and_flags_override_it(kind, tmp_path, resolved):
    path = write(tmp_path, SETTINGS, kind)
    cfg = resolved("--config", str(path))
    assert (cfg.algorithm, cfg.model, cfg.clients, cfg.rounds) == ("fedavg", "mlp", 20, 7)
    assert cfg.partition == {"name": "dirichlet", "beta": 0.5, "min_size": 3}
    assert (cfg.optimiser.lr, cfg.optimiser.momentum, cfg.optimiser.weight_decay) == (0.05, 0.8, 5e-4)

    cfg = resolved("--config", str(path), "--rounds", "3", "--lr", "0.1", "--model-seed", "9", "--min-size", "5")
    assert cfg.rounds == 3 and cfg.clients == 20  # the flag beats the file; the rest is the file's
    assert (cfg.optimiser.lr, cfg.optimiser.momentum) == (0.1, 0.8)  # key by key
    assert (cfg.seeds.data, cfg.seeds.model, cfg.seeds.sampling) == (1, 9, 3)
    assert cfg.partition == {"name": "dirichlet", "beta": 0.5, "min_size": 5}


@pytest.mark.parametrize("argv,partition", [
    # the file's scheme named again: its parameters stay, the flags override them one by one
    (["--partition", "dirichlet"], {"name": "dirichlet", "beta": 0.5, "min_size": 3}),
    (["--partition", "dirichlet", "--beta", "0.1"], {"name": "dirichlet", "beta": 0.1, "min_size": 3}),
    (["--beta", "0.1"], {"name": "dirichlet", "beta": 0.1, "min_size": 3}),
    # another scheme: the file's parameters belong to dirichlet and are dropped
    (["--partition", "quantity", "--alpha", "3"], {"name": "quantity", "alpha": 3}),
    (["--alpha", "3"], {"name": "quantity", "alpha": 3}),
    (["--partition", "iid"], {"name": "iid"}),
])
def test_partition_flags_merge_into_the_same_scheme_and_replace_another(argv, partition, tmp_path, resolved):
    path = write(tmp_path, SETTINGS, "toml")
    assert resolved("--config", str(path), *argv).partition == partition


def test_partition_flags_merge_into_the_default_scheme(resolved):
    # the default is quantity with alpha=2: naming it again must not drop alpha
    assert resolved("--partition", "quantity", "--clients", "5").partition == {"name": "quantity", "alpha": 2}
    assert resolved("--beta", "0.3").partition == {"name": "dirichlet", "beta": 0.3}


def test_longtail_flags_merge_into_the_outer_and_the_same_inner_scheme(tmp_path, resolved):
    path = tmp_path / "longtail.toml"
    path.write_text('[partition]\nname = "longtail"\nimbalance_factor = 100\nthen = { name = "dirichlet", beta = 0.5 }\n')
    cfg = resolved("--config", str(path), "--partition", "longtail", "--imbalance-factor", "10")
    assert cfg.partition == {"name": "longtail", "imbalance_factor": 10.0, "then": {"name": "dirichlet", "beta": 0.5}}
    cfg = resolved("--config", str(path), "--partition", "longtail", "--then", "dirichlet", "--min-size", "2")
    assert cfg.partition["then"] == {"name": "dirichlet", "beta": 0.5, "min_size": 2}
    cfg = resolved("--config", str(path), "--partition", "longtail", "--then", "iid")
    assert cfg.partition == {"name": "longtail", "imbalance_factor": 100, "then": {"name": "iid"}}
    # over a longtail file, a lone scheme flag tunes the inner scheme, not a new plain partition
    cfg = resolved("--config", str(path), "--beta", "0.1")
    assert cfg.partition == {"name": "longtail", "imbalance_factor": 100, "then": {"name": "dirichlet", "beta": 0.1}}
    cfg = resolved("--config", str(path), "--alpha", "2")
    assert cfg.partition == {"name": "longtail", "imbalance_factor": 100, "then": {"name": "quantity", "alpha": 2}}
    cfg = resolved("--config", str(path), "--imbalance-factor", "10")
    assert cfg.partition == {"name": "longtail", "imbalance_factor": 10.0, "then": {"name": "dirichlet", "beta": 0.5}}


def test_a_tiny_run_from_a_file_with_a_flag_and_the_default_partition_named(tmp_path):
    path = write(tmp_path, {"algorithm": "fedavg", "model": "mlp", "clients": 5, "rounds": 3}, "toml")
    out = tmp_path / "run"
    main(["run", "--config", str(path), "--rounds", "1", "--partition", "quantity", "--train-limit", "200",
          "--test-limit", "100", "--out", str(out), "--quiet"])
    saved = RunConfig.model_validate(json.loads((out / "config.json").read_text()))
    assert (saved.rounds, saved.clients, saved.model) == (1, 5, "mlp")
    assert saved.partition == {"name": "quantity", "alpha": 2}


@pytest.mark.parametrize("make,problem", [
    (lambda d: (d / "settings.toml").mkdir() or d / "settings.toml", "is a directory"),
    (lambda d: (d / "latin1.toml").write_bytes(b'dataset = "mnist"\n# caf\xe9\n') and d / "latin1.toml",
     "not UTF-8"),
    (lambda d: (d / "latin1.yaml").write_bytes(b"rounds: 2 # caf\xe9\n") and d / "latin1.yaml", "not UTF-8"),
])
def test_a_file_that_cannot_be_read_is_one_line_naming_it(make, problem, tmp_path, capsys):
    path = make(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["run", "--config", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "Traceback" not in err, err
    assert str(path) in err and problem in err, err

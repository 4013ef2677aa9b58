"""Component specs and the partition shorthands: ``fedlt run`` and ``fedlt partition`` resolve every
row of one table identically (both commands call ``resolve_partition``; the rows are checked end
to end through each command), and unsettable settings accept ``none``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fedlt.datasets
import fedlt.engine
import fedlt.partitioners as P
from fedlt.cli import main
from fedlt.cli.flags import resolve_partition
from fedlt.config import DEFAULT_PARTITION
from fedlt.errors import FedltError
from fedlt.spec import format_spec, parse_spec

# argv of the partition flags -> the spec both commands resolve over the default partition
TABLE = [
    ([], {"name": "quantity", "alpha": 2}),
    (["--alpha", "5"], {"name": "quantity", "alpha": 5}),
    (["--beta", "0.3"], {"name": "dirichlet", "beta": 0.3}),
    (["--beta", "0.3", "--min-size", "3"], {"name": "dirichlet", "beta": 0.3, "min_size": 3}),
    (["--shards-per-client", "2"], {"name": "shards", "shards_per_client": 2}),
    (["--partition", "iid"], {"name": "iid"}),
    (["--partition", "quantity"], {"name": "quantity", "alpha": 2}),  # the same scheme keeps its parameters
    (["--partition", "quantity(alpha=3)"], {"name": "quantity", "alpha": 3}),
    (["--partition", "dirichlet(beta=0.1, min_size=2)"], {"name": "dirichlet", "beta": 0.1, "min_size": 2}),
    (["--partition", "dirichlet(beta=0.1)", "--min-size", "2"], {"name": "dirichlet", "beta": 0.1, "min_size": 2}),
    (["--imbalance-factor", "10"], {"name": "longtail", "imbalance_factor": 10.0, "then": {"name": "iid"}}),
    (["--imbalance-factor", "4", "--beta", "0.5"],
     {"name": "longtail", "imbalance_factor": 4.0, "then": {"name": "dirichlet", "beta": 0.5}}),
    (["--imbalance-factor", "4", "--then", "quantity", "--alpha", "2"],
     {"name": "longtail", "imbalance_factor": 4.0, "then": {"name": "quantity", "alpha": 2}}),
    (["--then", "dirichlet(beta=0.5)", "--imbalance-factor", "3"],
     {"name": "longtail", "imbalance_factor": 3.0, "then": {"name": "dirichlet", "beta": 0.5}}),
    (["--partition", "longtail(imbalance_factor=10, then=dirichlet(beta=0.5))"],
     {"name": "longtail", "imbalance_factor": 10, "then": {"name": "dirichlet", "beta": 0.5}}),
    (["--partition", "longtail(imbalance_factor=10, then=dirichlet(beta=0.5))", "--min-size", "1"],
     {"name": "longtail", "imbalance_factor": 10, "then": {"name": "dirichlet", "beta": 0.5, "min_size": 1}}),
    (["--partition", "longtail(imbalance_factor=2, then=iid)", "--beta", "1"],
     {"name": "longtail", "imbalance_factor": 2, "then": {"name": "dirichlet", "beta": 1.0}}),
]
ERRORS = [
    (["--beta", "0.3", "--alpha", "2"], "choose one with --partition"),
    (["--partition", "dirichlet", "--alpha", "2"], "--alpha does not apply to dirichlet"),
    (["--partition", "iid", "--then", "dirichlet"], "--then is only meaningful"),
    (["--partition", "quantity", "--imbalance-factor", "3"], "--imbalance-factor does not apply to quantity"),
    (["--partition", "dirichlet(beta=0.1"], "--partition"),
    (["--partition", "dirichlet(0.1)"], "keyword arguments only"),
    (["--partition", "dirichlet(beta=__import__('os'))"], "keyword arguments only"),
    (["--partition", "dirichlet(beta=os.getcwd())"], "must be a literal"),
    (["--partition", "dirichlet(beta=-1)"], "beta"),
    (["--partition", "dirichelt"], "did you mean 'dirichlet'"),
    (["--min-size", "3"], "beta: Field required"),  # a lone --min-size names dirichlet, which needs beta
]

FLAG_TYPES = {"--alpha": int, "--beta": float, "--min-size": int, "--shards-per-client": int,
              "--imbalance-factor": float}


def direct(argv: list[str]) -> dict | None:
    """What ``resolve_partition`` makes of the argv, parsed the way typer types the flags."""
    args = dict(zip(argv[::2], argv[1::2]))
    flags = {f.lstrip("-").replace("-", "_"): FLAG_TYPES[f](v) for f, v in args.items() if f in FLAG_TYPES}
    return resolve_partition(args.get("--partition"), args.get("--then"), flags, DEFAULT_PARTITION)


@pytest.fixture
def resolved(resolved):
    """conftest's ``resolved`` with 10 clients (the small fake datasets here hold few samples)."""
    return lambda *argv: resolved("--clients", "10", *argv)


@pytest.fixture
def fake10():
    y = torch.from_numpy(np.random.default_rng(0).permutation(np.repeat(np.arange(10), 40)))
    data = SimpleNamespace(name="fake10", y_train=y, num_classes=10)
    with fedlt.datasets.REGISTRY.temporary("fake10", lambda root=None, download=False: data):
        yield data


@pytest.mark.parametrize("argv,want", TABLE, ids=[" ".join(a) or "none" for a, _ in TABLE])
def test_run_and_partition_resolve_the_table_identically(argv, want, resolved, fake10, tmp_path):
    assert (direct(argv) or DEFAULT_PARTITION) == want
    assert resolved(*argv).partition == want
    npz = tmp_path / "p.npz"
    main(["partition", "--dataset", "fake10", "--clients", "10", "--save", str(npz), *argv])
    manifest = P.Partition.load(npz).manifest
    built = P.create(want["name"], **{k: v for k, v in want.items() if k != "name"})
    assert manifest["name"] == want["name"] and manifest["params"] == built.params()


@pytest.mark.parametrize("argv,needle", ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_run_and_partition_reject_the_same_combinations_in_one_line(argv, needle, fake10, capsys, tmp_path):
    for command in (["run", "--out", str(tmp_path / "o"), "--quiet"], ["partition", "--dataset", "fake10"]):
        with pytest.raises(SystemExit) as info:
            main([*command, *argv])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and len(err.splitlines()) == 1 and needle in err, (command, err)
    assert not (tmp_path / "o").exists()


def test_spec_language_nests_and_round_trips():
    text = "longtail(imbalance_factor=100, then=dirichlet(beta=0.5, min_size=None), tags=[1, 2], rule=share)"
    spec = parse_spec(text)
    assert spec == {"name": "longtail", "imbalance_factor": 100, "rule": "share", "tags": [1, 2],
                    "then": {"name": "dirichlet", "beta": 0.5, "min_size": None}}
    assert parse_spec(format_spec(spec)) == spec
    assert parse_spec("timm:vit_tiny_patch16_224") == {"name": "timm:vit_tiny_patch16_224"}
    assert parse_spec(" mean ") == {"name": "mean"}
    assert parse_spec("x(a=none)") == {"name": "x", "a": None}
    # lower-case booleans as --set and TOML write them (issue 42's `topk(error_feedback=true)`);
    # a quoted 'true' stays text, which a boolean parameter refuses (issue 46)
    assert parse_spec("x(a=true, b=false, c=True, d='true')") == {"name": "x", "a": True, "b": False,
                                                                  "c": True, "d": "true"}
    for bad, needle in [("", "expected a component spec"), ("1abc", "not a component spec"),
                        ("a(b=1, b=2)", "given twice"), ("a(**k)", "'**'"), ("a(name=1)", "'name'"),
                        ("a(b=c+1)", "must be a literal"), ("a(b=1) + c(d=2)", "invalid syntax"), ("a(x=1)(y=2)", "invalid syntax"),
                        ("a) + (b", "not a component spec")]:
        with pytest.raises(FedltError, match=needle.replace("(", r"\(").replace("*", r"\*")):
            parse_spec(bad, "--x")


def test_model_and_aggregator_specs_reach_the_config(resolved, capsys, tmp_path):
    assert resolved("--model", "timm:resnet18").model == "timm:resnet18"
    cfg = resolved("--algo", "fedavg", "--model", "mlp", "--aggregator", "mean")
    assert cfg.model == "mlp" and cfg.algorithm_params == {"aggregator": {"name": "mean"}}
    cfg = resolved("--algo", "fedavg", "--aggregator", "fedadam(eta=0.01, tau=0.001)", "--server-lr", "0.1")
    assert cfg.algorithm_params == {"aggregator": {"name": "fedadam", "eta": 0.1, "tau": 0.001}}
    with pytest.raises(SystemExit):
        resolved("--model", "mlp(width=3)")
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "width" in err and "mlp" in err, err
    with pytest.raises(SystemExit):
        resolved("--model", "mlp(num_classes=3)")
    assert "come(s) from the dataset" in capsys.readouterr().err


def test_optional_settings_can_be_unset_and_set_from_flags(resolved, capsys, tmp_path):
    cfg = resolved("--clip", "none", "--split", "none", "--local-epochs", "2", "--train-limit", "300")
    assert cfg.optimiser.clip is None and cfg.split is None and cfg.local_epochs == 2 and cfg.train_limit == 300
    path = tmp_path / "c.toml"
    path.write_text("local_epochs = 3\ntrain_limit = 50\ndownload = true\n[optimiser]\nclip = 2.0\n")
    cfg = resolved("--config", str(path), "--local-epochs", "None", "--train-limit", "none", "--no-download")
    assert cfg.local_epochs is None and cfg.train_limit is None and cfg.download is False
    assert cfg.optimiser.clip == 2.0
    cfg = resolved("--set", "groups.many_above=50", "--set", "eval_batch=512", "--set", "optimiser.clip=none",
                   "--set", "groups.rule=share")
    assert (cfg.groups.many_above, cfg.eval_batch, cfg.optimiser.clip, cfg.groups.rule) == (50, 512, None, "share")
    for argv, needle in [(["--clip", "-1"], "optimiser.clip"), (["--clip", "lots"], "optimiser.clip"),
                         (["--set", "eval_batch=0"], "eval_batch"), (["--set", "nope"], "KEY=VALUE"),
                         (["--set", "bogus=1"], "bogus"), (["--threads", "0"], "--threads")]:
        with pytest.raises(SystemExit) as info:
            resolved(*argv)
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and len(err.splitlines()) == 1 and needle in err, (argv, err)


def test_threads_sets_torchs_thread_count_for_the_run(resolved):
    before = torch.get_num_threads()
    try:
        resolved("--threads", "1")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_list_kind_name_shows_parameters_defaults_and_docstring():
    from typer.testing import CliRunner

    import fedlt.cli.commands  # noqa: F401  (registers the commands on the app)
    from fedlt.cli import app

    def shown(*args: str) -> str:
        result = CliRunner().invoke(app, ["list", *args], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        return result.output

    out = shown("partitioners", "dirichlet")
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in out.splitlines() if line.count("│") >= 4}
    assert rows["beta"][0] == "required" and rows["min_size"] == ["10", "int"], rows
    assert P.Dirichlet.__doc__.strip().splitlines()[0] in out and "(partitioners, built-in)" in out
    out = shown("algorithms", "fedlc")  # a preset shows its own defaults
    assert "'fedlc(tau=0.5)'" in out and "'fedavg'" in out
    out = shown("losses", "logit_adjust")
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in out.splitlines() if line.count("│") >= 4}
    assert rows["class_counts"][0] == "supplied" and "set by fedlt" in out and rows["tau"] == ["1.0", "float"], rows

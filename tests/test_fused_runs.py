"""Short runs (2 rounds, a small MNIST subset) of fedvls, fedgrab and scala: ``fused="on"`` ends on
the same global weights as ``fused="off"`` within float tolerance, through RunConfig and the CLI's
``--fused`` flag."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from fedlt.cli import main

from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.io import load_checkpoint
from fedlt.losses.fused import cpu

SHORT = dict(dataset="mnist", train_limit=400, test_limit=100, clients=4, participation=0.5, rounds=2,
             local_iters=2, server_batch=64, eval_every=2,
             partition={"name": "quantity", "alpha": 5})


def final_weights(out) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / "checkpoint.pt")["algorithm"]["model"]


@pytest.mark.parametrize("algorithm,model,split", [("fedvls", "mlp", None), ("fedgrab", "mlp", None),
                                                   ("scala", "alexnet", "s2")])
def test_fused_on_and_off_end_on_the_same_weights(algorithm, model, split, tmp_path, one_thread):
    weights, fused_calls = {}, {}
    for mode in ("on", "off"):
        cfg = RunConfig(**SHORT, algorithm=algorithm, model=model, split=split, fused=mode, out=tmp_path / mode)
        with mock.patch.object(cpu, "objective", wraps=cpu.objective) as objective, \
                mock.patch.object(cpu, "sgb", wraps=cpu.sgb) as sgb, \
                mock.patch.object(cpu, "offset_ce_pair", wraps=cpu.offset_ce_pair) as pair:
            run(cfg)
        # SCALA's server computes both sides' losses as ONE fused pair (offset_ce_pair)
        fused_calls[mode] = objective.call_count + sgb.call_count + pair.call_count
        weights[mode] = final_weights(tmp_path / mode)
    assert fused_calls["on"] > 0 and fused_calls["off"] == 0  # the setting reached every loss object
    assert weights["on"].keys() == weights["off"].keys()
    for name, w in weights["off"].items():
        torch.testing.assert_close(weights["on"][name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_cli_fused_flag_reaches_the_config(tmp_path, capsys, one_thread):
    try:
        main(["run", "--algo", "fedvls", "--model", "mlp", "--rounds", "1", "--clients", "2", "--participation", "1", "--partition", "iid",
              "--train-limit", "100", "--test-limit", "50", "--local-iters", "1", "--fused", "off",
              "--out", str(tmp_path / "r"), "--quiet"])
    except SystemExit as done:
        assert done.code in (0, None)
    assert json.loads((tmp_path / "r" / "config.json").read_text())["fused"] == "off"
    capsys.readouterr()  # the first run's own lines (its note on the authors' settings)
    with pytest.raises(SystemExit) as bad:
        main(["run", "--fused", "maybe", "--out", str(tmp_path / "b"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert bad.value.code == 2 and "fused" in err and len(err.splitlines()) == 1


def test_scala_under_auto_takes_the_eager_pair_and_matches_the_per_client_reference(tmp_path, one_thread):
    """At MNIST's C = 10 ``auto`` keeps the fused kernels off but SCALA's server still computes
    both sides' losses in one call (the eager pair, vectorised over the clients); ``off`` runs one
    objective per client. Same weights within float tolerance."""
    import fedlt.losses.fused

    weights, pairs, fused = {}, {}, {}
    for mode in ("auto", "off"):
        cfg = RunConfig(**SHORT, algorithm="scala", model="alexnet", split="s2", fused=mode, out=tmp_path / mode)
        with mock.patch.object(fedlt.losses.fused, "offset_ce_pair", wraps=fedlt.losses.fused.offset_ce_pair) as pair, \
                mock.patch.object(cpu, "offset_ce_pair", wraps=cpu.offset_ce_pair) as kernel:
            run(cfg)
        pairs[mode], fused[mode] = pair.call_count, kernel.call_count
        weights[mode] = final_weights(tmp_path / mode)
    assert pairs["auto"] == SHORT["rounds"] * SHORT["local_iters"] and pairs["off"] == 0  # one call per server step
    assert fused["auto"] == fused["off"] == 0
    for name, w in weights["off"].items():
        torch.testing.assert_close(weights["auto"][name], w, rtol=1e-4, atol=1e-5, msg=name)

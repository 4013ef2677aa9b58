"""``--compile`` (fedlt.algorithms.compiled): the local steps' forward through torch.compile equals
the eager steps (the contract, fedlt.testing.check_compile), and what cannot be compiled says why.

The suite runs the contract with the ``aot_eager`` backend (dynamo's capture and AOTAutograd's
graphs, the guards and dynamic shapes of a run, without inductor's C++ code generation: seconds
instead of tens of seconds) on the plain step (fedavg: sequentially and in cohorts, by iterations
and by epochs) and on a variant that calls the model itself (moon: left eager, exactly); a step's
loss terms are not compiled, so another objective meets the same graphs. The whole FedAvg family,
and inductor itself, are the ``slow`` sweep (FEDLT_SLOW=1; CI skips it)."""

import pytest
import torch
from torch import nn

import fedlt.algorithms
from fedlt.algorithms import compiled
from fedlt.algorithms.fedavg_family import compile_notice, compile_reason
from fedlt.testing.compiled import check_compile

import cheap

FEDAVG_FAMILY = [n for n in fedlt.algorithms.REGISTRY.list()
                 if isinstance(fedlt.algorithms.create(n), fedlt.algorithms.fedavg_family.Federated)]


def test_compiled_steps_equal_eager():
    check_compile("fedavg", backend="aot_eager")


def test_a_variant_calling_the_model_itself_stays_eager_exactly():
    check_compile("moon", cohort=1, backend="aot_eager", local_iters=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", FEDAVG_FAMILY)
def test_the_family_compiles_or_says_why(name):
    check_compile(name, cheap.params(name), backend="aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedavg", "fedvls"])
def test_inductor_equals_eager(name):
    check_compile(name)


def test_what_is_left_eager_says_why():
    assert compile_reason(fedlt.algorithms.create("fedavg")) is None
    assert compile_reason(fedlt.algorithms.create("scaffold")) is None  # its correct hook runs after the backward
    assert "overrides ClientUpdate.terms" in compile_reason(fedlt.algorithms.create("moon"))
    assert "overrides ClientUpdate.ascent" in compile_reason(fedlt.algorithms.create("fedsam"))  # a two-pass step
    assert "split learning" in compile_reason(fedlt.algorithms.create("scala"))
    fedavg = fedlt.algorithms.create("fedavg")  # what a run with --compile starts by saying
    assert "measured slower than eager" in compile_notice(fedavg, torch.device("cpu"))
    assert "compiled on cuda" in compile_notice(fedavg, torch.device("cuda"))
    assert compile_notice(fedlt.algorithms.create("moon"), torch.device("cuda")).startswith(
        "fedlt: --compile leaves the local steps eager: MoonUpdate overrides")


def test_a_model_that_does_not_compile_runs_eagerly_and_says_why(caplog):
    def broken(graph, inputs):
        raise RuntimeError("this backend compiles nothing")

    model = nn.Sequential(nn.Linear(3, 2))
    step = compiled.forward(model, broken)
    x = torch.randn(4, 3)
    with caplog.at_level("WARNING", logger="fedlt"):
        out = step(x)
    assert torch.equal(out, model(x)) and "this backend compiles nothing" in compiled.failure(model)
    said = [r.getMessage() for r in caplog.records if r.name == "fedlt"]
    assert len(said) == 1 and said[0].startswith("fedlt: --compile: the step's forward runs eagerly from here: ")
    assert torch.equal(step(x), out) and len([r for r in caplog.records if r.name == "fedlt"]) == 1  # said once


def test_the_model_s_own_error_is_raised_as_without_compile():
    model = nn.Linear(3, 2)  # the cache holds its modules weakly: the caller keeps this one
    step = compiled.forward(model, "aot_eager")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        step(torch.randn(4, 5))


def test_off_by_default_and_a_flag(resolved):
    from fedlt.config import RunConfig

    assert RunConfig().compile is False and resolved("--compile").compile is True


def test_a_fallback_is_said_at_the_start_and_recorded(tmp_path, caplog):
    from fedlt.config import RunConfig
    from fedlt.engine import run
    from fedlt.testing.algorithms import TINY

    with caplog.at_level("WARNING", logger="fedlt"):
        summary = run(RunConfig(**dict(TINY, model="mlp", algorithm="moon", rounds=1, compile=True),
                                out=tmp_path / "run"))
    said = [r.getMessage() for r in caplog.records if r.name == "fedlt"]
    assert len(said) == 1 and said[0].startswith("fedlt: --compile leaves the local steps eager: ")
    assert "overrides ClientUpdate.terms" in summary["compile_fallback"] and summary["compile_fallback"] in said[0]
    assert '"compile": true' in (tmp_path / "run" / "config.json").read_text()

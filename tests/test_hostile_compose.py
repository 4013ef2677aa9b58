"""Hostile compositions, sizes and spellings (issue 46, part A): every composition of an algorithm
with a head and a server step it accepts as a parameter runs, or is refused in one line before
anything is written; sizes, counts and seeds are bounded; a number is a number and a boolean a
boolean; a model that does not fit the data is one line; a cohort falls back on randomness drawn
through torch.nn.functional.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

import fedlt.algorithms
import fedlt.server_steps
from fedlt.algorithms.cohort import cohort_reason
from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.engine import prepare, run
from fedlt.errors import FedltError, describe
from fedlt.models import build, check_fits, heads
from fedlt.spec import format_spec
from test_hostile_inputs import fails_cleanly

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = dict(model="mlp", partition={"name": "iid"}, train_limit=120, test_limit=40, clients=2, participation=1.0,
            rounds=1, local_iters=1, server_batch=16, eval_every=1)
TINY_FLAGS = ["--model", "mlp", "--partition", "iid", "--train-limit", "120", "--test-limit", "40", "--clients", "2",
              "--participation", "1", "--rounds", "1", "--local-iters", "1", "--server-batch", "16", "--quiet"]
# the published sizes cost seconds to minutes; a composition runs the same code at any size
CHEAP_HEADS = {"sse_c": {"steps": 2}}
CHEAP_STEPS = {"ccvr": {"samples_per_class": 4}, "creff": {"match_epochs": 1, "retrain_epochs": 1,
               "features_per_class": 2, "repeats": 1}, "fednpc": {"size": 16, "steps": 1}}
CHEAP_PERSONAL = {"fedetf": {"alternations": 1, "finetune_epochs": 1}}  # the authors' 20 × 3 epochs


# -- 1. every composition: runs, or one line before anything is written -------------------------------
def _compositions() -> list[tuple[str, str | None, str | None, bool]]:
    """(algorithm, head, step, personal evaluation) for every head and server step an algorithm
    takes as a parameter; the personal evaluation where the algorithm builds a personal model."""
    out, seen = [], set()
    for name in fedlt.algorithms.list():
        algorithm = fedlt.algorithms.create(name)
        fields = getattr(type(algorithm), "model_fields", {})
        # presets of one class with the head and step set explicitly are one composition (ccvr, creff, fednpc)
        if ("head" not in fields and "step" not in fields) or type(algorithm) in seen:
            continue
        seen.add(type(algorithm))
        head_names = heads.list() if "head" in fields else [None]
        step_names = fedlt.server_steps.list() if "step" in fields else [None]
        personal = [False, True] if callable(getattr(algorithm, "personal_model", None)) else [False]
        out += [(name, h, s, p) for h, s, p in itertools.product(head_names, step_names, personal)]
    return out


def _spec(name: str, cheap: dict) -> dict:
    return {"name": name, **cheap.get(name, {})}


def _settings(algorithm: str, head: str | None, step: str | None, personal: bool) -> tuple[dict, list[str]]:
    params = ({"head": _spec(head, CHEAP_HEADS)} if head else {}) | ({"step": _spec(step, CHEAP_STEPS)} if step else {})
    params |= CHEAP_PERSONAL.get(algorithm, {}) if personal else {}
    extra = dict(client_test={"name": "matched"}, client_eval=[{"name": "personal"}]) if personal else {}
    flags = [f"--set=algorithm_params.{k}={format_spec(v) if isinstance(v, dict) else v}" for k, v in params.items()]
    flags += ["--client-test", "matched", "--client-eval", "personal"] if personal else []
    return dict(TINY, algorithm=algorithm, algorithm_params=params, **extra), flags


COMPOSITIONS = _compositions()
REFUSED = {("fedetf", "prototypes", None, True), ("fedetf", "sse_c", None, True), ("fednh", "prototypes", "ccvr", False),
           ("fednh", "etf", "fednh", False), ("ccvr", None, "fednh", False)}  # the issue's cases among them
RUNS = {("fedloge", "etf", None, False), ("fedloge", "etf", None, True), ("fedetf", "etf", None, True)}


def test_the_registry_wide_matrix_holds_the_issues_cases():
    assert REFUSED | RUNS <= set(COMPOSITIONS) and len(COMPOSITIONS) >= 20


@pytest.mark.parametrize("algorithm,head,step,personal", COMPOSITIONS,
                         ids=[f"{a}-{h}-{s}{'-personal' if p else ''}" for a, h, s, p in COMPOSITIONS])
def test_every_composition_runs_or_is_refused_in_one_line(algorithm, head, step, personal, tmp_path, capsys):
    settings, flags = _settings(algorithm, head, step, personal)
    out = tmp_path / "run"
    try:
        config = RunConfig(**settings, out=out)
    except ValidationError as exc:
        assert (algorithm, head, step, personal) not in RUNS, describe(exc)
        # the CLI says it in one line, exit 2, and writes nothing
        err = fails_cleanly(["run", "--algo", algorithm, *TINY_FLAGS, *flags, "--out", str(out)], capsys, tmp_path)
        named = [p for p in (head and f"head {head!r}", step and f"server step {step!r}") if p]
        assert "needs" in err and any(p in err for p in named) or "model's linear classifier" in err, err
        return
    assert (algorithm, head, step, personal) not in REFUSED
    summary = run(config)
    assert summary["rounds"] == 1 and 0 <= summary["final"]["accuracy"] <= 1
    if personal:
        assert summary["per_client"]["personal"]["final"]["mean"] is not None


def test_fedloge_s_personal_model_loads_the_weights_of_its_ga_fr_global_model(tmp_path):
    """GA-FR's evaluated model keeps the training model's modules (g_aux re-aligned in place of g_head),
    so a client's personal model (LA-FR) loads its weights: it raised 'Error(s) in loading state_dict'."""
    summary = run(RunConfig(**TINY, algorithm="fedloge", algorithm_params={"head": CHEAP_HEADS["sse_c"] | {"name": "sse_c"},
                                                                          "global_head": "g_aux"},
                            client_test={"name": "matched"}, client_eval=[{"name": "personal"}], out=tmp_path / "r"))
    assert summary["per_client"]["personal"]["final"]["mean"] is not None


def test_a_refusal_names_both_parts_and_what_is_missing(tmp_path, capsys):
    err = fails_cleanly(["run", "--algo", "fedetf", *TINY_FLAGS, "--set", "algorithm_params.head=prototypes",
                         "--client-test", "matched", "--client-eval", "personal", "--out", str(tmp_path / "r")],
                        capsys, tmp_path)
    assert "fedetf's personal model" in err and "head 'prototypes'" in err and "'etf'" in err, err
    err = fails_cleanly(["run", "--algo", "fednh", *TINY_FLAGS, "--set", "algorithm_params.step=ccvr",
                         "--out", str(tmp_path / "r")], capsys, tmp_path)
    assert "server step 'ccvr'" in err and "head 'prototypes'" in err and "bias" in err, err


def test_an_algorithm_set_up_without_a_run_config_is_checked_when_built(tmp_path):
    config = RunConfig(**TINY, algorithm="fednh", out=tmp_path / "r")
    unchecked = config.model_copy(update={"algorithm_params": {"step": _spec("ccvr", CHEAP_STEPS)}})  # no validation
    with pytest.raises(FedltError, match="server step 'ccvr' needs a linear layer's weight and bias") as info:
        prepare(unchecked)
    assert len(str(info.value).splitlines()) == 1


def test_declarations_are_true_of_the_built_heads():
    """What a head declares it provides is there once built (fedlt.models.heads.CAPABILITIES)."""
    for name in heads.list():
        built = heads.build_head({"name": name, **CHEAP_HEADS.get(name, {})}, 16, 4)
        assert heads.provided(name) == heads.classifier_provides(built) != frozenset()
        have = heads.provided(name)
        assert ("in_features" not in have) or built.in_features == 16
        assert ("linear" not in have) or (built.weight.shape == (4, 16) and built.bias.shape == (4,))
        assert ("etf" not in have) or (hasattr(built, "proto") and hasattr(built, "linear_proto"))
        assert ("prototypes" not in have) or built.weight.shape == (4, 16)
    for name in fedlt.server_steps.list():
        assert fedlt.server_steps.requires(fedlt.server_steps.get(name)) <= set(heads.CAPABILITIES)


@heads.provides("linear", "in_features")
def _claims_linear(in_features: int, num_classes: int) -> nn.Module:
    """Declares 'linear' but has no bias: a re-training server step would fail on it mid-run."""
    return heads.PrototypeHead(in_features, num_classes, 1.0, 0)


def test_the_head_contract_holds_a_head_to_what_it_declares():
    from fedlt.testing import ContractError, check_head
    with pytest.raises(ContractError, match=r"breaks \[declares\]"):
        check_head(_claims_linear)


# -- 2. bounds -----------------------------------------------------------------------------------------
BOUNDS = [
    ("fedetf", {"head": {"name": "etf", "seed": 2**70}}, "seed must be an integer from 0 to 4294967295"),
    ("fedloge", {"head": {"name": "sse_c", "seed": 2**33}}, "seed must be an integer from 0 to 4294967295"),
    ("fednh", {"head": {"name": "prototypes", "seed": -1}}, "seed must be an integer from 0"),
    ("fedetf", {"head": {"name": "etf", "proj_dim": 10**12}}, "proj_dim must be an integer from 1 to"),
    ("fedloge", {"head": {"name": "sse_c", "steps": 10**9}}, "steps must be an integer from 0 to 100000"),
    ("fedetf", {"head": {"name": "etf", "scale": float("inf")}}, "scale must be a finite number"),
    ("ccvr", {"step": {"name": "ccvr", "samples_per_class": 10**12}}, "samples_per_class must be an integer from 1"),
    ("ccvr", {"step": {"name": "ccvr", "epochs": 10**9}}, "epochs must be an integer from 1 to 100000"),
    ("fednpc", {"step": {"name": "fednpc", "size": 10**12}}, "size must be an integer from 1 to 10000000"),
    ("fednpc", {"step": {"name": "fednpc", "steps": 10**9}}, "steps must be an integer from 1 to 100000"),
    ("creff", {"step": {"name": "creff", "retrain_epochs": 10**9}}, "retrain_epochs must be an integer from 1"),
    ("fedetf", {"finetune_epochs": 10**9}, "finetune_epochs: Input should be less than or equal to 1000"),
    ("fedetf", {"alternations": 10**9}, "alternations: Input should be less than or equal to 1000"),
    ("fedrep", {"head_epochs": 10**9}, "head_epochs: Input should be less than or equal to 1000"),
    ("fedavg_ft", {"finetune_epochs": 10**9}, "finetune_epochs: Input should be less than or equal to 1000"),
    ("fedbabu", {"finetune_epochs": 10**9}, "finetune_epochs: Input should be less than or equal to 1000"),
    ("fedlf", {"warm_up": 10**9}, "warm_up: Input should be less than or equal to 100000"),
]
PARTITIONS = [{"name": "dirichlet", "beta": 0.5, "min_size": 10**12}, {"name": "quantity", "alpha": 10**12},
              {"name": "shards", "shards_per_client": 10**12}]


@pytest.mark.parametrize("partition", PARTITIONS, ids=[p["name"] for p in PARTITIONS])
def test_partitioner_counts_are_bounded(partition):
    with pytest.raises(ValidationError, match="less than or equal to 10000000"):
        RunConfig(partition=partition)


@pytest.mark.parametrize("algorithm,params,message", BOUNDS, ids=[f"{a}-{next(iter(p))}" for a, p, _ in BOUNDS])
def test_sizes_counts_and_seeds_are_bounded(algorithm, params, message):
    with pytest.raises(ValidationError) as info:
        RunConfig(algorithm=algorithm, algorithm_params=params)
    assert message in describe(info.value) and len(describe(info.value).splitlines()) == 1, describe(info.value)


def test_a_tensor_beyond_memory_is_refused_with_its_size_before_the_run(tmp_path, capsys):
    # 10 classes × 10^7 virtual features × 200 float64 values: 149 GiB, refused when the step is set up
    err = fails_cleanly(["run", "--algo", "ccvr", *TINY_FLAGS, "--set",
                         "algorithm_params.step=ccvr(samples_per_class=10000000)", "--out", str(tmp_path / "r")],
                        capsys, tmp_path)
    assert "100000000×200" in err and "GiB" in err and "samples_per_class=10000000" in err, err


# -- 3. numbers are numbers, booleans booleans ---------------------------------------------------------
SPELLINGS = [
    (dict(client_test="matched(size='50')", client_eval="personal"), "size: expected a number, got the text '50'"),
    (dict(client_test="matched", client_eval="finetune(epochs='2')"), "epochs: expected a number, got the text '2'"),
    (dict(partition="dirichlet(beta='0.5')"), "beta: expected a number, got the text '0.5'"),
    (dict(algorithm_params={"aggregator": "fedadam(eta='0.1')"}), "eta: expected a number, got the text '0.1'"),
    (dict(algorithm="fedetf", algorithm_params={"lr_proto": "0.1"}), "lr_proto: expected a number"),
    (dict(algorithm="ditto", algorithm_params={"lam": True}), "lam: expected a number, got a boolean"),
    (dict(algorithm="apfl", algorithm_params={"alpha": True}), "alpha: expected a number, got a boolean"),
    (dict(algorithm="apfl", algorithm_params={"adaptive": "yes"}), "adaptive: expected True or False, got 'yes'"),
    (dict(algorithm="apfl", algorithm_params={"adaptive": 1}), "adaptive: expected True or False, got '1'"),
    (dict(algorithm="fedavg_ft", algorithm_params={"finetune_epochs": True}), "finetune_epochs: expected a number"),
    (dict(augment="random_crop(padding='4')"), "padding: expected a number, got the text '4'"),
]


@pytest.mark.parametrize("settings,message", SPELLINGS, ids=[str(i) for i in range(len(SPELLINGS))])
def test_numeric_strings_and_booleans_are_refused(settings, message):
    with pytest.raises(ValidationError) as info:
        RunConfig(**settings)
    assert message in describe(info.value) and len(describe(info.value).splitlines()) == 1, describe(info.value)


# -- 4. models checked against the data ----------------------------------------------------------------
def test_a_model_that_does_not_fit_the_images_is_one_line_and_leaves_nothing(tmp_path, capsys):
    flags = [f if f != "mlp" else "timm:test_vit(drop_rate=0.1)" for f in TINY_FLAGS]
    err = fails_cleanly(["run", "--algo", "fedavg", *flags, "--out", str(tmp_path / "out")], capsys, tmp_path)
    assert "does not take 1x28x28 inputs" in err and "patch size (16)" in err, err


def test_the_check_forwards_one_sample_shape_before_building():
    with pytest.raises(FedltError, match="does not take 1x28x28 inputs.*Kernel size") as info:
        check_fits("timm:test_convnext", in_chans=1, num_classes=10, image_size=28)
    assert len(str(info.value).splitlines()) == 1
    check_fits("timm:test_convnext", in_chans=3, num_classes=10, image_size=32)  # CIFAR's images fit


@pytest.mark.parametrize("argv,message", [
    (["timm:test_vit", "--dataset", "mnist"], "does not take 1x28x28 inputs"),
    (["mlp", "--image-size", "0"], "--image-size 0"),
    (["mlp", "--in-chans", "-3"], "--in-chans -3"),
    (["mlp", "--in-chans", "100000", "--image-size", "100000"], "PiB"),
    (["mlp", "--in-chans", "1000", "--image-size", "1000"], "GiB of weights"),
])
def test_splits_checks_the_model_against_the_input_first(argv, message, tmp_path, capsys):
    err = fails_cleanly(["splits", *argv], capsys, tmp_path)
    assert message in err, err


# -- 5. the cohort's fallback on functional randomness -------------------------------------------------
class _FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.dropout(x.flatten(1), 0.5, self.training))

    def get_classifier(self) -> nn.Linear:
        return self.fc


def test_the_cohort_finds_dropout_drawn_through_torch_functional():
    fedavg = fedlt.algorithms.create("fedavg")
    model = _FunctionalDropout()
    assert "random operation" in cohort_reason(fedavg, model, torch.zeros(2, 4))  # the probe under vmap
    assert model.training  # its mode is given back
    timm_model = build("timm:test_efficientnet_gn(drop_rate=0.1)", in_chans=1, num_classes=10, image_size=28)
    assert "drop_rate=0.1" in cohort_reason(fedavg, timm_model)  # timm's rate, without a probe
    plain = build("timm:test_efficientnet_gn", in_chans=1, num_classes=10, image_size=28)
    assert cohort_reason(fedavg, plain, torch.zeros(2, 1, 28, 28)) is None

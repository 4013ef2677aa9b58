"""fedlt.testing: every registered built-in passes its kind's contract (parametrised over the
registries, so a new built-in is covered the moment it is registered), and a deliberately broken
component fails each contract with a message naming the broken property."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import fedlt.aggregators
import fedlt.algorithms
import fedlt.datasets
import fedlt.losses
import fedlt.models
import fedlt.partitioners
import cheap
import fake_dataset_files
from fedlt.algorithms.fedavg_family import FedAvgFamily
from fedlt.errors import FedltError
from fedlt.losses import LossTerm
from fedlt.models.splitting import SPLITTERS
from fedlt.partitioners import Partition, Partitioner
from fedlt.testing import (ContractError, check_aggregator, check_algorithm, check_dataset, check_loss_term,
                           check_model, check_partitioner, check_splitter)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# -- every built-in ---------------------------------------------------------------------------------
# sums of exp, sigmoid bases, or logits rescaled per class (FedRS): not invariant to a row constant
NOT_SOFTMAX = {"logit_suppression", "sgb", "fedgrab", "fedvls", "eqlv2", "fedrs"}
LOSS_TERMS = [n for n in fedlt.losses.list() if getattr(fedlt.losses.get(n), "loss_term", True)]
PARTITIONER_EXAMPLES = {"dirichlet": {"beta": 0.5, "min_size": 2}, "quantity": {"alpha": 2},
                        "shards": {"shards_per_client": 2}, "longtail": {"imbalance_factor": 4.0},
                        "natural": {"merge": "random"}}  # merge=size is seed-independent by design
DROPS_SAMPLES = {"longtail"}
USES_GROUPS = {"natural"}
SPLITTER_EXAMPLES = {"own": ("alexnet", 1, 28), "timm_sequential": ("timm:resnet10t", 3, 32),
                     "timm_vit": ("timm:vit_tiny_patch16_224", 3, 32), "fx": ("mlp", 1, 28)}


@pytest.mark.parametrize("name", LOSS_TERMS)
def test_every_loss_term_passes_its_contract(name):
    check_loss_term(name, shift_invariant=name not in NOT_SOFTMAX)


@pytest.mark.parametrize("name", fedlt.partitioners.list())
def test_every_partitioner_passes_its_contract(name):
    data = {}
    if name in USES_GROUPS:  # 400 samples of 10 classes by 23 writers
        data = {"labels": np.random.default_rng(0).permutation(np.repeat(np.arange(10), 40)),
                "groups": np.arange(400) % 23}
    check_partitioner(name, PARTITIONER_EXAMPLES.get(name), covers_all=name not in DROPS_SAMPLES, **data)


@pytest.mark.parametrize("name", fedlt.models.list())
def test_every_model_passes_its_contract(name):
    check_model(name, in_chans=1, image_size=28)


def test_resnet8_takes_creffs_scaling():
    """Stages of 16, 32 and 64 times ``scaling`` channels (theirs, 4, by default); a bad value is one line."""
    assert fedlt.models.build("resnet8(scaling=1)", in_chans=1, num_classes=10, image_size=28).classifier.in_features == 64
    assert fedlt.models.build("resnet8", in_chans=1, num_classes=10, image_size=28).classifier.in_features == 256
    for bad in ("0", "True", "1.5"):
        with pytest.raises(FedltError, match=r"^model 'resnet8': scaling must be an integer in \[1, 64\], got"):
            fedlt.models.build(f"resnet8(scaling={bad})", in_chans=1, num_classes=10, image_size=28)


@pytest.mark.parametrize("name", SPLITTERS.list())
def test_every_splitter_passes_its_contract(name):
    model, chans, size = SPLITTER_EXAMPLES[name]  # a new splitter needs an example model here
    net = fedlt.models.build(model, in_chans=chans, num_classes=10, image_size=size)
    check_splitter(name, net, torch.randn(2, chans, size, size, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("name", fedlt.aggregators.list())
def test_every_aggregator_passes_its_contract(name):
    check_aggregator(name)


@pytest.mark.parametrize("name", fedlt.datasets.list())
def test_every_dataset_passes_its_contract(name, tmp_path, monkeypatch):
    """MNIST ships in the package; the torchvision sets read synthetic files in their own formats
    (nothing is downloaded), so fedlt's adapters run on every registered dataset."""
    params = {}
    if name in fake_dataset_files.NAMES:
        fake_dataset_files.write(name, tmp_path, monkeypatch)
        params = {"root": tmp_path}
    check_dataset(name, params)
    if params:  # the adapter kept every image and label of both splits
        data = fedlt.datasets.create(name, **params)
        assert (len(data.y_train), len(data.y_test)) == (fake_dataset_files.N_TRAIN, fake_dataset_files.N_TEST)


# CReFF's defaults (100 matching steps, 300 re-training epochs a round) scaled down to keep this fast;
# FedLoGe's and CCVR's published sizes too (tests/cheap.py: checked by their golden tests)
ALGORITHM_EXAMPLES = {"creff": {"step": {"name": "creff", "match_epochs": 3, "retrain_epochs": 2,
                                         "features_per_class": 8, "repeats": 2}},
                      "fedloge": cheap.params("fedloge"), "fedrela": cheap.params("fedrela"), "ccvr": cheap.params("ccvr"),
                      "fedic": cheap.params("fedic")}


@pytest.mark.parametrize("name", fedlt.algorithms.list())
def test_every_algorithm_passes_its_contract(name):
    check_algorithm(name, ALGORITHM_EXAMPLES.get(name))


# -- broken components ------------------------------------------------------------------------------
def fails(prop: str, check, *args, **kwargs) -> str:
    with pytest.raises(ContractError, match=re.escape(f"breaks [{prop}]")) as info:
        check(*args, **kwargs)
    return str(info.value)


class PerSample(LossTerm):
    name = "per_sample"

    def __call__(self, logits, targets, *, teacher_logits=None, params=None):
        return nn.functional.cross_entropy(logits, targets, reduction="none")


class NaiveSoftmax(LossTerm):
    name = "naive_softmax"

    def __call__(self, logits, targets, *, teacher_logits=None, params=None):
        p = logits.exp() / logits.exp().sum(1, keepdim=True)  # overflows at 1e4
        return -p.gather(1, targets[:, None]).log().mean()


class SqrtAtZero(LossTerm):
    name = "sqrt_at_zero"

    def __call__(self, logits, targets, *, teacher_logits=None, params=None):
        return (logits - logits.detach()).pow(2).sqrt().sum()  # value 0, gradient 0·inf = nan


class MeanLogit(LossTerm):
    name = "mean_logit"

    def __call__(self, logits, targets, *, teacher_logits=None, params=None):
        return logits.mean()


class ForgetfulCounter(LossTerm):
    """Scales CE by the steps it has seen, but does not restore that count from its state."""

    name = "forgetful"

    def __init__(self) -> None:
        self.steps = torch.zeros(())

    def __call__(self, logits, targets, *, teacher_logits=None, params=None):
        self.steps += 1
        return nn.functional.cross_entropy(logits, targets) * self.steps

    def state_dict(self):
        return {"steps": self.steps.clone()}

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("term,prop", [(PerSample, "scalar"), (NaiveSoftmax, "finite value"),
                                       (SqrtAtZero, "finite gradient"), (MeanLogit, "shift invariance"),
                                       (ForgetfulCounter, "state round trip")])
def test_broken_loss_terms_fail_naming_the_property(term, prop):
    fails(prop, check_loss_term, term)


def test_the_loss_contract_accepts_a_non_softmax_term_when_told():
    check_loss_term(MeanLogit, shift_invariant=False)


def labels_of(y) -> np.ndarray:
    return np.asarray(y, dtype=np.int64)


class Overlapping:
    """Every client also holds sample 0."""

    def __call__(self, labels, num_clients, seed, *, num_classes=None, dataset_name="unknown"):
        y = labels_of(labels)
        rng = np.random.default_rng(seed)
        chunks = np.array_split(rng.permutation(y.size), num_clients)
        chunks = [np.union1d(c, [0]) for c in chunks]
        return Partition.build(chunks, y, num_classes or int(y.max()) + 1, name="overlapping", params={}, seed=seed,
                               dataset_name=dataset_name)


class SeedBlind(Partitioner):
    name = "seed_blind"

    def assign(self, y, num_clients, num_classes, rng):
        return np.arange(y.size) % num_clients


class GlobalRng(Partitioner):
    name = "global_rng"

    def assign(self, y, num_clients, num_classes, rng):
        return np.random.randint(0, num_clients, size=y.size)  # ignores the seeded rng


class Dropping(Partitioner):
    name = "dropping"

    def assign(self, y, num_clients, num_classes, rng):
        owner = rng.integers(0, num_clients, size=y.size)
        owner[:5] = -1
        return owner


class RaisesValueError:
    def __call__(self, labels, num_clients, seed, *, num_classes=None, dataset_name="unknown"):
        y = labels_of(labels)
        if num_clients > y.size:
            raise ValueError("too many")
        return Overlapping()(labels, num_clients, seed, num_classes=num_classes)


STOP = threading.Event()


class Hangs(Partitioner):
    name = "hangs"

    def assign(self, y, num_clients, num_classes, rng):
        if num_clients > y.size:
            while not STOP.is_set():  # a retry loop that can never succeed
                time.sleep(0.01)
        return rng.integers(0, num_clients, size=y.size)


@pytest.mark.parametrize("partitioner,prop", [
    (Overlapping, "disjoint"), (SeedBlind, "different across seeds"), (GlobalRng, "deterministic per seed"),
    (Dropping, "covers"),
])
def test_broken_partitioners_fail_naming_the_property(partitioner, prop):
    fails(prop, check_partitioner, partitioner)


def test_a_partitioner_that_hangs_or_raises_a_bare_error_when_impossible_fails(monkeypatch):
    import fedlt.testing.partitioners as contract

    monkeypatch.setattr(contract, "HANG_SECONDS", 0.5)
    STOP.clear()
    try:
        assert "still running" in fails("clear error when impossible", check_partitioner, Hangs)
    finally:
        STOP.set()
    # Overlapping would fail earlier; a disjoint one that raises ValueError when impossible:
    class Disjoint(RaisesValueError):
        def __call__(self, labels, num_clients, seed, **kw):
            if num_clients > labels_of(labels).size:
                raise ValueError("too many")
            return fedlt.partitioners.create("iid")(labels, num_clients, seed, **kw)

    assert "ValueError" in fails("clear error when impossible", check_partitioner, Disjoint)


class WrongShape(nn.Module):
    def __init__(self, in_chans=1, num_classes=10, image_size=28):
        super().__init__()
        self.fc = nn.Linear(in_chans * image_size * image_size, num_classes + 1)

    def forward(self, x):
        return self.fc(x.flatten(1))


class Copying:
    """Splits an nn.Sequential but gives the server a copy of its layers (not the model's own)."""

    priority = 0

    def applies(self, model):
        return isinstance(model, nn.Sequential)

    def cut_points(self, model):
        return [("1", "1")]

    def split(self, model, index):
        import copy

        return model[:2], copy.deepcopy(model[2:])


class Skipping(Copying):
    """Drops the activation after the cut."""

    def split(self, model, index):
        return model[:2], model[3:]


def sequential() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3))


def test_broken_models_and_splitters_fail_naming_the_property():
    fails("logits", check_model, WrongShape)
    x = torch.randn(2, 1, 3, 4)
    fails("parameters partitioned", check_splitter, Copying(), sequential(), x)
    fails("server(client(x)) == model(x)", check_splitter, Skipping(), sequential(), x)
    fails("applies", check_splitter, Copying(), nn.Linear(2, 2), x)


class Float64Mean(fedlt.aggregators.Aggregator):
    name = "float64_mean"

    def __call__(self, global_state, results, trainable):
        return {k: torch.stack([s[k].double() for s, _ in results]).mean(0) for k in results[0][0]}


class FirstHeavier(fedlt.aggregators.Aggregator):
    """Halves the weight of each later client: depends on the arrival order."""

    name = "first_heavier"

    def __call__(self, global_state, results, trainable):
        weights = [2.0 ** -i for i in range(len(results))]
        return {k: (sum(w * s[k].double() for w, (s, _) in zip(weights, results)) / sum(weights)).to(ref.dtype)
                for k, ref in results[0][0].items()}


class PlusEpsilon(fedlt.aggregators.FedAvg):
    name = "plus_epsilon"

    def __call__(self, global_state, results, trainable):
        return {k: (s + 1e-3 if s.is_floating_point() else s) for k, s in super().__call__(
            global_state, results, trainable).items()}


class ForgetfulMomentum(fedlt.aggregators.FedAvgM):
    """FedAvgM whose load_state_dict forgets the momentum."""

    name = "forgetful_momentum"

    def load_state_dict(self, state):
        super().load_state_dict({})


def test_broken_aggregators_fail_naming_the_property():
    fails("keys and dtypes", check_aggregator, Float64Mean)
    fails("order independent", check_aggregator, FirstHeavier)
    fails("identical inputs", check_aggregator, PlusEpsilon)
    fails("state round trip", check_aggregator, ForgetfulMomentum)
    check_aggregator(fedlt.aggregators.FedAvgM, {"beta": 0.5})  # the unbroken parent passes


def fake_dataset(**changes: Any):
    from fedlt.datasets import InMemoryDataset

    g = torch.Generator().manual_seed(0)
    fields = dict(name="fake", x_train=torch.randn(64, 1, 6, 6, generator=g), y_train=torch.arange(64) % 4,
                  x_test=torch.randn(16, 1, 6, 6, generator=g), y_test=torch.arange(16) % 4, num_classes=4)
    fields.update(changes)
    return lambda **params: InMemoryDataset(**fields)


def test_broken_datasets_fail_naming_the_property():
    check_dataset(fake_dataset())  # the fake itself is fine
    fails("normalisation", check_dataset, fake_dataset(x_train=torch.rand(64, 1, 6, 6)))  # [0, 1], not standardised
    fails("dtypes", check_dataset, fake_dataset(y_train=(torch.arange(64) % 4).int()))
    fails("label range", check_dataset, fake_dataset(y_test=torch.arange(16) % 5))
    fails("shapes", check_dataset, fake_dataset(x_test=torch.randn(16, 6, 6)))


class ForgetfulAlgorithm(FedAvgFamily):
    """FedAvg that shrinks the global model by the rounds it has seen, a count its state omits."""

    _seen: int = 0

    def train_round(self, *args, **kwargs):
        metrics = super().train_round(*args, **kwargs)
        self._seen += 1
        with torch.no_grad():
            for p in self.global_model().parameters():
                p.mul_(1.0 - 0.2 * self._seen)
        return metrics


def test_an_algorithm_that_does_not_resume_exactly_fails_naming_the_first_field_that_differs():
    message = fails("exact resume", check_algorithm, ForgetfulAlgorithm)
    # round 1 is the same in both (the cut is taken after it); round 2 is the first that differs
    assert "metrics.jsonl.round 2." in message and "round 1." not in message, message


class WarmupCE(LossTerm):
    """docs/losses.md's round-dependent term: CE scaled by (round_index + 1) / rounds."""

    name = "warmup_ce"

    def __init__(self, *, round_index: int, rounds: int) -> None:
        self.scale = (round_index + 1) / rounds

    def __call__(self, logits, targets, *, teacher_logits=None, params=None):
        return self.scale * torch.nn.functional.cross_entropy(logits, targets)


def test_a_term_that_reads_rounds_resumes_exactly():
    """The resume contract cuts a run with the SAME ``rounds`` (as a kill leaves it): a term that
    reads ``rounds`` gives the same numbers in both runs and passes. Cutting a 1-round run and
    extending it to 2 gave round 1 a scale of 1 instead of 1/2: a false failure."""
    with fedlt.losses.REGISTRY.temporary("warmup_ce", WarmupCE):
        check_algorithm("fedavg", {"loss": "warmup_ce"})


def test_a_plugin_component_given_as_an_object_passes_like_a_builtin():
    check_loss_term(fedlt.losses.LogitAdjust, {"tau": 0.5})
    check_partitioner(fedlt.partitioners.Dirichlet, {"beta": 1.0, "min_size": 1})

"""Augmentation (``--augment``): every transform against a float64 reference written here (loops
over samples, numpy), the spec language and its one-line errors, per-client determinism (the same
client draws the same crops and flips wherever and whenever it runs; two clients draw
differently), and runs that augment give one answer twice and with the participants in reverse
order, while really augmenting (the result differs from a run without)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedlt.augment as A
from fedlt import wire
from fedlt.algorithms.base import LocalSchedule
from fedlt.algorithms.protocol import ClientTask, LocalRunner, client_rng, seed_forked
from fedlt.config import RunConfig
from fedlt.errors import FedltError
from fedlt.testing.engines import differences

pytestmark = pytest.mark.usefixtures("one_thread")


def images(b=6, c=3, h=7, w=9, seed=0):
    return torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=20, deadline=None)
@given(padding=st.integers(0, 3), size=st.integers(1, 7), seed=st.integers(0, 2**31), fill=st.floats(-2, 2))
def test_random_crop_is_a_padded_window_at_positions_drawn_from_the_global_generator(padding, size, seed, fill):
    x = images()
    torch.manual_seed(seed)
    out = A.RandomCrop(size=size, padding=padding, fill=fill)(x)
    torch.manual_seed(seed)  # the draws, in the documented order: all tops, then all lefts
    h, w = 7 + 2 * padding, 9 + 2 * padding
    tops = torch.randint(0, h - size + 1, (6,)).numpy()
    lefts = torch.randint(0, w - size + 1, (6,)).numpy()
    padded = np.full((6, 3, h, w), fill, dtype=np.float64)
    padded[:, :, padding:padding + 7, padding:padding + 9] = x.double().numpy()
    want = np.stack([padded[b, :, t:t + size, l:l + size] for b, (t, l) in enumerate(zip(tops, lefts))])
    np.testing.assert_allclose(out.double().numpy(), want, rtol=0, atol=1e-6)
    assert A.RandomCrop(size=size, padding=padding).output_shape((3, 7, 9)) == (3, size, size)


def test_random_crop_moves_and_evaluates_as_a_centre_crop():
    x = images(b=200, h=8, w=8)
    torch.manual_seed(0)
    out = A.RandomCrop(padding=4)(x)
    shifted = [not torch.equal(out[b], x[b]) for b in range(200)]
    assert 150 < sum(shifted) < 200  # 1 position in 81 is the original one
    assert torch.equal(A.RandomCrop(padding=4).eval(x), x)
    # torchvision's centre crop offset: round((8 - 5) / 2) = 2 (half to even)
    assert torch.equal(A.RandomCrop(size=5).eval(x), x[:, :, 2:7, 2:7])


@pytest.mark.parametrize("name,axis", [("hflip", 3), ("vflip", 2)])
def test_flips_follow_a_per_sample_coin_from_the_global_generator(name, axis):
    x = images(b=50)
    torch.manual_seed(3)
    out = A.create(name, p=0.3)(x)
    torch.manual_seed(3)
    coins = torch.rand(50).numpy() < 0.3
    want = np.stack([np.flip(x[b].numpy(), axis - 1) if coins[b] else x[b].numpy() for b in range(50)])
    assert np.array_equal(out.numpy(), want) and 0 < coins.sum() < 50
    assert torch.equal(A.create(name, p=0.0)(x), x) and torch.equal(A.create(name, p=1.0)(x), x.flip(axis))
    assert torch.equal(A.create(name).eval(x), x)


def test_resize_center_crop_and_normalize_match_references():
    from torchvision.transforms.v2 import functional as TF

    x = images(h=11, w=13)
    got = A.Resize(size=(6, 8)).eval(x)
    want = TF.resize(x.double(), [6, 8], antialias=True)  # torchvision's Resize on tensors, in float64
    np.testing.assert_allclose(got.double().numpy(), want.numpy(), atol=1e-5)
    assert torch.allclose(A.Resize(size=5)(torch.full((2, 1, 9, 9), 0.25)), torch.full((2, 1, 5, 5), 0.25))
    for size in ((4, 6), (5, 8), (11, 13), (2, 3)):
        assert torch.equal(A.CenterCrop(size=size)(x), TF.center_crop(x, list(size))), size
    mean, std = [0.5, -1.0, 2.0], [2.0, 0.5, 4.0]
    want = (x.double().numpy() - np.array(mean)[None, :, None, None]) / np.array(std)[None, :, None, None]
    np.testing.assert_allclose(A.Normalize(mean=mean, std=std)(x).double().numpy(), want, atol=1e-6)


def test_computed_normalize_statistics_are_the_training_sets_after_the_transforms_before_it():
    x = images(b=3000, c=2, h=6, w=6) * torch.tensor([3.0, 0.5]).view(1, 2, 1, 1) + 7  # > CHUNK: several chunks
    specs = A.fit("center_crop(size=4) + normalize", x)
    cropped = x[:, :, 1:5, 1:5].double().numpy()
    np.testing.assert_allclose(specs[1]["mean"], cropped.mean(axis=(0, 2, 3)), rtol=1e-9)
    np.testing.assert_allclose(specs[1]["std"], cropped.std(axis=(0, 2, 3)), rtol=1e-9)
    out = A.build(specs).eval(x).double()
    np.testing.assert_allclose(out.mean(dim=(0, 2, 3)), 0, atol=1e-6)
    np.testing.assert_allclose(out.std(dim=(0, 2, 3)), 1, atol=1e-3)


def test_the_spec_language_and_its_errors():
    assert A.parse_augment("random_crop(padding=4) + hflip") == [{"name": "random_crop", "padding": 4},
                                                                  {"name": "hflip"}]
    assert A.parse_augment("normalize(mean=[0.5, 0.5], std=[0.2, 0.2])+vflip(p=0.1)")[0]["mean"] == [0.5, 0.5]
    assert A.parse_augment("none") == [] and not A.build(None)
    assert A.format_augment(A.parse_augment("random_crop(padding=4) + hflip")) == "random_crop(padding=4) + hflip"
    assert RunConfig(augment="random_crop(padding=4) + hflip").augment[1] == {"name": "hflip"}
    for text, message in (("hflip +", "an empty item"), ("blur", "unknown augmentation 'blur'"),
                          ("hflip(p=2)", "hflip: p"), ("normalize(mean=[1])", "give both mean and std"),
                          ("resize(size=4", "not a component spec")):
        with pytest.raises(ValueError, match=message) as info:  # pydantic's error, a ValueError
            RunConfig(augment=text)
        assert "augment" in str(info.value)
    with pytest.raises(FedltError, match="random_crop size 30×30 is larger than the 28×28 images"):
        A.fit("random_crop(size=30)", torch.zeros(2, 1, 28, 28))
    with pytest.raises(FedltError, match="normalize has 2 means for 3-channel images"):
        A.fit("normalize(mean=[0, 0], std=[1, 1])", torch.zeros(2, 3, 4, 4))


def _task(cid, round_index=0, seed=0):
    from fedlt.context import RoundContext

    ctx = RoundContext(round_index=round_index, rounds=1, num_clients=4, participants=(cid,), num_classes=2,
                       global_counts=torch.ones(2), participant_counts=torch.ones(1, 2), classifier_weight=None,
                       sampling_seed=seed, fused="off", model=None)
    return ClientTask(cid, ctx, {}, None, {}, LocalSchedule(4), "ce", {})


def test_draws_come_from_the_clients_own_stream():
    pipeline = A.build("random_crop(padding=2) + hflip")
    x = images(b=16)

    def draw(task):
        with client_rng(task):
            return pipeline(x)

    torch.manual_seed(123)
    first = draw(_task(1))
    torch.randn(7)  # whatever ran before in this process does not matter
    assert torch.equal(draw(_task(1)), first)
    assert not torch.equal(draw(_task(2)), first)  # another client
    assert not torch.equal(draw(_task(1, round_index=1)), first)  # another round
    assert not torch.equal(draw(_task(1, seed=1)), first)  # another sampling seed


def test_the_schedule_carries_the_specs_over_the_wire():
    schedule = LocalSchedule(8, iters=2, augment=tuple(A.fit("random_crop(padding=4) + normalize",
                                                             images(b=4))))
    assert wire.decode(*wire.encode(schedule)) == schedule


@pytest.mark.parametrize("algorithm", ["fedavg", "scala", "sfl_localloss"])
def test_an_augmented_run_is_the_same_twice_and_in_reverse_order_and_really_augments(algorithm):
    from test_engines import ReversedRunner, rounds  # tests/test_engines.py: the participants run in reverse

    settings = dict(algorithm=algorithm, model="mlp" if algorithm == "fedavg" else "alexnet", clients=4,
                    participation=1.0, train_limit=200, test_limit=50, local_iters=2, server_batch=16,
                    partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})
    augmented = RunConfig(**settings, augment="random_crop(padding=2) + hflip + normalize")
    once, once_states = rounds(augmented, LocalRunner())
    twice, twice_states = rounds(augmented, LocalRunner())
    backward, backward_states = rounds(augmented, ReversedRunner())
    assert not differences(once, twice, 0.0) and not differences(once_states, twice_states, 0.0)
    assert not differences(once, backward, 0.0) and not differences(once_states, backward_states, 0.0)
    plain, _ = rounds(RunConfig(**settings, augment="normalize"), LocalRunner())
    assert differences(once, plain, 1e-6)  # the random crops and flips changed the training


def test_a_suspended_split_session_replays_the_augmented_batch_it_was_holding():
    """A session suspended between forward and backward (a Flower node between messages) trains
    exactly like a live one: the pending batch's augmented input travels with its state."""
    from test_engines import rounds
    from test_session_suspend import SuspendingRunner  # tests/test_session_suspend.py

    config = RunConfig(algorithm="scala", clients=3, participation=1.0, train_limit=300, test_limit=50,
                       server_batch=24, local_iters=3, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5},
                       augment="random_crop(padding=3) + hflip")
    live, live_states = rounds(config, LocalRunner())
    suspended, suspended_states = rounds(config, SuspendingRunner())
    assert not differences(live, suspended, 0.0) and not differences(live_states, suspended_states, 0.0)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**63 - 1))
def test_seeding_a_cpu_block_draws_what_torch_manual_seed_draws(seed):
    """``seed_forked`` seeds the CPU generator alone for a client on the CPU (torch.manual_seed's
    lazy CUDA queue formats a stack per call while CUDA is not initialised): the draws are the same."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        expected = (torch.rand(5), torch.randint(0, 10, (5,)), torch.randperm(7))
    with torch.random.fork_rng(devices=[]):
        seed_forked(seed, torch.device("cpu"))
        drawn = (torch.rand(5), torch.randint(0, 10, (5,)), torch.randperm(7))
    assert all(torch.equal(a, b) for a, b in zip(expected, drawn))


def test_a_client_on_another_device_than_the_cpu_seeds_every_generator(monkeypatch):
    """Not only CUDA has a generator of its own: on MPS a model's dropout draws from the MPS one,
    which torch.manual_seed seeds and the CPU generator's seed alone would leave to whatever ran
    before (no per-client stream, no exact resume). The meta device stands in for MPS here."""
    from types import SimpleNamespace

    seeded = []
    monkeypatch.setattr(torch, "manual_seed", lambda seed: seeded.append(seed))
    task = SimpleNamespace(data=SimpleNamespace(x=torch.empty(2, 3, device="meta")), cid=1, round_index=0,
                           context=SimpleNamespace(sampling_seed=7))
    with client_rng(task):
        pass
    assert len(seeded) == 1

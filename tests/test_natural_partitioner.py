"""The ``natural`` partitioner: every group (writer, user, site) lands whole on one client, merged
into K clients by size (balanced, largest first) or at random (seeded); it composes with
``longtail``, reaches the engine and ``fedlt partition`` from the dataset's ``groups_train``, and
refuses data without groups or more clients than groups in one line."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fedlt.partitioners as P
from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.datasets.base import InMemoryDataset
from fedlt.engine import make_partition
from fedlt.errors import FedltError


def grouped_labels(sizes, num_classes=5, seed=0):
    """Labels and group ids: group g has sizes[g] samples, interleaved in random order."""
    rng = np.random.default_rng(seed)
    groups = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    return rng.integers(0, num_classes, groups.size), groups


def owners(part, size):
    owner = np.full(size, -1)
    for k, idx in enumerate(part.client_indices):
        owner[idx] = k
    return owner


def group_clients(owner, groups):
    """For each group present, the set of clients holding its samples."""
    return {int(g): set(owner[groups == g].tolist()) for g in np.unique(groups)}


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=1, max_size=25), data=st.data())
def test_groups_stay_whole_and_size_merging_balances_the_clients(sizes, data):
    k = data.draw(st.integers(1, len(sizes)))
    y, groups = grouped_labels(sizes)
    by_size = P.Natural()(y, k, 0, num_classes=5, groups=groups)
    owner = owners(by_size, y.size)
    assert all(len(c) == 1 for c in group_clients(owner, groups).values())  # no group is split
    assert (owner >= 0).all()
    loads = np.array([len(i) for i in by_size.client_indices])
    # greedy largest-first: the spread of the client sizes is at most the largest group
    assert loads.max() - loads.min() <= max(sizes)
    if k == len(sizes):  # one group each, client k holds the k-th largest (ties: lower group id)
        order = sorted(range(len(sizes)), key=lambda g: (-sizes[g], g))
        assert [int(groups[i[0]]) for i in by_size.client_indices] == order
    assert P.Natural()(y, k, 7, num_classes=5, groups=groups).sha256 == by_size.sha256  # seed-independent

    seed = data.draw(st.integers(0, 2**32 - 1))
    at_random = P.Natural(merge="random")(y, k, seed, num_classes=5, groups=groups)
    owner = owners(at_random, y.size)
    clients_of = group_clients(owner, groups)
    assert all(len(c) == 1 for c in clients_of.values()) and (owner >= 0).all()
    groups_per_client = np.bincount([next(iter(c)) for c in clients_of.values()], minlength=k)
    assert set(groups_per_client.tolist()) <= {len(sizes) // k, -(-len(sizes) // k)}
    assert P.Natural(merge="random")(y, k, seed, num_classes=5, groups=groups).sha256 == at_random.sha256


def test_random_merging_depends_on_the_seed_and_string_ids_work():
    y, groups = grouped_labels([5] * 12)
    names = np.array([f"writer_{g:02d}" for g in groups])
    parts = {P.Natural(merge="random")(y, 4, s, num_classes=5, groups=names).sha256 for s in range(5)}
    assert len(parts) > 1
    # string ids and their integer codes (in sorted order) give the same partition
    assert (P.Natural()(y, 4, 0, num_classes=5, groups=names).sha256
            == P.Natural()(y, 4, 0, num_classes=5, groups=groups).sha256)


def test_longtail_then_natural_keeps_groups_whole_among_the_kept_samples():
    y, groups = grouped_labels([40] * 10, num_classes=5)
    part = P.create("longtail", imbalance_factor=10, then={"name": "natural"})(y, 6, 0, num_classes=5, groups=groups)
    owner = owners(part, y.size)
    kept = owner >= 0
    counts = np.bincount(y[kept], minlength=5)
    assert counts[0] > counts[-1] and not kept.all()  # the long tail was applied
    assert all(len(c) == 1 for c in group_clients(owner[kept], groups[kept]).values())
    assert part.manifest["params"] == {"imbalance_factor": 10.0, "then": {"name": "natural", "merge": "size"}}


def test_without_groups_or_with_too_many_clients_is_one_line():
    y, groups = grouped_labels([3, 4, 5])
    for call, message in ((lambda: P.Natural()(y, 2, 0), "natural needs each training sample's group id"),
                          (lambda: P.Natural()(y, 4, 0, groups=groups), "the data has 3 groups, fewer than the 4"),
                          (lambda: P.Natural()(y, 2, 0, groups=groups[:5]), "groups must hold one id per training"),
                          (lambda: P.Natural()(y, 2, 0, groups=groups * 0.5), "groups must be integer or string")):
        with pytest.raises(FedltError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def _dataset(groups):
    y, _ = grouped_labels([1] * groups.size)
    x = np.zeros((groups.size, 1, 2, 2), np.float32)
    import torch

    return InMemoryDataset("toy", torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(x[:4]),
                           torch.from_numpy(y[:4]), 5, torch.from_numpy(groups))


def test_the_engine_passes_the_datasets_groups_and_a_plain_function_partitioner_still_works():
    _, groups = grouped_labels([6, 2, 9, 4, 7])
    data = _dataset(groups)
    part = make_partition(RunConfig(partition={"name": "natural"}, clients=5), data)
    assert [int(groups[i[0]]) for i in part.client_indices] == [2, 4, 0, 3, 1]  # largest group first

    def halves(labels, num_clients, seed, *, num_classes=None, dataset_name="x"):  # a plugin's function
        return P.IID()(labels, num_clients, seed, num_classes=num_classes, dataset_name=dataset_name)

    assert P.partition_data(halves, data, 2, 0).num_clients == 2


def test_fedlt_partition_shows_a_natural_split_of_an_arrays_file(tmp_path, capsys):
    rng = np.random.default_rng(0)
    path = tmp_path / "femnist_like.npz"
    np.savez(path, x_train=rng.integers(0, 256, (120, 8, 8), dtype=np.uint8), y_train=rng.integers(0, 4, 120),
             x_test=rng.integers(0, 256, (20, 8, 8), dtype=np.uint8), y_test=rng.integers(0, 4, 20),
             groups_train=np.array([f"f{i % 9:04d}" for i in range(120)]))
    main(["partition", "--dataset", "arrays", "--data-root", str(path), "--partition", "natural(merge=random)",
          "--clients", "3", "--plot", str(tmp_path / "heat.png")])
    out = capsys.readouterr().out
    assert "natural(merge=random)" in out and "120 of 120" in out and (tmp_path / "heat.png").stat().st_size > 0
    with pytest.raises(SystemExit) as info:
        main(["partition", "--dataset", "arrays", "--data-root", str(path), "--partition", "natural", "--clients", "10"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "the data has 9 groups, fewer than the 10 clients" in err
    assert len(err.splitlines()) == 1

"""The device contract on the CPU (fedlt.testing.device): every registered algorithm keeps its
round on the run's device and its clients' step loops free of host synchronisation."""

import pytest
import torch

import fedlt.algorithms
from fedlt.algorithms.base import LocalSchedule
from fedlt.algorithms.fedavg_family import ClientUpdate, FedAvgFamily
from fedlt.testing import ContractError, check_device
from fedlt.testing.device import PRETEND, OnDevice, on_pretend_device

import cheap


@pytest.mark.parametrize("name", fedlt.algorithms.REGISTRY.list())
def test_every_algorithm_is_device_clean(name):
    check_device(name, cheap.params(name))  # CReFF's, CCVR's and FedLoGe's server-side sizes cut (tests/cheap.py)


def test_the_audit_sees_a_stray_host_tensor_and_every_kind_of_sync():
    with on_pretend_device() as audit:
        x = torch.randn(4, 3).to(PRETEND)
        assert isinstance(x, OnDevice) and x.device == PRETEND
        y = x * 2 + torch.zeros(3, device=x.device)  # placed like x: not a mix
        z = torch.tensor(1.0)  # a 0-d host tensor is a scalar, as CUDA accepts
        _ = y + z
        assert not audit.mixed
        _ = y + torch.ones(3)  # a stray host tensor
        assert len(audit.mixed) == 1 and "aten.add" in next(iter(audit.mixed))
        float(y.sum()), bool(y.sum() > 0), y.sum().item(), y.cpu()
    assert sum(audit.syncs.values()) == 4
    assert all("test_device_audit" not in k for k in audit.syncs)  # named by fedlt line, or "outside fedlt"


class _ReadsEachStep(ClientUpdate):
    def parts(self, local, model, objective, x, y, extra):
        parts = super().parts(local, model, objective, x, y, extra)
        float(parts["objective"].detach())  # a per-step host read: what the contract forbids
        return parts


class _Chatty(FedAvgFamily):
    def client_fn(self):
        return _ReadsEachStep()


class _StrayIndex(ClientUpdate):
    def parts(self, local, model, objective, x, y, extra):
        keep = torch.arange(len(y))  # built on the host: indexing device data with it copies every step
        return super().parts(local, model, objective, x[keep], y[keep], extra)


class _Stray(FedAvgFamily):
    def client_fn(self):
        return _StrayIndex()


def test_the_contract_fails_a_per_step_sync():
    with pytest.raises(ContractError, match=r"\[no per-step sync\].*test_device_audit|no per-step sync"):
        check_device(_Chatty)


def test_the_contract_fails_a_host_tensor_in_the_step_loop():
    with pytest.raises(ContractError, match=r"\[on the device\].*aten.index"):
        check_device(_Stray)


def test_index_batches_cross_to_the_device_once_per_permutation():
    g = torch.Generator().manual_seed(0)
    host = list(LocalSchedule(4, iters=5).batches(10, torch.Generator().manual_seed(0)))
    with on_pretend_device() as audit:
        placed = list(LocalSchedule(4, iters=5).batches(10, g, PRETEND))
    assert all(isinstance(b, OnDevice) for b in placed)
    assert [b.elem.tolist() for b in placed] == [b.tolist() for b in host]  # the same draws on every device
    assert not audit.syncs


def test_augmentation_runs_on_the_device_without_per_step_copies():
    # random_crop and hflip draw on the host (the same draws on every device) and cross pinned and
    # non-blocking; normalize's statistics are made on the device once
    check_device("fedavg", augment=[{"name": "random_crop", "padding": 2}, {"name": "hflip"},
                                    {"name": "normalize", "mean": [0.1], "std": [0.3]}])


@pytest.mark.parametrize("name,settings", [("fedavg", {}), ("scaffold", {"local_epochs": 1, "batch_size": 8})])
def test_cohort_training_is_device_clean(name, settings):
    check_device(name, cohort=2, **settings)

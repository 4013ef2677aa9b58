"""A round's client losses are read back from the device once, after its last client
(fedlt.algorithms.base.deferred_losses, LocalRunner.each): on a GPU the host sets the next client up
while the device still trains the one before. Read late, each loss must still act as if read at its
client's end: the same numbers, a non-finite one that client's failure (or the round's error before
any later client's), a check made but not returned (a discarded loop) read too, a check made by work
that then raised taking the place of the error it caused."""

from __future__ import annotations

import math
import weakref
from types import SimpleNamespace

import pytest
import torch

import fedlt.algorithms.protocol as protocol
from fedlt.algorithms.base import NonFiniteLoss, PendingLoss, deferred_losses, loss_of, read_back
from fedlt.algorithms.fedavg_family import OBJECTIVE, check_parts
from fedlt.algorithms.pfl import _joined
from fedlt.algorithms.stateful import _check_finite
from fedlt.algorithms.protocol import ClientFailure, ClientResult, LocalRunner, run_client
from fedlt.config import RunConfig
from fedlt.testing.algorithms import TINY
from fedlt.testing.device import audit_round, client_syncs


def checked(loss: float, cid: int):
    """What a client's loop makes of a one-step loss: its mean, or NonFiniteLoss naming the client."""
    value = torch.tensor(loss)

    def read(numbers: list[float]) -> float:
        if not numbers[0]:
            raise NonFiniteLoss(f"non-finite loss ({value.item()}) at local step 1, client {cid}")
        return numbers[1]

    return loss_of([torch.isfinite(value), value.double()], read)


class Scripted:
    """An algorithm whose client ``k`` returns the loss ``losses[k]`` (after a discarded loop with
    ``discarded[k]``, then raising ``raises[k]``, where given)."""

    def __init__(self, losses, discarded=None, raises=None):
        self.losses, self.discarded, self.raises = losses, discarded or {}, raises or {}

    def client_work(self, task):
        if task.cid in self.discarded:
            checked(self.discarded[task.cid], task.cid)  # a loop whose result the work drops
        loss = checked(self.losses[task.cid], task.cid)
        if task.cid in self.raises:
            raise self.raises[task.cid]
        return ClientResult(task.cid, {}, 1, 1, loss)


def tasks(n: int):
    return [SimpleNamespace(cid=k, fault=None, upload=None, round_index=0, context=SimpleNamespace(
        sampling_seed=0, round_index=0)) for k in range(n)]


@pytest.fixture
def runs(monkeypatch):
    """The local runner's calls, with tasks passed as they are (no tensors to isolate) and every
    read of the device counted."""
    reads = []
    real = protocol.read_back
    monkeypatch.setattr(protocol, "isolated", lambda task: task)
    monkeypatch.setattr(protocol, "client_rng", lambda task: __import__("contextlib").nullcontext())
    monkeypatch.setattr(protocol, "read_back", lambda values: reads.append(len(values)) or real(values))
    return reads


def test_a_rounds_losses_are_read_once_and_are_the_numbers_read_at_once(runs):
    out = LocalRunner().call(Scripted([0.5, 1.25, 2.0]), tasks(3))
    assert [r.train_loss for r in out] == [0.5, 1.25, 2.0] and all(type(r.train_loss) is float for r in out)
    assert runs == [6]  # one read: every client's two numbers
    alone = run_client(Scripted([1.25, 1.25]), tasks(2)[1])  # outside the runner: read at once
    assert alone.train_loss == 1.25 and type(alone.train_loss) is float
    made_by_hand = SimpleNamespace(client_work=lambda task: ClientResult(  # a PendingLoss not made by loss_of
        task.cid, {}, 1, 1, PendingLoss([torch.tensor(2.5)], lambda numbers: numbers[0] * 2)))
    assert LocalRunner().call(made_by_hand, tasks(1))[0].train_loss == 5.0


def test_a_non_finite_loss_is_its_clients_failure_or_the_rounds_error_before_a_later_clients(runs):
    out = LocalRunner(tolerate=True).call(Scripted([0.5, math.nan, 2.0]), tasks(3))
    assert isinstance(out[1], ClientFailure) and out[1].cid == 1
    assert out[1].reason == "failed: NonFiniteLoss: non-finite loss (nan) at local step 1, client 1"
    assert [out[0].train_loss, out[2].train_loss] == [0.5, 2.0]
    with pytest.raises(NonFiniteLoss, match="client 1"):
        LocalRunner().call(Scripted([0.5, math.inf, 2.0]), tasks(3))
    # client 2's own error comes after client 1's non-finite loss, as when each was read at once
    with pytest.raises(NonFiniteLoss, match="client 1"):
        LocalRunner().call(Scripted([0.5, math.nan, 2.0], raises={2: ValueError("later")}), tasks(3))
    with pytest.raises(ValueError, match="later"):
        LocalRunner().call(Scripted([0.5, 1.0, 2.0], raises={2: ValueError("later")}), tasks(3))


def test_a_discarded_loops_check_and_a_check_before_an_error_are_read(runs):
    out = LocalRunner(tolerate=True).call(Scripted([0.5, 1.0], discarded={1: math.nan}), tasks(2))
    assert out[0].train_loss == 0.5 and isinstance(out[1], ClientFailure) and "NonFiniteLoss" in out[1].reason
    # the work raised after a non-finite loss: read at once, the loss would have stopped it first
    out = LocalRunner(tolerate=True).call(Scripted([0.5, math.nan], raises={1: RuntimeError("svd of nan")}),
                                          tasks(2))
    assert out[1].reason.startswith("failed: NonFiniteLoss: non-finite loss (nan)"), out[1].reason
    out = LocalRunner(tolerate=True).call(Scripted([0.5, 1.0], raises={1: RuntimeError("own")}), tasks(2))
    assert out[1].reason == "failed: RuntimeError: own"


def test_joined_losses_read_as_the_phases_would_and_raise_the_first_phases_error():
    with deferred_losses():
        first, second = checked(1.0, 0), checked(4.0, 0)
        joined = first.joined(second, lambda a, b: (a * 1 + b * 3) / 4)
        bad = checked(math.nan, 7).joined(checked(math.inf, 8), lambda a, b: a + b)
    assert isinstance(joined, PendingLoss) and joined.read([1.0, 1.0, 1.0, 4.0]) == 3.25
    assert float(joined) == 3.25  # client code needing the number reads it at once
    with pytest.raises(NonFiniteLoss, match="client 7"):
        float(bad)
    with pytest.raises(NonFiniteLoss, match="client 7"):
        bad.read([0.0, math.nan, 0.0, math.inf])


def test_a_waiting_check_keeps_none_of_its_clients_tensors_alive():
    """A check waits for the round's last client: it must hold its loss table, not the client's task
    (its copies of the global weights, payload and state) nor a first phase's trained model — else
    a round keeps one more model per client alive until its end (on the device, on a GPU)."""
    big = {"w": torch.ones(1000)}
    task = SimpleNamespace(cid=3, objective="ce", weights=big, payload={"c": big["w"].clone()})
    held = [weakref.ref(big["w"]), weakref.ref(task.payload["c"])]
    with deferred_losses():
        pending = check_parts({OBJECTIVE: [torch.tensor(1.5), torch.tensor(2.5)]}, 2, task)
        first = ClientResult(3, {"w": torch.ones(1000)}, 1, 2, checked(1.0, 3))
        joined = _joined(first, ClientResult(3, {}, 1, 2, checked(3.0, 3))).train_loss
    held.append(weakref.ref(first.weights["w"]))
    del big, task, first  # freed at once by reference counting, when nothing else holds them
    assert [ref() is None for ref in held] == [True, True, True]
    assert pending.read(read_back(pending.values)) == 2.0 and joined.read(read_back(joined.values)) == 2.0


def test_scaffolds_control_variate_check_is_one_flag_read_with_the_rounds_losses(runs):
    c_i = {"w": torch.ones(3), "b": torch.tensor([1.0, math.inf])}
    with pytest.raises(NonFiniteLoss, match="control variate of client 4 is not finite"):
        _check_finite(c_i, 4, 0.1, 2)  # outside a runner: read at once
    scaffold_like = SimpleNamespace(client_work=lambda task: _check_finite(c_i, task.cid, 0.1, 2) or ClientResult(
        task.cid, {}, 1, 1, checked(0.5, task.cid)))
    out = LocalRunner(tolerate=True).call(scaffold_like, tasks(2))
    assert [o.reason for o in out] == [f"failed: NonFiniteLoss: SCAFFOLD's control variate of client {k} is not "
                                       "finite (its step (x - y)/(K·lr) overflows at lr=0.1, K=2)" for k in (0, 1)]
    assert runs == [6]  # the round's one read: two clients' flag, finiteness and mean


# one loop a client; two phases joined (FedRep: head, body); SCAFFOLD's check of its control variate
@pytest.mark.parametrize("name", ["fedavg", "fedrep", "scaffold"])
def test_no_client_waits_for_the_device_and_a_round_reads_it_once(name, tmp_path):
    """On the device audit's pretend device (fedlt.testing.device): no host synchronisation inside
    any client's work, one for the round's checks (each round trains 2 of the 4 clients)."""
    config = RunConfig(**dict(TINY, clients=4, participation=1.0, model="mlp"), algorithm=name, out=tmp_path / "run")
    audit, = audit_round(config, rounds=2, local_iters=(2,))
    assert not client_syncs(audit), client_syncs(audit)
    reads = sum(n for where, n in audit.syncs.items() if "algorithms/base.py" in where)
    assert reads == 2, audit.syncs

"""The personalised algorithms (issue 32), each against an independent float64 re-implementation
of its update rule (two rounds, partial participation: client 1 carries its own part into round 2,
client 2 joins late), a mutant of the implementation that the reference rejects, and the personal
model each one builds: different from the global model where the method says so, equal where it
says so."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fedlt.algorithms
import fedlt.algorithms.pfl
import fedlt.errors
from fedlt.algorithms.base import ClientData, LocalSchedule, RunContext, client_generator
from fedlt.algorithms.cohort import cohort_reason
from fedlt.algorithms.personal import EvalTask, stream_seed
from fedlt.algorithms.pfl import (PERSONAL, ApflUpdate, Ditto, DittoUpdate, FedBABU, FedPer, FedRep, FedRoD, LGFedAvg,
                                  Local, PartsUpdate, RepUpdate, RoDUpdate)
from fedlt.algorithms.protocol import ClientStates
from fedlt.algorithms.stateful import features_of
from fedlt.engine import train_round
from fedlt.models import classifier
from fedlt.models.alexnet import MLP

pytestmark = pytest.mark.usefixtures("one_thread")

C, D, H = 3, 4, 5  # classes, input features, hidden units of the tiny MLP
LR, EPOCHS, BATCH = 0.1, 2, 4
ROUNDS = [[0, 1], [1, 2]]
SIZES = [8, 12, 6]
BODY, HEAD = ["1.weight", "1.bias"], ["3.weight", "3.bias"]
NAMES = BODY + HEAD


def tiny_clients() -> list[ClientData]:
    g = torch.Generator().manual_seed(1)
    clients = []
    for cid, n in enumerate(SIZES):
        x = torch.randn(n, D, generator=g, dtype=torch.float64)
        y = torch.randint(0, C, (n,), generator=g)
        clients.append(ClientData(cid, x, y, torch.bincount(y, minlength=C)))
    return clients


def initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return MLP(D, C, hidden=(H,)).double().state_dict()


def context() -> RunContext:
    init = initial()

    def build():
        model = MLP(D, C, hidden=(H,)).double()
        model.load_state_dict(init)
        return model

    return RunContext(num_classes=C, input_shape=(1, 1, D), build_model=build, split=None, server_batch=10,
                      local_iters=3, local_epochs=EPOCHS, batch_size=BATCH, lr=LR, momentum=0.0,
                      weight_decay=0.0, clip=None, sampling_seed=0, device=torch.device("cpu"), num_clients=len(SIZES))


def library(algorithm, rounds=ROUNDS):
    """Two rounds of ``algorithm`` (a registered name or an instance) as the engine runs them."""
    algorithm = fedlt.algorithms.create(algorithm) if isinstance(algorithm, str) else algorithm
    ctx, clients, states = context(), tiny_clients(), ClientStates()
    algorithm.setup(ctx)
    for r, part in enumerate(rounds):
        train_round(algorithm, ctx, r, [clients[i] for i in part], states)
    return {k: v.clone() for k, v in algorithm.global_model().state_dict().items()}, algorithm, states


# -- the independent reference: a hand-written MLP and plain SGD ---------------------------------
def features(w, x):
    return torch.relu(x @ w["1.weight"].T + w["1.bias"])


def linear(w, prefix, h):
    return h @ w[f"{prefix}weight"].T + w[f"{prefix}bias"]


def cross_entropy(z, y, offset=None):
    z = z if offset is None else z + offset
    return sum(torch.logsumexp(z[i], 0) - z[i, y[i]] for i in range(len(y))) / len(y)


def ce_loss(w, x, y):
    return cross_entropy(linear(w, "3.", features(w, x)), y)


def round_batches(r, cid, epochs=EPOCHS):
    """The client's minibatch order (data plumbing shared with the library, not the math)."""
    return list(LocalSchedule(BATCH, epochs=epochs).batches(SIZES[cid], client_generator(0, r, cid)))


def stream_batches(r, cid, purpose, epochs):
    g = torch.Generator().manual_seed(stream_seed(0, r, cid, purpose) % (2**63))
    return list(LocalSchedule(BATCH, epochs=epochs).batches(SIZES[cid], g))


def copy(w):
    return {k: v.detach().clone() for k, v in w.items()}


def sgd(w, data, order, loss_fn, trainable, extra=lambda w: {}):
    """Plain SGD over the minibatches ``order`` on the ``trainable`` keys of w, with extra(w)[k]
    added to a key's gradient."""
    w = copy(w)
    for idx in order:
        x, y = data.x[idx], data.y[idx]
        leaves = {k: v.clone().requires_grad_(k in trainable) for k, v in w.items()}
        grads = dict(zip(trainable, torch.autograd.grad(loss_fn(leaves, x, y), [leaves[k] for k in trainable])))
        add = extra(w)
        for k in trainable:
            w[k] = w[k] - LR * (grads[k] + add.get(k, 0.0))
    return w


def weighted(ws, sizes, keys):
    total = sum(sizes)
    return {k: sum(n / total * w[k] for w, n in zip(ws, sizes)) for k in keys}


def close(a, b, keys=None):
    return max(float((a[k] - b[k]).abs().max()) for k in (keys or b))


def reference_parts(keep, shared, train=lambda w, data, r: None):
    """The shared shape of local / FedPer / FedRep / FedBABU / LG-FedAvg: start from the global
    model with the client's own ``keep`` keys, train (``train``), keep ``keep``, average ``shared``."""
    clients, x, own = tiny_clients(), initial(), {}
    for r, part in enumerate(ROUNDS):
        trained = []
        for k in part:
            start = x | own.get(k, {})
            w = train(start, clients[k], r)
            own[k] = {n: w[n] for n in keep}
            trained.append(w)
        if shared:
            x = x | weighted(trained, [SIZES[k] for k in part], shared)
    return x, own


def all_sgd(w, data, r):
    return sgd(w, data, round_batches(r, data.cid), ce_loss, NAMES)


def reference_fedrep(head_epochs):
    def train(w, data, r):
        w = sgd(w, data, stream_batches(r, data.cid, "fedrep-head", head_epochs), ce_loss, HEAD)
        return sgd(w, data, round_batches(r, data.cid), ce_loss, BODY)
    return reference_parts(HEAD, BODY, train)


def reference_fedbabu():
    return reference_parts([], BODY, lambda w, data, r: sgd(w, data, round_batches(r, data.cid), ce_loss, BODY))


# -- FedRoD: the generic side on balanced softmax, the personal head on detached inputs -------------
RO_BODY, GENERIC, PHEAD = BODY, ["3.generic.weight", "3.generic.bias"], ["3.personal.weight", "3.personal.bias"]


def rod_initial():
    w = initial()
    return {"1.weight": w["1.weight"], "1.bias": w["1.bias"], "3.generic.weight": w["3.weight"],
            "3.generic.bias": w["3.bias"], "3.personal.weight": w["3.weight"], "3.personal.bias": w["3.bias"]}


def reference_fedrod(detach=True):
    clients, x, own = tiny_clients(), rod_initial(), {}
    for r, part in enumerate(ROUNDS):
        trained = []
        for k in part:
            data = clients[k]
            offset = torch.log(data.class_counts.double())  # every class present: balanced softmax = CE(z + log n)
            w = x | own.get(k, {})
            for idx in round_batches(r, k):
                xb, yb = data.x[idx], data.y[idx]
                leaves = {n: v.clone().requires_grad_(True) for n, v in w.items()}
                h = features(leaves, xb)
                z = linear(leaves, "3.generic.", h)
                generic = cross_entropy(z, yb, offset)
                hp, zp = (h.detach(), z.detach()) if detach else (h, z)
                personal = cross_entropy(zp + linear(leaves, "3.personal.", hp), yb)
                names = list(w)
                grads = dict(zip(names, torch.autograd.grad(generic + personal, [leaves[n] for n in names],
                                                            allow_unused=True)))
                w = {n: w[n] - LR * (grads[n] if grads[n] is not None else 0.0) for n in names}
            own[k] = {n: w[n] for n in PHEAD}
            trained.append(w)
        x = x | weighted(trained, [SIZES[k] for k in part], RO_BODY + GENERIC)
    return x, own


def reference_ditto(lam):
    clients, x, init, own = tiny_clients(), initial(), initial(), {}
    for r, part in enumerate(ROUNDS):
        trained = []
        for k in part:
            order = round_batches(r, k)
            trained.append(sgd(x, clients[k], order, ce_loss, NAMES))
            received = copy(x)
            own[k] = sgd(own.get(k, init), clients[k], order, ce_loss, NAMES,
                         extra=lambda v: {n: lam * (v[n] - received[n]) for n in NAMES})
        x = weighted(trained, [SIZES[k] for k in part], NAMES)
    return x, own


# -- against the references ----------------------------------------------------------------------
def own_part(states, cid):
    return states.get(cid).get(PERSONAL, {})


def check_parts(got, states, ref_x, ref_own, tol=1e-9):
    assert close(got, ref_x) < tol
    for cid, part in ref_own.items():
        if part:
            assert close(own_part(states, cid), part) < tol


CASES = {  # name: (reference, the parts the client keeps)
    "local": (lambda: reference_parts(NAMES, [], all_sgd), NAMES),
    "fedper": (lambda: reference_parts(HEAD, BODY, all_sgd), HEAD),
    "lg_fedavg": (lambda: reference_parts(BODY, HEAD, all_sgd), BODY),
    "fedrep": (lambda: reference_fedrep(1), HEAD),
    "fedbabu": (reference_fedbabu, []),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_partial_sharing_methods_match_their_reference(name):
    reference, keep = CASES[name]
    ref_x, ref_own = reference()
    got, _, states = library(name)
    check_parts(got, states, ref_x, ref_own)
    assert set(states) == ({0, 1, 2} if keep else set())  # own parts only where the method keeps one
    if name != "local":
        assert close(got, initial(), BODY if name != "lg_fedavg" else HEAD) > 1e-3  # the shared part moved


def test_local_never_changes_the_server_model():
    got, _, states = library("local")
    assert close(got, initial()) == 0.0
    assert close(own_part(states, 1), initial()) > 1e-3


def test_fedrep_head_epochs_is_its_own_phase():
    ref_x, ref_own = reference_fedrep(3)
    got, _, states = library(FedRep(head_epochs=3))
    check_parts(got, states, ref_x, ref_own)


def test_fedrod_matches_its_reference():
    ref_x, ref_own = reference_fedrod()
    got, _, states = library("fedrod")
    check_parts(got, states, ref_x, ref_own)
    assert close(got, rod_initial(), PHEAD) == 0.0  # the server's personal head is never aggregated


@pytest.mark.parametrize("lam", [1.0, 0.0])
def test_ditto_matches_its_reference(lam):
    ref_x, ref_own = reference_ditto(lam)
    got, _, states = library(Ditto(lam=lam))
    check_parts(got, states, ref_x, ref_own)
    fedavg, _, _ = library("fedavg")
    assert close(got, fedavg) < 1e-12  # the global model is FedAvg's exactly


# -- mutants the references reject -----------------------------------------------------------------
class HeadAggregated(FedPer):
    shared = "all"  # the head averaged too: FedAvg, not FedPer


class BodyKept(LGFedAvg):
    shared = "body"  # the wrong part shared


class HeadTrained(FedBABU):
    freeze = "none"  # the head not frozen


class LocalSends(Local):
    shared = "all"  # federated after all


@dataclasses.dataclass(frozen=True)
class SwappedRep(RepUpdate):
    def __call__(self, task, model=None):  # the frozen parts swapped: the body first, then the head
        schedule = dataclasses.replace(task.schedule, epochs=self.head_epochs, iters=None)
        body = PartsUpdate(keep="head", freeze="head", shared="body", stream="fedrep-head")
        first = body(dataclasses.replace(task, schedule=schedule), model)
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        head = PartsUpdate(keep="head", freeze="body", shared="body")
        return head(dataclasses.replace(task, weights=trained, state=first.state), model)


class RepSwapped(FedRep):
    def client_fn(self):
        return SwappedRep(self.keep, self.freeze, self.shared, head_epochs=self.head_epochs)


@dataclasses.dataclass(frozen=True)
class AttachedRoD(RoDUpdate):
    def parts(self, local, model, objective, x, y, extra):  # the personal head's gradient reaches the body
        with features_of(model) as seen:
            z = model(x)
        personal = classifier(model).personal(seen[0])
        return {"objective": objective(z, y, **extra), "personal": F.cross_entropy(z + personal, y)}


class RoDAttached(FedRoD):
    def client_fn(self):
        return AttachedRoD(self.keep, self.freeze, self.shared)


@dataclasses.dataclass(frozen=True)
class AwayFromGlobal(DittoUpdate):
    def __call__(self, task, model=None):  # λ's sign flipped: pushed away from w
        return DittoUpdate.__call__(dataclasses.replace(self, lam=-self.lam), task, model)


class DittoWrongSign(Ditto):
    def client_fn(self):
        return AwayFromGlobal(self.lam)


MUTANTS = {
    "fedper, head aggregated": (HeadAggregated, lambda: reference_parts(HEAD, BODY, all_sgd)),
    "lg_fedavg, body shared": (BodyKept, lambda: reference_parts(BODY, HEAD, all_sgd)),
    "fedbabu, head trained": (HeadTrained, reference_fedbabu),
    "local, model sent": (LocalSends, lambda: reference_parts(NAMES, [], all_sgd)),
    "fedrep, frozen parts swapped": (RepSwapped, lambda: reference_fedrep(1)),
    "fedrod, personal head not detached": (RoDAttached, lambda: reference_fedrod()),
    "ditto, wrong sign of lambda": (DittoWrongSign, lambda: reference_ditto(1.0)),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_reference_rejects_a_mutant(mutant):
    cls, reference = MUTANTS[mutant]
    ref_x, ref_own = reference()
    got, _, states = library(cls())
    gaps = [close(got, ref_x)] + [close(own_part(states, c), p) for c, p in ref_own.items() if p and own_part(states, c)]
    assert max(gaps) > 1e-4


def test_the_fedrod_reference_itself_sees_the_detach():
    (a, _), (b, _) = reference_fedrod(True), reference_fedrod(False)
    assert close(a, b) > 1e-4


# -- the personal models -------------------------------------------------------------------------------
FT_EPOCHS = 2


def eval_task(algorithm, states, cid, round_index=1):
    ctx = context()
    clients = tiny_clients()
    test = tiny_clients()[(cid + 1) % 3]  # any labelled data will do as a test set here
    weights = {k: v.clone() for k, v in algorithm.global_model().state_dict().items()}
    return EvalTask(cid, ctx.round(round_index, clients), weights, states.get(cid), "personal", data=clients[cid],
                    test=dataclasses.replace(test, cid=cid), schedule=ctx.schedule(BATCH), objective="ce")


def outputs(model, cid):
    with torch.no_grad():
        return model(tiny_clients()[cid].x)


def reference_logits(w, cid):
    return linear(w, "3.", features(w, tiny_clients()[cid].x))


@pytest.mark.parametrize("name", ["fedper", "lg_fedavg", "local", "ditto"])
def test_personal_model_is_the_global_one_with_the_clients_own_part(name):
    got, algorithm, states = library(name)
    for cid in range(3):
        model = algorithm.personal_model(eval_task(algorithm, states, cid))
        expected = got | own_part(states, cid)
        assert close(model.state_dict(), expected) == 0.0 and not model.training
        assert close(model.state_dict(), got) > 1e-3  # every client has trained its own part by now


@pytest.mark.parametrize("name", ["fedper", "lg_fedavg", "local", "ditto", "apfl"])
def test_a_client_never_sampled_has_the_global_model_as_its_personal_model(name):
    _, algorithm, states = library(name, rounds=[[0, 1]])
    model = algorithm.personal_model(eval_task(algorithm, states, 2))
    assert close(model.state_dict(), algorithm.global_model().state_dict()) == 0.0
    assert not states.get(2)


def test_a_fedrod_client_never_sampled_adds_the_initial_personal_head():
    got, algorithm, states = library("fedrod", rounds=[[0, 1]])
    model = algorithm.personal_model(eval_task(algorithm, states, 2))
    h = features(got, tiny_clients()[2].x)
    expected = linear(got, "3.generic.", h) + linear(rod_initial(), "3.personal.", h)
    assert float((outputs(model, 2) - expected).abs().max()) < 1e-12


def test_the_personalised_algorithms_train_in_cohorts():
    # the loop's start and frozen_keys hooks; FedRep's and Ditto's phases one cohort each; APFL's
    # stepped hook client by client after each batched step
    for name in ("fedavg_ft", "fedper", "fedbabu", "lg_fedavg", "local", "fedrep", "ditto", "apfl"):
        assert cohort_reason(fedlt.algorithms.create(name), MLP(D, C)) is None


def test_fedrod_personal_prediction_is_generic_plus_personal_logits():
    got, algorithm, states = library("fedrod")
    cid = 1
    model = algorithm.personal_model(eval_task(algorithm, states, cid))
    w = got | own_part(states, cid)
    h = features(w, tiny_clients()[cid].x)
    expected = linear(w, "3.generic.", h) + linear(w, "3.personal.", h)
    assert float((outputs(model, cid) - expected).abs().max()) < 1e-12
    generic = outputs(algorithm.global_model(), cid)  # the global model answers with the generic head only
    assert float((generic - linear(got, "3.generic.", features(got, tiny_clients()[cid].x))).abs().max()) < 1e-12


def reference_finetune(w, cid, round_index):
    return sgd(w, tiny_clients()[cid], stream_batches(round_index, cid, "finetune", FT_EPOCHS), ce_loss, NAMES)


@pytest.mark.parametrize("name", ["fedavg_ft", "fedbabu"])
def test_fine_tuned_personal_model_matches_its_reference(name):
    algorithm = fedlt.algorithms.create(name, finetune_epochs=FT_EPOCHS)
    got, algorithm, states = library(algorithm)
    task = eval_task(algorithm, states, 0)
    rng = torch.get_rng_state()
    model = algorithm.personal_model(task)
    assert torch.equal(rng, torch.get_rng_state())  # evaluating draws nothing from the caller's stream
    expected = reference_finetune(got, 0, 1)
    assert close(model.state_dict(), expected) < 1e-9
    assert close(expected, got, HEAD) > 1e-3  # the head is fine-tuned too (FedBABU's head moves only here)
    assert close(algorithm.global_model().state_dict(), got) == 0.0 and not states.get(0)  # nothing stored
    again = algorithm.personal_model(task)
    assert close(again.state_dict(), model.state_dict()) == 0.0  # deterministic: the client's own stream


def test_a_mutant_fine_tune_on_the_rounds_stream_is_rejected():
    got, algorithm, states = library(fedlt.algorithms.create("fedavg_ft", finetune_epochs=FT_EPOCHS))
    model = algorithm.personal_model(eval_task(algorithm, states, 0))
    wrong = sgd(got, tiny_clients()[0], round_batches(1, 0, FT_EPOCHS), ce_loss, NAMES)
    assert close(model.state_dict(), wrong) > 1e-4


def test_fine_tuning_needs_the_clients_data():
    _, algorithm, states = library(fedlt.algorithms.create("fedavg_ft", finetune_epochs=1))
    task = dataclasses.replace(eval_task(algorithm, states, 0), data=None)
    with pytest.raises(fedlt.errors.FedltError, match="training data"):
        algorithm.personal_model(task)


@pytest.mark.parametrize("name", ["fedper", "fedrod", "ditto", "apfl"])
def test_personal_state_survives_a_checkpoint_round_trip(name, tmp_path):
    """The engine checkpoints ClientStates with torch.save (weights_only load): a client's own part
    comes back bit for bit, and so does its personal model."""
    _, algorithm, states = library(name)
    torch.save(states.state_dict(), tmp_path / "states.pt")
    restored = ClientStates()
    restored.load_state_dict(torch.load(tmp_path / "states.pt", weights_only=True))
    for cid in range(3):
        a = algorithm.personal_model(eval_task(algorithm, states, cid))
        b = algorithm.personal_model(eval_task(algorithm, restored, cid))
        assert close(a.state_dict(), b.state_dict()) == 0.0


# -- APFL --------------------------------------------------------------------------------------------
def reference_apfl(alpha0=0.5, adaptive=True):
    clients, x, init, own, alphas = tiny_clients(), initial(), initial(), {}, {}
    for r, part in enumerate(ROUNDS):
        trained = []
        for k in part:
            data, w, v, alpha = clients[k], copy(x), copy(own.get(k, init)), alphas.get(k, alpha0)
            for step, idx in enumerate(round_batches(r, k)):
                xb, yb = data.x[idx], data.y[idx]
                w = sgd(w, data, [idx], ce_loss, NAMES)  # w's step first
                lv = {n: t.clone().requires_grad_(True) for n, t in v.items()}
                lw = {n: t.clone().requires_grad_(True) for n, t in w.items()}
                mixed = alpha * linear(lv, "3.", features(lv, xb)) + (1 - alpha) * linear(lw, "3.", features(lw, xb))
                grads = torch.autograd.grad(cross_entropy(mixed, yb), [lv[n] for n in NAMES] + [lw[n] for n in NAMES])
                gv, gw = dict(zip(NAMES, grads[:4])), dict(zip(NAMES, grads[4:]))
                v = {n: v[n] - LR * gv[n] for n in NAMES}
                if adaptive and step == 0:  # the authors' alpha_update, once a round
                    grad = sum(float(((v[n] - w[n]) * (alpha * gv[n] + (1 - alpha) * gw[n])).sum()) for n in NAMES)
                    alpha = min(max(alpha - LR * (grad + 0.02 * alpha), 0.0), 1.0)
            own[k], alphas[k] = v, alpha
            trained.append(w)
        x = weighted(trained, [SIZES[k] for k in part], NAMES)
    return x, own, alphas


def test_apfl_matches_the_authors_update():
    ref_x, ref_own, ref_alpha = reference_apfl()
    got, algorithm, states = library("apfl")
    check_parts(got, states, ref_x, ref_own)
    for cid, alpha in ref_alpha.items():
        assert abs(float(states.get(cid)["alpha"]) - alpha) < 1e-9
    assert all(abs(a - 0.5) > 1e-4 for a in ref_alpha.values())  # α really moved
    fedavg, _, _ = library("fedavg")
    assert close(got, fedavg) < 1e-12  # the global model is FedAvg's exactly


class ApflFixed(ApflUpdate):
    def stepped(self, local, model, x, y, step):  # α never updated
        super().stepped(local, model, x, y, step if step else 1)


class ApflMutant(fedlt.algorithms.pfl.APFL):
    def client_fn(self):
        return ApflFixed(self.alpha, self.adaptive)


def test_the_apfl_reference_rejects_alpha_left_alone():
    _, ref_own, ref_alpha = reference_apfl()
    _, _, states = library(ApflMutant())
    assert max(abs(float(states.get(c)["alpha"]) - a) for c, a in ref_alpha.items()) > 1e-4
    assert max(close(own_part(states, c), p) for c, p in ref_own.items()) > 1e-6


def test_apfl_personal_prediction_mixes_the_outputs():
    got, algorithm, states = library("apfl")
    cid = 1
    model = algorithm.personal_model(eval_task(algorithm, states, cid))
    alpha, v = float(states.get(cid)["alpha"]), own_part(states, cid)
    expected = alpha * reference_logits(v, cid) + (1 - alpha) * reference_logits(got, cid)
    assert float((outputs(model, cid) - expected).abs().max()) < 1e-12
    assert float((outputs(model, cid) - reference_logits(got, cid)).abs().max()) > 1e-4

"""One answer on every engine, for everything registered (issue 27): the engine contract over
every registered algorithm (built-ins and installed plugins) with a stateful aggregator, a
stateful loss, a plugin's split server side and a model with dropout among the cases; client
randomness independent of the order clients run in; client work isolated from the server's
state; a round-context field reaching a new loss term with no edit of fedlt."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fedlt.algorithms
import fedlt.losses
from fedlt import io
from fedlt.algorithms.protocol import ClientStates, LocalRunner, LocalSessions, isolated, run_client
from fedlt.algorithms.stateful import Scaffold, ScaffoldUpdate
from fedlt.config import RunConfig
from fedlt.engine import prepare, run, train_round
from fedlt.losses.adjust import CE
from fedlt.testing.engines import differences

import cheap

pytest.importorskip("flwr")
from fedlt.testing import check_engines  # noqa: E402

DROPOUT = {"model": "tiny_cnn(width=4, dropout=0.5)"}  # the example plugin's model, dropout before the classifier


@pytest.mark.xdist_group("ray")  # one Ray at a time (tests/conftest.py)
def test_every_registered_algorithm_gives_one_answer_on_every_engine_with_dropped_clients(one_thread):
    """Local and Flower simulation: same global weights, server state and client states after 2
    rounds in which one sampled client drops out each round (a split-learning client leaves
    mid-exchange), a dropped client's state does not change, and for EVERY installed algorithm
    (the registry's, plugins included: nothing listed by hand) the Flower run's directory as a
    kill after round 1 leaves it, resumed with the same settings, ends where the uninterrupted
    run does. Kept cheap: 4 clients (2 sampled a round), 300 samples, the MLP."""
    installed = fedlt.algorithms.list()
    assert {"example_fedcm", "example_feddc"} <= set(installed)  # the plugin's algorithms are among them
    check_engines([*cheap.cases(installed), ("scala", {"server": {"name": "grouped", "size": 2}})],  # tests/cheap.py
                  drops=True, resume=True, clients=4, train_limit=300)


@pytest.mark.xdist_group("ray")
def test_stateful_parts_and_random_draws_give_one_answer_on_every_engine(one_thread):
    """Without drops: a stateful aggregator (a built-in's, a plugin's), a stateful loss evaluated
    on SCALA's server, a plugin's split server side, torch's generator drawn in client work."""
    cases = [("fedavg", {"aggregator": "fedadam"}),  # a stateful aggregator (Adam's moments)
             ("fedavg", {"aggregator": "lookahead"}),  # a plugin's stateful aggregator
             ("scala", {"client_loss": "fedgrab"}),  # a stateful loss evaluated on the server, kept per client
             ("scala", {"server": {"name": "grouped", "size": 2}}),  # a plugin's split server side
             ("fedavg", {}, DROPOUT), ("scaffold", {}, DROPOUT)]  # torch's generator drawn in client work
    check_engines(cases, resume=False)


class ReversedRunner(LocalRunner):
    """The participants' work in reverse order (results handed back in task order)."""

    def call(self, algorithm, tasks):
        return [run_client(algorithm, isolated(t)) for t in reversed(tasks)][::-1]

    def exchange(self, algorithm, tasks):
        sessions = LocalSessions(algorithm, tasks)
        sessions.sessions.reverse()
        return _Reordered(sessions)


class _Reordered:
    def __init__(self, sessions):
        self.sessions = sessions

    def forward(self):
        return self.sessions.forward()[::-1]

    def backward(self, grads):
        self.sessions.backward(list(grads)[::-1])

    def finish(self):
        return self.sessions.finish()[::-1]


def rounds(config: RunConfig, runner, n: int = 2):
    from fedlt.algorithms.base import ClientData
    from fedlt.engine import sample_clients

    prep, states = prepare(config), ClientStates()
    for r in range(n):
        chosen = sample_clients(config.clients, config.participation, config.seeds.sampling, r)
        clients = []
        for cid in chosen:
            idx = torch.as_tensor(prep.partition.client_indices[cid], dtype=torch.long)
            clients.append(ClientData(cid, prep.data.x_train[idx], prep.data.y_train[idx], prep.counts[cid]))
        train_round(prep.algorithm, prep.ctx, r, clients, states, runner)
    return prep.algorithm.state_dict(), states.state_dict()


@pytest.mark.parametrize("algorithm", ["fedavg", "scala"])
def test_a_clients_random_draws_do_not_depend_on_the_order_clients_run_in(algorithm, one_thread, tmp_path):
    """Dropout draws from the client's own stream: the same result, bit for bit, with the
    participants run in reverse order; and the dropout really draws (another seed differs)."""
    model = "tiny_cnn(width=4, dropout=0.5)" if algorithm == "fedavg" else "alexnet"
    settings = dict(algorithm=algorithm, model=model, clients=4, participation=1.0, train_limit=200, local_iters=2,
                    server_batch=16, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})
    if algorithm == "scala":  # AlexNet's client part (s2) has no dropout; its server part does: cut before it
        settings["split"] = "s4"
    forward, forward_states = rounds(RunConfig(**settings), LocalRunner())
    backward, backward_states = rounds(RunConfig(**settings), ReversedRunner())
    assert not differences(forward, backward, 0.0) and not differences(forward_states, backward_states, 0.0)
    other, _ = rounds(RunConfig(**settings, seeds={"sampling": 1}), LocalRunner())
    assert differences(forward["model"], other["model"], 1e-6)


@dataclasses.dataclass(frozen=True)
class MutatingUpdate(ScaffoldUpdate):
    """SCAFFOLD's client, then it scribbles over everything it received."""

    def __call__(self, task, model=None):
        result = super().__call__(task, model)
        with torch.no_grad():
            for tensor in [*task.weights.values(), *task.payload["c"].values(), task.context.global_counts,
                           *task.state.get("c", {}).values()]:
                tensor.add_(1)
        return result


class MutatingScaffold(Scaffold):
    def client_fn(self):
        return MutatingUpdate()


def test_client_work_cannot_change_the_server_or_the_store(one_thread, tmp_path):
    """The mutating client's run ends exactly like plain SCAFFOLD's: the global model, the
    server control variate, the round context and every stored client state are the server's
    own, not the tensors the client received."""
    settings = dict(model="mlp", clients=4, participation=0.5, train_limit=200, local_iters=2,
                    partition={"name": "dirichlet", "beta": 0.5, "min_size": 5}, rounds=3)
    ends = []
    for name, algorithm in (("plain", Scaffold), ("mutating", MutatingScaffold)):
        with fedlt.algorithms.REGISTRY.temporary(f"isolation_{name}", algorithm):
            run(RunConfig(**settings, algorithm=f"isolation_{name}", out=tmp_path / name))
        ends.append(io.load_checkpoint(tmp_path / name / "checkpoint.pt"))
    for part in ("algorithm", "client_states"):
        assert not differences(ends[0][part], ends[1][part], 0.0), part


class WarmupCE(CE):
    """A new term that needs the round and the total number of rounds (a warm-up schedule):
    CE scaled by (round_index + 1) / rounds. It names the fields; nothing in fedlt changes."""

    name = "warmup_ce"
    fused_family = None  # its own scale: never replaced by the fused cross-entropy
    seen: list[tuple[int, int, tuple[int, ...]]] = []

    def __init__(self, *, round_index: int, rounds: int, participants: tuple[int, ...]) -> None:
        super().__init__()
        self.scale = (round_index + 1) / rounds
        WarmupCE.seen.append((round_index, rounds, participants))

    def __call__(self, logits, targets, **kwargs):
        return self.scale * super().__call__(logits, targets, **kwargs)


def test_a_loss_term_reads_any_round_context_field_without_an_edit_of_fedlt(tmp_path, one_thread):
    WarmupCE.seen.clear()
    with fedlt.losses.REGISTRY.temporary("warmup_ce", WarmupCE):
        run(RunConfig(algorithm="fedavg", algorithm_params={"loss": "warmup_ce"}, model="mlp", clients=4,
                      participation=0.5, rounds=3, train_limit=200, partition={"name": "iid"}, out=tmp_path / "run"))
    seen = sorted({s for s in WarmupCE.seen if s[1] == 3})  # (config-time validation builds it on a stand-in round)
    assert [(r, n) for r, n, _ in seen] == [(0, 3), (1, 3), (2, 3)], seen
    assert all(len(p) == 2 for _, _, p in seen)  # the round's two participants

"""One answer on every engine, for everything registered (issue 27): the engine contract over
every registered algorithm (built-ins and installed plugins) with a stateful aggregator, a
stateful loss, a plugin's split server side and a model with dropout among the cases; Flower's
own run directory beside the local engine's and a run extended by a resume (every Flower run of
this module shares ONE simulation: Ray starts once); client
randomness independent of the order clients run in; client work isolated from the server's
state; a round-context field reaching a new loss term with no edit of fedlt."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

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
from fedlt.flower.simulation import Job, simulate  # noqa: E402
from fedlt.testing import ContractError  # noqa: E402
from fedlt.testing.engines import EngineCheck  # noqa: E402

DROPOUT = {"model": "tiny_cnn(width=4, dropout=0.5)"}  # the example plugin's model, dropout before the classifier


STATEFUL = [("fedavg", {"aggregator": "fedadam"}),  # a stateful aggregator (Adam's moments)
            ("fedavg", {"aggregator": "lookahead"}),  # a plugin's stateful aggregator
            ("scala", {"client_loss": "fedgrab"}),  # a stateful loss evaluated on the server, kept per client
            ("scala", {"server": {"name": "grouped", "size": 2}}),  # a plugin's split server side
            ("fedavg", {}, DROPOUT), ("scaffold", {}, DROPOUT)]  # torch's generator drawn in client work

# Flower's own runs beside the local engine's (test_the_run_directory_...): the FedAvg family, a
# server optimiser, a stateful client loss, SCALA's per-iteration exchange; a run extended by a resume
COMMON = dict(clients=3, participation=1.0, rounds=2, train_limit=600, test_limit=200, server_batch=48,
              local_iters=2, eval_every=1, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})
CASES = {
    "fedavg": dict(algorithm="fedavg"),
    "fedgrab": dict(algorithm="fedgrab"),  # SGB state persists on each client across rounds
    "fedadam": dict(algorithm="fedavg", algorithm_params={"aggregator": "fedadam"}),
    "scala": dict(algorithm="scala"),  # T exchanges per round
}


def config(case: str, out, **changes) -> RunConfig:
    return RunConfig(**{**COMMON, **CASES[case], **changes, "out": out})


@pytest.fixture(scope="module")
def simulation(tmp_path_factory, one_thread):
    """Every Flower run of this module in ONE simulation: Ray and its client actors start once,
    which was most of each check's time (fedlt.testing.engines.EngineCheck)."""
    root = tmp_path_factory.mktemp("engines")
    installed = fedlt.algorithms.list()
    every = EngineCheck([*cheap.cases(installed), ("scala", {"server": {"name": "grouped", "size": 2}})],  # tests/cheap.py
                        root / "every", drops=True, resume=True, clients=4, train_limit=300)
    stateful = EngineCheck(STATEFUL, root / "stateful", resume=False)
    runs = root / "runs"
    own = [Job(config(case, runs / f"{case}-flower", engine="flower")) for case in CASES]
    own += [Job(config("fedgrab", runs / "resumed", engine="flower", rounds=1)),
            Job(config("fedgrab", runs / "resumed", engine="flower"), resume=True)]
    for check in (every, stateful):
        check.run_local()
    for case in CASES:
        run(config(case, runs / f"{case}-local"))
    outcomes = simulate([*every.jobs, *stateful.jobs, *own])
    return SimpleNamespace(installed=installed, every=every, stateful=stateful, runs=runs,
                           outcomes=outcomes[len(every.jobs) + len(stateful.jobs):])


@pytest.mark.xdist_group("ray")  # one Ray at a time (tests/conftest.py)
def test_every_registered_algorithm_gives_one_answer_on_every_engine_with_dropped_clients(simulation):
    """Local and Flower simulation: same global weights, server state and client states after 2
    rounds in which one sampled client drops out each round (a split-learning client leaves
    mid-exchange), a dropped client's state does not change, and for EVERY installed algorithm
    (the registry's, plugins included: nothing listed by hand) the Flower run's directory as a
    kill after round 1 leaves it, resumed with the same settings, ends where the uninterrupted
    run does. Kept cheap: 4 clients (2 sampled a round), 300 samples, the MLP."""
    assert {"example_fedcm", "example_feddc"} <= set(simulation.installed)  # the plugin's algorithms are among them
    simulation.every.verify()


@pytest.mark.xdist_group("ray")
def test_stateful_parts_and_random_draws_give_one_answer_on_every_engine(simulation):
    """Without drops: a stateful aggregator (a built-in's, a plugin's), a stateful loss evaluated
    on SCALA's server, a plugin's split server side, torch's generator drawn in client work."""
    simulation.stateful.verify()


def test_the_engine_check_fails_when_flower_ends_elsewhere(one_thread, tmp_path):
    """The contract's teeth, without Ray: Flower's runs faked as copies of the local ones pass;
    one weight moved by 1e-3 in the Flower run's checkpoint is named."""
    check = EngineCheck(["fedavg"], tmp_path, train_limit=200)
    check.run_local()
    (local, flower, resumed, _), = check.runs
    for out in (flower.out, resumed.out):
        shutil.copytree(local.out, out)
    check.verify()
    saved = io.load_checkpoint(flower.out / "checkpoint.pt")
    name = next(iter(saved["algorithm"]["model"]))
    saved["algorithm"]["model"][name] = saved["algorithm"]["model"][name] + 1e-3
    io.save_checkpoint(flower.out / "checkpoint.pt", saved)
    with pytest.raises(ContractError, match=rf"'fedavg' breaks \[same answer on every engine\].*{name}"):
        check.verify()


def model_of(run_dir) -> dict[str, torch.Tensor]:
    return io.load_checkpoint(run_dir / "checkpoint.pt")["algorithm"]["model"]


@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("case", list(CASES))
def test_flower_and_local_engines_train_the_same_global_model(simulation, case):
    flower, local = model_of(simulation.runs / f"{case}-flower"), model_of(simulation.runs / f"{case}-local")
    assert flower.keys() == local.keys()
    for name in local:
        torch.testing.assert_close(flower[name], local[name], rtol=0, atol=1e-6, msg=f"{case}: {name}")


@pytest.mark.xdist_group("ray")
def test_the_comparison_can_tell_runs_apart(simulation):
    """FedAvg and FedAdam from the same start differ by far more than the tolerance."""
    a, b = model_of(simulation.runs / "fedavg-flower"), model_of(simulation.runs / "fedadam-flower")
    assert max(float((a[n] - b[n]).abs().max()) for n in a if a[n].is_floating_point()) > 1e-3


@pytest.mark.xdist_group("ray")
def test_the_run_directory_is_the_same_as_the_local_engines(simulation):
    root, outcomes = simulation.runs, simulation.outcomes
    for case in CASES:
        flower, local = root / f"{case}-flower", root / f"{case}-local"
        # and Flower's and Ray's log lines, kept off the terminal (fedlt.flower.simulation)
        assert sorted(p.name for p in flower.iterdir()) == sorted([*(p.name for p in local.iterdir()), "flower.log"])
        assert (flower / "partition.npz").read_bytes() == (local / "partition.npz").read_bytes()
        rows = [json.loads(line) for line in (flower / "metrics.jsonl").read_text().splitlines()]
        local_rows = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2] and rows[0].keys() == local_rows[0].keys()
        for r, l in zip(rows, local_rows):
            assert r["accuracy"] == l["accuracy"] and abs(r["loss"] - l["loss"]) < 1e-5
        assert json.loads((flower / "config.json").read_text())["engine"] == "flower"
    # exchanges (one message per participant each): 1 per round for FedAvg, T + 1 per round for
    # SCALA (gradients ride on the next forward)
    assert outcomes[0]["exchanges"] == 2
    assert outcomes[3]["exchanges"] == 2 * (COMMON["local_iters"] + 1)


@pytest.mark.xdist_group("ray")
def test_client_state_travels_and_resume_continues_exactly(simulation):
    """A run of 1 round extended to 2 by a resume ends as the 2-round run (SGB's per-client state
    came back from every node and travels again)."""
    whole = io.load_checkpoint(simulation.runs / "fedgrab-flower" / "checkpoint.pt")
    resumed = io.load_checkpoint(simulation.runs / "resumed" / "checkpoint.pt")
    assert sorted(whole["client_states"]) == [0, 1, 2]  # SGB's state came back from every node
    for name, tensor in whole["algorithm"]["model"].items():
        assert torch.equal(resumed["algorithm"]["model"][name], tensor), name
    assert [r["accuracy"] for r in resumed["metrics"]] == [r["accuracy"] for r in whole["metrics"]]


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

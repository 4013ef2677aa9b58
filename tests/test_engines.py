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
from pathlib import Path
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
            # a plugin's split server side with 3 participants: 2 server forwards an iteration, one of
            # a partial group (`every` has this case too, but with 2 participants: one group)
            ("scala", {"server": {"name": "grouped", "size": 2}}),
            ("fedavg", {}, DROPOUT), ("scaffold", {}, DROPOUT),  # torch's generator drawn in client work
            # 2 clients that never train (issue 44), evaluated on their own nodes: global, personal
            # (FedRep's new-client head, trained there) and fine-tuned
            ("fedrep", {}, {"new_clients": 2})]

# issue 42: client-level DP + compressed uploads (error feedback in the client states), with the
# drops and the Flower resume of `every`: same model, states, bytes and ε on both engines
PRIVATE = ("fedvls", {}, {"privacy": "client_level(clip=1.0, noise_multiplier=1.1)",
                          "upload": "topk(fraction=0.1, error_feedback=true)"})

# issue 42: --secure-aggregation is Flower's SecAgg+ on Flower and fedlt's simulated masking locally,
# with client-level DP; 3 sampled a round and one of them dropped (2 mask), and the Flower resume
SECURE = ("fedvls", {}, {"privacy": "client_level(clip=1.0, noise_multiplier=1.1)", "secure_aggregation": True,
                         "participation": 0.75})

# the runs the tests below read beside the contract's verdict: the FedAvg family, a server
# optimiser, a stateful client loss (SGB's state persists on each client), SCALA's per-iteration
# exchange; ("fedadam" is STATEFUL's FedAdam, the others are `every`'s cases, with dropped clients)
OWN = {"fedavg": ("every", "fedavg", {}), "fedgrab": ("every", "fedgrab", {}), "scala": ("every", "scala", {}),
       "fedadam": ("stateful", "fedavg", {"aggregator": "fedadam"})}


def case_runs(check: EngineCheck, name: str, params: dict | None = None
              ) -> tuple[RunConfig, RunConfig, RunConfig, Path]:
    """``check``'s runs (local, flower, resumed, local cut) of the case ``name`` with ``params``
    and no settings of its own."""
    for (case, case_params, own), runs in zip(check.cases, check.runs):
        if case == name and case_params == (params or {}) and not own:
            return runs
    raise LookupError(f"no case {name} {params} in the check")


@pytest.fixture(scope="module")
def simulation(tmp_path_factory, one_thread):
    """Every Flower run of this module in ONE simulation: Ray and its client actors start once,
    which was most of each check's time (fedlt.testing.engines.EngineCheck). Besides the checks'
    runs: `every`'s FedGraB run as 1 round extended to 2 by a resume (2 Flower jobs), and STATEFUL's
    FedAdam run with plain FedAvg on the local engine."""
    root = tmp_path_factory.mktemp("engines")
    installed = fedlt.algorithms.list()
    grouped = ("scala", {"server": {"name": "grouped", "size": 2}})
    # `every` evaluates after round 2 only (eval_every=2: ~0.5 s less a case on Flower, ~0.2 s
    # locally): its per-client fields are compared at round 2, and its resume, cut after round 1,
    # covers them. Evaluating between rounds is still checked on both engines by `stateful`
    # (eval_every=1) and on Flower by the run extended by a resume (its round 1 is a last round)
    every = EngineCheck([*cheap.cases(installed), grouped, PRIVATE],  # tests/cheap.py
                        root / "every", drops=True, resume=True, clients=4, train_limit=300, eval_every=2)
    stateful = EngineCheck(STATEFUL, root / "stateful", resume=False, eval_every=1)
    # atol 1e-4: SecAgg+'s rounding (~1e-9 of the update) moves the per-client losses of this
    # DP-noised model (~700) by ~5e-5; the model itself is compared at 1e-6 below
    secure = EngineCheck([SECURE], root / "secure", atol=1e-4, drops=True, resume=True, clients=4, train_limit=300,
                         eval_every=2)
    fedgrab = case_runs(every, "fedgrab")[1]
    extended = [Job(fedgrab.model_copy(update={"rounds": 1, "out": root / "extended"})),
                Job(fedgrab.model_copy(update={"out": root / "extended"}), resume=True)]
    for check in (every, stateful, secure):
        check.run_local()
    adam = case_runs(stateful, "fedavg", {"aggregator": "fedadam"})[0]
    run(adam.model_copy(update={"algorithm_params": {}, "out": root / "fedavg-local"}))
    run(secure.runs[0][0].model_copy(update={"secure_aggregation": False, "out": root / "secure-plain"}))
    jobs = [*every.jobs, *stateful.jobs, *extended, *secure.jobs]
    outcomes = simulate(jobs)
    exchanges = {(Path(j.config.out), j.resume): o["exchanges"] for j, o in zip(jobs, outcomes)}  # in job order
    return SimpleNamespace(installed=installed, every=every, stateful=stateful, secure=secure, root=root,
                           grouped=grouped, exchanges=exchanges)


def own_runs(simulation, case: str) -> tuple[RunConfig, RunConfig, RunConfig, Path]:
    check, name, params = OWN[case]
    return case_runs(getattr(simulation, check), name, params)


@pytest.mark.xdist_group("ray")  # one Ray at a time (tests/conftest.py)
def test_every_registered_algorithm_gives_one_answer_on_every_engine_with_dropped_clients(simulation):
    """Local and Flower simulation: same global weights, server state and client states after 2
    rounds in which one sampled client drops out each round (a split-learning client leaves
    mid-exchange), a dropped client's state does not change, and for EVERY installed algorithm
    (the registry's, plugins included: nothing listed by hand) the Flower run's directory as a
    kill after round 1 leaves it, resumed with the same settings, ends where the uninterrupted
    run does. Kept cheap: 4 clients (2 sampled a round), 300 samples, the MLP, the evaluations
    (the global model's and each client's) after round 2 only."""
    assert {"example_fedcm", "example_feddc"} <= set(simulation.installed)  # the plugin's algorithms are among them
    assert simulation.grouped in [(name, params) for name, params, _ in simulation.every.cases]
    simulation.every.verify()


@pytest.mark.xdist_group("ray")
def test_private_compressed_uploads_count_the_same_bytes_and_epsilon_on_every_engine(simulation):
    """The DP + top-k case of `every` (its models and states are compared by the contract): each
    round's bytes_up / bytes_down (the wire size of what crossed: on Flower what the codec sent)
    and ε are the local engine's exactly, with a client dropped in each round."""
    name, params, own = PRIVATE
    local, flower, *_ = next(runs for (n, p, o), runs in zip(simulation.every.cases, simulation.every.runs)
                             if (n, p, o) == (name, params, own))
    keys = ("bytes_up", "bytes_down", "epsilon", "dropped")
    rows = [[{k: r[k] for k in keys} for r in map(json.loads, (Path(c.out) / "metrics.jsonl").read_text().splitlines())]
            for c in (local, flower)]
    assert rows[0] == rows[1] and all(r["epsilon"] > 0 and r["dropped"] for r in rows[0])


@pytest.mark.xdist_group("ray")
def test_secure_aggregation_on_flower_is_secaggplus_and_gives_the_plain_runs_model(simulation):
    """FedVLS + client-level DP + --secure-aggregation with a client dropped each round: on Flower
    each round's training went through Flower's SecAggPlusWorkflow and secaggplus_mod (their log
    lines), and the contract holds against the local engine's masked run (model, server and client
    states, per-client numbers within 1e-4; the Flower run cut after round 1 and resumed ends bit for
    bit where it did, ε included). Against the plain (unmasked) local run: the same ε every round
    and every weight within 1e-6 — SecAgg+'s quantisation moves each round's update by at most
    (n/qK)·2c/T = (2/3)·2·1/2^30 ≈ 1.2e-9 (2 of 3 upload; fedlt.flower.secaggplus), the rest is float32 rounding."""
    simulation.secure.verify()
    local, flower, resumed, _ = simulation.secure.runs[0]
    log = (Path(flower.out) / "flower.log").read_text()
    # the simulation's log lines go to each of its runs: 2 rounds, then round 2 of the resumed run
    assert log.count("Secure aggregation completed.") == 3 and "Secure aggregation halted" not in log
    plain = simulation.root / "secure-plain"
    assert [r["epsilon"] for r in rows_of(plain)] == [r["epsilon"] for r in rows_of(flower.out)]
    ours, theirs = model_of(flower.out), model_of(plain)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(ours[n], theirs[n]) for n in theirs)  # quantised: not the plain sum bit for bit


@pytest.mark.xdist_group("ray")
def test_stateful_parts_and_random_draws_give_one_answer_on_every_engine(simulation):
    """Without drops: a stateful aggregator (a built-in's, a plugin's), a stateful loss evaluated
    on SCALA's server, a plugin's split server side, torch's generator drawn in client work; the
    global model and each client evaluated after each round (an evaluation between rounds leaves
    round 2 as it was on either engine)."""
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
    return io.load_checkpoint(Path(run_dir) / "checkpoint.pt")["algorithm"]["model"]


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("case", list(OWN))
def test_flower_and_local_engines_train_the_same_global_model(simulation, case):
    """The global model of the contract's runs without its relative tolerance: every weight
    within 1e-6 (the contract allows 1e-6 + 1e-5·|value|)."""
    local, flower, *_ = own_runs(simulation, case)
    flower, local = model_of(flower.out), model_of(local.out)
    assert flower.keys() == local.keys()
    for name in local:
        torch.testing.assert_close(flower[name], local[name], rtol=0, atol=1e-6, msg=f"{case}: {name}")


@pytest.mark.xdist_group("ray")
def test_the_comparison_can_tell_runs_apart(simulation):
    """FedAvg and FedAdam from the same start (STATEFUL's settings) differ by far more than the
    tolerance: FedAdam's run on either engine against FedAvg's on the local engine."""
    fedavg = model_of(simulation.root / "fedavg-local")
    for adam in own_runs(simulation, "fedadam")[:2]:
        b = model_of(adam.out)
        assert max(float((fedavg[n] - b[n]).abs().max()) for n in fedavg if fedavg[n].is_floating_point()) > 1e-3


@pytest.mark.xdist_group("ray")
def test_the_run_directory_is_the_same_as_the_local_engines(simulation):
    """For every case of both checks: the Flower run's directory holds the local run's files and
    flower.log, the same partition bytes, metrics rows with the same fields, the same accuracy
    and a loss within 1e-5 in each round, and its config names the Flower engine."""
    for check in (simulation.every, simulation.stateful):
        for (name, params, _), (local, flower, *_) in zip(check.cases, check.runs):
            label, flower, local = f"{name}{params}", Path(flower.out), Path(local.out)
            # and Flower's and Ray's log lines, kept off the terminal (fedlt.flower.simulation)
            assert sorted(p.name for p in flower.iterdir()) == sorted([*(p.name for p in local.iterdir()), "flower.log"]), label
            assert (flower / "partition.npz").read_bytes() == (local / "partition.npz").read_bytes(), label
            rows, local_rows = rows_of(flower), rows_of(local)
            assert [r["round"] for r in rows] == [1, 2] and [r.keys() for r in rows] == [r.keys() for r in local_rows], label
            for r, l in zip(rows, local_rows):
                if "accuracy" in l:
                    assert r["accuracy"] == l["accuracy"] and abs(r["loss"] - l["loss"]) < 1e-5, label
            assert "accuracy" in rows[-1], label
            assert json.loads((flower / "config.json").read_text())["engine"] == "flower", label


def expected_exchanges(config: RunConfig, per_round: int, eval_runs: int, trained: list[int]) -> int:
    """One message per participant each: ``per_round`` for each trained round, and for each
    evaluated one (every ``eval_every``-th and the last), one per per-client evaluation that runs
    (``personal`` of an algorithm with no personal model is ``global_local``'s: evaluated once)."""
    evaluated = [r for r in trained if r % config.eval_every == 0 or r == config.rounds]
    return per_round * len(trained) + eval_runs * len(evaluated)


@pytest.mark.xdist_group("ray")
def test_the_flower_runner_makes_one_exchange_per_call_and_t_plus_one_per_split_round(simulation):
    """Message round trips (one message per participant each) of `every`'s Flower runs, one
    sampled client dropped each round: 1 a round for FedAvg, T + 1 a round for SCALA (gradients
    ride on the next forward; the participant left keeps the exchange going), plus the per-client
    evaluations that run at the clients (FedAvg: finetune; SCALA's AlexNet: none — global_local =
    personal is scored at the server); the run resumed after round 1 makes round 2's only."""
    for name, modes in (("fedavg", ["global_local", "personal", "finetune"]), ("scala", ["global_local", "personal"])):
        _, flower, resumed, _ = case_runs(simulation.every, name)
        assert [m["name"] for m in flower.client_eval_modes()] == modes, name
        # global_local (= personal here) is scored by the server in one pass over the rows the
        # clients test on (issue 43), so only the fine-tune evaluation exchanges messages
        per_round = flower.local_iters + 1 if name == "scala" else 1
        eval_runs = len([m for m in modes if m not in ("global_local", "personal")])
        whole, cut = simulation.exchanges[Path(flower.out), False], simulation.exchanges[Path(resumed.out), True]
        assert whole == expected_exchanges(flower, per_round, eval_runs, [1, 2]), name
        assert cut == expected_exchanges(flower, per_round, eval_runs, [2]), name


@pytest.mark.xdist_group("ray")
def test_client_state_travels_and_resume_continues_exactly(simulation):
    """`every`'s FedGraB run (dropped clients) as 1 round extended to 2 by a resume — another path
    than the contract's cut-and-resume with the same rounds — ends as the uninterrupted 2-round
    run: the model, the client states, the last round's metrics bit for bit (the 1-round run
    evaluated after its round 1, the whole run did not: an evaluation between rounds on Flower
    changes nothing); SGB's per-client state came back from every client that returned a result
    (and travels again)."""
    flower = own_runs(simulation, "fedgrab")[1]
    whole = io.load_checkpoint(Path(flower.out) / "checkpoint.pt")
    extended = io.load_checkpoint(simulation.root / "extended" / "checkpoint.pt")
    returned = sorted({cid for row in whole["metrics"] for cid in row["returned"]})
    assert returned and sorted(whole["client_states"]) == returned, returned
    for part in ("algorithm", "client_states"):
        assert not differences(extended[part], whole[part], 0.0), part
    last = [{k: v for k, v in rows[-1].items() if not k.endswith("_s")} for rows in (whole["metrics"], extended["metrics"])]
    assert last[0] == last[1]


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

"""``--graphs`` (fedlt.algorithms.graphs): a client's whole step captured once per batch shape and
replayed equals the eager steps bit for bit on the CPU stand-in, per-client state included (the
contract, fedlt.testing.check_graphs); a wrong transfer or a state the transfer cannot see is
caught; what cannot be captured says why.

The suite runs the contract on fedlogit (per-client offsets), fedprox (per-client anchors) and
fedvls (a teacher reading the received weights), on a variant with a tensor in ``local`` and on a
stated fallback (fedgrab); with cohorts (fedlt.algorithms.cohort_graphs) on fedavg, fedlogit and
two stated fallbacks; the whole family, one client at a time and in cohorts, is the ``slow``
sweep (FEDLT_SLOW=1)."""

import contextlib
from dataclasses import dataclass

import pytest
import torch

import fedlt.algorithms
from fedlt.algorithms import graphs
from fedlt.algorithms.fedavg_family import OBJECTIVE, ClientUpdate, FedAvgFamily, Federated
from fedlt.testing import ContractError
from fedlt.testing.graphs import check_graphs

import cheap

FEDAVG_FAMILY = [n for n in fedlt.algorithms.REGISTRY.list()
                 if isinstance(fedlt.algorithms.create(n), Federated)]


@pytest.mark.parametrize("name", ["fedlogit", "fedprox", "fedvls"])
def test_replayed_steps_equal_eager_bit_for_bit(name):
    check_graphs(name, replayed=True)  # captured, not a stated fallback


def test_a_step_graph_kept_alive_is_seen_before_capture():
    """A step's autograd graph that outlives it holds the parameters' AccumulateGrad nodes, bound
    to its stream: CUDA invalidated every capture made while one lived (the H200 run of
    2026-11-28: "operation failed due to a previous error during capture"). ``kept_graph`` sees
    it on any device, and a step returns its parts detached."""
    model = torch.nn.Linear(3, 2)
    loss = model(torch.ones(4, 3)).sum()
    loss.backward()
    assert graphs.kept_graph(model, list(model.parameters())) == "weight"
    del loss
    assert graphs.kept_graph(model, list(model.parameters())) is None


def test_what_cannot_be_captured_runs_eagerly_exactly_and_says_why():
    check_graphs("fedgrab")  # SGB's gating draws from a generator of its own, which no transfer can copy


# the stated fallbacks on the CPU stand-in (docs/gpu.md#whole-step-cuda-graphs); every other
# FedAvg-family algorithm must replay, so a new refusal fails the sweep instead of passing as "said"
EAGER_ON_THE_STAND_IN = {"apfl", "fedsam", "fedgrab", "fedlf", "fedproto", "fedloge", "fedrela", "fedyoyo",
                         "fedlc", "fedrod"}


@pytest.mark.slow
@pytest.mark.parametrize("name", FEDAVG_FAMILY)
def test_the_family_replays_or_says_why(name):
    check_graphs(name, cheap.params(name), replayed=name not in EAGER_ON_THE_STAND_IN)


def test_a_transfer_that_copies_nothing_is_caught(monkeypatch):
    """The contract's point: without the transfer every client after the first would train with
    the first one's offsets (its clients' class counts differ), and the contract fails."""
    monkeypatch.setattr(graphs, "transfer", lambda into, source: None)
    with pytest.raises(ContractError, match="same as eager"):
        check_graphs("fedlogit")


_HIDDEN: dict[str, torch.Tensor] = {}


@dataclass(frozen=True)
class HiddenOffset(ClientUpdate):
    """A variant keeping a per-client tensor where the transfer cannot see it (a module global,
    rebound per client): a graph keeps reading the tensor it was captured with."""

    def begin(self, task, model, params):
        _HIDDEN["offset"] = task.data.class_counts.float().add(1).log().to(task.data.x.device)

    def terms(self, local, forward, objective, y, extra):
        return {OBJECTIVE: objective(forward.logits + _HIDDEN["offset"], y, **extra)}


@dataclass(frozen=True)
class SeenOffset(HiddenOffset):
    """The same term with the tensor in ``local``, which the transfer walks."""

    def begin(self, task, model, params):
        return {"offset": task.data.class_counts.float().add(1).log().to(task.data.x.device)}

    def terms(self, local, forward, objective, y, extra):
        return {OBJECTIVE: objective(forward.logits + local["offset"], y, **extra)}


class Hidden(FedAvgFamily):
    def client_fn(self):
        return HiddenOffset()


class Seen(FedAvgFamily):
    def client_fn(self):
        return SeenOffset()


def test_a_state_the_transfer_cannot_see_is_caught_and_the_same_in_local_passes():
    with pytest.raises(ContractError, match="same as eager"):
        check_graphs(Hidden)
    check_graphs(Seen)


def test_the_structure_names_what_it_cannot_see_through():
    state = graphs.StepState(objective={"gen": torch.Generator()}, local=None, weights=None, update=None)
    walked = graphs.structure(state, {})
    assert walked.reason == "state.objective['gen'] is a Generator, whose state a graph transfer cannot see"
    a, b = torch.ones(2), torch.zeros(2)
    one = graphs.structure(graphs.StepState([a, 1.0], None, None, None), {})
    other = graphs.structure(graphs.StepState([b, 2.0], None, None, None), {})
    assert one.leaves[0] is a and one.signature != other.signature  # a Python number is frozen: another graph


def test_the_stand_in_refuses_a_host_synchronisation_as_cuda_s_capture_does():
    x = torch.ones(3)
    check = graphs._Checking(torch.device("cpu"))
    with check:
        float(x.sum())
    assert "aten._local_scalar_dense" in check.reason


def test_the_stand_in_replays_on_the_recorded_tensors():
    w, x = torch.ones(3, requires_grad=True), torch.arange(3.0)
    graph = graphs.RecordedGraph(torch.device("cpu"))

    def step():
        loss = (w * x).sum()
        loss.backward()
        with torch.no_grad():
            w.sub_(0.5 * w.grad)
        w.grad = None
        return loss

    loss = graph.capture(step)  # runs once, recording
    assert torch.equal(w.detach(), torch.tensor([1.0, 0.5, 0.0]))
    x.copy_(torch.tensor([2.0, 2.0, 2.0]))  # a new input at the same address
    graph.replay()
    assert float(loss.detach()) == 1.5 * 2 and torch.equal(w.detach(), torch.tensor([0.0, -0.5, -1.0]))


def test_off_by_default_and_a_flag(resolved):
    from fedlt.config import RunConfig

    assert RunConfig().graphs is False and resolved("--graphs").graphs is True


def test_graphs_combine_with_cohorts_and_compile():
    from fedlt.config import RunConfig

    both = RunConfig(graphs=True, cohort=4, compile=True)
    assert both.graphs and both.cohort == 4 and both.compile


@pytest.mark.parametrize("cohort", [1, 3])
def test_a_compiled_step_s_graphs_equal_its_eager_compiled_steps(cohort):
    """``--compile --graphs``: the compiled forward (and backward) inside the captured step, without
    inductor's own CUDA graphs (compiled.options); on the CPU through aot_eager, whose aten
    operators the stand-in records."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # an earlier test in this process may have compiled the same forward: no new frame then
    compiled_frames = counters["frames"]["ok"]
    check_graphs("fedavg", replayed=True, compile=True, cohort=cohort)
    assert counters["frames"]["ok"] > compiled_frames  # the forward did go through dynamo


def test_the_stand_in_refuses_inductor_s_kernels_it_cannot_record():
    assert "aot_eager" in graphs.compiled_reason("recorded", "inductor")
    assert graphs.compiled_reason("recorded", "aot_eager") is None and graphs.compiled_reason("cuda", "inductor") is None


def test_on_the_cpu_a_run_says_why_it_runs_eagerly_and_records_it(tmp_path, caplog):
    from fedlt.config import RunConfig
    from fedlt.engine import run
    from fedlt.testing.algorithms import TINY

    with caplog.at_level("WARNING", logger="fedlt"):
        summary = run(RunConfig(**dict(TINY, model="mlp", algorithm="fedavg", rounds=1, clients=2, graphs=True),
                                out=tmp_path / "run"))
    said = [r.getMessage() for r in caplog.records if r.name == "fedlt"]
    assert said == ["fedlt: --graphs leaves the local steps eager: CUDA graphs need a CUDA device; the steps run "
                    "eagerly on cpu"]
    assert summary["graphs_fallback"] == "CUDA graphs need a CUDA device; the steps run eagerly on cpu"


def test_a_random_operator_in_the_step_is_refused():
    check = graphs._Checking(torch.device("cpu"))
    with check:
        torch.nn.functional.dropout(torch.ones(3), 0.5)
    assert "draws random numbers" in check.reason


def test_a_step_changing_python_state_is_refused():
    state = graphs.StepState(objective={"t": torch.ones(1)}, local=[], weights=None, update=None)
    before = graphs.structure(state, {})
    state.local.append(1)  # a counter, a list a step appends to: a graph would freeze it
    assert "changes Python-level state" in graphs._python_change(before, graphs.structure(state, {}))
    state.local.pop()
    state.objective["t"] = torch.zeros(1)  # an attribute set to a new tensor: the graph reads the old one
    assert "replaces a tensor" in graphs._python_change(before, graphs.structure(state, {}))


def test_a_failed_cuda_capture_leaves_the_current_stream_as_it_found_it(monkeypatch):
    """torch.cuda.graph's __exit__ runs capture_end before it restores the stream; when capture_end
    raises (the H200's "operation failed due to a previous error during capture"), the eager steps
    of the stated fallback must not stay on the capture stream. CUDA's calls stubbed: the order of
    torch's own __exit__ (torch/cuda/graphs.py) is what is modelled."""
    current = ["the caller's stream"]

    class Graph:  # torch.cuda.graph: enters its capture stream; capture_end raises in __exit__
        def __init__(self, cuda_graph, pool=None):
            pass

        def __enter__(self):
            current[0] = "the capture stream"

        def __exit__(self, *exc):
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", Graph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.__setitem__(0, stream))
    with pytest.raises(RuntimeError, match="previous error during capture"):
        graphs.CudaGraph(torch.device("cuda")).capture(lambda: None)
    assert current[0] == "the caller's stream"


_KEPT: list[torch.Tensor] = []


@dataclass(frozen=True)
class KeepsItsGraph(ClientUpdate):
    """A variant whose loss outlives its step (held where the transfer does not look), and with it
    the parameters' AccumulateGrad nodes."""

    def terms(self, local, forward, objective, y, extra):
        _KEPT[:] = [objective(forward.logits, y, **extra)]
        return {OBJECTIVE: _KEPT[0]}


class Keeps(FedAvgFamily):
    def client_fn(self):
        return KeepsItsGraph()


def test_a_step_keeping_its_graph_runs_eagerly_said_and_leaves_no_group_behind(monkeypatch, caplog):
    """Refused before the client's state is copied into a group (each refused client with a
    signature of its own would otherwise leave a copy of its state behind, for the process)."""
    made = []
    new_group = graphs.ClientGraphs._new_group
    monkeypatch.setattr(graphs.ClientGraphs, "_new_group", lambda self: made.append(1) or new_group(self))
    with caplog.at_level("INFO", logger="fedlt"):
        check_graphs(Keeps)  # equal to eager, its fallback stated
    assert any("an autograd graph of an earlier step is still alive" in r.getMessage() for r in caplog.records)
    assert made == []


# -- a cohort's step captured (fedlt.algorithms.cohort_graphs) ------------------------------------
@pytest.mark.parametrize("name", ["fedavg", "fedlogit"])
def test_a_cohort_s_replayed_steps_equal_its_eager_steps_bit_for_bit(name):
    """fedavg: six clients in cohorts of three — two cohorts of one kind train on the same
    canonical stacks in round 1 (each copies its own in), cohorts of 3 and 2 in round 2; fedlogit:
    three clients whose offsets differ, one cohort a round."""
    check_graphs(name, replayed=True, cohort=3, clients=6 if name == "fedavg" else 3)


# FedAvg-family algorithms whose steps all replay under --graphs --cohort 3 on the CPU stand-in: the
# cohort's graphs (a plain offset cross-entropy), or one client's graphs where the cohort refuses
# the algorithm (feddecorr, fedgela, fednh, fednpc); the others train in the eager cohort, said
# (ditto in part: its personal phase's proximal ``correct`` stays eager)
COHORT_REPLAYED = {"ccvr", "creff", "fedavg", "fedavg_ft", "fedbabu", "feddecorr", "fedetf", "fedexp",
                   "fedgela", "fedic", "fedlogit", "fednh", "fednova", "fednpc", "fedper", "fedrep", "lg_fedavg",
                   "local"}


@pytest.mark.slow
@pytest.mark.parametrize("name", FEDAVG_FAMILY)
def test_the_family_s_cohorts_replay_or_say_why(name):
    check_graphs(name, cheap.params(name), replayed=name in COHORT_REPLAYED, cohort=3, clients=6)


def test_a_cohort_whose_clients_need_their_own_python_says_why_and_equals_eager(caplog):
    with caplog.at_level("INFO", logger="fedlt"):
        check_graphs("fedprox", cohort=3)  # its proximal term reads each client's anchor
        check_graphs("scaffold", cohort=3)  # its correct hook edits each client's gradient
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "plain offset cross-entropy only" in said and "ScaffoldUpdate overrides ClientUpdate.correct" in said


def test_a_client_whose_objects_are_built_alike_replays_its_first_step_too():
    """FedAvg's cross-entropy builds nothing in its first call, so once round 1 has captured every
    batch shape, every step of round 2 replays, each client's first included (its momentum from
    zero); the contract holds the result equal to eager (test_the_family_replays_or_says_why)."""
    from fedlt.algorithms.base import ClientData
    from fedlt.algorithms.protocol import ClientStates, LocalRunner
    from fedlt.config import RunConfig
    from fedlt.engine import prepare, train_round
    from fedlt.testing.algorithms import TINY

    config = RunConfig(**dict(TINY, model="mlp", clients=3, participation=1.0, local_epochs=1, batch_size=8,
                              algorithm="fedavg", graphs=True))
    with graphs.default_backend("recorded"):
        prep, states, replayed, steps = prepare(config), ClientStates(), [], []
        for r in range(2):
            clients = [ClientData(cid, prep.data.x_train[idx], prep.data.y_train[idx], prep.counts[cid])
                       for cid, idx in ((c, torch.as_tensor(prep.partition.client_indices[c])) for c in range(3))]
            before = graphs.totals()["replays"]
            train_round(prep.algorithm, prep.ctx, r, clients, states, LocalRunner())
            replayed.append(graphs.totals()["replays"] - before)
            steps.append(sum(-(-len(c) // 8) for c in clients))
    assert graphs.failure(prep.algorithm._work) is None
    assert replayed[0] < steps[0] and replayed[1] == steps[1]



def test_a_cohort_whose_capture_fails_mid_way_continues_eagerly_exactly(monkeypatch, caplog):
    """Every second capture fails after the stand-in ran the step on the canonical stacks (as a
    CUDA capture invalidated late leaves its work undone, so the stacks must be restored): a cohort
    that adopted the stacks and replayed steps meets a shape it cannot capture and continues
    eagerly on those stacks, the next cohort of its kind replays again; equal to eager, said."""
    captures, capture = [], graphs.RecordedGraph.capture

    def every_second_fails(self, run):
        captures.append(run)
        if len(captures) % 2:
            return capture(self, run)
        run()
        raise RuntimeError("capture invalidated")

    monkeypatch.setattr(graphs.RecordedGraph, "capture", every_second_fails)
    with caplog.at_level("INFO", logger="fedlt"):
        check_graphs("fedavg", cohort=3, clients=6)
    assert len(captures) > 2
    assert "capture failed: RuntimeError: capture invalidated" in " ".join(r.getMessage() for r in caplog.records)


class _DoubleHead(torch.nn.Module):
    """A float32 body under a float64 head: the logits' dtype is not the first weights'."""

    def __init__(self, in_chans: int = 1, num_classes: int = 10, image_size: int = 28) -> None:
        super().__init__()
        self.body = torch.nn.Linear(in_chans * image_size * image_size, 16)
        self.head = torch.nn.Linear(16, num_classes).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x.flatten(1))).double())


def test_a_cohort_whose_logits_are_not_in_its_weights_dtype_says_why_and_equals_eager(caplog):
    """The canonical offsets are keyed by the weights' dtype; float64 logits from float32 weights
    made each cohort an offsets table of its own, which the graph of the first cohort of a kind
    read for every later one (fedlogit's round-2 train loss 2.47 off, relative): now refused, said."""
    import fedlt.models

    with fedlt.models.REGISTRY.temporary("double_head", _DoubleHead), caplog.at_level("INFO", logger="fedlt"):
        check_graphs("fedlogit", cohort=3, clients=6, model="double_head")
    assert "the model's logits are not in its weights' dtype" in " ".join(r.getMessage() for r in caplog.records)


def test_a_cuda_warm_up_that_raises_is_waited_for_before_the_state_is_restored(monkeypatch):
    """The warm-up runs on a side stream; one that raises (out of memory) may leave kernels queued
    there, so the current stream waits for it before the saved weights and momentum are copied back
    (else a late warm-up kernel overwrites the restored state). Streams faked: no CUDA here."""
    from contextlib import nullcontext

    waits = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            waits.append((self.name, other.name))

    current = Stream("current")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    backend = graphs.CudaGraph.__new__(graphs.CudaGraph)
    backend.device = torch.device("cuda")

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        backend.warm_up(out_of_memory, 3)
    assert waits == [("side", "current"), ("current", "side")]


def test_a_refused_cohort_shape_is_not_checked_again_and_the_others_still_replay(monkeypatch):
    """A shape whose checked step is refused stays eager for every cohort of its kind (stated
    once), instead of a checked step — and its capture's warm-up — again in every cohort; the
    shapes that were captured go on replaying."""
    from fedlt.algorithms import cohort_graphs

    checked, check = [], cohort_graphs.CohortGraphs._checked_step_then_capture

    def refuse_single_clients(self, ks, group, key):
        checked.append((id(self.canonical), key))
        if len(ks) == 1:  # a lone client's shape: refused as a host synchronisation would be
            self.canonical.refused[key] = "refused for the test"
            return self.cohort.plain_step(ks, self.cohort._index(ks), torch.stack([x for _, x, _ in group]),
                                          torch.stack([y for _, _, y in group]))
        return check(self, ks, group, key)

    monkeypatch.setattr(cohort_graphs.CohortGraphs, "_checked_step_then_capture", refuse_single_clients)
    before = graphs.totals()["replays"]
    check_graphs("fedavg", cohort=3, clients=6)
    assert len(checked) == len(set(checked)) and graphs.totals()["replays"] > before


def test_every_cohort_graph_of_a_work_module_shares_one_cuda_memory_pool(monkeypatch):
    """Up to MAX_GRAPHS cohort graphs, each with a group's activations: one pool for a work module's
    cohort graphs (passed to torch.cuda.graph), not one each (CUDA's calls stubbed)."""
    from fedlt.algorithms import cohort_graphs

    handles, pools = [], []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: handles.append(object()) or handles[-1])
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    module, other = graphs.ModuleGraphs(), graphs.ModuleGraphs()

    def replayer(backend, of):
        made = object.__new__(cohort_graphs.CohortGraphs)
        made.backend, made.module, made.device = backend, of, torch.device("cuda")
        return made

    first, second, elsewhere = replayer("cuda", module), replayer("cuda", module), replayer("cuda", other)
    assert first._pool() is second._pool() is handles[0] and elsewhere._pool() is handles[1]
    assert replayer("recorded", module)._pool() is None
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: pools.append(pool) or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    graphs.make_backend("cuda", torch.device("cuda"), first._pool()).capture(lambda: None)
    assert pools == [handles[0]]


def test_the_stand_in_s_capture_records_the_compiled_forward():
    """CUDA's capture runs the compiled kernels; dynamo skips compiled code under a dispatch mode
    that does not ignore compile internals, so the stand-in's capture recorded the eager forward
    and ``check_graphs(compile=True)`` never replayed a compiled one (review14). The checked step
    runs the eager forward (a new shape compiles in the warm-up after it, not under the checking)."""
    from fedlt.algorithms import compiled

    calls = []

    def spy(gm, inputs):  # a dynamo backend that counts the compiled graph's runs
        def run(*args):
            calls.append(1)
            return gm(*args)
        return run

    model = torch.nn.Linear(4, 3)
    forward = compiled.forward(model, spy, cudagraphs=False)
    x = torch.randn(5, 4)
    forward(x)
    before = len(calls)
    with graphs._Checking(torch.device("cpu")):
        forward(x)
    recorded = graphs.RecordedGraph(torch.device("cpu"))
    out = recorded.capture(lambda: forward(x))
    assert len(calls) == before + 1 and recorded.ops
    x.copy_(torch.randn(5, 4))
    recorded.replay()  # the recorded compiled graph's operators, on the new input
    torch.testing.assert_close(out, model(x).detach(), rtol=0, atol=0)


@pytest.mark.parametrize("cohort", [1, 2])
def test_a_step_our_graphs_never_capture_keeps_inductor_s_own_cuda_graphs(monkeypatch, tmp_path, cohort):
    """``--compile --graphs`` where the steps stay eager (here: no CUDA device) compiles as
    ``--compile`` alone, inductor's CUDA graphs on (on CUDA), not the plain mode that only a step
    captured by ours needs; captured by the stand-in, the plain mode (review14)."""
    from fedlt.algorithms import compiled
    from fedlt.config import RunConfig
    from fedlt.engine import run
    from fedlt.testing.algorithms import TINY

    asked = []

    def spy(original):
        def make(model, backend=compiled.BACKEND, cudagraphs=True):
            asked.append(cudagraphs)
            return original(model, "eager", cudagraphs)  # dynamo's eager backend: nothing generated
        return make

    monkeypatch.setattr(compiled, "forward", spy(compiled.forward))
    monkeypatch.setattr(compiled, "vmapped", spy(compiled.vmapped))
    config = dict(TINY, model="mlp", algorithm="fedavg", rounds=1, clients=2, graphs=True, compile=True, cohort=cohort)
    run(RunConfig(**config, out=tmp_path / "eager"))
    assert asked and all(asked)
    asked.clear()
    with graphs.default_backend("recorded"), compiled.default_backend("aot_eager"):  # the stand-in's pair
        run(RunConfig(**config, out=tmp_path / "captured"))
    assert asked and not any(asked)


def test_a_compile_failing_inside_a_cuda_capture_fails_the_capture_not_the_compile(monkeypatch):
    """A compilation error raised while a CUDA stream captures is the capture's failure (the shape
    then stays eager, said by the graphs), not a reason to run every later step eagerly (review14)."""
    from fedlt.algorithms import compiled

    def broken(gm, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    step = compiled.Compiled(lambda x: x * 2, lambda args: [(args[0], 0)], torch.device("cuda"), broken,
                             cudagraphs=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        step(torch.ones(3))
    assert step.failed is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert torch.equal(step(torch.ones(3)), torch.full((3,), 2.0)) and "not permitted" in step.failed


def test_a_cohort_that_silently_skips_its_graphs_fails_the_contract(monkeypatch):
    """A cohort that trained without its graphs and said nothing fails [replayed], though its
    numbers equal eager's (a cohort the runner refuses states why: tests/test_cohort.py)."""
    from fedlt.algorithms import cohort_graphs

    monkeypatch.setattr(cohort_graphs, "open", lambda cohort: None)
    with pytest.raises(ContractError, match=r"breaks \[replayed\].*no step was captured or replayed"):
        check_graphs("fedavg", cohort=3)


@pytest.mark.parametrize("name, said", [
    ("scaffold", "fedlt: --graphs leaves the cohort's steps eager: ScaffoldUpdate overrides ClientUpdate.correct"),
    ("fedavg", "fedlt: --graphs: the steps replayed by the 'recorded' stand-in on cpu")])
def test_a_cohort_run_with_graphs_says_at_its_start_whether_its_steps_are_captured(name, said, tmp_path, caplog):
    from fedlt.config import RunConfig
    from fedlt.engine import run
    from fedlt.testing.algorithms import TINY

    with caplog.at_level("WARNING", logger="fedlt"), graphs.default_backend("recorded"):
        run(RunConfig(**dict(TINY, model="mlp", algorithm=name, rounds=1, clients=2, participation=1.0, cohort=2,
                             graphs=True), out=tmp_path / "run"))
    lines = [r.getMessage() for r in caplog.records if r.name == "fedlt" and "--graphs" in r.getMessage()]
    assert lines and lines[0].startswith(said), lines

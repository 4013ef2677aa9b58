"""What crosses between the three roles of a round (STYLE.md "Three roles"): the client side, the
server side (a strategy) and the engine that drives them.

    engine ──RoundContext──► strategy ──ClientTask──► client work ──ClientResult──► strategy

An algorithm declares how its clients work by what it defines, and an engine's ``ClientRunner``
runs that wherever the clients are (this process, Flower nodes, ...):

- ``client_work(task) -> ClientResult``: one call per participant per round (the FedAvg family);
  the strategy side asks ``runner.call(algorithm, tasks)``;
- ``open_session(task)``: a split-learning session (``forward() -> Upload``,
  ``backward(grad)``, ``finish() -> ClientResult``) driven in lockstep by the server side through
  ``runner.exchange(algorithm, tasks)``.

A task holds everything a client's work depends on — the round context, the global weights it
starts from, its data, its persistent state, its schedule — so the same task gives the same result
in this process, in another one, or on a Flower node: every field crosses the lossless wire format
(``fedlt.wire``) with no per-field code, and everything random in a client's work draws from
torch's generator seeded from (sampling seed, round, client id) (``client_rng``), whatever the
order in which clients run. Client work gets its own copies of the tensors it receives
(``isolated``): it cannot change the global model, the strategy's state or the engine's store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fedlt import wire
from fedlt.errors import first_line
from fedlt.algorithms.base import ClientData, LocalSchedule, NonFiniteLoss, PendingLoss, deferred_losses, read_back
from fedlt.algorithms.client_states import ClientStates  # noqa: F401  (re-exported: algorithms import it from here)
from fedlt.context import ModelSpec, RoundContext
from fedlt.privacy.upload import UploadPlan, client_upload

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ClientTask:
    """One participant's work order for one round.

    ``weights``: the global weights it starts from (the whole model, or the client part in split
    learning); ``state``: its persistent state from the engine's store (``{}`` on its first
    round); ``objective``: its local loss expression; ``payload``: what else its strategy sends
    (SCAFFOLD's server control variate, ...). ``data`` is the one field that does not travel: a
    node holds its own.
    """

    cid: int
    context: RoundContext
    weights: State
    data: ClientData | None
    state: dict[str, Any]
    schedule: LocalSchedule
    objective: str
    payload: dict[str, Any] = field(default_factory=dict)
    fault: str | None = None  # an injected fault (fedlt.availability's ``scripted``): "raise" or "nan"
    upload: UploadPlan | None = None  # what the client does to its update before sending it (fedlt.privacy.upload)

    @property
    def round_index(self) -> int:
        return self.context.round_index


@dataclass
class ClientResult:
    """What a participant sends back: its new weights, |D_k|, the local steps it took and their
    mean loss where the client computes it (0 when its loss is evaluated on the server, as in
    SCALA), its new persistent state, and ``extras``: what else its strategy reads (SCAFFOLD's
    control-variate change, ...)."""

    cid: int
    weights: State
    num_samples: int
    steps: int = 0
    # inside the local runner's work a PendingLoss until the runner reads the round's (one host
    # synchronisation, fedlt.algorithms.base.deferred_losses); float(...) reads one at once
    train_loss: float | PendingLoss = 0.0
    state: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    packed: dict[str, Any] | None = None  # the update in its wire form, under a task's upload plan (then
    # ``weights`` holds only the entries sent as they are); the server side opens it (fedlt.uploads)


@dataclass
class Upload:
    """What a split-learning client sends the server in one local iteration: its activations (no
    graph), their labels, and — when a loss distils from the global model — the received global
    client part's activations on the same inputs (the server finishes the teacher's forward)."""

    activations: torch.Tensor
    labels: torch.Tensor
    teacher_activations: torch.Tensor | None = None


@dataclass
class ClientFailure:
    """A participant that did not return, in place of its result or upload: its id and why —
    ``unavailable``, ``late`` (past the round's deadline) or ``failed: <first line of its error>``.
    A transport (a runner) reports it; the round's fault policy decides what it does."""

    cid: int
    reason: str


for _cls in (ClientTask, ClientResult, Upload, ClientFailure, RoundContext, ModelSpec, LocalSchedule):
    wire.register(_cls)


class Sessions(Protocol):
    """The round's split-learning sessions, driven together. An entry is None (forward, finish)
    for a participant that has left the round — told to leave (``drop``) or lost (a transport
    that tolerates failures reports a ClientFailure there instead, once). The transports share
    this bookkeeping: :class:`RoundSessions`."""

    def forward(self) -> list[Upload | ClientFailure | None]: ...
    def backward(self, grads: list[torch.Tensor | None]) -> None: ...
    def finish(self) -> list[ClientResult | ClientFailure | None]: ...
    def drop(self, k: int) -> None: ...


class ClientRunner(Protocol):
    """An engine's way of running client work (STYLE.md: the engine drives the two sides). A
    transport that tolerates failures (the round policy's ``on_failure="drop"``) returns a
    ClientFailure in place of a lost participant's result; otherwise a failure raises. The
    transports share one base: :class:`Runner` (and every kind of one-call work goes through its
    ``each``)."""

    def call(self, algorithm: Any, tasks: Sequence[ClientTask]) -> list[ClientResult | ClientFailure]: ...
    def exchange(self, algorithm: Any, tasks: Sequence[ClientTask]) -> Sessions: ...
    # per-client evaluation (fedlt.algorithms.personal): EvalTasks -> ClientScores | ClientFailure,
    # in task order, run where each client's data lives; optional (the evaluator runs a runner
    # without it in this process)
    def evaluate(self, algorithm: Any, tasks: Sequence[Any]) -> list[Any]: ...


# -- randomness and isolation, shared by every engine ------------------------------------------------
def client_seed(sampling_seed: int, round_index: int, cid: int) -> int:
    """The seed of torch's generator during client ``cid``'s work in round ``round_index``."""
    words = np.random.SeedSequence([sampling_seed, round_index, cid, 0xC11E]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def _devices(task: ClientTask) -> list:
    device = task.data.x.device if task.data is not None else torch.device("cpu")
    return [device] if device.type == "cuda" else []


def seed_forked(seed: int, device: torch.device) -> None:
    """``torch.manual_seed(seed)`` for a client whose data is on ``device``. On the CPU only the
    CPU's generator is seeded: torch.manual_seed also queues a seed for every CUDA device, and
    while CUDA is not initialised the queue formats the caller's stack each call — 0.75 ms at a
    stack depth of 10, 2.5 ms at 60, twice a client a round on every CPU run (docs/benchmarks.md);
    the draws are the same. On any other device (CUDA, MPS: their dropout and on-device draws come
    from that device's generator) torch.manual_seed seeds them all, as before."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


@contextmanager
def client_rng(task: ClientTask, state: dict[str, torch.Tensor] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Torch's global generators, for the block, in the client's own stream: seeded from (sampling
    seed, round, cid), or continued from ``state`` (a session between two calls); the yielded dict
    holds the stream's state after the block. The caller's streams are untouched."""
    devices = _devices(task)
    after: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=devices):
        if state is None:
            seed_forked(client_seed(task.context.sampling_seed, task.round_index, task.cid),
                        task.data.x.device if task.data is not None else torch.device("cpu"))
        else:
            torch.set_rng_state(state["cpu"])
            if devices and "cuda" in state:
                torch.cuda.set_rng_state(state["cuda"], devices[0])
        yield after
        after["cpu"] = torch.get_rng_state()
        if devices:
            after["cuda"] = torch.cuda.get_rng_state(devices[0])


def copy_tensors(value: Any) -> Any:
    """``value`` with every tensor in it (nested containers and dataclasses) replaced by a copy."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copy_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_tensors(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: copy_tensors(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    return value


def isolated(task: Any) -> Any:
    """The task (a ClientTask, or another work order with some of these fields) with its own
    copies of what it shares with the server (the global weights, the strategy's payload, the
    store's state, the round context); its data is already its own."""
    names = {f.name for f in dataclasses.fields(task)}
    return dataclasses.replace(task, **{n: copy_tensors(getattr(task, n))
                                        for n in ("context", "weights", "state", "payload") if n in names})


HELD = ("data", "test")  # a task's fields that never travel: a node or worker holds its own


def travelling(task: Any) -> Any:
    """The task as it crosses to a worker process or a Flower node: every field but the data the
    other side holds itself (``data``, and ``test`` where the task has one), which are None."""
    names = {f.name for f in dataclasses.fields(task)}
    return dataclasses.replace(task, **{n: None for n in HELD if n in names})


def failure_reason(exc: BaseException) -> str:
    """How a failed client is recorded: ``failed: <ErrorType>: <first line>`` (as a Flower node's
    error report reads once unwrapped)."""
    return f"failed: {type(exc).__name__}: {first_line(exc)}"


class InjectedFault(RuntimeError):
    """A failure a test scenario asked for (``task.fault``), raised inside the client's work."""


def run_client(algorithm: Any, task: ClientTask) -> ClientResult:
    """A participant's one-call work, as every engine runs it: in the client's own random stream
    (and with its injected fault, if a scenario set one: raise, or return non-finite weights)."""
    if task.fault == "raise":
        raise InjectedFault(f"injected failure of client {task.cid} in round {task.round_index + 1}")
    with client_rng(task):
        result = algorithm.client_work(task)
    return uploaded(task, _with_injected_nan(task, result))


def uploaded(task: ClientTask, result: ClientResult) -> ClientResult:
    """The result as the client sends it: under the task's upload plan, its update Δ = θ − w
    clipped, compressed, noised or masked (fedlt.privacy.upload), the transforms' state kept in
    the client's state under ``"upload"``."""
    if task.upload is None or not task.upload.changes_upload:
        return result
    kept, packed, chain_state = client_upload(
        task.upload, task.weights, result.weights, task.state.get("upload", {}), cid=task.cid,
        participants=task.context.participants, seed=task.context.sampling_seed, round_index=task.round_index,
        num_samples=result.num_samples)
    state = {k: v for k, v in result.state.items() if k != "upload"} | ({"upload": chain_state} if chain_state else {})
    return dataclasses.replace(result, weights=kept, packed=packed, state=state)


def _with_injected_nan(task: ClientTask, result: ClientResult) -> ClientResult:
    """The result with non-finite weights when a scenario asked this client to corrupt its update."""
    if task.fault == "nan":
        result.weights = {k: v.float().fill_(float("nan")).to(v.dtype) if v.is_floating_point() else v
                          for k, v in result.weights.items()}
    return result


# The kinds of one-call client work a runner runs, by name: fn(algorithm, task). "evaluate" is
# installed by fedlt.algorithms.personal (imported with fedlt.algorithms), which this module
# cannot import: its fine-tune runs the FedAvg family's client loop, which imports this module.
CLIENT_CALLS: dict[str, Callable[[Any, Any], Any]] = {"work": run_client}


class SeededSession:
    """A split-learning session whose every call runs in the client's own random stream, carried
    from call to call (and through ``state_dict`` when an engine suspends the session)."""

    def __init__(self, algorithm: Any, task: ClientTask) -> None:
        self.task = task
        with client_rng(task) as after:
            self.session = algorithm.open_session(task)
        self.rng = dict(after)

    def _run(self, method: str, *args: Any) -> Any:
        with client_rng(self.task, self.rng) as after:
            out = getattr(self.session, method)(*args)
        self.rng = dict(after)
        return out

    def forward(self) -> Upload:
        if self.task.fault == "raise":
            raise InjectedFault(f"injected failure of client {self.task.cid} in round {self.task.round_index + 1}")
        return self._run("forward")

    def backward(self, grad: torch.Tensor | None) -> None:
        self._run("backward", grad)

    def finish(self) -> ClientResult:
        return uploaded(self.task, _with_injected_nan(self.task, self._run("finish")))

    def state_dict(self) -> dict[str, Any]:
        return {"session": self.session.state_dict(), "rng": self.rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng = dict(state["rng"])
        with client_rng(self.task, self.rng) as after:
            self.session.load_state_dict(state["session"])
        self.rng = dict(after)


class RoundSessions:
    """The bookkeeping every transport's sessions share (local, worker processes, Flower nodes;
    the round policy's wrapper uses ``gone`` / ``drop`` / ``live``): which participants have left
    the round — told to (``drop``) or lost (``fail``) — and each loss reported once, as a
    ClientFailure in the next output that returns (``report``: a forward's or a finish's). A
    participant that left gets no more calls and is None in every later output.

    A subclass implements ``forward`` / ``backward`` / ``finish`` by calling its live sessions
    (``live()``), ``fail``-ing those it loses, and returning ``report(values)``."""

    def __init__(self, tasks: Sequence[Any]) -> None:
        self.tasks = list(tasks)
        self.gone: set[int] = set()
        self.unreported: dict[int, ClientFailure] = {}

    def drop(self, k: int) -> None:
        self.gone.add(k)

    def live(self) -> list[int]:
        return [k for k in range(len(self.tasks)) if k not in self.gone]

    def fail(self, k: int, reason: str) -> None:
        """Participant ``k`` is lost (its first loss counts): it leaves, to be reported once."""
        if k not in self.gone:
            self.gone.add(k)
            self.unreported[k] = ClientFailure(self.tasks[k].cid, reason)

    def report(self, values: dict[int, Any]) -> list[Any]:
        """The output of one call, in task order: ``values[k]`` for a participant still in the
        round, the ClientFailure of one lost since the last report, None for the others."""
        out = [None if k in self.gone else values.get(k) for k in range(len(self.tasks))]
        for k, failure in self.unreported.items():
            out[k] = failure
        self.unreported = {}
        return out


class Runner:
    """The base of the transports' ClientRunners (this process, worker processes, Flower nodes).

    ``tolerate``: a participant whose work raises (or whose transport loses it) becomes a
    ClientFailure instead of stopping the run (the round policy's ``on_failure="drop"``).

    Every kind of one-call client work goes through ``each(job, algorithm, tasks)``: run
    ``CLIENT_CALLS[job](algorithm, task)`` once per task wherever the transport's clients are,
    results (or ClientFailures) in task order. ``call`` is the ``"work"`` job; another kind of
    one-call work (e.g. a per-client evaluation) registers its client function in CLIENT_CALLS
    and adds a one-line method here (``return self.each("evaluate", algorithm, tasks)``), and
    every transport runs it with no code of its own. ``exchange`` opens the round's sessions."""

    def __init__(self, tolerate: bool = False) -> None:
        self.tolerate = tolerate

    def call(self, algorithm: Any, tasks: Sequence[ClientTask]) -> list[ClientResult | ClientFailure]:
        return self.each("work", algorithm, tasks)

    def each(self, job: str, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def evaluate(self, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
        """Per-client evaluation (fedlt.algorithms.personal): each EvalTask's ClientScores."""
        return self.each("evaluate", algorithm, tasks)

    def exchange(self, algorithm: Any, tasks: Sequence[ClientTask]) -> Sessions:
        raise NotImplementedError

    def guarded(self, cid: int, work: Callable[[], Any]) -> Any:
        """``work()``; under ``tolerate``, an error of it becomes client ``cid``'s ClientFailure."""
        return guarded(self.tolerate, cid, work)


def guarded(tolerate: bool, cid: int, work: Callable[[], Any]) -> Any:
    """``work()``; when ``tolerate``, an error of it is client ``cid``'s ClientFailure (its first
    error line) instead (a worker process runs this too, with its runner's ``tolerate``)."""
    if not tolerate:
        return work()
    try:
        return work()
    except Exception as exc:  # noqa: BLE001  (any failure of client work drops the client)
        return ClientFailure(cid, failure_reason(exc))


class LocalSessions(RoundSessions):
    """The round's sessions in this process, one after another. ``tolerate``: a session whose
    call raises leaves the round, reported once as a ClientFailure (its first error line) in the
    next forward's or finish's output."""

    def __init__(self, algorithm: Any, tasks: Sequence[ClientTask], tolerate: bool = False) -> None:
        super().__init__(tasks)
        self.tolerate = tolerate
        self.sessions = [self._guard(k, lambda t=t: SeededSession(algorithm, isolated(t)))
                         for k, t in enumerate(self.tasks)]

    def _guard(self, k: int, call: Callable[[], Any]) -> Any:
        out = guarded(self.tolerate, self.tasks[k].cid, call)
        if isinstance(out, ClientFailure):
            self.fail(k, out.reason)
            return None
        return out

    def _each(self, method: str, args: list | None = None) -> dict[int, Any]:
        return {k: self._guard(k, lambda s=self.sessions[k], k=k: getattr(s, method)(*(() if args is None else (args[k],))))
                for k in self.live()}

    def forward(self) -> list[Upload | ClientFailure | None]:
        return self.report(self._each("forward"))

    def backward(self, grads: list[torch.Tensor | None]) -> None:
        self._each("backward", grads)  # a failure here is reported by the next call that returns

    def finish(self) -> list[ClientResult | ClientFailure | None]:
        return self.report(self._each("finish"))


class LocalRunner(Runner):
    """The local engine's runner: every participant in this process, one after another, each on
    its own copies of what it received. ``tolerate``: a participant whose work raises becomes a
    ClientFailure (its first error line) instead of stopping the run."""

    def each(self, job: str, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
        """Every task's work, one after another; the loss checks of ``work`` read back together at
        the end (``deferred_losses``: one host synchronisation a round, not one a client), each as
        it would have been read in its client's work: a non-finite loss is that client's failure,
        or (not tolerated) the round's error before any later client's. Another job's work (a
        fine-tuned evaluation) reads its loops' losses itself."""
        work, out, checks = CLIENT_CALLS[job], [], []
        with deferred_losses(defer=job == "work") as made:
            for t in tasks:
                made.clear()
                try:
                    out.append(self.guarded(t.cid, lambda t=t: _checked_first(made, lambda: work(algorithm, isolated(t)))))
                except Exception:  # not tolerated: an earlier client's non-finite loss is the round's error
                    read_losses(out, checks, self.tolerate)
                    raise
                checks.append(list(made))
        return read_losses(out, checks, self.tolerate)

    def exchange(self, algorithm: Any, tasks: Sequence[ClientTask]) -> Sessions:
        return LocalSessions(algorithm, tasks, self.tolerate)


def _checked_first(made: list[PendingLoss], work: Callable[[], Any]) -> Any:
    """``work()``; should it raise, a non-finite loss among the checks it made (``made``) is raised
    in its place: read at once, it would have stopped the client before what raised."""
    try:
        return work()
    except Exception:
        for pending in made:
            float(pending)  # read at once: raises its NonFiniteLoss
        raise


def read_losses(results: list[Any], checks: list[list[PendingLoss]], tolerate: bool) -> list[Any]:
    """``results`` with their clients' loss checks (``checks[k]``: every PendingLoss client k's
    work made, its result's among them or joined from them) read in one host synchronisation: a
    client with a non-finite loss becomes a ClientFailure when failures are tolerated, else its
    NonFiniteLoss is raised (the first such client's); the others' ``train_loss`` become floats."""
    returned = [r.train_loss for r in results if isinstance(r, ClientResult) and isinstance(r.train_loss, PendingLoss)]
    values = list({id(v): v for pending in [*(p for made in checks for p in made), *returned]
                   for v in pending.values}.values())
    if not values:
        return results
    number = dict(zip(map(id, values), read_back(values)))
    out = []
    for result, made in zip(results, checks):
        try:
            for pending in made:
                pending.read([number[id(v)] for v in pending.values])
            if isinstance(result, ClientResult) and isinstance(result.train_loss, PendingLoss):
                loss = result.train_loss
                result = dataclasses.replace(result, train_loss=loss.read([number[id(v)] for v in loss.values]))
        except NonFiniteLoss as exc:
            if not tolerate:
                raise
            result = ClientFailure(result.cid, failure_reason(exc))
        out.append(result)
    return out


def evaluate_with(runner: Any, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
    """Each EvalTask's ClientScores through ``runner``: its ``evaluate``, else its ``each`` (a
    wrapper such as the round policy's), else (a user's own runner) in this process."""
    if hasattr(runner, "evaluate"):
        return runner.evaluate(algorithm, tasks)
    if hasattr(runner, "each"):
        return runner.each("evaluate", algorithm, tasks)
    tolerate = bool(getattr(runner, "tolerate", False))
    return [guarded(tolerate, t.cid, lambda t=t: CLIENT_CALLS["evaluate"](algorithm, isolated(t))) for t in tasks]

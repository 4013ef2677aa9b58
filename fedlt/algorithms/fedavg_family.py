"""The FedAvg family: one client function × one strategy (SPEC §2, §4).

FedAvg, FedProx, FedLogit, FedLC, FedVLS and Fed-GraB differ only in their local objective, so
each is ``FedAvgFamily`` with a different default ``loss`` — no subclass per algorithm. The
client's work is the function ``client_update(task) -> ClientResult``; the server side is a
``Strategy`` (the global model and its aggregator, with the aggregator's state); the round itself
is ``Federated.train_round``, shared by every one-call-per-round algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from dataclasses import is_dataclass
from typing import Any, ClassVar

import torch
from pydantic import ConfigDict, Field, PrivateAttr
from torch import nn
from torch.func import functional_call

import fedlt.augment
from fedlt.algorithms import compiled, graphs, preset
from fedlt.algorithms.base import (AggregatorSpec, ClientData, LocalSchedule, LossExpression, NonFiniteLoss, PendingLoss,
                                   RunContext, backward_precision, build_aggregator, build_objective, channels_last,
                                   client_generator, forward_precision, loss_of, place_model, proportional_batches,
                                   upcast)
from fedlt.algorithms.protocol import ClientResult, ClientRunner, ClientStates, ClientTask, State
from fedlt.context import RoundContext
from fedlt.models import classifier, eval_mode
from fedlt.errors import FedltError
from fedlt.server_steps import classifier_inputs
from fedlt.privacy.dpsgd import PrivateStep, noise_generator, poisson_batches, stateful_terms, steps_per_round
from fedlt.spec import Params


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters, in the order of ``[p for p in model.parameters() if p.requires_grad]``."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


OBJECTIVE = "objective"  # the part of a step's loss that is the task's loss expression


def features_of(model: nn.Module) -> AbstractContextManager[list[torch.Tensor]]:
    """Collects, flattened to B×d, the input of the model's classifier on every forward inside
    the block (also through ``functional_call`` with other weights): the representation h of the
    papers, with no change to the model or to what it computes."""
    return classifier_inputs(classifier(model))


class StepForward:
    """One client's forward of one local step, as a variant's ``ClientUpdate.terms`` reads it:
    ``logits`` (the model on the step's x), ``features`` (the classifier's input h, B×d, when
    the variant asks for it: ``ClientUpdate.features``), ``call(module, *inputs)`` (a submodule
    of ``model`` run with this client's weights: FedRoD's personal head), ``param(module, name)``
    (this client's tensor of a submodule: FedLF's classifier weight) and ``reference(weights)``
    (h of the model with other weights on the same x, in eval mode, no gradient: MOON's
    received and previous models). This one runs ``model`` itself; a cohort gives each of its
    clients the same interface over its slice of the batched forward."""

    def __init__(self, model: nn.Module, x: torch.Tensor, features: bool) -> None:
        self.model, self.x = model, x
        self.features: torch.Tensor | None = None
        if features:
            with features_of(model) as seen:
                self.logits = model(x)
            self.features = seen[0]
        else:
            self.logits = model(x)

    def call(self, module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        return module(*inputs)

    def param(self, module: nn.Module, name: str) -> torch.Tensor:
        return getattr(module, name)

    @torch.no_grad()
    def reference(self, weights: State) -> torch.Tensor:
        with features_of(self.model) as seen, eval_mode(self.model):
            functional_call(self.model, weights, (self.x,))
        return seen[0]


class ClientUpdate:
    """The client's work for one round — local SGD on the objective — as an object whose steps
    a stateful algorithm overrides (SCAFFOLD's gradient correction, SAM's two-pass step, MOON's
    extra term), so every variant shares this one loop.

    Calling it is ``client_update(task, model)``. The hooks, in the order the loop calls them:
    ``build`` (the work module when none is given), ``without_loop`` (a task answered without
    training), ``start`` (the task the loop trains: the
    received one, or with the client's own part in place, as a personalised method keeps it),
    ``frozen_keys`` (parameters kept out of training for the round), ``begin`` (once: what this round's variant needs, returned as ``local``), per step
    ``step_input`` (the input the step's forward runs on), ``backward`` (the loss's named parts
    and their gradients; by default ``parts`` then ``.backward()`` of their sum, and again at
    w + ε when ``ascent`` gives ε: SAM), ``correct`` (edits the gradients before clipping) and
    ``stepped`` (after the optimiser's step, same minibatch), then
    ``end`` (once: the client's new persistent state and the extras the strategy reads), then
    ``upload`` (once: the weights the client sends back for aggregation; its trained weights by
    default, FedDC's θ + h in a drift-decoupling variant). A variant that adds a term to the
    loss adds a named part, so a non-finite step names the part that produced it. Subclasses
    are plain, picklable dataclasses holding their hyper-parameters only: nothing is carried
    between calls. ``generator(task)`` gives the minibatch-order stream (the round's).
    """

    def __call__(self, task: ClientTask, model: nn.Module | None = None) -> ClientResult:
        model = self.build(task) if model is None else model
        answered = self.without_loop(task, model)
        if answered is not None:
            return answered
        with frozen(model, self.frozen_keys(model)):
            return self.loop(self.start(task), model)

    def without_loop(self, task: ClientTask, model: nn.Module) -> ClientResult | None:
        """A task answered without local training (None, the default: train): CCVR's and
        CReFF's statistics-only tasks."""
        return None

    def build(self, task: ClientTask) -> nn.Module:
        """A work module of the round's architecture on the data's device."""
        return place_model(task.context.model.build(), task.data.x.device)

    def start(self, task: ClientTask) -> ClientTask:
        """The task the loop trains: the received one (a personalised variant puts the client's
        own part, from its state, in place of the received one)."""
        return task

    def frozen_keys(self, model: nn.Module) -> Sequence[str]:
        """State-dict keys of the parameters kept out of training this round (none)."""
        return ()

    def loop(self, task: ClientTask, model: nn.Module) -> ClientResult:
        """The local loop on ``model`` from ``task.weights`` (the parameters that train are those
        with ``requires_grad``)."""
        model.load_state_dict(task.weights)
        layout = torch.channels_last if channels_last(model, task.data.x.device) else torch.contiguous_format
        model.train()
        names = trainable_names(model)
        objective = build_objective(task.objective, task.context, task.cid, task.data.class_counts,
                                    [task.weights[n] for n in names], task.state.get("loss"))
        params = [p for p in model.parameters() if p.requires_grad]
        optimiser = task.schedule.optimiser(params)
        generator = self.generator(task)
        augment = fedlt.augment.build(task.schedule.augment)  # once per round; draws from the client's stream
        local = self.begin(task, model, params)
        private = private_step(task, objective)
        forward = self.step_forward(task, model) if private is None else model  # DP-SGD: its own per-sample forward
        step = partial(self.one_step, task.schedule, model, forward, params, private)
        state = graphs.StepState(objective, local, task.weights if objective.needs_teacher else None, self)
        replay = self.step_graphs(task, model, params, step, state, private)
        parts: dict[str, list[torch.Tensor]] = {}  # kept on the device: one host synchronisation per round
        steps = 0
        for x, y in task.data.batches(index_batches(task, generator, private)):
            x = augment(x).contiguous(memory_format=layout) if x.dim() == 4 else augment(x)
            step_parts = replay.step(optimiser, x, y) if replay is not None else step(state, optimiser, x, y)
            for name, value in step_parts.items():
                parts.setdefault(name, []).append(value.detach())
            self.stepped(local, model, x, y, steps)
            steps += 1
        if replay is not None:
            replay.finish(optimiser)
        train_loss = check_parts(parts, steps, task)
        own, extras = self.end(local, task, model, params, steps)
        state = ({"loss": objective.state_dict()} if objective.state_dict() else {}) | own
        weights = self.upload(local, task, model, own)
        return ClientResult(task.cid, weights, len(task.data), steps, train_loss, state, extras=extras)

    def one_step(self, schedule: LocalSchedule, model: nn.Module, forward: Any, params: list[nn.Parameter],
                 private: PrivateStep | None, state: graphs.StepState, optimiser: torch.optim.Optimizer,
                 x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """One local step on the minibatch (x, y) — the loss's parts and their gradients,
        ``correct``, the clip, the optimiser's step — reading the client's objects from ``state``
        only (a captured graph replays it on the objects it was captured with: fedlt.algorithms.graphs)."""
        objective, local, extra = state.objective, state.local, {}
        optimiser.zero_grad(set_to_none=True)
        with forward_precision(schedule.precision, x.device):  # the forward and the loss; backward outside
            if objective.needs_teacher:
                extra["teacher_logits"] = upcast(teacher_logits(model, state.weights, x))
            if objective.needs_params:
                extra["params"] = params
            step_parts = (self.backward(local, forward, params, objective, x, y, extra) if private is None
                          else private.parts(model, params, objective, x, y, extra))
        self.correct(local, params)
        if private is None:  # DP-SGD's per-sample clip bounds the step instead
            schedule.clip_(params)
        optimiser.step()
        # detached: a step's autograd graph must not outlive it — it holds the parameters'
        # AccumulateGrad nodes, made on the stream of this step, and a graph captured while
        # they live is invalidated on CUDA (the H200 run of 2026-11-28, docs/gpu.md)
        return {name: value.detach() for name, value in step_parts.items()}

    def step_graphs(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter], step: Callable,
                    state: graphs.StepState, private: PrivateStep | None) -> graphs.ClientGraphs | None:
        """Under ``--graphs`` (a schedule with a backend) the replayer of this client's steps
        (fedlt.algorithms.graphs), or None: eager steps (the reason noted)."""
        backend = task.schedule.graphs
        if backend is None:
            return None
        reason = self.uncaptured_reason(task, private)
        if reason is None:
            s = task.schedule
            settings = (type(self).__qualname__, tuple(trainable_names(model)), s.lr, s.momentum, s.weight_decay,
                        s.clip, s.precision, model.training)
            replay = graphs.ClientGraphs(backend, model, params, state, step, s.optimiser, settings)
            reason = replay.failed
        if reason is not None:
            graphs.left_eager(model, reason)
            return None
        return replay

    def uncaptured_reason(self, task: ClientTask, private: PrivateStep | None) -> str | None:
        """Why this client's steps under ``--graphs`` are never captured (None: they are, shape by shape)."""
        backend = task.schedule.graphs
        return (graph_reason(type(self)) or graphs.device_reason(backend, task.data.x.device)
                or graphs.compiled_reason(backend, task.schedule.compile)
                or ("DP-SGD's per-sample step (--privacy sample_level) runs eagerly" if private is not None else None)
                or ("--precision bf16: autocast's weight cache cannot be captured (PyTorch's CUDA graphs notes)"
                    if task.schedule.precision != "fp32" else None))

    def step_forward(self, task: ClientTask, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | nn.Module:
        """The module the step's ``parts`` calls: ``model`` itself, or under ``--compile`` (a
        schedule with a backend) its compiled forward where the step is the plain ``model(x)``
        (:func:`step_reason`); every other hook gets ``model``."""
        backend = task.schedule.compile
        if backend is None:
            return model
        reason = step_reason(type(self))
        if reason is not None:
            compiled.left_eager(model, reason)
            return model
        # inductor's own CUDA graphs where ours never capture the step (they cannot nest in ours)
        captured = task.schedule.graphs is not None and self.uncaptured_reason(task, None) is None
        return compiled.forward(model, backend, cudagraphs=not captured)

    def generator(self, task: ClientTask) -> torch.Generator:
        """The minibatch-order stream: the client's round stream; a fine-tune draws from its own."""
        return client_generator(task.context.sampling_seed, task.round_index, task.cid)

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        return None

    features: ClassVar[bool] = False  # whether ``terms`` reads the representation (``StepForward.features``)
    # why a cohort (fedlt.algorithms.cohort) must not batch this loop although it could: its
    # result would not equal the sequential one within the cohort's tolerance
    cohort_refusal: ClassVar[str | None] = None
    # why whole-step graphs (fedlt.algorithms.graphs, --graphs) must not capture this loop's
    # steps although the structural transfer could: state the step reads that it cannot see
    graphs_refusal: ClassVar[str | None] = None

    def step_input(self, local: Any, x: torch.Tensor) -> torch.Tensor:
        """The input the step's forward runs on, drawn in the client's stream: the minibatch x
        (FedYoYo: x and its Cutout view, concatenated); ``terms`` reads the forward on it."""
        return x

    def parts(self, local: Any, model: nn.Module, objective, x: torch.Tensor, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The step's loss as named parts (their sum is minimised): ``terms`` of the model's
        forward on ``step_input(x)``. A variant that adds a term overrides ``terms``, which a
        cohort runs too."""
        return self.terms(local, StepForward(model, self.step_input(local, x), self.features), objective, y, extra)

    def terms(self, local: Any, forward: StepForward, objective, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The step's loss as named parts from its forward: the objective, and what a variant
        adds under a name of its own."""
        return {OBJECTIVE: objective(upcast(forward.logits), y, **extra)}  # bf16 logits: the loss in float32

    def backward(self, local: Any, model: nn.Module, params: list[nn.Parameter], objective, x: torch.Tensor,
                 y: torch.Tensor, extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        parts = self.parts(local, model, objective, x, y, extra)
        with backward_precision(x.device):  # autocast covers the forward only
            sum(parts.values()).backward()
        if type(self).ascent is not ClientUpdate.ascent:
            self._again_at_ascent(local, model, params, objective, x, y, extra)
        return parts

    def ascent(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """A sharpness-aware step's perturbation ε of the weights from the step's gradients g,
        each stacked over clients (K × the parameter's shape: K = 1 in a client's own loop, a
        cohort's clients in one; a norm is a client's own row's, never the cohort's): the step's
        gradient is taken again at w + ε and applied at w. None (the default): one pass."""
        return None

    def _again_at_ascent(self, local: Any, model: nn.Module, params: list[nn.Parameter], objective,
                         x: torch.Tensor, y: torch.Tensor, extra: dict[str, Any]) -> None:
        """The gradients replaced by those of the step's loss at w + ε (``ascent``), then the
        weights moved back by −ε (a parameter the loss did not reach has g = 0)."""
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).unsqueeze(0) for p in params]
        with torch.no_grad():
            ascent = [e.squeeze(0) for e in self.ascent(grads)]
            for p, e in zip(params, ascent):
                p.add_(e)
        for p in params:
            p.grad = None
        again = self.parts(local, model, objective, x, y, extra)
        with backward_precision(x.device):
            sum(again.values()).backward()
        with torch.no_grad():
            for p, e in zip(params, ascent):
                p.sub_(e)

    def correct(self, local: Any, params: list[nn.Parameter]) -> None:
        pass

    def stepped(self, local: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        """After the optimiser's step ``step`` (from 0), on the same minibatch: a second model's
        step that reads the one just taken (APFL's personal model and its α)."""

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the client's own persistent state, beside its loss terms'; extras for the strategy)."""
        return {}, {}

    def upload(self, local: Any, task: ClientTask, model: nn.Module, state: dict[str, Any]) -> State:
        """What the client sends back as its model — the strategy aggregates it as the client's
        weights: by default copies of the trained weights (every key of the model's state dict).
        ``state`` is the client's new own state from ``end``. Return every key of the state dict,
        in its dtypes, as new tensors: ``model`` is a work module the next client overwrites."""
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def step_reason(update: type[ClientUpdate]) -> str | None:
    """Why a variant's step cannot have its forward compiled (None: it can): its step reads more
    than the logits of ``model(x)`` — ``terms``, ``parts`` or ``backward`` overridden (a submodule
    through ``StepForward.call``, a parameter, a reference forward, a two-pass step) or the
    representation (``features``: a module hook the compiled graph does not carry)."""
    for hook in ("terms", "parts", "backward", "ascent"):
        if getattr(update, hook) is not getattr(ClientUpdate, hook):
            return f"{update.__name__} overrides ClientUpdate.{hook} (its step reads more than model(x): a " \
                   "submodule, a parameter, the representation or a second forward)"
    if update.features:
        return f"{update.__name__} reads the representation (a hook on the classifier's input)"
    return None


def compile_reason(algorithm: Any) -> str | None:
    """Why ``--compile`` leaves ``algorithm``'s local steps eager (None: their forward is compiled)."""
    fn = algorithm.client_fn() if isinstance(algorithm, Federated) else None
    if fn is None:
        return f"{type(algorithm).__name__} is not one call per client per round (split learning runs sessions)"
    return _update_reason(fn, type(algorithm).__name__) or compiled.unavailable()


def compile_notice(algorithm: Any, device: torch.device) -> str:
    """The line a run with ``--compile`` starts with: why its steps stay eager, or what compiling
    them costs on ``device`` (on the CPU it was measured level with eager: docs/benchmarks.md)."""
    reason = compile_reason(algorithm)
    if reason is not None:
        return f"fedlt: --compile leaves the local steps eager: {reason}"
    if device.type == "cpu":
        return ("fedlt: --compile on the CPU: the first round compiles (tens of seconds) and the rounds after it "
                "were measured level with eager, not faster (PFLlib's CNN, docs/benchmarks.md); it is meant for CUDA")
    return f"fedlt: --compile: the local steps' forward and backward compiled on {device} (the first round compiles)"


def _update_reason(update: Any, owner: str, own_reason: Callable[[type], str | None] = None) -> str | None:
    """``own_reason`` (``step_reason`` by default) of a ``ClientUpdate`` variant and of the variants
    it runs inside (a wrapper's fields: FedLoGe's head around its update, FedReLa's relabelling
    around that)."""
    own_reason = own_reason or step_reason
    update = _PLAIN if update is client_update else update
    inner = [v for v in getattr(update, "__dict__", {}).values()
             if isinstance(v, ClientUpdate) or v is client_update or (is_dataclass(v) and not isinstance(v, type))]
    if not isinstance(update, ClientUpdate) and not inner:
        return f"{owner}'s client work is not a ClientUpdate loop"
    own = own_reason(type(update)) if isinstance(update, ClientUpdate) else None
    return own or next((r for r in (_update_reason(v, owner, own_reason) for v in inner) if r is not None), None)


def compile_fallback(algorithm: Any) -> str | None:
    """Why a run with ``--compile`` trained eagerly (``summary.json``'s ``compile_fallback``): the
    algorithm's reason (:func:`compile_reason`), else the first compilation failure of its work
    module in this process (None: every step this process ran was compiled)."""
    return compile_reason(algorithm) or compiled.failure(getattr(algorithm, "_work", None))


def graph_reason(update: type[ClientUpdate]) -> str | None:
    """Why a variant's steps cannot be captured as whole-step graphs (None: they can): work
    between steps in Python (``stepped``: APFL's second model), a two-pass step that moves the
    weights in Python (``ascent``: SAM), or the variant's own stated refusal (``graphs_refusal``)."""
    if update.stepped is not ClientUpdate.stepped:
        return f"{update.__name__} overrides ClientUpdate.stepped (a second model's step after each step, in Python)"
    if update.ascent is not ClientUpdate.ascent:
        return f"{update.__name__} overrides ClientUpdate.ascent (a two-pass step: the weights moved by ε and back)"
    return update.graphs_refusal


def graphs_reason(algorithm: Any) -> str | None:
    """Why ``--graphs`` leaves ``algorithm``'s local steps eager (None: they are captured)."""
    fn = algorithm.client_fn() if isinstance(algorithm, Federated) else None
    if fn is None:
        return f"{type(algorithm).__name__} is not one call per client per round (split learning runs sessions)"
    return _update_reason(fn, type(algorithm).__name__, graph_reason)


def graphs_notice(algorithm: Any, device: torch.device, cohort_reason: str | None = None) -> str:
    """The line a run with ``--graphs`` starts with: why its steps stay eager, or what it captures
    (``cohort_reason``: why a cohort's steps stay eager although one client's would not)."""
    reason = graphs_reason(algorithm) or graphs.device_reason(graphs.BACKEND, device)
    if reason is not None:
        return f"fedlt: --graphs leaves the local steps eager: {reason}"
    if cohort_reason is not None:
        return f"fedlt: --graphs leaves the cohort's steps eager: {cohort_reason}"
    if graphs.BACKEND != "cuda":
        return (f"fedlt: --graphs: the steps replayed by the {graphs.BACKEND!r} stand-in on {device} "
                "(for tests: no faster)")
    return (f"fedlt: --graphs: the local steps replayed as CUDA graphs on {device}, one per batch shape (with "
            "--cohort, per group size and batch shape); the first rounds capture them")


def graphs_fallback(algorithm: Any, device: torch.device) -> str | None:
    """Why a run with ``--graphs`` trained eagerly (``summary.json``'s ``graphs_fallback``): the
    algorithm's or the device's reason, else the first refusal met in this process (None: the
    steps were replayed, but for the eager ones a new batch shape or a loss term's first call needs)."""
    return (graphs_reason(algorithm) or graphs.device_reason(graphs.BACKEND, device)
            or graphs.failure(getattr(algorithm, "_work", None)))


def private_step(task: ClientTask, objective: Any) -> PrivateStep | None:
    """DP-SGD's step when the task's plan asks for sample-level DP (fedlt.privacy.dpsgd), else None;
    the objective then runs its reference (not fused) form, which ``vmap`` takes."""
    dp = task.upload.sample_level if task.upload is not None else None
    if dp is None:
        return None
    stateful = stateful_terms(objective)
    if stateful:
        raise FedltError(f"privacy: sample_level (DP-SGD) cannot run loss {task.objective!r}: its term(s) "
                         f"{', '.join(stateful)} keep state across steps, which per-sample gradients would move once "
                         "per sample")
    objective.fused = "off"
    # on the model's device (``build``'s, also for images decoded from files): a host generator
    # cannot draw the noise of a CUDA parameter
    generator = noise_generator(task.context.sampling_seed, task.round_index, task.cid, task.data.x.device)
    return PrivateStep(float(dp[0]), float(dp[1]), min(task.schedule.batch, len(task.data)), generator)


def index_batches(task: ClientTask, generator: torch.Generator, private: PrivateStep | None):
    """The round's minibatch indices: the schedule's, or under DP-SGD as many Poisson-sampled ones."""
    s, n = task.schedule, len(task.data)
    if private is None:
        return s.batches(n, generator, task.data.index_device)
    return poisson_batches(n, private.batch, steps_per_round(s.batch, n, s.iters, s.epochs, s.drop_last), generator,
                           task.data.index_device)


def client_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each client's L2 norm over all entries of ``tensors``, each stacked over clients (K × the
    parameter's shape, a scalar parameter's K): the K norms, one per row."""
    rows = [torch.linalg.vector_norm(t.reshape(len(t), -1), dim=1) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(rows, 1), dim=1)


def check_parts(parts: dict[str, list[torch.Tensor]], steps: int, task: ClientTask) -> float | PendingLoss:
    """The round's mean loss (the parts summed per step), after one finiteness check of every
    part at every step (one host synchronisation, or none here inside ``deferred_losses``: its
    runner reads it with the round's other clients'); a non-finite one is named: the objective by
    its expression, a variant's term by its own name."""
    if not steps or not parts:  # no step, or DP-SGD's Poisson batches all empty
        return 0.0
    names = list(parts)
    table = torch.stack([torch.stack(parts[n]) for n in names])  # parts × steps
    # the read may wait for the round's last client: it keeps the table and two names, not the
    # task (its copies of the global weights, payload and state: a model more per client)
    cid, objective = task.cid, task.objective

    def read(numbers: list[float]) -> float:
        all_finite, mean = numbers
        if not all_finite:
            part, step = (int(i) for i in (~torch.isfinite(table)).nonzero()[0])
            what = f"loss {objective!r}" if names[part] == OBJECTIVE else names[part]
            raise NonFiniteLoss(f"non-finite loss ({table[part, step].item()}) at local step {step + 1}, "
                                f"client {cid}, {what}")
        return mean

    return loss_of([torch.isfinite(table).all(), table.double().sum(0).mean()], read)


class AroundUpdate:
    """A client update run around another (``update``: a ``ClientUpdate`` or another
    ``AroundUpdate``): ``before`` gives the task it trains from the received one (``model``: the
    work module, or None), ``after`` its result from the inner update's (FedReLa: the client's
    labels, then kept in its state). A cohort (fedlt.algorithms.cohort) runs ``before`` and
    ``after`` client by client and trains the inner update's tasks together."""

    update: Any

    def before(self, task: ClientTask, model: nn.Module | None) -> ClientTask:
        return task

    def after(self, task: ClientTask, result: ClientResult) -> ClientResult:
        """``task``: what ``before`` gave."""
        return result

    def __call__(self, task: ClientTask, model: nn.Module | None = None) -> ClientResult:
        prepared = self.before(task, model)
        return self.after(prepared, self.update(prepared, model))


class PhasedUpdate(ClientUpdate):
    """A round of several local loops, one after another on the same work module and in the
    client's one random stream (FedRep: the head, then the body; Ditto: w, then v).
    ``phase(index, task, done)`` gives phase ``index``'s loop and task from the round's task and
    the results of the phases before it (None: the round is over), ``join`` the round's result
    from the phases'. ``loops()`` names every loop a phase may run, and phase ``index`` runs the
    same loop for every client: so a cohort (fedlt.algorithms.cohort) runs each phase for all of
    its clients together."""

    def loops(self) -> Sequence[ClientUpdate]:
        raise NotImplementedError

    def phase(self, index: int, task: ClientTask,
              done: Sequence[ClientResult]) -> tuple[ClientUpdate, ClientTask] | None:
        raise NotImplementedError

    def join(self, task: ClientTask, done: Sequence[ClientResult]) -> ClientResult:
        raise NotImplementedError

    def __call__(self, task: ClientTask, model: nn.Module | None = None) -> ClientResult:
        model = self.build(task) if model is None else model
        done: list[ClientResult] = []
        while (step := self.phase(len(done), task, done)) is not None:
            update, phase_task = step
            done.append(update(phase_task, model))
        return self.join(task, done)


@contextmanager
def frozen(model: nn.Module, keys: Sequence[str]) -> Iterator[None]:
    """The parameters named by ``keys`` out of training for the block (``requires_grad`` off, so
    the loop's optimiser never sees them), then restored."""
    params = dict(model.named_parameters())
    saved = {k: params[k].requires_grad for k in keys if k in params}
    for k in saved:
        params[k].requires_grad_(False)
    try:
        yield
    finally:
        for k, flag in saved.items():
            params[k].requires_grad_(flag)


_PLAIN = ClientUpdate()


def client_update(task: ClientTask, model: nn.Module | None = None) -> ClientResult:
    """Train the received weights on the client's data for one round (SPEC §2's local objective).

    ``model`` is a reusable work module of the right architecture (its weights are overwritten
    with ``task.weights``; it keeps nothing between calls); without it one is built from the
    round's model spec. The teacher of terms such as FedVLS's vacant-class distillation is the
    received global model itself, run through the same module with ``task.weights`` in eval mode.
    Returns the trained weights, the client's new persistent state (its loss terms' state, e.g.
    SGB's collector and PID; ``{}`` when it has none) and its metrics.
    """
    return _PLAIN(task, model)


@torch.no_grad()
def teacher_logits(model: nn.Module, weights: State, x: torch.Tensor) -> torch.Tensor:
    with eval_mode(model):  # the global model as evaluated: no BatchNorm statistics move
        return functional_call(model, weights, (x,))


class Strategy:
    """The server side of a one-call-per-round algorithm: the global model and an aggregator.

    ``configure`` turns the round's participants into tasks (SCALA-style B_k from all
    participants' sizes when training by iterations); ``aggregate`` folds the results into the
    new global model. Its ``state_dict`` (global model and aggregator state — server momentum,
    Adam moments) is what the engine checkpoints for the server side.
    """

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str) -> None:
        self.model, self.aggregator, self.ctx, self.objective = model, aggregator, ctx, objective
        self.trainable = trainable_names(model)

    def configure(self, round: RoundContext, participants: Sequence[ClientData],
                  states: ClientStates) -> list[ClientTask]:
        weights = self.model.state_dict()  # unchanged until aggregation; each client works on its own copy
        batches = proportional_batches([len(c) for c in participants], self.ctx.server_batch)
        payload = self.payload(round)
        return [ClientTask(c.cid, round, weights, c, states.get(c.cid), self.ctx.schedule(b), self.objective, payload)
                for c, b in zip(participants, batches)]

    def payload(self, round: RoundContext) -> dict[str, Any]:
        """What every participant receives besides the weights (SCAFFOLD's server control variate)."""
        return {}

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        new = self.aggregator(self.model.state_dict(), [(r.weights, float(r.num_samples)) for r in results],
                              self.trainable)
        self.model.load_state_dict(new)
        return {"train_loss": sum(r.train_loss for r in results) / len(results)}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "aggregator": self.aggregator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.aggregator.load_state_dict(state.get("aggregator", {}))


ClientFn = Callable[[ClientTask, "nn.Module | None"], ClientResult]


class Federated(Params):
    """A one-call-per-round algorithm: ``client_fn()`` (a function of its task) × ``make_strategy``.

    ``train_round`` is the whole round: configure → run every task through the engine's runner
    (``runner.call``: in this process, or on Flower nodes) → store the clients' states →
    aggregate. ``client_work`` is the client side, the same on every engine.
    """

    model_config = ConfigDict(extra="forbid")
    _ctx: RunContext = PrivateAttr()
    _strategy: Strategy = PrivateAttr()
    _work: nn.Module = PrivateAttr()

    def client_fn(self) -> ClientFn:
        """The client's work; algorithms with another local update (SCAFFOLD, ...) return theirs."""
        return client_update

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        raise NotImplementedError

    def setup(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self._strategy = self.make_strategy(place_model(ctx.build_model(), ctx.device), ctx)
        self._work = place_model(ctx.build_model(), ctx.device)

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def client_work(self, task: ClientTask) -> ClientResult:
        """One participant's round, on this process's reusable work module."""
        return self.client_fn()(task, self._work)

    def train_round(self, round: RoundContext, participants: list[ClientData], states: ClientStates,
                    runner: ClientRunner) -> dict[str, float]:
        results = runner.call(self, self._strategy.configure(round, participants, states))
        for r in results:
            states.put(r.cid, r.state)
        return self._strategy.aggregate(round, results)

    def global_model(self) -> nn.Module:
        return self._strategy.model

    def state_dict(self) -> dict[str, Any]:
        return self._strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._strategy.load_state_dict(state)


class FedAvgFamily(Federated):
    """Local objective ``loss`` (a loss expression, SPEC §2) aggregated by ``aggregator`` (SPEC §4)."""

    loss: LossExpression = Field("ce", description="the local objective, a loss expression (SPEC §2)")
    aggregator: AggregatorSpec = Field("fedavg", description="the server's aggregator spec (SPEC §4)")

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return Strategy(model, build_aggregator(self.aggregator), ctx, self.loss)

    def reads_each_update(self) -> str | None:
        """Why the server needs each participant's own weights, not only their weighted mean (None:
        the mean is enough) — under secure aggregation or central DP it gets the mean alone."""
        return getattr(build_aggregator(self.aggregator), "reads_each_update", None)


preset("fedavg", FedAvgFamily, "FedAvg: cross-entropy locally, |D_k|-weighted averaging.", loss="ce")
preset("fedprox", FedAvgFamily, "FedProx: CE + (mu/2)·‖w − w_global‖².", loss="ce + fedprox(mu=0.01)")
preset("fedlogit", FedAvgFamily, "FedLogit: logit-adjusted CE with the client's prior.", loss="logit_adjust(tau=1)")
preset("fedlc", FedAvgFamily, "FedLC: CE on logits calibrated by −tau·n_c^(−1/4).", loss="fedlc(tau=0.5)")
preset("fedvls", FedAvgFamily, "FedVLS: logit adjustment + vacant-class distillation + logit suppression.",
       loss="fedvls(lam=0.1)")
preset("fedgrab", FedAvgFamily, "Fed-GraB: SGB re-weighting gated by the DPA prior of the received classifier.",
       loss="fedgrab")

__all__ = ["client_update", "ClientUpdate", "PhasedUpdate", "StepForward", "features_of", "frozen", "Strategy", "Federated", "FedAvgFamily", "NonFiniteLoss",
           "trainable_names"]

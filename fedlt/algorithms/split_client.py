"""The client side of split learning as a session (SPEC §3): ``forward() -> Upload``,
``backward(activation_grad)``, ``finish() -> ClientResult``.

A session owns one participant's replica of the client part for one round — its weights, its
optimiser and its minibatch stream — and nothing else; what it needs arrives in its ClientTask,
and what the server needs leaves in its uploads. The local engine calls these methods directly;
the Flower engine turns each call into a message.

Client sessions are registered components (``REGISTRY``, entry-point group
``fedlt.split_clients``), chosen by spec in a split algorithm's ``client`` parameter. The
registered object is a *kind* of session: ``open(task, module)`` starts one participant's
session, ``client_side(client, ctx)`` is the module clients train (the client part, or it plus an
auxiliary head), ``trained_by_server`` says whether the server sends activation gradients back,
and ``keeps_part`` whether each client keeps its own part between rounds (SplitFed V3) instead of
receiving the averaged one.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import fedlt.augment
import fedlt.losses
from fedlt.algorithms.base import (ClientData, LocalSchedule, RunContext, build_objective, client_generator,
                                   forward_precision, raise_first_non_finite, upcast)
from fedlt.algorithms.protocol import ClientResult, ClientTask, State, Upload
from fedlt.models import eval_mode
from fedlt.registry import Registry


def client_objective(task: ClientTask, anchors: State):
    """Client k's loss for this round, built once, its persistent state restored: its prior from
    its class counts, its weight terms (FedProx) anchored at ``anchors`` (its own round-start
    weights), Fed-GraB's DPA prior from the round's global classifier."""
    return build_objective(task.objective, task.context, task.cid, task.data.class_counts, list(anchors.values()),
                           task.state.get("loss"))


def side_state(objective, weight_space: bool) -> dict[str, Any]:
    """The state of the objective's terms that run on one side: the weight-space terms (on the
    client, where the weights are) or the others (where the logits are); the two halves together
    are the objective's whole state."""
    labels = {label for label, (w, t) in zip(objective.labels, objective.terms)
              if bool(w != 0 and t.needs_params) == weight_space}
    return {k: v for k, v in objective.state_dict().items() if k.partition(".")[0] in labels}


def split_terms(objective) -> tuple[Any, Any]:
    """(logit-space part, weight-space part) of a composite objective; either may be None. The
    logit part runs where the logits are (the server in SCALA), the weight part where the
    weights are (the client)."""
    logit = [(w, t) for w, t in objective.terms if w != 0 and not t.needs_params]
    weight = [(w, t) for w, t in objective.terms if w != 0 and t.needs_params]
    return (fedlt.losses.Composite(logit) if logit else None, fedlt.losses.Composite(weight) if weight else None)


class Replica:
    """One side's weights copied for one round (a participant's client part, or a server copy in
    SplitFed V1/V3): parameters as leaf tensors run through the shared module with
    ``functional_call``, so no module is copied; each replica has its own optimiser."""

    def __init__(self, module: nn.Module, start: State, schedule: LocalSchedule) -> None:
        self.module = module
        param_names = {name for name, _ in module.named_parameters()}
        self.params = {n: t.detach().clone().requires_grad_(True) for n, t in start.items() if n in param_names}
        self.buffers = {n: t.detach().clone() for n, t in start.items() if n not in param_names}
        self.schedule = schedule
        self.optimiser = schedule.optimiser(list(self.params.values()))

    def __call__(self, x: torch.Tensor):
        """The replica's forward; under ``precision="bf16"`` autocast inside, its outputs (what
        crosses to the other side, and the logits a loss reads) float32."""
        with forward_precision(self.schedule.precision, x.device):
            out = functional_call(self.module, {**self.params, **self.buffers}, (x,))
        if self.schedule.precision == "fp32":
            return out
        return tuple(upcast(o) for o in out) if isinstance(out, tuple) else upcast(out)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.params.values())

    def step(self, output: torch.Tensor, output_grad: torch.Tensor | None = None, extra: torch.Tensor | None = None) -> None:
        """Backpropagate ``output`` (a loss, or activations with the gradient the server sent)
        and ``extra`` (a weight-space loss such as FedProx's, if any), clip, and step."""
        self.optimiser.zero_grad(set_to_none=True)
        output.backward(output_grad)
        if extra is not None:
            extra.backward()
        self.schedule.clip_(self.parameters())
        self.optimiser.step()

    def apply(self, grads: list[torch.Tensor]) -> None:
        """Step with gradients computed elsewhere (in parameter order)."""
        for p, g in zip(self.parameters(), grads):
            p.grad = g
        self.schedule.clip_(self.parameters())
        self.optimiser.step()
        self.optimiser.zero_grad(set_to_none=True)

    def state(self) -> State:
        return {**{n: t.detach() for n, t in self.params.items()}, **self.buffers}

    def load(self, weights: State, optimiser: dict[str, Any]) -> None:
        """Continue from a suspended replica's weights and optimiser state (momentum buffers)."""
        with torch.no_grad():
            for n, t in {**self.params, **self.buffers}.items():
                t.copy_(weights[n])
        self.optimiser.load_state_dict(optimiser)


def skip(batches, drawn: int) -> None:
    """Advance a batch stream past the ``drawn`` batches a suspended session had taken."""
    for _ in range(drawn):
        next(batches)


class BatchStream:
    """A session's minibatches, one per ``next``: ``(idx, x, y)`` from the client's stream of
    index batches (its own generator's order), read through the client data (from files: decoded
    ahead by the loader workers, which start at the first ``next``). ``skip(n)`` before that
    passes over the batches a suspended session had drawn, without reading them."""

    def __init__(self, data: ClientData, index_batches: Iterator[torch.Tensor]) -> None:
        self.data, self.index_batches = data, index_batches
        self.drawn: collections.deque = collections.deque()  # handed to the reader, not yet returned
        self.stream: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _noted(self) -> Iterator[torch.Tensor]:
        for idx in self.index_batches:
            self.drawn.append(idx)
            yield idx

    def skip(self, n: int) -> None:
        skip(self.index_batches, n)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.stream is None:
            self.stream = self.data.batches(self._noted())
        x, y = next(self.stream)
        return self.drawn.popleft(), x, y

    def close(self) -> None:
        self.stream = None  # a loader's worker processes end with it


class ClientWithHead(nn.Module):
    """SFL-LocalLoss's client side: the client layers plus an auxiliary linear head on the flattened
    activations, trained with the client's local loss; the server sends no gradient back."""

    def __init__(self, client: nn.Module, activation_numel: int, num_classes: int) -> None:
        super().__init__()
        self.client = client
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(activation_numel, num_classes))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        activations = self.client(x)
        return activations, self.head(activations)


class ActivationClient:
    """SCALA / SplitFed: forward a minibatch, receive the gradient of the client's loss w.r.t. the
    activations (computed by the server from its logits), backpropagate it, step.

    The replica starts from the client's own kept part when its state holds one (SplitFed V3),
    else from the received global client part. Weight-space terms of the client's loss (FedProx)
    are added here, anchored at that start."""

    def __init__(self, task: ClientTask, module: nn.Module) -> None:
        self.task, self.module = task, module
        start = task.state.get("client_model", task.weights)
        self.replica = Replica(module, start, task.schedule)
        self.keeps_part = "client_model" in task.state
        self.objective = client_objective(task, {n: start[n] for n in self.replica.params})
        self.teacher = bool(task.payload.get("send_teacher")) or self.objective.needs_teacher
        _, self.weight_terms = split_terms(self.objective)
        self.batches = BatchStream(task.data, task.schedule.batches(
            len(task.data), client_generator(task.context.sampling_seed, task.round_index, task.cid),
            task.data.index_device))
        self.augment = fedlt.augment.build(task.schedule.augment)  # once per round
        self.pending: torch.Tensor | None = None
        self.pending_idx: torch.Tensor | None = None
        self.pending_x: torch.Tensor | None = None  # an augmented batch cannot be recomputed from its indices
        self.drawn = 0

    def forward(self) -> Upload:
        idx, x, y = next(self.batches)
        self.drawn += 1
        x = self.augment(x)
        self.pending, self.pending_idx = self.replica(x), idx
        self.pending_x = x if self.augment else None
        teacher = None
        if self.teacher:
            with torch.no_grad(), eval_mode(self.module):  # the received global client part, as evaluated
                teacher = functional_call(self.module, self.task.weights, (x,))
        return Upload(self.pending.detach(), y, teacher)

    def backward(self, activation_grad: torch.Tensor | None) -> None:
        extra = None
        if self.weight_terms is not None:
            extra = self.weight_terms(None, None, params=self.replica.parameters())
        self.replica.step(self.pending, activation_grad, extra)
        self.pending = self.pending_idx = self.pending_x = None

    def state_dict(self) -> dict[str, Any]:
        """The session between two calls, for an engine that cannot keep it alive (Flower keeps it
        in the node's context between messages): the replica and its optimiser, how many batches
        were drawn, and the pending forward's batch (a graph does not serialise: it is recomputed)."""
        return {"replica": self.replica.state(), "optimiser": self.replica.optimiser.state_dict(),
                "drawn": self.drawn, "pending_idx": self.pending_idx, "pending_x": self.pending_x,
                "loss": self.objective.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a suspended session: the same weights, momentum and batch stream; a pending
        forward is run again on the same batch (same output, BatchNorm statistics not moved twice)."""
        self.replica.load(state["replica"], state["optimiser"])
        self.batches.skip(state["drawn"])
        self.drawn, self.pending_idx = state["drawn"], state["pending_idx"]
        if state["loss"]:
            self.objective.load_state_dict(state["loss"])
        if self.pending_idx is not None:
            moved = {n: b.clone() for n, b in self.replica.buffers.items()}
            self.pending_x = state.get("pending_x")
            self.pending = self.replica(self.task.data.take(self.pending_idx)[0] if self.pending_x is None
                                        else self.pending_x)
            with torch.no_grad():
                for n, b in self.replica.buffers.items():
                    b.copy_(moved[n])

    def finish(self) -> ClientResult:
        self.batches.close()
        weights = self.replica.state()
        state = {"client_model": weights} if self.keeps_part else {}  # the replica is discarded; V3 keeps it
        loss_state = side_state(self.objective, weight_space=True)  # the server returns the logit terms' state
        if loss_state:
            state["loss"] = loss_state
        return ClientResult(self.task.cid, weights, len(self.task.data), self.drawn, state=state)


class LocalLossClient:
    """SFL-LocalLoss: the client trains its layers plus an auxiliary head with its own loss at
    every forward and uploads its activations; no gradient comes back."""

    def __init__(self, task: ClientTask, module: nn.Module) -> None:
        self.task = task
        self.replica = Replica(module, task.weights, task.schedule)
        self.objective = client_objective(task, {n: task.weights[n] for n in self.replica.params})
        self.batches = BatchStream(task.data, task.schedule.batches(
            len(task.data), client_generator(task.context.sampling_seed, task.round_index, task.cid),
            task.data.index_device))
        self.augment = fedlt.augment.build(task.schedule.augment)  # once per round
        self.losses: list[torch.Tensor] = []
        self.drawn = 0

    def forward(self) -> Upload:
        _, x, y = next(self.batches)
        self.drawn += 1
        x = self.augment(x)
        activations, aux_logits = self.replica(x)
        extra: dict[str, Any] = {}
        if self.objective.needs_params:
            extra["params"] = self.replica.parameters()
        loss = self.objective(aux_logits, y, **extra)
        self.replica.step(loss)
        self.losses.append(loss.detach())
        teacher = None
        if self.task.payload.get("send_teacher"):  # for a server loss that distils: the received client layers
            layers = self.replica.module.client
            weights = {k.removeprefix("client."): v for k, v in self.task.weights.items() if k.startswith("client.")}
            with torch.no_grad(), eval_mode(layers):
                teacher = functional_call(layers, weights, (x,))
        return Upload(activations.detach(), y, teacher)

    def backward(self, activation_grad: torch.Tensor | None) -> None:
        """Nothing comes back from the server."""

    def state_dict(self) -> dict[str, Any]:
        """The session between two calls (see ActivationClient.state_dict), with its loss state."""
        return {"replica": self.replica.state(), "optimiser": self.replica.optimiser.state_dict(),
                "drawn": self.drawn, "loss": self.objective.state_dict(), "losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.replica.load(state["replica"], state["optimiser"])
        self.batches.skip(state["drawn"])
        self.drawn, self.losses = state["drawn"], list(state["losses"])
        if state["loss"]:
            self.objective.load_state_dict(state["loss"])

    def finish(self) -> ClientResult:
        self.batches.close()
        losses = torch.stack(self.losses)
        raise_first_non_finite(losses, f"client {self.task.cid}, client loss {self.task.objective!r}", "local iteration")
        state = {"loss": self.objective.state_dict()} if self.objective.state_dict() else {}
        return ClientResult(self.task.cid, self.replica.state(), len(self.task.data), self.drawn,
                            float(losses.double().mean()), state)


# -- the registered kinds of session ------------------------------------------------------------------
def _session_kind_check(obj: Any) -> str | None:
    missing = [m for m in ("open", "client_side") if not callable(getattr(obj, m, None))]
    missing += [a for a in ("trained_by_server", "keeps_part") if not hasattr(obj, a)]
    return f"{type(obj).__name__} lacks {', '.join(missing)} (see fedlt.algorithms.split_client)" if missing else None


REGISTRY: Registry = Registry("split_client", product=_session_kind_check)


class Activation:
    """SCALA / SplitFed: clients upload activations and get the gradient of their loss w.r.t.
    them back from the server. ``keep_part``: each client keeps its own client part between
    rounds (SplitFed V3; a newcomer starts from the initial part) instead of receiving the
    average; the average is then the global model's client part, for evaluation only.

    Args:
        keep_part: each client keeps its own client part between rounds (SplitFed V3).
    """

    trained_by_server = True

    def __init__(self, keep_part: bool = False) -> None:
        if not isinstance(keep_part, bool):
            raise TypeError(f"keep_part must be true or false, got {keep_part!r}")
        self.keeps_part = keep_part

    def client_side(self, client: nn.Module, ctx: RunContext) -> nn.Module:
        return client

    def open(self, task: ClientTask, module: nn.Module) -> ActivationClient:
        return ActivationClient(task, module)


class LocalLoss:
    """SFL-LocalLoss: clients train their layers through an auxiliary linear head with their own
    loss and upload activations; the server sends no gradient back."""

    trained_by_server = False
    keeps_part = False

    def client_side(self, client: nn.Module, ctx: RunContext) -> nn.Module:
        with torch.no_grad(), eval_mode(client):  # a probe must not move BatchNorm statistics
            numel = client(torch.zeros(1, *ctx.input_shape, device=ctx.device))[0].numel()
        return ClientWithHead(client, numel, ctx.num_classes).to(ctx.device)

    def open(self, task: ClientTask, module: nn.Module) -> LocalLossClient:
        return LocalLossClient(task, module)


REGISTRY.register("activation")(Activation)
REGISTRY.register("local_loss")(LocalLoss)

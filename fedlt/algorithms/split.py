"""Split federated learning (SPEC §3) as a composition: a client session × a server side × a
strategy for the client parts; SCALA is the default.

Each round the strategy hands every participant a task (the global client part, its B_k, its
persistent state); for T local iterations every session forwards a minibatch, the server side
turns the uploads into activation gradients, and every session backpropagates its own; then the
sessions' client parts are aggregated by |D_k| (or by a server optimiser) while the server part
stays one model with a run-long optimiser (or, SplitFed V1/V3, copies averaged by the server side).

| algorithm | client session | server side | client parts |
|---|---|---|---|
| scala | ActivationClient | ConcatServer | averaged |
| splitfed_v1 | ActivationClient | CopiesServer | averaged |
| splitfed_v2 | ActivationClient | SequentialServer | averaged |
| splitfed_v3 | ActivationClient | CopiesServer | kept per client (client state) |
| sfl_localloss | LocalLossClient | SequentialServer | averaged |
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
from torch import nn

from fedlt.algorithms import preset
from fedlt.algorithms.base import (AggregatorSpec, ClientData, LossExpression, RunContext, build_aggregator,
                                   proportional_batches)
from fedlt.algorithms.protocol import ClientResult, ClientStates, ClientTask
from fedlt.algorithms.split_client import (ActivationClient, ClientWithHead, LocalLossClient, Upload,
                                           client_objective)
from fedlt.algorithms.split_server import SERVER_SIDES, ServerSide
from fedlt.errors import FedltError
from fedlt.models import classifier, eval_mode, split


class Sessions(Protocol):
    """The round's participants, driven together: the local engine calls sessions in this
    process; the Flower engine sends one message per participant per call."""

    def forward(self) -> list[Upload]: ...
    def backward(self, grads: list[torch.Tensor | None]) -> None: ...
    def finish(self) -> list[ClientResult]: ...


class LocalSessions:
    def __init__(self, session: Callable[[ClientTask, nn.Module], Any], tasks: Sequence[ClientTask],
                 module: nn.Module) -> None:
        self.sessions = [session(t, module) for t in tasks]

    def forward(self) -> list[Upload]:
        return [s.forward() for s in self.sessions]

    def backward(self, grads: list[torch.Tensor | None]) -> None:
        for s, g in zip(self.sessions, grads):
            s.backward(g)

    def finish(self) -> list[ClientResult]:
        return [s.finish() for s in self.sessions]


class SplitStrategy:
    """The server side's bookkeeping for the client parts: tasks out, results in.

    ``configure`` sends every participant the global client part, its B_k (SPEC §3, from all
    participants' sizes) and the global classifier (Fed-GraB's DPA prior); with ``keep_parts``
    (SplitFed V3) a newcomer's state starts from the initial client part. ``aggregate`` folds
    the returned client parts into the global one with the aggregator (a server optimiser acts
    on the client part only; the server part has its own optimiser, SPEC §4)."""

    def __init__(self, model: nn.Module, client_side: nn.Module, server: ServerSide, aggregator, ctx: RunContext,
                 objective: str, keep_parts: bool) -> None:
        self.model, self.client_side, self.server, self.aggregator = model, client_side, server, aggregator
        self.ctx, self.objective = ctx, objective
        self.trainable = [n for n, p in client_side.named_parameters() if p.requires_grad]
        self.initial = {n: t.detach().clone() for n, t in client_side.state_dict().items()} if keep_parts else None
        self.send_teacher = False  # clients upload the teacher's activations (a loss on either side distils)

    def classifier_weight(self) -> torch.Tensor | None:
        try:
            return classifier(self.model).weight.detach().clone()
        except FedltError:  # objectives that don't read the classifier still run on such models
            return None

    def configure(self, round_index: int, participants: Sequence[ClientData], states: ClientStates) -> list[ClientTask]:
        ctx = self.ctx
        weights = self.client_side.state_dict()  # unchanged until aggregate: replicas copy it
        payload = {"classifier_weight": self.classifier_weight(), "send_teacher": self.send_teacher,
                   "global_counts": ctx.global_counts}
        batches = proportional_batches([len(c) for c in participants], ctx.server_batch)
        tasks = []
        for c, b in zip(participants, batches):
            state = states.get(c.cid)
            if self.initial is not None and "client_model" not in state:
                state = {**state, "client_model": self.initial}  # V3: a newcomer's own part is the initial one
            tasks.append(ClientTask(c.cid, round_index, weights, c, state, ctx.schedule(b), self.objective,
                                    ctx.sampling_seed, ctx.num_classes, ctx.model, ctx.fused, payload))
        return tasks

    def aggregate(self, round_index: int, results: Sequence[ClientResult]) -> None:
        # V3 keeps every client's own part; the global client part is then their average, used for
        # evaluation only and never sent back
        self.client_side.load_state_dict(self.aggregator(
            self.client_side.state_dict(), [(r.weights, float(r.num_samples)) for r in results], self.trainable))

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "client_side": self.client_side.state_dict(),
                "server_side": self.server.state_dict(), "aggregator": self.aggregator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a copy: torch's optimiser keeps the given momentum tensors, which must not stay shared
        # with the state's source (another live algorithm, not only a checkpoint file)
        state = copy.deepcopy(state)
        self.model.load_state_dict(state["model"])
        self.client_side.load_state_dict(state["client_side"])
        self.server.load_state_dict(state["server_side"])
        self.aggregator.load_state_dict(state.get("aggregator", {}))


class SplitLearning(BaseModel):
    """Split FL; the defaults are SCALA (SPEC §3). The other algorithms are other parts:

    - ``server_mode``: the server side — ``concat`` (SCALA: ONE forward of all participants'
      activations per iteration), ``sequential`` (SplitFed V2: each client's batch in turn),
      ``copies`` (SplitFed V1/V3: a server copy per participant, averaged by |D_k|).
    - ``average_clients``: client parts averaged by |D_k| (True) or kept per client in the
      client's persistent state (V3).
    - ``local_loss``: the client session trains through an auxiliary head with ``client_loss``
      and gets no gradient from the server (SFL-LocalLoss).
    - ``client_loss`` / ``server_loss``: loss expressions (SPEC §2). A client's logit-space terms
      run on the server's logits with the client's prior p_k; its weight-space terms (FedProx) on
      the client, anchored at its own round-start weights. The server's loss takes the label
      counts of the batch it sees (``server_prior="batch"``) or of the round's participants
      pooled (``"participants"``). Teacher terms (FedVLS) get the round's global model in eval
      mode; a stateful term (SGB) keeps its state per client and one state for the server side.
    - ``aggregator``: of the client parts (a server optimiser such as ``fedadam`` acts there).
    """

    model_config = ConfigDict(extra="forbid")
    client_loss: LossExpression = Field("logit_adjust", description="the clients' loss expression (SPEC §2)")
    server_loss: LossExpression = Field("logit_adjust", description="the server's loss expression (SPEC §2)")
    server_prior: Literal["batch", "participants"] = Field(
        "batch", description="the server loss's label counts: the batch it sees, or the round's participants pooled")
    server_mode: Literal["concat", "sequential", "copies"] = Field(
        "concat", description="the server side: one forward of all activations, each client's batch in turn, "
                              "or a server copy per participant")
    average_clients: bool = Field(True, description="average the client parts (else each client keeps its own)")
    local_loss: bool = Field(False, description="clients train through an auxiliary head, with no gradient "
                                                "from the server")
    aggregator: AggregatorSpec = Field("fedavg", description="aggregator of the client parts (SPEC §4)")

    _ctx: RunContext = PrivateAttr()
    _strategy: SplitStrategy = PrivateAttr()
    _session: Any = PrivateAttr()

    def setup(self, ctx: RunContext) -> None:
        if ctx.local_epochs is not None:
            raise FedltError("local_epochs: split algorithms train T = local_iters iterations per round in lockstep "
                             "(SPEC §3); epoch-based local training is for the FedAvg family")
        self._ctx = ctx
        model = ctx.build_model().to(ctx.device)
        client, server = split(model, ctx.split)
        client_side = client
        if self.local_loss:
            with torch.no_grad(), eval_mode(client):  # a probe must not move BatchNorm statistics
                numel = client(torch.zeros(1, *ctx.input_shape, device=ctx.device))[0].numel()
            client_side = ClientWithHead(client, numel, ctx.num_classes).to(ctx.device)
        self._session = LocalLossClient if self.local_loss else ActivationClient
        server_side = SERVER_SIDES[self.server_mode](server, ctx, self.server_loss, self.server_prior,
                                                     clients_send_gradients=not self.local_loss)
        self._strategy = SplitStrategy(model, client_side, server_side, build_aggregator(self.aggregator), ctx,
                                       self.client_loss, keep_parts=not self.average_clients)
        self._check_objectives(ctx)

    def _check_objectives(self, ctx: RunContext) -> None:
        """Build both sides' objectives once now, so a term that cannot work on this model (e.g.
        fedgrab without a classifier) fails before the run writes anything."""
        placeholder = torch.ones(ctx.num_classes, dtype=torch.int64, device=ctx.device)
        probe = ClientData(0, torch.empty(1), torch.empty(1), placeholder)  # one (empty) sample
        task, = self._strategy.configure(0, [probe], ClientStates())
        objective = client_objective(task, task.weights)
        if self.local_loss and objective.needs_teacher:
            raise FedltError(f"client_loss {self.client_loss!r} distils from the global model, which an "
                             "SFL-LocalLoss client does not hold (it has no server part)")
        server = self._strategy.server
        server.participants_counts, server.start, server.classifier_weight = placeholder, \
            server.module.state_dict(), task.payload["classifier_weight"]
        needs_teacher = server.server_objective(placeholder).needs_teacher or objective.needs_teacher
        self._strategy.send_teacher = needs_teacher

    @property
    def strategy(self) -> SplitStrategy:
        return self._strategy

    def open_sessions(self, tasks: Sequence[ClientTask]) -> Sessions:
        return LocalSessions(self._session, tasks, self._strategy.client_side)

    def train_round(self, round_index: int, participants: list[ClientData], states: ClientStates,
                    open_sessions: Callable[[Sequence[ClientTask]], Sessions] | None = None) -> dict[str, float]:
        tasks = self._strategy.configure(round_index, participants, states)
        sessions = (open_sessions or self.open_sessions)(tasks)
        server = self._strategy.server
        server.begin_round(tasks)
        for _ in range(self._ctx.local_iters):
            sessions.backward(server.step(sessions.forward()))
        results = sessions.finish()
        loss_states, metrics = server.end_round()
        for r in results:
            if loss_states.get(r.cid):  # client losses evaluated on the server (SCALA) keep their state there
                r.state = {**r.state, "loss": loss_states[r.cid]}
            states.put(r.cid, r.state)
        self._strategy.aggregate(round_index, results)
        return metrics

    def global_model(self) -> nn.Module:
        return self._strategy.model

    def state_dict(self) -> dict[str, Any]:
        return self._strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._strategy.load_state_dict(state)


SPLITFED = {"client_loss": "ce", "server_loss": "ce"}  # SplitFed's one CE loss on both sides

preset("scala", SplitLearning, "SCALA: concatenated activations, logit adjustment with P_s (server) and p_k (clients).")
preset("splitfed_v1", SplitLearning, "SplitFed V1: a server copy per client, server copies and client parts averaged.",
       server_mode="copies", **SPLITFED)
preset("splitfed_v2", SplitLearning,
       "SplitFed V2: one server updated by each client's batch in turn; client parts averaged.",
       server_mode="sequential", **SPLITFED)
preset("splitfed_v3", SplitLearning, "SplitFed V3: client parts kept per client, server copies averaged.",
       server_mode="copies", average_clients=False, **SPLITFED)
preset("sfl_localloss", SplitLearning,
       "SFL-LocalLoss: clients train with a local auxiliary head; no gradient from the server.",
       server_mode="sequential", local_loss=True, **SPLITFED)

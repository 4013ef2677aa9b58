"""Split federated learning (SPEC §3) as a composition: a client session × a server side × a
strategy for the client parts; SCALA is the default.

Each round the strategy hands every participant a task (the global client part, its B_k, its
persistent state); for T local iterations every session forwards a minibatch, the server side
turns the uploads into activation gradients, and every session backpropagates its own; then the
sessions' client parts are aggregated by |D_k| (or by a server optimiser) while the server part
stays one model with a run-long optimiser (or, SplitFed V1/V3, copies averaged by the server side).
Client sessions and server sides are registered components chosen by spec (``client``,
``server``), so a plugin's own server side composes with every session and loss.

| algorithm | ``client`` (session) | ``server`` (server side) | client parts |
|---|---|---|---|
| scala | activation | concat | averaged |
| splitfed_v1 | activation | copies | averaged |
| splitfed_v2 | activation | sequential | averaged |
| splitfed_v3 | activation(keep_part=True) | copies | kept per client (client state) |
| sfl_localloss | local_loss | sequential | averaged |
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field, PrivateAttr
from torch import nn

from fedlt.algorithms import preset, split_client, split_server
from fedlt.algorithms.base import (AggregatorSpec, ClientData, LossExpression, RunContext, build_aggregator,
                                   from_spec, proportional_batches, spec_of)
from fedlt.algorithms.protocol import ClientResult, ClientRunner, ClientStates, ClientTask
from fedlt.algorithms.split_client import client_objective
from fedlt.algorithms.split_server import ServerSide
from fedlt.context import RoundContext
from fedlt.errors import FedltError
from fedlt.models import classifier, split
from fedlt.spec import Params


SessionSpec = spec_of(split_client.REGISTRY, "client session")
ServerSpec = spec_of(split_server.REGISTRY, "server side")


class SplitStrategy:
    """The server side's bookkeeping for the client parts: tasks out, results in.

    ``configure`` sends every participant the global client part and its B_k (SPEC §3, from all
    participants' sizes); the round context carries the global classifier (Fed-GraB's DPA
    prior); with ``keep_parts`` (SplitFed V3) a newcomer's state starts from the initial client
    part. ``aggregate`` folds the returned client parts into the global one with the aggregator
    (a server optimiser acts on the client part only; the server part has its own optimiser,
    SPEC §4)."""

    def __init__(self, model: nn.Module, client_side: nn.Module, server: ServerSide, aggregator, ctx: RunContext,
                 objective: str, keep_parts: bool) -> None:
        self.model, self.client_side, self.server, self.aggregator = model, client_side, server, aggregator
        self.ctx, self.objective = ctx, objective
        self.trainable = [n for n, p in client_side.named_parameters() if p.requires_grad]
        self.initial = {n: t.detach().clone() for n, t in client_side.state_dict().items()} if keep_parts else None
        self.send_teacher = False  # clients upload the teacher's activations (a loss on either side distils)

    def configure(self, round: RoundContext, participants: Sequence[ClientData],
                  states: ClientStates) -> list[ClientTask]:
        ctx = self.ctx
        weights = self.client_side.state_dict()  # unchanged until aggregate: replicas copy it
        payload = {"send_teacher": self.send_teacher}
        batches = proportional_batches([len(c) for c in participants], ctx.server_batch)
        tasks = []
        for c, b in zip(participants, batches):
            state = states.get(c.cid)
            if self.initial is not None and "client_model" not in state:
                state = {**state, "client_model": self.initial}  # V3: a newcomer's own part is the initial one
            tasks.append(ClientTask(c.cid, round, weights, c, state, ctx.schedule(b), self.objective, payload))
        return tasks

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> None:
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


class SplitLearning(Params):
    """Split FL; the defaults are SCALA (SPEC §3). The other algorithms are other parts:

    - ``client``: the client session (spec) — ``activation`` (clients get the gradient of their
      loss w.r.t. their activations from the server; ``activation(keep_part=True)``: each keeps
      its own client part, SplitFed V3) or ``local_loss`` (an auxiliary head and the client's own
      loss, no gradient from the server: SFL-LocalLoss); a plugin may add its own.
    - ``server``: the server side (spec) — ``concat`` (SCALA: ONE forward of all participants'
      activations per iteration), ``sequential`` (SplitFed V2: each client's batch in turn),
      ``copies`` (SplitFed V1/V3: a server copy per participant, averaged by |D_k|); a plugin
      may add its own.
    - ``client_loss`` / ``server_loss``: loss expressions (SPEC §2). A client's logit-space terms
      run on the server's logits with the client's prior p_k; its weight-space terms (FedProx) on
      the client, anchored at its own round-start weights. The server's loss takes the label
      counts of the batch it sees (``server_prior="batch"``) or of the round's participants
      pooled (``"participants"``). Teacher terms (FedVLS) get the round's global model in eval
      mode; a stateful term keeps its state per client (wherever it runs) and one state for the
      server side.
    - ``aggregator``: of the client parts (a server optimiser such as ``fedadam`` acts there).
    """

    model_config = ConfigDict(extra="forbid")
    client: SessionSpec = Field("activation", description="the client session (spec): activation, "
                                "activation(keep_part=True) for SplitFed V3, local_loss, or a plugin's")
    server: ServerSpec = Field("concat", description="the server side (spec): concat (SCALA), sequential "
                               "(SplitFed V2), copies (SplitFed V1/V3), or a plugin's")
    client_loss: LossExpression = Field("logit_adjust", description="the clients' loss expression (SPEC §2)")
    server_loss: LossExpression = Field("logit_adjust", description="the server's loss expression (SPEC §2)")
    server_prior: Literal["batch", "participants"] = Field(
        "batch", description="the server loss's label counts: the batch it sees, or the round's participants pooled")
    aggregator: AggregatorSpec = Field("fedavg", description="how the client parts are aggregated (spec; a server "
                                       "optimiser such as fedadam acts on the client part)")

    _ctx: RunContext = PrivateAttr()
    _strategy: SplitStrategy = PrivateAttr()
    _sessions: Any = PrivateAttr()

    def setup(self, ctx: RunContext) -> None:
        if ctx.local_epochs is not None:
            raise FedltError("local_epochs: split algorithms train T = local_iters iterations per round in lockstep "
                             "(SPEC §3); epoch-based local training is for the FedAvg family")
        self._ctx = ctx
        model = ctx.build_model().to(ctx.device)
        client, server_part = split(model, ctx.split)
        self._sessions = from_spec(split_client.REGISTRY, self.client)
        server: ServerSide = from_spec(split_server.REGISTRY, self.server)
        server.bind(server_part, ctx, self.server_loss, self.server_prior,
                    clients_send_gradients=self._sessions.trained_by_server)
        self._strategy = SplitStrategy(model, self._sessions.client_side(client, ctx), server,
                                       build_aggregator(self.aggregator), ctx, self.client_loss,
                                       keep_parts=self._sessions.keeps_part)
        self._check_objectives(ctx)

    def _check_objectives(self, ctx: RunContext) -> None:
        """Build both sides' objectives once now, so a term that cannot work on this model (e.g.
        fedgrab without a classifier) fails before the run writes anything."""
        placeholder = torch.ones(ctx.num_classes, dtype=torch.int64, device=ctx.device)
        probe = ClientData(0, torch.empty(1), torch.empty(1), placeholder)  # one (empty) sample
        round = ctx.round(0, [probe], classifier_of(self._strategy.model))
        task, = self._strategy.configure(round, [probe], ClientStates())
        objective = client_objective(task, task.weights)
        if not self._sessions.trained_by_server and objective.needs_teacher:
            raise FedltError(f"client_loss {self.client_loss!r} distils from the global model, which a client "
                             f"session {self.client!r} does not hold (it has no server part)")
        server = self._strategy.server
        server.begin_round(round, [task])  # the server side's own set-up for a round, on the probe
        needs_teacher = server.server_objective(placeholder).needs_teacher or objective.needs_teacher
        self._strategy.send_teacher = needs_teacher

    @property
    def strategy(self) -> SplitStrategy:
        return self._strategy

    def open_session(self, task: ClientTask):
        """One participant's session for the round, on this process's client-side module."""
        return self._sessions.open(task, self._strategy.client_side)

    def train_round(self, round: RoundContext, participants: list[ClientData], states: ClientStates,
                    runner: ClientRunner) -> dict[str, float]:
        tasks = self._strategy.configure(round, participants, states)
        sessions = runner.exchange(self, tasks)
        server = self._strategy.server
        server.begin_round(round, tasks)
        for _ in range(self._ctx.local_iters):
            sessions.backward(server.step(sessions.forward()))
        results = sessions.finish()
        loss_states, metrics = server.end_round()
        for r in results:
            # a client's loss runs on both sides (logit terms where the logits are, weight terms on
            # the client): its state is the two halves together
            server_half = loss_states.get(r.cid, {})
            loss = {**r.state.get("loss", {}), **server_half}
            r.state = {k: v for k, v in r.state.items() if k != "loss"} | ({"loss": loss} if loss else {})
            states.put(r.cid, r.state)
        self._strategy.aggregate(round, results)
        return metrics

    def global_model(self) -> nn.Module:
        return self._strategy.model

    def state_dict(self) -> dict[str, Any]:
        return self._strategy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._strategy.load_state_dict(state)


def classifier_of(model: nn.Module) -> torch.Tensor | None:
    """The model's classifier weight (a copy), or None for a model without ``get_classifier``."""
    try:
        return classifier(model).weight.detach().clone()
    except FedltError:
        return None


SPLITFED = {"client_loss": "ce", "server_loss": "ce"}  # SplitFed's one CE loss on both sides

preset("scala", SplitLearning, "SCALA: concatenated activations, logit adjustment with P_s (server) and p_k (clients).")
preset("splitfed_v1", SplitLearning, "SplitFed V1: a server copy per client, server copies and client parts averaged.",
       server="copies", **SPLITFED)
preset("splitfed_v2", SplitLearning,
       "SplitFed V2: one server updated by each client's batch in turn; client parts averaged.",
       server="sequential", **SPLITFED)
preset("splitfed_v3", SplitLearning, "SplitFed V3: client parts kept per client, server copies averaged.",
       client={"name": "activation", "keep_part": True}, server="copies", **SPLITFED)
preset("sfl_localloss", SplitLearning,
       "SFL-LocalLoss: clients train with a local auxiliary head; no gradient from the server.",
       client="local_loss", server="sequential", **SPLITFED)

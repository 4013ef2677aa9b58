"""ONE engine for split federated learning (SPEC §3); SCALA is its default configuration.

The model is cut into a client part and a server part that share the global model's parameters.
Each round, every participant trains a replica of the client part (parameters held as plain
tensors and run with ``torch.func.functional_call``, so no module is copied), in lockstep for T
local iterations. In SCALA's iteration the server concatenates all activations, forwards ONCE,
and from those same logits derives both its own loss (prior of the concatenated batch) and every
client's loss (the client's prior, mean over its own rows); both gradients are taken at the
server weights before this iteration's server step. The client replicas are then averaged by
|D_k|; the server model is one model with a persistent optimiser, never averaged.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, PrivateAttr
from torch import nn
from torch.func import functional_call

import fedlt.aggregators
import fedlt.losses
from fedlt.algorithms import preset
from fedlt.algorithms.base import (AggregatorName, ClientData, LocalSchedule, LossExpression, RunContext,
                                   client_generator, objective_seed, objective_value, proportional_batches)
from fedlt.errors import FedltError
from fedlt.models import classifier, eval_mode, split

State = dict[str, torch.Tensor]


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
        return functional_call(self.module, {**self.params, **self.buffers}, (x,))

    def parameters(self) -> list[torch.Tensor]:
        return list(self.params.values())

    def step(self, output: torch.Tensor, output_grad: torch.Tensor | None = None,
             param_grads: list[torch.Tensor] | None = None) -> None:
        """Backpropagate ``output`` (a loss, or activations with the gradient the server sent),
        add ``param_grads`` (from weight-space terms such as fedprox, if any), and step."""
        self.optimiser.zero_grad(set_to_none=True)
        output.backward(output_grad)
        for p, g in zip(self.parameters(), param_grads or []):
            p.grad = g if p.grad is None else p.grad + g
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


class PersistentServer:
    """The one server model of SCALA / SplitFed V2, trained in place; its optimiser (and momentum)
    lives for the whole run. Same calls as a ``Replica``."""

    def __init__(self, module: nn.Module, optimiser: torch.optim.Optimizer, schedule: LocalSchedule) -> None:
        self.module, self.optimiser, self.schedule = module, optimiser, schedule

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    apply = Replica.apply


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


class SplitLearning(BaseModel):
    """Split FL engine; the defaults are SCALA (SPEC §3). The other algorithms are options:

    - ``server_mode``: ``concat`` (SCALA: one server, ONE forward of all participants'
      activations per iteration), ``sequential`` (SplitFed V2: one server updated by each
      client's batch in turn), ``copies`` (SplitFed V1/V3: a server copy per participant,
      copies averaged by |D_k| at the end of the round).
    - ``average_clients``: client parts averaged by |D_k| (True) or kept per client (V3).
    - ``local_loss``: clients train through an auxiliary head with ``client_loss`` and get no
      gradient from the server (SFL-LocalLoss).
    - ``client_loss`` / ``server_loss``: loss expressions (SPEC §2). The client side is built with
      the client's class counts p_k; the server side with the label counts of the batch it sees
      (``server_prior="batch"``) or of the round's participants pooled (``"participants"``).
      Both gradients come from the same server logits at the pre-step server weights. Either side
      takes any term: teacher terms (FedVLS) get the round's global model in eval mode, weight
      terms (FedProx) that side's round-start weights, and a stateful term (Fed-GraB's SGB) keeps
      its state per client on the client side and one state for the server side.
    """

    model_config = ConfigDict(extra="forbid")
    client_loss: LossExpression = "logit_adjust"
    server_loss: LossExpression = "logit_adjust"
    server_prior: Literal["batch", "participants"] = "batch"
    server_mode: Literal["concat", "sequential", "copies"] = "concat"
    average_clients: bool = True
    local_loss: bool = False
    aggregator: AggregatorName = "fedavg"

    _ctx: RunContext = PrivateAttr()
    _model: nn.Module = PrivateAttr()
    _client: nn.Module = PrivateAttr()  # the client part of the global model
    _client_side: nn.Module = PrivateAttr()  # what a participant trains: _client, or _client + head
    _server: nn.Module = PrivateAttr()
    _server_optimiser: torch.optim.Optimizer = PrivateAttr()
    _client_states: dict[int, dict[str, Any]] = PrivateAttr(default_factory=dict)
    _server_loss_state: dict[str, Any] = PrivateAttr(default_factory=dict)
    _initial_client: State | None = PrivateAttr(None)  # V3: where a client's first round starts

    def setup(self, ctx: RunContext) -> None:
        if ctx.local_epochs is not None:
            raise FedltError("local_epochs: split algorithms train T = local_iters iterations per round in lockstep "
                             "(SPEC §3); epoch-based local training is for the FedAvg family")
        self._ctx = ctx
        self._model = ctx.build_model().to(ctx.device)
        self._client, self._server = split(self._model, ctx.split)
        self._client_side = self._client
        if self.local_loss:
            with torch.no_grad(), eval_mode(self._client):  # a probe must not move BatchNorm statistics
                numel = self._client(torch.zeros(1, *ctx.input_shape, device=ctx.device))[0].numel()
            self._client_side = ClientWithHead(self._client, numel, ctx.num_classes).to(ctx.device)
        self._server_optimiser = ctx.schedule(ctx.server_batch).optimiser(list(self._server.parameters()))
        if not self.average_clients:
            self._initial_client = {n: t.detach().clone() for n, t in self._client_side.state_dict().items()}
        # build both sides' objectives once now, so a term that cannot work on this model (e.g.
        # fedgrab without a classifier) fails before the run writes anything
        placeholder = torch.ones(ctx.num_classes, dtype=torch.int64, device=ctx.device)
        probe = ClientData(0, torch.empty(0), torch.empty(0), placeholder)
        self._client_objective(probe, self._client_side.state_dict(), self._head_weight())
        self._server_objective(placeholder, self._server.state_dict(), self._head_weight())

    # -- one round ------------------------------------------------------------------------------
    def train_round(self, round_index: int, clients: list[ClientData]) -> dict[str, float]:
        ctx = self._ctx
        start = self._client_side.state_dict()  # unchanged until _finish_round; replicas copy it
        server_start = {n: t.detach().clone() for n, t in self._server.state_dict().items()}
        batches = proportional_batches([len(c) for c in clients], ctx.server_batch)
        head_weight = self._head_weight()  # the received global classifier (Fed-GraB's DPA prior)
        replicas = [Replica(self._client_side, self._client_start(c, start), ctx.schedule(b))
                    for c, b in zip(clients, batches)]
        if self.server_mode == "copies":
            servers = [Replica(self._server, server_start, ctx.schedule(b)) for b in batches]
        else:
            servers = [PersistentServer(self._server, self._server_optimiser, ctx.schedule(ctx.server_batch))]
        streams = [ctx.schedule(b).batches(len(c), client_generator(ctx.sampling_seed, round_index, c.cid))
                   for c, b in zip(clients, batches)]
        objectives = [self._client_objective(c, start, head_weight) for c in clients]
        participants_counts = torch.stack([c.class_counts for c in clients]).sum(0)

        def server_objective(labels: torch.Tensor):
            prior = torch.bincount(labels, minlength=ctx.num_classes) if self.server_prior == "batch" \
                else participants_counts
            return self._server_objective(prior, server_start, head_weight)

        teacher = self._teacher(start, server_start)  # evaluated only for terms that need it
        # which clients' activations each server forward takes, in order
        groups = [list(range(len(clients)))] if self.server_mode == "concat" else [[k] for k in range(len(clients))]
        server_losses = []
        for step in range(ctx.local_iters):
            picks = [next(s) for s in streams]
            xs = [c.x[i] for c, i in zip(clients, picks)]
            ys = [c.y[i] for c, i in zip(clients, picks)]
            outputs = [r(x) for r, x in zip(replicas, xs)]
            where = f"local iteration {step + 1}"  # the engine prefixes the round
            if self.local_loss:  # the client trains on its own head; the server gets detached activations
                for k, ((acts, aux_logits), replica) in enumerate(zip(outputs, replicas)):
                    replica.step(self._client_value(objectives[k], aux_logits, ys[k], teacher, xs[k], replica,
                                                    f"{where}, client {clients[k].cid}"))
                outputs = [acts.detach() for acts, _ in outputs]
            grads: list[tuple | None] = [None] * len(clients)
            for group in groups:
                server = servers[group[0]] if self.server_mode == "copies" else servers[0]
                group_grads, loss = self._server_step(
                    server, [outputs[k] for k in group], [xs[k] for k in group], [ys[k] for k in group],
                    [objectives[k] for k in group], [clients[k].cid for k in group], teacher,
                    server_objective, where, [replicas[k] for k in group])
                for k, g in zip(group, group_grads):
                    grads[k] = g
                server_losses.append(loss)
            if not self.local_loss:
                for replica, acts, (act_grad, param_grads) in zip(replicas, outputs, grads):
                    replica.step(acts, act_grad, param_grads)
        self._finish_round(clients, replicas, servers, objectives)
        return {"train_loss": sum(server_losses) / len(server_losses)}

    def _server_step(self, server, activations, xs, ys, objectives, client_ids, teacher, server_objective, where,
                     replicas):
        """ONE server forward of the given clients' concatenated activations; the server gradient
        and the clients' activation gradients from the same logits, both at the pre-step server
        weights; then the server step. Returns, per client, (activation gradient, gradients of
        weight-space terms w.r.t. its parameters) — (None, None) for local-loss clients — and
        the server loss."""
        sizes = [len(y) for y in ys]
        joined = torch.cat([a.detach() for a in activations]).requires_grad_(not self.local_loss)
        labels = torch.cat(ys)
        logits = server(joined)
        objective = server_objective(labels)
        params = server.parameters()
        server_loss = objective_value(objective, logits, labels, f"{where}, server loss {self.server_loss!r}",
                                      teacher=lambda: teacher(torch.cat(xs)), params=params)
        self._server_loss_state = objective.state_dict()
        server_grads = torch.autograd.grad(server_loss, params, retain_graph=not self.local_loss)
        client_grads: list[tuple] = [(None, None)] * len(sizes)
        if not self.local_loss:
            client_total = sum(
                self._client_value(o, rows, y, teacher, x, r, f"{where}, client {k}")
                for rows, y, o, x, r, k in zip(logits.split(sizes), ys, objectives, xs, replicas, client_ids))
            # weight-space terms (fedprox) reach the client parameters directly, not via the logits
            weight_params = [r.parameters() if o.needs_params else [] for r, o in zip(replicas, objectives)]
            flat = [p for ps in weight_params for p in ps]
            joined_grad, *param_grads = torch.autograd.grad(client_total, [joined, *flat], allow_unused=True)
            param_grads = [torch.zeros_like(p) if g is None else g for p, g in zip(flat, param_grads)]
            client_grads = []
            for act_grad, ps in zip(joined_grad.split(sizes), weight_params):
                client_grads.append((act_grad, param_grads[: len(ps)] or None))
                param_grads = param_grads[len(ps):]
        server.apply(list(server_grads))
        return client_grads, float(server_loss.detach())

    def _client_value(self, objective, logits, labels, teacher, x, replica: Replica, where: str) -> torch.Tensor:
        return objective_value(objective, logits, labels, f"{where}, client loss {self.client_loss!r}",
                               teacher=lambda: teacher(x), params=replica.parameters())

    def _finish_round(self, clients, replicas, servers, objectives) -> None:
        aggregate = fedlt.aggregators.get(self.aggregator)
        weighted = [(r.state(), float(len(c))) for r, c in zip(replicas, clients)]
        # V3 keeps every client's own part; the global client part is then their average, used
        # for evaluation only and never sent back.
        self._client_side.load_state_dict(aggregate(weighted))
        if self.server_mode == "copies":
            self._server.load_state_dict(aggregate([(s.state(), float(len(c))) for s, c in zip(servers, clients)]))
        for c, o, r in zip(clients, objectives, replicas):
            state: dict[str, Any] = {}
            if o.state_dict():
                state["loss"] = o.state_dict()
            if not self.average_clients:
                state["client_model"] = r.state()  # the replica is discarded; the next one copies it
            if state:
                self._client_states[c.cid] = state

    def _client_start(self, data: ClientData, global_start: State) -> State:
        if self.average_clients:
            return global_start
        # V3: a client's own part; on its first round, the initial model (never another's average)
        return self._client_states.get(data.cid, {}).get("client_model", self._initial_client)

    def _head_weight(self) -> torch.Tensor | None:
        try:
            return classifier(self._model).weight.detach().clone()
        except FedltError:  # objectives that don't read the classifier still run on such models
            return None

    def _client_objective(self, data: ClientData, start: State, head_weight: torch.Tensor | None):
        param_names = [n for n, _ in self._client_side.named_parameters()]
        objective = fedlt.losses.build(
            self.client_loss, class_counts=data.class_counts, num_classes=self._ctx.num_classes,
            classifier_weight=head_weight, global_params=[start[n] for n in param_names],
            seed=objective_seed(self._ctx.sampling_seed, data.cid),
        )
        saved = self._client_states.get(data.cid, {}).get("loss")
        if saved:
            objective.load_state_dict(saved)
        return objective

    def _server_objective(self, prior_counts: torch.Tensor, server_start: State, head_weight: torch.Tensor | None):
        """The server side's loss for one server forward: its prior from ``prior_counts``, weight
        terms anchored at the round-start server weights, and the server side's one persistent
        state (stateful terms such as SGB); seeded apart from every client (cids are >= 0)."""
        param_names = [n for n, _ in self._server.named_parameters()]
        objective = fedlt.losses.build(
            self.server_loss, class_counts=prior_counts, num_classes=self._ctx.num_classes,
            classifier_weight=head_weight, global_params=[server_start[n] for n in param_names],
            seed=objective_seed(self._ctx.sampling_seed, -1),
        )
        if self._server_loss_state:
            objective.load_state_dict(self._server_loss_state)
        return objective

    def _teacher(self, client_start: State, server_start: State):
        """The global model received this round (client and server parts at round start), as a
        no-grad function of the input; used by objectives such as FedVLS's vacant-class KD."""
        client_params = client_start
        if self.local_loss:  # the teacher is the global model itself, without the auxiliary head
            client_params = {k.removeprefix("client."): v for k, v in client_start.items() if k.startswith("client.")}

        def teacher(x: torch.Tensor) -> torch.Tensor:
            with eval_mode(self._client, self._server):  # the global model as evaluated; no BatchNorm update
                return functional_call(self._server, server_start,
                                       (functional_call(self._client, client_params, (x,)),))

        return teacher

    # -- state ----------------------------------------------------------------------------------
    def global_model(self) -> nn.Module:
        return self._model

    def state_dict(self) -> dict[str, Any]:
        return {"client_side": self._client_side.state_dict(), "model": self._model.state_dict(),
                "server_optimiser": self._server_optimiser.state_dict(), "client_states": self._client_states,
                "server_loss_state": self._server_loss_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a copy: torch's optimiser keeps the given momentum tensors, which must not stay shared
        # with the state's source (another live algorithm, not only a checkpoint file)
        state = copy.deepcopy(state)
        self._model.load_state_dict(state["model"])
        self._client_side.load_state_dict(state["client_side"])
        self._server_optimiser.load_state_dict(state["server_optimiser"])
        self._client_states = {int(k): v for k, v in state["client_states"].items()}
        self._server_loss_state = state.get("server_loss_state", {})  # absent in older checkpoints


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

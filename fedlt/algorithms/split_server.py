"""The server side of split learning (SPEC §3): ``step(uploads) -> activation gradients``.

Server sides are registered components (``REGISTRY``, entry-point group
``fedlt.split_servers``), chosen by spec in a split algorithm's ``server`` parameter: created
from their own parameters, then ``bind``-ed to the run (the server part, the run context, the
server loss). Three built-ins differ only in how the server model meets the participants'
activations:

- ``ConcatServer`` (SCALA): one server model, ONE forward of all participants' concatenated
  activations per local iteration; from those logits the server loss (prior P_s of the batch, or
  of the participants pooled) and every client's loss (its prior p_k, mean over its own rows),
  both gradients at the pre-step server weights; then one server step.
- ``SequentialServer`` (SplitFed V2, SFL-LocalLoss): one server model updated by each
  participant's activations in turn.
- ``CopiesServer`` (SplitFed V1/V3): a copy of the server model per participant, each with its
  own optimiser, averaged by |D_k| at the end of the round.

The server model and (for the first two) its optimiser persist for the whole run; they are the
server side's ``state_dict``. Clients' losses are evaluated here, where the logits are: each
participant's logit-space terms are built once per round, and their state (Fed-GraB's SGB) goes
back into the client's persistent state at the end of the round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import fedlt.aggregators
import fedlt.losses
import fedlt.losses.fused
from fedlt.algorithms.base import RunContext, build_objective, forward_precision, raise_first_non_finite, upcast
from fedlt.algorithms.protocol import ClientTask, Upload
from fedlt.algorithms.split_client import Replica, client_objective, side_state, split_terms
from fedlt.context import RoundContext
from fedlt.models import eval_mode
from fedlt.registry import Registry


def _server_side_check(obj: Any) -> str | None:
    missing = [m for m in ("bind", "begin_round", "step", "end_round", "state_dict", "load_state_dict")
               if not callable(getattr(obj, m, None))]
    return f"{type(obj).__name__} lacks {', '.join(missing)} (see fedlt.algorithms.split_server.ServerSide)" \
        if missing else None


REGISTRY: Registry = Registry("split_server", product=_server_side_check)


class PersistentServer:
    """The one server model of SCALA / SplitFed V2, trained in place with its run-long optimiser;
    same calls as a ``Replica``."""

    def __init__(self, module: nn.Module, optimiser: torch.optim.Optimizer, ctx: RunContext) -> None:
        self.module, self.optimiser, self.schedule = module, optimiser, ctx.schedule(ctx.server_batch)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The forward (under bf16 autocast for ``precision="bf16"``: logits back in float32)."""
        with forward_precision(self.schedule.precision, x.device):
            out = self.module(x)
        return upcast(out)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    apply = Replica.apply


class ServerSide:
    """What every split server does; subclasses say which model meets which activations.

    ``begin_round`` builds the round's objectives once (each participant's logit-space loss,
    the server's loss expression parsed once per run); ``step`` runs one local iteration;
    ``end_round`` returns each participant's new loss state (of the terms evaluated here) and
    the round's metrics. A plugin's server side subclasses this (or any built-in) and overrides
    ``groups`` / ``round_servers`` / ``end_round``.
    """

    def bind(self, module: nn.Module, ctx: RunContext, server_loss: str, server_prior: str,
             clients_send_gradients: bool) -> None:
        """Attach to the run: the server part (trained in place), the run context, the server's
        loss expression and prior (SPEC §3), and whether clients need activation gradients back."""
        self.module, self.ctx = module, ctx
        self.server_loss, self.server_prior = server_loss, server_prior
        self.trains_clients = clients_send_gradients  # False: local-loss clients need no gradient back
        self.server_terms = fedlt.losses.parse(server_loss)  # parsed once per run
        self.optimiser = ctx.schedule(ctx.server_batch).optimiser(list(module.parameters()))
        self.loss_state: dict[str, Any] = {}  # the server side's own stateful terms (one SGB state)
        self.param_names = [n for n, _ in module.named_parameters()]

    # -- the round -------------------------------------------------------------------------------
    def begin_round(self, round: RoundContext, tasks: Sequence[ClientTask]) -> None:
        self.round, self.tasks = round, list(tasks)
        self.gone: set[int] = set()  # participants that left the round (their uploads stop)
        self.start = {n: t.detach().clone() for n, t in self.module.state_dict().items()}
        self.client_objectives = []
        if self.trains_clients:
            for task in tasks:
                full = client_objective(task, task.weights)
                self.client_objectives.append((full, split_terms(full)[0]))
        self.server_losses: list[torch.Tensor] = []
        self.client_losses: list[list[torch.Tensor]] = [[] for _ in tasks]
        self.servers = self.round_servers()

    def round_servers(self) -> list:
        return [PersistentServer(self.module, self.optimiser, self.ctx)]

    def server_for(self, k: int):
        return self.servers[0]

    @property
    def participants_counts(self) -> torch.Tensor:
        """The pooled class counts of the participants still in the round (SPEC §3's
        ``server_prior="participants"``: a client that left no longer counts)."""
        return torch.stack([t.data.class_counts for k, t in enumerate(self.tasks) if k not in self.gone]).sum(0)

    def groups(self) -> list[list[int]]:
        """Which participants' activations each server forward takes, in order."""
        return [[k] for k in range(len(self.tasks))]

    def step(self, uploads: Sequence[Upload | None]) -> list[torch.Tensor | None]:
        """One local iteration; a None upload is a participant that left the round: it is out of
        every later forward (SCALA's concatenation shrinks) and gets no gradient."""
        self.gone.update(k for k, u in enumerate(uploads) if u is None)
        grads: list[torch.Tensor | None] = [None] * len(uploads)
        for group in self.groups():
            group = [k for k in group if k not in self.gone]
            if not group:
                continue
            for k, g in zip(group, self.forward_backward(self.server_for(group[0]), group, uploads)):
                grads[k] = g
        return grads

    def end_round(self) -> tuple[dict[int, dict[str, Any]], dict[str, float]]:
        losses = torch.stack(self.server_losses)
        raise_first_non_finite(losses, f"server loss {self.server_loss!r}", "server forward")
        for k, (task, values) in enumerate(zip(self.tasks, self.client_losses)):
            if values and k not in self.gone:
                raise_first_non_finite(torch.stack(values), f"client {task.cid}, client loss {task.objective!r}",
                                       "local iteration")
        states = {task.cid: side_state(full, weight_space=False)
                  for k, (task, (full, _)) in enumerate(zip(self.tasks, self.client_objectives)) if k not in self.gone}
        return states, {"train_loss": float(losses.double().mean())}

    # -- one server forward ----------------------------------------------------------------------
    def server_objective(self, labels: torch.Tensor):
        counts = (torch.bincount(labels, minlength=self.ctx.num_classes) if self.server_prior == "batch"
                  else self.participants_counts)
        return build_objective(self.server_terms, self.round, -1, counts,
                               [self.start[n] for n in self.param_names], self.loss_state)

    def teacher(self, activations: torch.Tensor) -> torch.Tensor:
        """The received global model's logits: the server part at round start on the teacher
        activations the clients computed with the received client part."""
        with torch.no_grad(), eval_mode(self.module):
            return functional_call(self.module, self.start, (activations,))

    def forward_backward(self, server, group: list[int], uploads: Sequence[Upload]) -> list[torch.Tensor | None]:
        """ONE server forward of the group's concatenated activations; the server gradient and the
        clients' activation gradients from the same logits, both at the pre-step server weights;
        then the server step."""
        ups = [uploads[k] for k in group]
        sizes = [len(u.labels) for u in ups]
        joined = torch.cat([u.activations for u in ups]).requires_grad_(self.trains_clients)
        labels = torch.cat([u.labels for u in ups])
        logits = server(joined)
        objective = self.server_objective(labels)
        extra: dict[str, Any] = {}
        # only clients whose objective distils send teacher activations (vacant_kd needs two or
        # more vacant classes): one teacher forward over those, rows handed back per client
        sent = [u.teacher_activations is not None for u in ups]
        teachers, teacher_rows = None, [None] * len(ups)
        if any(sent):
            present = self.teacher(torch.cat([u.teacher_activations for u in ups if u.teacher_activations is not None]))
            parts = iter(present.split([n for n, s in zip(sizes, sent) if s]))
            teacher_rows = [next(parts) if s else None for s in sent]
            teachers = present if all(sent) else None  # a distilling server loss makes every client send
        if objective.needs_teacher:
            extra["teacher_logits"] = teachers
        if objective.needs_params:
            extra["params"] = server.parameters()
        pair = self.fused_pair(objective, group, logits, labels, sizes, extra)
        server_loss = pair[0] if pair is not None else objective(logits, labels, **extra)
        self.loss_state = objective.state_dict()
        params = server.parameters()
        server_grads = torch.autograd.grad(server_loss, params, retain_graph=self.trains_clients)
        self.server_losses.append(server_loss.detach())
        out: list[torch.Tensor | None] = [None] * len(group)
        if self.trains_clients:
            client_total = None
            if pair is not None:  # every client's loss came out of the same fused pass
                client_total = pair[1].sum()
                for k, value in zip(group, pair[1].detach()):
                    self.client_losses[k].append(value)
            else:
                rows = logits.split(sizes)
                for k, z, u, t in zip(group, rows, ups, teacher_rows):
                    logit_terms = self.client_objectives[k][1]
                    if logit_terms is None:  # a client loss made only of weight terms: nothing from the logits
                        continue
                    value = logit_terms(z, u.labels, teacher_logits=t)
                    self.client_losses[k].append(value.detach())
                    client_total = value if client_total is None else client_total + value
            if client_total is not None:
                out = list(torch.autograd.grad(client_total, joined)[0].split(sizes))
            else:
                out = [torch.zeros_like(u.activations) for u in ups]
        server.apply(list(server_grads))
        return out

    def fused_pair(self, objective, group: list[int], logits: torch.Tensor, labels: torch.Tensor, sizes: list[int],
                   extra: dict[str, Any]):
        """SCALA's two losses from ONE call over the server logits (docs/fused.md) when both sides
        are single offset cross-entropies: the fused pass, or under ``auto`` on small logits the
        eager pair (a few ops for any number of clients); None with ``fused="off"`` (the
        objectives then run as built, one per client: the reference) or for other objectives."""
        if not self.trains_clients or extra or self.ctx.fused == "off":
            return None
        offsets = fedlt.losses.fused.pair_offsets(objective, [self.client_objectives[k][1] for k in group],
                                                  self.ctx.num_classes)
        if offsets is None:
            return None
        return fedlt.losses.fused.offset_ce_pair(logits, labels, *offsets, sizes, fused=self.ctx.fused)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"optimiser": self.optimiser.state_dict(), "loss_state": self.loss_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimiser.load_state_dict(state["optimiser"])
        self.loss_state = state.get("loss_state", {})


class ConcatServer(ServerSide):
    """SCALA: every participant's activations in ONE server forward per local iteration."""

    def groups(self) -> list[list[int]]:
        return [list(range(len(self.tasks)))]


class SequentialServer(ServerSide):
    """SplitFed V2 (and SFL-LocalLoss): one server model, each participant's batch in turn."""


class CopiesServer(ServerSide):
    """SplitFed V1/V3: a server copy per participant (fresh optimiser each round), the copies
    averaged by |D_k| at the end of the round."""

    def round_servers(self) -> list:
        return [Replica(self.module, self.start, t.schedule) for t in self.tasks]

    def server_for(self, k: int):
        return self.servers[k]

    def end_round(self) -> tuple[dict[int, dict[str, Any]], dict[str, float]]:
        self.module.load_state_dict(fedlt.aggregators.weighted_average(
            [(s.state(), float(len(t.data))) for k, (s, t) in enumerate(zip(self.servers, self.tasks))
             if k not in self.gone]))
        return super().end_round()


REGISTRY.register("concat")(ConcatServer)
REGISTRY.register("sequential")(SequentialServer)
REGISTRY.register("copies")(CopiesServer)

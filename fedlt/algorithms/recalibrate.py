"""Algorithms whose server runs a registered server-side step after aggregation on statistics
the participants upload (``fedlt.server_steps``): CCVR, CReFF, FedNH, FedNPC (issue 33).

``Recalibrated`` is FedAvg (any loss, any aggregator) plus a ``step`` spec. Each round:
configure → the participants' local training (a step with ``fresh = False`` also collects its
statistics there, on the received weights, before training) → aggregate → (a ``fresh`` step:
a second ``runner.call`` in which each participant only collects, on the aggregated weights) →
``step.apply`` → the re-calibrated classifier. The aggregated model keeps training; the model
the engine evaluates (``global_model()``) is it with the re-calibrated classifier, for the round
the step ran in. A step with ``after_training`` collects at the end of each participant's local
training, on its trained weights; one with ``moves_model`` writes its classifier into the
aggregated model itself (FedNH's prototypes). Everything crosses as ``ClientTask.payload`` / ``ClientResult.extras``, so the
algorithm runs on every engine.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import nn

import fedlt.server_steps
from fedlt.algorithms import preset
from fedlt.algorithms.base import ClientData, RunContext, as_spec, build_aggregator, client_generator, spec_of
from fedlt.algorithms.compatibility import check_built
from fedlt.algorithms.fedavg_family import ClientUpdate, FedAvgFamily, Strategy
from fedlt.algorithms.protocol import ClientResult, ClientRunner, ClientStates, ClientTask
from fedlt.context import RoundContext
from fedlt.datasets.source import to_device
from fedlt.models import classifier

StepSpec = spec_of(fedlt.server_steps.REGISTRY, "server step")
KEY = "server_step"  # the payload's and the extras' entry
COLLECT_BATCH = 256  # samples per forward when a client computes its statistics


def build_step(spec: str | dict[str, Any]) -> Any:
    spec = as_spec(spec)
    return fedlt.server_steps.create(spec.pop("name"), **spec)


def _collect_generator(task: ClientTask) -> torch.Generator:
    """The client's draws for its statistics: their own stream, apart from its minibatch order."""
    return torch.Generator().manual_seed(client_generator(task.context.sampling_seed, task.round_index,
                                                          task.cid).initial_seed() ^ 0x5EED)


def collect(step: Any, task: ClientTask, model: nn.Module) -> dict[str, Any]:
    """``step.collect`` on the client's whole local set, with the weights ``model`` holds."""
    index = torch.arange(len(task.data), device=task.data.index_device).split(COLLECT_BATCH)
    return step.collect(model, task.data.batches(index), task.payload[KEY], task.context.num_classes,
                        _collect_generator(task))


def on_host(value: Any) -> Any:
    """``value`` (tensors in dicts, lists and tuples) with every tensor on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_host(v) for v in value)
    return value


def host_copy(head: nn.Module) -> nn.Module:
    """A classifier with ``head``'s weights, on the CPU: a linear one built, not deep-copied (a
    module on a device is copied tensor by tensor); a head (fedlt.models.heads) copied whole."""
    if not isinstance(head, nn.Linear):
        return copy.deepcopy(head).cpu()
    out = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, dtype=head.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(head.weight.detach().cpu())
        if head.bias is not None:
            out.bias.copy_(head.bias.detach().cpu())
    return out


def write_head(out: nn.Module, head: dict[str, torch.Tensor]) -> None:
    """``head``'s weight (and bias, where ``out`` has one) copied into the classifier ``out`` in
    place (a head's ``weight`` is the tensor it scores against: its buffer)."""
    with torch.no_grad():
        out.weight.copy_(to_device(head["weight"], out.weight.device))  # the step's head is on the host
        if getattr(out, "bias", None) is not None:
            out.bias.copy_(to_device(head["bias"], out.bias.device))


@dataclass(frozen=True)
class _After:
    """``begin``'s note to ``end``: the step collects once training is done."""

    step: Any


@dataclass(frozen=True)
class StepUpdate(ClientUpdate):
    """FedAvg's local update, plus the step's statistics: before training on the received weights
    (``fresh = False``), after it on the trained ones (``after_training``), or alone, untrained,
    when the task asks only for them (``collect``)."""

    step: dict[str, Any] = field(default_factory=dict)
    trains_in_the_loop: ClassVar[bool] = True  # its training is ClientUpdate.__call__ (DP-SGD applies)

    def without_loop(self, task: ClientTask, model: nn.Module) -> ClientResult | None:
        if not task.payload.get("collect"):
            return None
        model.load_state_dict(task.weights)
        stats = collect(build_step(self.step), task, model)
        return ClientResult(task.cid, {}, len(task.data), 0, 0.0, task.state, extras={KEY: stats})

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> Any:
        step = build_step(self.step)
        if not task.payload.get("due") or step.fresh:
            return None
        return _After(step) if fedlt.server_steps.after_training(step) else collect(step, task, model)

    def end(self, local: Any, task: ClientTask, model: nn.Module, params: list[nn.Parameter],
            steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
        if isinstance(local, _After):
            local = collect(local.step, task, model)  # on the weights just trained
        return {}, ({KEY: local} if local is not None else {})


class StepStrategy(Strategy):
    """FedAvg's server plus the step: its state and the re-calibrated classifier (``head``, None
    until the step has run in the current round) are checkpointed with the model."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str, step: Any) -> None:
        super().__init__(model, aggregator, ctx, objective)
        self.step = step
        step.setup(classifier(model), torch.Generator().manual_seed(ctx.sampling_seed))
        self.head: dict[str, torch.Tensor] | None = None
        self._inference: nn.Module | None = None

    def payload(self, round: RoundContext) -> dict[str, Any]:
        return {KEY: self.step.payload(), "due": self.step.due(round.round_index, round.rounds)}

    def aggregate(self, round: RoundContext, results: Sequence[ClientResult]) -> dict[str, float]:
        metrics = super().aggregate(round, results)
        self.set_head(None)
        if not self.step.fresh and self.step.due(round.round_index, round.rounds):
            self.calibrate(results)
        return metrics

    def collect_tasks(self, round: RoundContext, participants: Sequence[ClientData],
                      states: ClientStates) -> list[ClientTask]:
        weights = self.model.state_dict()
        payload = {KEY: self.step.payload(), "collect": True}
        return [ClientTask(c.cid, round, weights, c, states.get(c.cid), self.ctx.schedule(1), self.objective, payload)
                for c in participants]

    def calibrate(self, results: Sequence[Any]) -> None:
        """``step.apply`` on the uploads, in client order (the same sum on every engine), on the
        host: the step's float64 work and its state are the same whichever device trained."""
        uploads = [on_host(r.extras[KEY]) for r in sorted(results, key=lambda r: r.cid)
                   if isinstance(r, ClientResult) and KEY in r.extras]
        if not uploads:
            return
        head = self.step.apply(host_copy(classifier(self.model)), uploads)
        if fedlt.server_steps.moves_model(self.step):
            write_head(classifier(self.model), head)
        else:
            self.set_head(head)

    def set_head(self, head: dict[str, torch.Tensor] | None) -> None:
        self.head, self._inference = head, None

    def inference_model(self) -> nn.Module:
        """The aggregated model with the re-calibrated classifier (the model itself before it)."""
        if self.head is None:
            return self.model
        if self._inference is None:
            self._inference = copy.deepcopy(self.model)
            write_head(classifier(self._inference), self.head)
        return self._inference

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"step": self.step.state_dict(), "head": self.head}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.step.load_state_dict(state["step"])
        self.set_head(state["head"])


class Recalibrated(FedAvgFamily):
    """FedAvg with a server-side step after aggregation (``step``: a ``fedlt.server_steps`` spec)."""

    step: StepSpec = Field("ccvr", description="the server-side step, a fedlt.server_steps spec")

    def step_spec(self) -> dict[str, Any]:
        """The step's spec (a subclass may complete it from its own fields)."""
        return as_spec(self.step)

    def client_fn(self) -> ClientUpdate:
        return StepUpdate(self.step_spec())

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        step = build_step(self.step_spec())
        check_built(f"server step {self.step_spec()['name']!r}", fedlt.server_steps.requires(step), classifier(model))
        return StepStrategy(model, build_aggregator(self.aggregator), ctx, self.loss, step)

    def train_round(self, round: RoundContext, participants: list[ClientData], states: ClientStates,
                    runner: ClientRunner) -> dict[str, float]:
        metrics = super().train_round(round, participants, states, runner)
        strategy = self._strategy
        if strategy.step.fresh and strategy.step.due(round.round_index, round.rounds):
            strategy.calibrate(runner.call(self, strategy.collect_tasks(round, participants, states)))
        return metrics

    def global_model(self) -> nn.Module:
        return self._strategy.inference_model()


preset("ccvr", Recalibrated, "CCVR: FedAvg, then the classifier re-calibrated on virtual features sampled from "
       "the participants' pooled per-class feature Gaussians.", step="ccvr")
preset("fednpc", Recalibrated, "FedNPC: FedAvg, then the classifier re-trained on standard-normal noise features "
       "with uniform labels after the last round, used for inference.", step="fednpc")
preset("creff", Recalibrated, "CReFF: FedAvg, plus a classifier re-trained on federated features optimised "
       "by gradient matching, used for inference.", step="creff")

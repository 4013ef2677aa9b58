"""FedYoYo (arXiv 2503.06916; shanss132/FedYoYo), as the authors' ``main_fedyoyo.py``: FedAvg
whose clients train a weak and a strong view of each minibatch on logits adjusted by a prior,
and distil the weak view's predictions into the strong view's where the weak view is right.

Each round, before training, every participant measures on the **received** global model the
"effective number" of each of its classes (``effective_numbers``, their
``Local.calculate_eff_weight``), the server sums them (plus one per class), smooths them across
rounds and normalises them into a global prior π (``YoYoStrategy.measure``, the loop of their
``FedYoYo()``). A participant's step (``YoYoUpdate.step_input`` and ``terms``): its prior moves towards its own
label distribution p (π ← (1 − γ)π + γp, at every step, carried over the round), the logits of
both views are shifted by log(π^τ + 1e-9), the loss is the objective (``ce``) on both views
plus λ·min(r/warmup, 1)·KL(softmax(weak/T) ‖ softmax(strong/T)) averaged over the samples whose
weak-view prediction is their label (r the round from 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

import fedlt.augment
import fedlt.server_steps
from fedlt.algorithms import register
from fedlt.algorithms.base import ClientData, RunContext, build_aggregator, client_generator, upcast
from fedlt.algorithms.fedavg_family import OBJECTIVE, ClientUpdate, FedAvgFamily, StepForward, Strategy
from fedlt.algorithms.protocol import ClientResult, ClientRunner, ClientStates, ClientTask
from fedlt.context import RoundContext
from fedlt.datasets.source import to_device

PRIOR, COLLECT, EFFECTIVE = "fedyoyo_prior", "fedyoyo_collect", "fedyoyo_effective"  # payload / extras keys
EPS = 1e-6  # their EPS: the smallest mean correlation of a class
ABNORMAL = 1e4  # their first round's outlier bound
FEATURE_BATCH = 256  # samples per forward when the features are extracted


def cutout(x: torch.Tensor, length: int) -> torch.Tensor:
    """Their ``Cutout(n_holes=1, length)`` on a batch (B, C, H, W): per sample a square of side
    ``length`` around a uniform centre, clipped at the borders, set to 0 (the standardised mean);
    inputs that are not images, or ``length`` 0, pass unchanged. Draws from torch's global
    generator (the client's stream)."""
    if x.dim() != 4 or length <= 0:
        return x
    b, _, h, w = x.shape
    cy = to_device(torch.randint(h, (b, 1)), x.device)  # drawn on the host: the same on every device
    cx = to_device(torch.randint(w, (b, 1)), x.device)
    rows, cols = torch.arange(h, device=x.device), torch.arange(w, device=x.device)
    inside_rows = (rows >= cy - length // 2) & (rows < cy + length // 2)  # B×H
    inside_cols = (cols >= cx - length // 2) & (cols < cx + length // 2)  # B×W
    hole = inside_rows[:, :, None] & inside_cols[:, None, :]
    return x.masked_fill(hole[:, None], 0)


def effective_numbers(features: torch.Tensor, labels: torch.Tensor, batches: Sequence[torch.Tensor],
                      num_classes: int) -> torch.Tensor:
    """Their ``calculate_eff_weight``: the features centred by their class's mean (over all
    samples), then per minibatch (``batches``: index tensors) and class c with n ≥ 2 samples in
    it, 1 / max(mean pairwise cosine similarity, EPS) — 1 for a single sample — summed over the
    minibatches (float64; a zero feature vector correlates 0 with every other)."""
    f, y = features.double(), labels.long()
    onehot = F.one_hot(y, num_classes).double()
    means = (onehot.t() @ f) / onehot.sum(0).clamp(min=1)[:, None]
    centred = f - means[y]
    norms = centred.norm(dim=1, keepdim=True)
    unit = torch.where(norms > 0, centred / norms.clamp(min=1e-300), torch.zeros_like(centred))
    batch_of = torch.empty_like(y)
    for b, idx in enumerate(batches):  # one scatter per minibatch index: no per-sample work
        batch_of[idx] = b
    group = batch_of * num_classes + y
    groups = len(batches) * num_classes
    sums = torch.zeros(groups, f.shape[1], dtype=f.dtype, device=f.device).index_add_(0, group, unit)
    counts = torch.zeros(groups, dtype=f.dtype, device=f.device).index_add_(0, group, torch.ones_like(f[:, 0]))
    correlation = sums.pow(2).sum(1) / counts.clamp(min=1).pow(2)  # aᵀRa with a = 1/n
    eff = torch.where(counts == 1, torch.ones_like(counts), 1 / correlation.clamp(min=EPS))
    return torch.where(counts > 0, eff, torch.zeros_like(eff)).view(len(batches), num_classes).sum(0)


def smoothed(current: torch.Tensor, previous: torch.Tensor | None, momentum: float = 0.9,
             change_threshold: float = 100.0) -> torch.Tensor:
    """Their server update of the summed effective numbers: in the first round, entries above
    ABNORMAL replaced by the mean of the others; then previous·momentum + current·(1 − momentum),
    each entry whose relative change from ``previous`` exceeds ``change_threshold`` kept at its
    previous value (``apply_change_threshold``)."""
    current = current.double()
    if previous is None:
        abnormal = current > ABNORMAL
        if bool(abnormal.any()) and not bool(abnormal.all()):
            current = torch.where(abnormal, current[~abnormal].mean(), current)
        return current
    mixed = previous * momentum + current * (1 - momentum)
    change = ((mixed - previous) / (previous + 1e-8)).abs()
    return torch.where(change > change_threshold, previous, mixed)


@dataclass
class _Prior:
    """A round's moving prior (their ``prior``, updated at every step), the client's label
    distribution and the round's distillation ramp min(r/warmup, 1)."""

    prior: torch.Tensor
    local: torch.Tensor
    ramp: float


@dataclass(frozen=True)
class YoYoUpdate(ClientUpdate):
    """FedYoYo's local update; a ``COLLECT`` task only measures the effective numbers on the
    received weights (one epoch's minibatch partition of the schedule's size, drawn from the
    client's own stream apart from its training order)."""

    lam: float = 4.0
    gamma: float = 0.1
    tau: float = 1.5
    temperature: float = 1.5
    warmup: int = 50
    cutout_length: int = 16

    def without_loop(self, task: ClientTask, model: nn.Module) -> ClientResult | None:
        if not task.payload.get(COLLECT):
            return None
        model.load_state_dict(task.weights)
        return ClientResult(task.cid, {}, len(task.data), 0, 0.0, task.state,
                            extras={EFFECTIVE: self.measure(task, model).cpu()})

    def measure(self, task: ClientTask, model: nn.Module) -> torch.Tensor:
        n = len(task.data)
        index = torch.arange(n, device=task.data.index_device).split(FEATURE_BATCH)
        view = fedlt.augment.build(task.schedule.augment).eval  # their img0: the test transform
        batches = ((view(x), y) for x, y in task.data.batches(index))
        features, labels = fedlt.server_steps.features(model, batches)
        seed = client_generator(task.context.sampling_seed, task.round_index, task.cid).initial_seed() ^ 0x7070
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(labels.device)
        return effective_numbers(features, labels, order.split(task.schedule.batch), task.context.num_classes)

    def begin(self, task: ClientTask, model: nn.Module, params: list[nn.Parameter]) -> _Prior:
        counts = task.data.class_counts.to(params[0].device, torch.promote_types(params[0].dtype, torch.float32))
        prior = task.payload.get(PRIOR)
        prior = torch.full_like(counts, 1 / len(counts)) if prior is None else prior.to(counts)
        ramp = min((task.round_index + 1) / self.warmup, 1.0) if self.warmup > 0 else 1.0
        return _Prior(prior, counts / counts.sum(), ramp)

    def step_input(self, local: Any, x: torch.Tensor) -> torch.Tensor:
        """The weak view and its Cutout strong view, one batch (their forward of both)."""
        return torch.cat([x, cutout(x, self.cutout_length)])

    def terms(self, local: Any, forward: StepForward, objective, y: torch.Tensor,
              extra: dict[str, Any]) -> dict[str, torch.Tensor]:
        state = local
        state.prior = (1 - self.gamma) * state.prior + self.gamma * state.local
        adjusted = upcast(forward.logits) + torch.log(state.prior.pow(self.tau) + 1e-9)
        weak, strong = adjusted.chunk(2)
        teacher = F.softmax(weak.detach() / self.temperature, 1)
        student = F.log_softmax(strong / self.temperature, 1)
        right = (weak.detach().argmax(1) == y).to(teacher.dtype)
        divergence = (torch.special.xlogy(teacher, teacher) - teacher * student).sum(1)
        distillation = (divergence * right).sum() / right.sum().clamp(min=1)  # theirs: NaN (no sample) -> 0
        return {OBJECTIVE: objective(adjusted, torch.cat([y, y]), **extra),
                "self_distillation": self.lam * state.ramp * distillation}


class YoYoStrategy(Strategy):
    """FedAvg's server plus the global prior: the smoothed effective numbers (``effective``, their
    ``eff_global_pre``, checkpointed) measured by the round's participants before training."""

    def __init__(self, model: nn.Module, aggregator, ctx: RunContext, objective: str) -> None:
        super().__init__(model, aggregator, ctx, objective)
        self.effective: torch.Tensor | None = None
        self.prior: torch.Tensor | None = None

    def payload(self, round: RoundContext) -> dict[str, Any]:
        return {PRIOR: self.prior}

    def collect_tasks(self, round: RoundContext, participants: Sequence[ClientData],
                      states: ClientStates) -> list[ClientTask]:
        return [dataclasses.replace(t, payload={COLLECT: True}) for t in self.configure(round, participants, states)]

    def measure(self, results: Sequence[Any]) -> None:
        """1 + the participants' effective numbers (in client order), smoothed, normalised to the prior."""
        current = torch.ones(self.ctx.num_classes, dtype=torch.float64)
        for r in sorted((r for r in results if isinstance(r, ClientResult)), key=lambda r: r.cid):
            current = current + r.extras[EFFECTIVE].double()
        self.effective = smoothed(current, self.effective)
        self.prior = (self.effective / self.effective.sum()).float()

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"effective": self.effective}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.effective = state.get("effective")


class FedYoYo(FedAvgFamily):
    """FedYoYo: each round the participants measure their classes' effective numbers on the
    received model, the server turns them into a global prior, then the participants train
    their weak view and a Cutout strong view on prior-adjusted logits with self-distillation.
    Defaults: their README script (``fedyoyo.sh``: λ = 4, γ = 0.1, warm-up 50) and their
    ``main_fedyoyo.py`` (τ = 1.5, T = 1.5, Cutout of side 16)."""

    lam: float = Field(4.0, ge=0, allow_inf_nan=False, description="the self-distillation weight (their --lamda)")
    gamma: float = Field(0.1, ge=0, le=1, allow_inf_nan=False, description="the per-step pull of the prior "
                         "towards the client's label distribution (their --gamma)")
    tau: float = Field(1.5, ge=0, allow_inf_nan=False, description="the prior's exponent in the logit "
                       "adjustment (their --tau)")
    temperature: float = Field(1.5, gt=0, allow_inf_nan=False, description="the distillation temperature (their --T)")
    warmup: int = Field(50, ge=0, description="rounds over which the distillation weight ramps up (their --warmup)")
    cutout_length: int = Field(16, ge=0, description="side of the strong view's Cutout square (0: none)")

    def client_fn(self) -> YoYoUpdate:
        return YoYoUpdate(self.lam, self.gamma, self.tau, self.temperature, self.warmup, self.cutout_length)

    def make_strategy(self, model: nn.Module, ctx: RunContext) -> Strategy:
        return YoYoStrategy(model, build_aggregator(self.aggregator), ctx, self.loss)

    def train_round(self, round: RoundContext, participants: list[ClientData], states: ClientStates,
                    runner: ClientRunner) -> dict[str, float]:
        strategy = self._strategy
        strategy.measure(runner.call(self, strategy.collect_tasks(round, participants, states)))
        return super().train_round(round, participants, states, runner)


register("fedyoyo")(FedYoYo)

__all__ = ["FedYoYo", "YoYoUpdate", "YoYoStrategy", "cutout", "effective_numbers", "smoothed"]

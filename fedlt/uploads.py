"""The server's side of the uploads, between the round policy and an engine's transport
(docs/transforms.md, docs/privacy.md, SPEC §9).

``UploadRunner`` wraps any ClientRunner. Every task goes out with the round's
:class:`~fedlt.privacy.upload.UploadPlan` (when the run sets ``upload``, ``privacy`` or
``secure_aggregation``), which the client applies to its update wherever it runs; what comes back
is opened here before the round policy and the algorithm see it:

- transforms only: each client's packed update read back to weights w + Δ'_k, aggregated by the
  algorithm as usual;
- secure aggregation and/or central DP: the server learns only the sum (unmasked, with mask
  recovery for dropouts) or the clipped updates, forms the round's aggregate update A — the
  weighted mean Σ w_kΔ_k / Σ w_k, or under client-level DP the fixed-denominator mean
  Σ_k clip(Δ_k) / (qK) + N(0, (σ_Δ·C/(qK))²) — and hands every returned participant w + A (the
  algorithm's aggregator then returns w + A exactly: SPEC §4's identical-models rule; a server
  optimiser treats A as its pseudo-gradient).

Every round's row gets ``bytes_down`` / ``bytes_up`` (the wire size, :func:`fedlt.wire.size`, of
every task sent and every result, split-learning activation and gradient exchanged, less the
client's own persistent state, which a deployed client keeps on its device) and, under
DP, ``epsilon`` at the run's δ (dp-accounting) and the round's ``clip_norm``. The server's state
(the accountant's rounds, the adaptive clip norm) is in the run's checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedlt import wire
from fedlt.algorithms.protocol import ClientFailure, ClientResult, ClientRunner, ClientTask, Sessions, travelling
from fedlt.errors import FedltError
from fedlt.algorithms.base import proportional_batches
from fedlt.privacy import (Accountant, ClientLevel, Mechanism, Plan, SampleAccountant, calibrate,
                           calibrate_sample_level, default_delta, mechanism)
from fedlt.privacy import epsilon as epsilon_after
from fedlt.privacy.dpsgd import steps_per_round
from fedlt.privacy.upload import UploadPlan, masked_sum, open_upload, secaggplus_sum


def noise_seed(sampling_seed: int, round_index: int) -> int:
    """The seed of the server's DP noise in one round (a resumed round draws the same)."""
    words = np.random.SeedSequence([sampling_seed, round_index, 0xD15C]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def stateless(message: Any) -> Any:
    """A task or result as a deployment sends it: without the client's own persistent state,
    which a real client keeps on its device (fedlt's engines carry it to and from the store)."""
    names = {f.name for f in dataclasses.fields(message)} if dataclasses.is_dataclass(message) else set()
    return dataclasses.replace(message, state={}) if "state" in names else message


@dataclasses.dataclass
class UploadSettings:
    """What the run asked for: the ``--upload`` chain, the DP mechanism, secure aggregation, and
    what the accountant needs (clients K, participants per round m = round(qK), rounds, δ; for
    sample-level DP the clients' sizes and the local schedule: b_k and the steps of a round)."""

    transforms: tuple = ()
    privacy: dict[str, Any] | None = None
    secure: bool = False
    clients: int = 1
    per_round: int = 1
    rounds: int = 1
    delta: float | None = None
    target_epsilon: float | None = None
    sampling_seed: int = 0
    sizes: tuple[int, ...] = ()  # |D_k| of every training client (sample-level DP)
    schedule: LocalPlan | None = None
    stop_at_epsilon: float | None = None

    @classmethod
    def of(cls, config: Any, sizes: Sequence[int] = ()) -> "UploadSettings":
        per_round = max(int(round(config.participation * config.clients)), 1)
        plan = LocalPlan(config.server_batch, config.local_iters, config.local_epochs, config.batch_size,
                         config.drop_last)
        return cls(tuple(config.upload), config.privacy, config.secure_aggregation, config.clients, per_round,
                   config.rounds, config.delta, config.target_epsilon, config.seeds.sampling,
                   tuple(int(n) for n in sizes), plan, getattr(config, "stop_at_epsilon", None))

    def mechanism(self) -> Mechanism | None:
        """The DP mechanism, its σ calibrated to ``target_epsilon`` over the run's rounds if asked."""
        if self.privacy is None:
            return None
        mech = mechanism(self.privacy)
        if self.target_epsilon is not None:
            if mech.level == "sample":
                sigma = calibrate_sample_level(self.target_epsilon, self.run_delta, self.worst_case_plans())
            elif mech.central:
                sigma = calibrate(self.target_epsilon, self.run_delta, self.rounds, self.clients, self.per_round)
            else:
                sigma = calibrate(self.target_epsilon, self.run_delta, self.rounds, 1, 1)
            mech = mech.model_copy(update={"noise_multiplier": sigma})
        return mech

    def worst_case_plans(self) -> list[tuple[int, int, int]]:
        """(n_k, the largest b_k, steps over the run) of every client sampled in every round: under
        iteration-based training b_k = ⌊n_k·B/Σ_j n_j⌋ is largest beside the m − 1 smallest others."""
        if not self.sizes or self.schedule is None:
            raise FedltError("privacy: sample-level calibration needs the clients' sizes (fedlt.uploads.UploadSettings.of)")
        smallest = sorted(self.sizes)
        out = []
        for n in self.sizes:
            others = list(smallest)
            others.remove(n)
            batch = self.schedule.batch(n, n + sum(others[:self.per_round - 1]))
            out.append((n, min(batch, n), self.rounds * self.schedule.steps(batch, n)))
        return out

    def planned(self, participants: Sequence[int]) -> list[Plan]:
        """(cid, n_k, b_k, steps) of these participants' local training in one round, as the schedule plans it."""
        total = sum(self.sizes[c] for c in participants)
        return [(c, self.sizes[c], b := self.schedule.batch(self.sizes[c], total),
                 self.schedule.steps(b, self.sizes[c])) for c in participants]

    @property
    def run_delta(self) -> float:
        if self.delta is not None:
            return self.delta
        if self.privacy is not None and self.privacy.get("name") == "sample_level" and self.sizes:
            return default_delta(sum(self.sizes))  # below 1/N, N samples in all: a sample-level guarantee
        return default_delta(self.clients)


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """The run's local schedule as the accountant plans with it (fedlt.algorithms.base.LocalSchedule):
    b_k = ⌊n_k·B/Σ_j n_j⌋ (≥ 1) over the round's participants and ``iters`` steps, or by epochs
    ``batch_size`` and epochs × batches per epoch."""

    server_batch: int
    iters: int
    epochs: int | None
    batch_size: int
    drop_last: bool = False

    def batch(self, n: int, total: int) -> int:
        return self.batch_size if self.epochs is not None else proportional_batches([n, total - n], self.server_batch)[0]

    def steps(self, batch: int, n: int) -> int:
        return steps_per_round(batch, n, self.iters, self.epochs, self.drop_last)


class UploadRunner:
    """A ClientRunner applying the upload plan around ``transport`` (see the module)."""

    def __init__(self, transport: ClientRunner, settings: UploadSettings) -> None:
        self.transport, self.settings = transport, settings
        self.mech = settings.mechanism()
        self.accountant = None if self.mech is None else (
            SampleAccountant(self.mech, settings.run_delta) if self.mech.level == "sample"
            else Accountant(self.mech, settings.clients, settings.per_round, settings.run_delta))
        self.clip_norm = self.mech.clip if self.mech is not None else None
        self.active = bool(settings.transforms or self.mech is not None or settings.secure)
        self.counts = {"bytes_down": 0, "bytes_up": 0}
        self.extra: dict[str, Any] = {}
        self.planned_round: int | None = None  # the round whose training upload got the plan

    @property
    def tolerate(self) -> bool:
        return bool(getattr(self.transport, "tolerate", False))

    # -- the plan ------------------------------------------------------------------------------------
    def plan(self) -> UploadPlan | None:
        if not self.active:
            return None
        mech = self.mech
        if mech is not None and mech.level == "sample":  # DP-SGD in training; the update goes as it is
            return UploadPlan(transforms=self.settings.transforms, secure=self.settings.secure,
                              sample_level=(mech.clip, mech.noise_multiplier))
        return UploadPlan(transforms=self.settings.transforms, clip=self.clip_norm,
                          noise_std=None if mech is None or mech.central else mech.noise_multiplier * mech.clip,
                          secure=self.settings.secure, uniform=mech is not None and mech.central)

    def _send(self, tasks: Sequence[ClientTask]) -> list[ClientTask]:
        """The tasks with the plan: on the round's first call only (the training upload; a second
        call of the round — CCVR's statistics on the aggregated model — goes out as it is)."""
        first = bool(tasks) and tasks[0].round_index != self.planned_round
        plan = self.plan() if first else None
        if first:
            self.planned_round = tasks[0].round_index
        out = [dataclasses.replace(t, upload=plan) for t in tasks]
        self.counts["bytes_down"] += sum(wire.size(stateless(travelling(t)), "task") for t in out)
        return out

    def _count_up(self, outcomes: Sequence[Any]) -> None:
        self.counts["bytes_up"] += sum(wire.size(stateless(o), "upload") for o in outcomes
                                       if o is not None and not isinstance(o, ClientFailure))

    # -- the runner ----------------------------------------------------------------------------------
    def call(self, algorithm: Any, tasks: Sequence[ClientTask]) -> list[ClientResult | ClientFailure]:
        sent = self._send(tasks)
        outcomes = self.transport.call(algorithm, sent) if sent else []
        self._count_up(outcomes)
        return self.settle(sent, outcomes)

    def exchange(self, algorithm: Any, tasks: Sequence[ClientTask]) -> "UploadSessions":
        sent = self._send(tasks)
        return UploadSessions(self, sent, self.transport.exchange(algorithm, sent))

    def each(self, job: str, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
        return self.transport.each(job, algorithm, tasks)

    def evaluate(self, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
        return self.transport.each("evaluate", algorithm, tasks)

    # -- opening what came back ----------------------------------------------------------------------
    def settle(self, tasks: Sequence[ClientTask], outcomes: Sequence[Any]) -> list[Any]:
        """The outcomes with every result's weights as the algorithm aggregates them."""
        results = [o for o in outcomes if isinstance(o, ClientResult)]
        if not results or tasks[0].upload is None:
            return list(outcomes)
        task = tasks[0]
        if self.mech is not None and self.mech.level == "sample":  # the clients' DP-SGD steps, accounted
            batches = {t.cid: t.schedule.batch for t in tasks}
            self.extra = {"epsilon": self.accountant.record(
                [(r.cid, r.num_samples, min(batches[r.cid], r.num_samples), r.steps) for r in results])}
        if not task.upload.changes_upload:
            return list(outcomes)
        if any(r.packed is None for r in results):
            raise FedltError("upload: a client's result came back without its packed update (a client path that "
                             "does not apply fedlt.algorithms.protocol.uploaded)")
        central = self.mech is not None and self.mech.central
        if self.mech is not None and not central and self.mech.level == "client":  # local DP: the clients' noised uploads are the release
            self.extra = {"epsilon": self.accountant.step(), "clip_norm": self.clip_norm}
        if not (self.settings.secure or central):
            opened = {r.cid: open_upload(task.weights, r.weights, r.packed) for r in results}
            return [dataclasses.replace(o, weights=opened[o.cid], packed=None) if isinstance(o, ClientResult) else o
                    for o in outcomes]
        mean, kept = self.aggregate(task, results)
        new = {k: task.weights[k] + mean[k].to(task.weights[k]) for k in mean}
        return [dataclasses.replace(o, weights=o.weights | new, packed=None) if isinstance(o, ClientResult) else o
                for o in outcomes]

    def aggregate(self, task: ClientTask, results: Sequence[ClientResult]) -> tuple[dict[str, torch.Tensor], Any]:
        """The round's aggregate update A (see the module), from the sum the server may read."""
        glob, ctx = task.weights, task.context
        if self.settings.secure and "aggregate" in results[0].packed:  # Flower's SecAgg+ (fedlt.flower.secaggplus)
            total, weight, unclipped = secaggplus_sum(glob, list(results[0].packed["keys"]),
                                                      results[0].packed["aggregate"], len(results))
        elif self.settings.secure:
            keys = list(results[0].packed["keys"])
            masked = {r.cid: r.packed["masked"] for r in results}
            total, weight, unclipped = masked_sum(glob, keys, masked, ctx.participants, ctx.sampling_seed,
                                                  ctx.round_index)
        else:
            opened = [open_upload(glob, {}, r.packed) for r in results]
            total = {k: sum((o[k] - glob[k]).double() for o in opened) for k in results[0].packed["forms"]}
            weight = float(len(results))
            unclipped = float(sum(bool(r.packed.get("unclipped")) for r in results))
        if self.mech is None or not self.mech.central:  # secure aggregation without central noise: the weighted mean
            return {k: v / weight for k, v in total.items()}, None
        return self.private_mean(total, unclipped, ctx.round_index), None

    def private_mean(self, total: dict[str, torch.Tensor], unclipped: float, round_index: int) -> dict[str, torch.Tensor]:
        """Σ clip(Δ_k)/(qK) + N(0, (σ_Δ·C/(qK))²); the accountant's step; adaptive C's update."""
        mech, expected = self.mech, float(self.settings.per_round)
        generator = torch.Generator().manual_seed(noise_seed(self.settings.sampling_seed, round_index))
        std = self.accountant.multiplier * self.clip_norm / expected
        out = {k: v.double() / expected
               + std * torch.randn(v.shape, dtype=torch.float64, generator=generator).to(v.device)
               for k, v in sorted(total.items())}
        self.extra = {"epsilon": self.accountant.step(), "clip_norm": self.clip_norm}
        if isinstance(mech, ClientLevel) and mech.adaptive:
            noisy = (unclipped + mech.count_std(expected) * float(torch.randn((), generator=generator))) / expected
            self.clip_norm = self.clip_norm * math.exp(-mech.clip_lr * (noisy - mech.target_quantile))
        return out

    # -- the budget ----------------------------------------------------------------------------------
    def prospective_epsilon(self, participants: Sequence[int]) -> float | None:
        """The run's ε were these participants to train one more round as planned (None without DP)."""
        acc = self.accountant
        if acc is None:
            return None
        if isinstance(acc, SampleAccountant):
            return acc.prospective(self.settings.planned(participants))
        if self.mech.central:
            return epsilon_after(acc.multiplier, acc.rounds + 1, acc.clients, acc.per_round, acc.delta)
        return epsilon_after(acc.multiplier, acc.rounds + 1, 1, 1, acc.delta)

    # -- per round -----------------------------------------------------------------------------------
    def row(self) -> dict[str, Any]:
        """The round's bytes (and ε, C under DP); the counters start again."""
        row = dict(self.counts) | self.extra
        if self.accountant is not None and "epsilon" not in row:
            row["epsilon"] = self.accountant.epsilon()  # a round whose aggregate was not released
        self.counts = {"bytes_down": 0, "bytes_up": 0}
        self.extra = {}
        return row

    def state_dict(self) -> dict[str, Any]:
        if self.accountant is None:
            return {}
        return self.accountant.state_dict() | {"clip_norm": torch.tensor(self.clip_norm, dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.accountant is not None and state:
            self.accountant.load_state_dict(state)
            self.clip_norm = float(state["clip_norm"])


class UploadSessions:
    """The round's split-learning sessions, their traffic counted (activations and labels up,
    gradients down), their finished results opened as ``UploadRunner.call``'s are."""

    def __init__(self, runner: UploadRunner, tasks: Sequence[ClientTask], inner: Sessions) -> None:
        self.runner, self.tasks, self.inner = runner, tasks, inner

    def forward(self) -> list[Any]:
        out = self.inner.forward()
        self.runner._count_up(out)
        return out

    def backward(self, grads: list[torch.Tensor | None]) -> None:
        self.runner.counts["bytes_down"] += sum(wire.size(g, "gradient") for g in grads if g is not None)
        self.inner.backward(grads)

    def finish(self) -> list[Any]:
        out = self.inner.finish()
        self.runner._count_up(out)
        return self.runner.settle(self.tasks, out)

    def drop(self, k: int) -> None:
        self.inner.drop(k)

    def __getattr__(self, name: str) -> Any:  # gone, live, ...: the inner sessions' bookkeeping
        return getattr(self.inner, name)


def summary(metrics: Sequence[dict[str, Any]], config: Any, sizes: Sequence[int] = ()) -> dict[str, Any]:
    """The run's traffic (bytes up and down over every round) and, under DP, its guarantee: the
    mechanism (σ as calibrated), δ, the final ε, the accountant that gave it, and whether the run
    stopped because its next round would have spent more than ``stop_at_epsilon``."""
    out: dict[str, Any] = {"bytes_up": sum(r.get("bytes_up", 0) for r in metrics),
                           "bytes_down": sum(r.get("bytes_down", 0) for r in metrics)}
    if config.privacy is None:
        return out
    settings = UploadSettings.of(config, sizes)
    mech = settings.mechanism()
    if mech.level == "sample":
        sampling = ("each client's local steps, Poisson-sampled batches of rate b_k/n_k; the largest client's ε "
                    "(dp-accounting RDP, PoissonSampledDpEvent, ADD_OR_REMOVE_ONE)")
    elif mech.central:
        sampling = (f"{settings.per_round} of {settings.clients} clients a round without replacement "
                    "(dp-accounting RDP, SampledWithoutReplacementDpEvent, REPLACE_ONE)")
    else:
        sampling = "every round, the worst client (dp-accounting RDP, Gaussian)"
    eps = [r["epsilon"] for r in metrics if "epsilon" in r]
    budget = settings.stop_at_epsilon
    stopped = budget is not None and len(metrics) < config.rounds
    return out | {"privacy": {"mechanism": mech.spec(), "delta": settings.run_delta,
                              "epsilon": eps[-1] if eps else 0.0, "sampling": sampling,
                              "secure_aggregation": settings.secure, "stop_at_epsilon": budget,
                              "stopped_by_privacy_budget": stopped}}

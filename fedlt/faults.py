"""The round policy between the algorithm and an engine's transport (docs/faults.md).

``PolicyRunner`` wraps any ClientRunner: before a task goes out it applies the availability
(a client sampled but unavailable ``after`` sampling fails during the round; one whose simulated
round time passes ``round_timeout`` is ``late``); what comes back — results, or the transport's
ClientFailures when it tolerates them — is checked (an update that is not finite is a failure);
every drop is recorded with its reason in the round's ``RoundLog``; a failure under
``on_failure="stop"`` stops the run; fewer than ``min_results`` returned clients raise
``RoundIncomplete`` before anything of the round is applied. The algorithm sees only the
clients that returned (a split-learning participant that left is None in the uploads), so each
aggregates over them by its own rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedlt.algorithms.protocol import ClientFailure, ClientResult, ClientRunner, ClientTask, RoundSessions, Upload
from fedlt.errors import FedltError


class RoundIncomplete(FedltError):
    """Fewer clients returned than the round policy's ``min_results``: the round is not applied."""


@dataclass
class RoundLog:
    """What happened to the round's sampled clients: who returned, who was dropped and why."""

    sampled: list[int]
    dropped: dict[int, str] = field(default_factory=dict)
    reachable: int | None = None  # availability acting before sampling: how many clients could be sampled

    @property
    def returned(self) -> list[int]:
        return [c for c in self.sampled if c not in self.dropped]

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {"sampled": list(self.sampled), "returned": self.returned,
                               "dropped": {str(c): r for c, r in sorted(self.dropped.items())}}
        return row if self.reachable is None else row | {"reachable": self.reachable}


def finite_update(result: ClientResult) -> bool:
    """Every floating weight finite (a float64 sum of each tensor is finite iff its values are)."""
    sums = [t.sum(dtype=torch.float64) for t in result.weights.values() if t.is_floating_point()]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())


class PolicyRunner:
    """A ClientRunner applying the round policy around ``transport`` (see the module)."""

    def __init__(self, transport: ClientRunner, availability: Any, faults: Any, sampling_seed: int) -> None:
        self.transport, self.availability, self.faults, self.seed = transport, availability, faults, sampling_seed
        self.log = RoundLog([])

    def begin(self, round_index: int, sampled: Sequence[int], reachable: Sequence[int] | None = None) -> None:
        self.round_index = round_index
        self.log = RoundLog(list(sampled), reachable=None if reachable is None else len(reachable))

    # -- what is decided before a task goes out ----------------------------------------------------
    def _late(self, cid: int) -> str | None:
        timeout = self.faults.round_timeout
        took = self.availability.duration(self.seed, self.round_index, cid)
        if timeout is not None and took > timeout:
            return f"late (simulated {took:.3g} s > round_timeout {timeout:g} s)"
        return None

    def _fails_during_round(self, cid: int) -> bool:
        return self.availability.when == "after" and not self.availability.available(self.seed, self.round_index, cid)

    def _with_fault(self, task: ClientTask) -> ClientTask:
        fault = self.availability.fault(self.seed, self.round_index, task.cid)
        return dataclasses.replace(task, fault=fault) if fault else task

    def drop(self, cid: int, reason: str) -> None:
        """Record a lost participant; under ``on_failure="stop"`` a failure (not an unavailable
        client, which is the availability model at work) stops the run."""
        if self.faults.on_failure == "stop" and not reason.startswith("unavailable"):
            raise FedltError(f"round {self.round_index + 1}: client {cid} {reason} (on_failure=stop; "
                             "faults.on_failure=drop leaves it out of the round)")
        self.log.dropped[cid] = reason

    def check(self) -> None:
        needed = self.faults.required(len(self.log.sampled)) if self.log.sampled else 1
        if len(self.log.returned) < needed:
            dropped = ", ".join(f"{c}: {r}" for c, r in sorted(self.log.dropped.items())) or "none"
            raise RoundIncomplete(f"round {self.round_index + 1}: {len(self.log.returned)} of "
                                  f"{len(self.log.sampled)} sampled client(s) returned, min_results needs {needed} "
                                  f"(dropped: {dropped})")

    # -- the runner ------------------------------------------------------------------------------
    def call(self, algorithm: Any, tasks: Sequence[ClientTask]) -> list[ClientResult]:
        live = []
        for t in tasks:
            reason = "unavailable" if self._fails_during_round(t.cid) else self._late(t.cid)
            if reason:
                self.drop(t.cid, reason)
            else:
                live.append(self._with_fault(t))
        results = self.accepted(self.transport.call(algorithm, live) if live else [])
        self.check()
        return results

    def accepted(self, outcomes: Sequence[ClientResult | ClientFailure | None]) -> list[ClientResult]:
        """The results the round applies: a failure, or (under ``drop``) an update that is not
        finite, is dropped with its reason."""
        results = []
        for outcome in outcomes:
            if isinstance(outcome, ClientFailure):
                self.drop(outcome.cid, outcome.reason)
            elif self.faults.on_failure == "drop" and not finite_update(outcome):
                self.drop(outcome.cid, "failed: its update is not finite")
            else:
                results.append(outcome)
        return results

    def exchange(self, algorithm: Any, tasks: Sequence[ClientTask]) -> "PolicySessions":
        return PolicySessions(self, algorithm, list(tasks))

    def each(self, job: str, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
        """Other kinds of one-call work than a round's training (``Runner.each``) go to the
        transport as they are: the availability model and the fault policy govern training."""
        return self.transport.each(job, algorithm, tasks)


class PolicySessions(RoundSessions):
    """The round's split-learning sessions under the round policy: late participants never
    start; one unavailable ``after`` sampling leaves at an iteration drawn from its stream; one
    the transport lost leaves when it is lost. A participant that left is None in the uploads
    and gets no gradient; its result never arrives (its loss is in the round's log, not in the
    outputs)."""

    def __init__(self, runner: PolicyRunner, algorithm: Any, tasks: list[ClientTask]) -> None:
        super().__init__(tasks)
        self.runner = runner
        self.started = [k for k, t in enumerate(tasks) if not self._late(t)]  # positions in the transport's sessions
        iterations = tasks[0].schedule.iters or 0 if tasks else 0
        self.leaves = {k: runner.availability.leaves_at(runner.seed, runner.round_index, tasks[k].cid, iterations)
                       for k in self.started if runner._fails_during_round(tasks[k].cid)}
        self.gone = set(range(len(tasks))) - set(self.started)
        self.inner = (runner.transport.exchange(algorithm, [runner._with_fault(tasks[k]) for k in self.started])
                      if self.started else None)
        self.iteration = 0

    def _late(self, task: ClientTask) -> bool:
        reason = self.runner._late(task.cid)
        if reason:
            self.runner.drop(task.cid, reason)
        return bool(reason)

    def drop(self, k: int) -> None:
        if k not in self.gone and k in self.started:
            self.inner.drop(self.started.index(k))
        super().drop(k)

    def _outer(self, inner_out: list) -> list:
        """The transport's outputs placed back at the participants' positions; failures recorded
        in the round's log (and the participant gone)."""
        values: dict[int, Any] = {}
        for k, value in zip(self.started, inner_out):
            if isinstance(value, ClientFailure):
                self.runner.drop(value.cid, value.reason)
                self.gone.add(k)
            else:
                values[k] = value
        return self.report(values)

    def forward(self) -> list[Upload | None]:
        for k, at in self.leaves.items():
            if at == self.iteration and k not in self.gone:
                self.runner.drop(self.tasks[k].cid, f"unavailable (left at local iteration {at + 1})")
                self.drop(k)
        self.iteration += 1
        return self._outer(self.inner.forward()) if self.inner else [None] * len(self.tasks)

    def backward(self, grads: list[torch.Tensor | None]) -> None:
        if self.inner:
            self.inner.backward([grads[k] for k in self.started])

    def finish(self) -> list[ClientResult]:
        out = self._outer(self.inner.finish()) if self.inner else []
        results = self.runner.accepted([r for r in out if isinstance(r, ClientResult)])
        self.runner.check()
        return results

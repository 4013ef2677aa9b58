"""Whole-step graphs of a cohort (``--graphs --cohort N``, docs/gpu.md#whole-step-cuda-graphs):
the cohort's vmapped step (fedlt.algorithms.cohort) captured once per (group size, batch shape)
and replayed, so N clients' step is one graph — the device floor of a round of many small
clients, where one client after another stays at ~70 small kernels a step (the H200 profile).

What a captured step reads must sit at fixed addresses, so every cohort of one kind (size,
parameters, optimiser settings) trains on one *canonical* set of stacks: its weights, momentum,
fixed tensors and logit offsets. A cohort copies its own into them at its first step taken here
(``adopt``) and trains on them to its end: its results are read from them before the next cohort
runs, and what a result keeps is copied, as it is from the work module sequentially. A step
copies its group's minibatches into the graph's static inputs (``torch.stack(out=...)``) and,
for a part of the cohort, the group's rows into its static index.

Captured: :meth:`fedlt.algorithms.cohort.Cohort.plain_step` — a plain offset cross-entropy
(``ce``, ``logit_adjust``, a finite ``fedlc``), a variant that adds nothing per client to the
step (no ``correct``, ``stepped``, ``ascent`` or ``step_input``), no BatchNorm statistics,
float32. Anything else trains in the eager cohort, the reason stated once. The first step of a
shape is a checked eager step (host synchronisations, random operators and host copies refused,
as for one client's graphs); its refusal, or a failed capture, leaves that shape eager for every
cohort of the kind (stated, not retried), while the other shapes replay. The momentum buffers
start at zero, so a client's first step (torch makes the buffer d_p; μ·0 + d_p is d_p) is
replayed like the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fedlt.algorithms import graphs
from fedlt.algorithms.fedavg_family import ClientUpdate

MAX_GRAPHS = 128  # per work module: group sizes × batch shapes; beyond it the cohort's steps run eagerly (stated)
# hooks that run a client's own Python inside or after the step, which one graph of the group cannot
HOOKS = ("correct", "stepped", "ascent", "step_input")


@dataclass
class Captured:
    """One captured group step: its static inputs and its output (the group's step losses)."""

    backend: Any
    index: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    losses: torch.Tensor


@dataclass
class Canonical:
    """The stacks every cohort of one kind trains on while its steps replay, and their graphs."""

    weights: list[torch.Tensor]
    momentum: list[torch.Tensor]
    fixed: dict[str, torch.Tensor]
    offsets: torch.Tensor
    graphs: dict[tuple, Captured] = field(default_factory=dict)
    refused: dict[tuple, str] = field(default_factory=dict)  # a shape's checked step or capture refused: eager, not retried


def reason(cohort: Any) -> str | None:
    """Why ``cohort``'s steps cannot be captured (None: they can)."""
    update, schedule = cohort.update, cohort.schedule
    device = cohort.weights[0].device if cohort.weights else torch.device("cpu")
    found = graphs.device_reason(schedule.graphs, device) or graphs.compiled_reason(schedule.graphs, schedule.compile)
    if found is not None:
        return found
    if schedule.precision != "fp32":
        return "--precision bf16: autocast's weight cache cannot be captured (PyTorch's CUDA graphs notes)"
    if cohort.running:
        return "the model's BatchNorm keeps per-client running statistics, which the cohort's captured step does not carry"
    found = hook_reason(update)
    if found is not None:
        return found
    if cohort._offsets(cohort.tasks[0].data.class_counts.numel()) is None:
        return ("the cohort captures a plain offset cross-entropy only (ce, logit_adjust, a finite fedlc); this "
                "objective's terms are computed client by client, eagerly")
    return None


def hook_reason(update: Any) -> str | None:
    """Why ``update``'s cohort steps cannot be captured whatever its objective (None: they may be):
    a hook that runs a client's own Python in or after its step."""
    for hook in HOOKS:
        if getattr(type(update), hook) is not getattr(ClientUpdate, hook):
            return (f"{type(update).__name__} overrides ClientUpdate.{hook} (a client's own Python in its step), "
                    "which one graph of the cohort's group cannot run")
    return None


def open(cohort: Any) -> "CohortGraphs | None":
    """The replayer of ``cohort``'s steps, or None: its steps run eagerly (the reason noted)."""
    why = reason(cohort)
    if why is not None:
        graphs.left_eager(cohort.model, why)
        return None
    return CohortGraphs(cohort)


class CohortGraphs:
    """One cohort's steps after its clients' first: replayed per (group size, batch shape)."""

    def __init__(self, cohort: Any) -> None:
        self.cohort, self.backend = cohort, cohort.schedule.graphs
        self.device = cohort.weights[0].device
        self.module = graphs._GRAPHS.setdefault(cohort.model, graphs.ModuleGraphs())
        self.canonical: Canonical | None = None

    def step(self, ks: list[int], group: list[tuple[int, torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """The group's step: replayed, or a checked eager step (then captured) where its shape has
        no graph yet. Returns the group's step losses; None where its shape was refused (then the
        cohort's eager step runs it, on the canonical stacks)."""
        if self.canonical is None:
            self.adopt()
        x0, y0 = group[0][1], group[0][2]
        key = (len(ks), tuple(x0.shape), x0.dtype, tuple(y0.shape), y0.dtype)
        if key in self.canonical.refused:
            return None
        graph = self.canonical.graphs.get(key)
        if graph is None:
            return self._checked_step_then_capture(ks, group, key)
        torch.stack([x for _, x, _ in group], out=graph.x)
        torch.stack([y for _, _, y in group], out=graph.y)
        if len(ks) < len(self.cohort.clients):  # a full group's index is every row, as captured
            graph.index.copy_(self.cohort._index(ks))
        graph.backend.replay()
        self.module.replays += 1
        graphs._TOTALS["replays"] += 1
        return graph.losses.clone()

    def adopt(self) -> None:
        """The cohort's stacks copied into the canonical ones of its kind, which it trains on from now."""
        c = self.cohort
        offsets_key = (self.device, c.weights[0].dtype)  # float32 precision: the logits' own dtype
        if offsets_key not in c.offsets_on:
            c.offsets_on[offsets_key] = c.offsets.to(device=self.device, dtype=c.weights[0].dtype)
        mine = Canonical(c.weights, c.momentum, c.fixed, c.offsets_on[offsets_key])
        s = c.schedule
        kind = (len(c.clients), type(c.update).__qualname__, tuple(c.names), (s.lr, s.momentum, s.weight_decay, s.clip),
                *(_layout(t) for t in [*mine.weights, *mine.momentum, mine.offsets]),
                tuple((n, _layout(t)) for n, t in mine.fixed.items()))
        canonical = self.module.cohorts.get(kind)
        if canonical is None:  # a private copy: the cohort's own stacks are read after its round
            canonical = Canonical([t.clone() for t in mine.weights], [t.clone() for t in mine.momentum],
                                  {n: t.clone() for n, t in mine.fixed.items()}, mine.offsets.clone())
            self.module.cohorts[kind] = canonical
        graphs.transfer([*canonical.weights, *canonical.momentum, *canonical.fixed.values(), canonical.offsets],
                        [*mine.weights, *mine.momentum, *mine.fixed.values(), mine.offsets])
        c.weights, c.momentum, c.fixed = canonical.weights, canonical.momentum, canonical.fixed
        c.offsets_on[offsets_key] = canonical.offsets
        # every client's momentum as started: at the cohort's first step its buffers are zero, and
        # μ·0 + d_p is the d_p torch's first step makes the buffer, so the first step is one graph too
        for started in c.started:
            started.update(range(len(c.clients)))
        self.canonical = canonical

    def _checked_step_then_capture(self, ks: list[int], group: list, key: tuple) -> torch.Tensor:
        c = self.cohort
        index = c._index(ks)
        x, y = torch.stack([x for _, x, _ in group]), torch.stack([y for _, _, y in group])
        checking = graphs._Checking(self.device)
        with checking:
            losses = c.plain_step(ks, index, x, y)
        why = checking.reason
        if why is None and any(t is not self.canonical.offsets for t in c.offsets_on.values()):
            # adopt keyed the canonical offsets by the weights' dtype; logits of another dtype made
            # the cohort a table of its own, which a graph shared by its kind would read for every cohort
            why = (f"the model's logits are not in its weights' dtype ({c.weights[0].dtype}): the cohort's logit "
                   "offsets would be its own table, not the one every cohort of its kind shares")
        if why is None and sum(len(k.graphs) for k in self.module.cohorts.values()) >= MAX_GRAPHS:
            why = f"more than {MAX_GRAPHS} group sizes and batch shapes of cohorts on one work module"
        try:
            if why is not None:
                raise graphs.CaptureRefused(why)
            self._capture(ks, index, x, y, key)
        except graphs.CaptureRefused as exc:  # this shape eager for every cohort of the kind, the others replayed
            self.canonical.refused[key] = str(exc)
            graphs.left_eager(c.model, str(exc))
        return losses

    def _capture(self, ks: list[int], index: torch.Tensor, x: torch.Tensor, y: torch.Tensor, key: tuple) -> None:
        """PyTorch's whole-network recipe on saved and restored stacks: warm-up steps, the capture."""
        c, canonical = self.cohort, self.canonical
        static = (index.clone(), x.clone(), y.clone())
        backend = graphs.make_backend(self.backend, self.device, self._pool())
        losses = graphs.capture_on_saved(backend, lambda: c.plain_step(ks, *static),
                                         graphs.saved([*canonical.weights, *canonical.momentum]))
        canonical.graphs[key] = Captured(backend, *static, losses)
        self.module.captured += 1
        graphs._TOTALS["captured"] += 1

    def _pool(self) -> Any:
        """One memory pool for every cohort graph of the work module (up to :data:`MAX_GRAPHS` of
        them, each with a group's activations: a pool each would keep them all). Shared safely:
        the graphs replay one at a time, each reads only tensors made outside the pool (its static
        inputs, the canonical stacks), and its one output is cloned before another replays."""
        if self.backend != "cuda":
            return None
        if self.module.cohort_pool is None:
            self.module.cohort_pool = torch.cuda.graph_pool_handle()
        return self.module.cohort_pool


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


__all__ = ["CohortGraphs", "MAX_GRAPHS", "hook_reason", "open", "reason"]

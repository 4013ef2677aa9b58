"""Many clients in one step (``--cohort N``, docs/gpu.md): the FedAvg family's local training of
N participants run together as one functional step over stacked weights.

Sequentially, each participant's round is its own loop of small kernels (forward, backward, clip,
SGD), which leaves a GPU idle between launches for the small models of label-skew benchmarks
(PFLlib's MNIST CNN). Here the N participants' weights are stacked along a new leading
dimension, and each local step is

    logits[k] = f(θ_k, x_k) for every k at once       (``torch.func.vmap`` of ``functional_call``)
    loss = Σ_k objective_k(logits[k], y_k)            (each client's own objective object; one
                                                       cross-entropy over all rows when each is CE(z + o_k, y))
    ∂loss/∂θ_k = ∂objective_k/∂θ_k                     (one backward: the clients do not interact)
    per client: the variant's ``correct`` hook, clip to its own norm, SGD with its own momentum

so the model's forward and backward are batched over clients, while everything that is a
client's own stays its own: its minibatch stream (its generator), its augmentation and loss
randomness (its stream of torch's generator, carried between steps as ``SeededSession`` does),
its loss terms and their state (SGB), its momentum buffers, its persistent state (SCAFFOLD's
c_i, FedDyn's g_k). A step takes the active clients whose minibatches have the same shape
together; a client whose steps have run out is masked (it takes no step and keeps its weights
and momentum), and an epoch's short last batch forms a group of its own.

The result equals the sequential path up to float reassociation (batched vs single matmuls;
the contract ``fedlt.testing.check_cohort`` holds it within 1e-5). Off by default: on the CPU
it was measured slower than the sequential loop. What cannot be vmapped falls back to the
sequential runner, with the reason from :func:`cohort_reason`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

import fedlt.augment
from fedlt.algorithms import cohort_graphs, compiled
from fedlt.algorithms.base import (backward_precision, build_objective, forward_precision,
                                   upcast)
from fedlt.algorithms.fedavg_family import (OBJECTIVE, AroundUpdate, ClientUpdate, Federated, PhasedUpdate, _PLAIN,
                                            check_parts, client_norms, client_update, features_of, frozen,
                                            step_reason, trainable_names)
from fedlt.algorithms.fedavg_family import graphs_notice as sequential_graphs_notice
from fedlt.algorithms.protocol import (ClientFailure, ClientResult, ClientRunner, ClientTask, Sessions, client_rng,
                                       isolated, uploaded)
from fedlt.datasets.source import to_device
from fedlt.models import eval_mode

def client_variant(algorithm: Any) -> ClientUpdate | None:
    """The algorithm's client loop as a ``ClientUpdate`` (the plain function is ``_PLAIN``), inside
    the updates run around it (:func:`around`); None when its client work is something else."""
    arounds = around(algorithm)
    fn = arounds[-1].update if arounds else _given(algorithm)
    if fn is client_update:
        return _PLAIN
    return fn if isinstance(fn, ClientUpdate) else None


def _given(algorithm: Any) -> Any:
    fn = algorithm.client_fn() if isinstance(algorithm, Federated) else None
    return getattr(fn, "given_module", fn)  # a wrapper that only builds the module when none is given (a head's)


def around(algorithm: Any) -> list[AroundUpdate]:
    """The updates run around the algorithm's client loop, outermost first (FedReLa's relabelling)."""
    out, fn = [], _given(algorithm)
    while isinstance(fn, AroundUpdate):
        out.append(fn)
        fn = fn.update
    return out


# timm's attributes of randomness drawn in forward through torch.nn.functional, not a Dropout module
# (EfficientNet's head: F.dropout(x, self.drop_rate); DropPath's drop_prob; ViT's drop_path_rate)
RANDOM_ATTRIBUTES = ("drop_rate", "drop_path_rate", "drop_prob", "drop_block_rate", "attn_drop_rate", "proj_drop_rate")
_PROBED: "weakref.WeakKeyDictionary[nn.Module, str | None]" = weakref.WeakKeyDictionary()


def _random_module(model: nn.Module) -> str | None:
    """A module whose forward draws random numbers in training mode: a Dropout module, or one with a
    timm rate attribute above 0 (functional dropout, DropPath)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"the model has {type(m).__name__} (its randomness would not follow each client's stream)"
        for attr in RANDOM_ATTRIBUTES:
            rate = getattr(m, attr, None)
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
                return (f"the model's {type(m).__name__} draws random numbers in its forward ({attr}={rate:g}: "
                        "functional dropout, which vmap cannot give each client's stream)")
    return None


def _probe(model: nn.Module, sample: torch.Tensor) -> str | None:
    """A training-mode forward of one sample under vmap with random operations refused (vmap's
    ``randomness="error"``): the reason when the model draws random numbers anywhere in it
    (F.dropout, torch.rand in a forward), whatever module does it. Once per model."""
    if model in _PROBED:
        return _PROBED[model]
    reason = None
    mode = model.training
    # the buffers batched over one client, so BatchNorm's in-place update of its running statistics
    # is one of a batched tensor (vmap refuses it on the module's own), on a copy; two copies of
    # the sample, so a BatchNorm1d has more than one value per channel
    buffers = {n: b.unsqueeze(0).clone() for n, b in model.named_buffers()}
    x = sample[:1].expand(2, *sample.shape[1:]).unsqueeze(0)
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            vmap(lambda b, xs: functional_call(model, b, (xs,)), randomness="error")(buffers, x)
    except RuntimeError as exc:
        if "random" in str(exc):
            reason = "the model's forward calls a random operation (e.g. F.dropout), which vmap cannot give each " \
                     "client's stream"
    except Exception:  # noqa: BLE001  (another failure is the cohort's to report, with its client)
        pass
    finally:
        model.train(mode)
    _PROBED[model] = reason
    return reason


def cohort_reason(algorithm: Any, model: nn.Module, sample: torch.Tensor | None = None) -> str | None:
    """Why ``algorithm``'s clients cannot train as one cohort on ``model`` (None: they can);
    ``sample`` (a client's input batch) lets a probe under vmap find randomness no module declares."""
    if not isinstance(algorithm, Federated):
        return f"{type(algorithm).__name__} is not one call per client per round (split learning runs sessions)"
    update = client_variant(algorithm)
    if update is None:
        return f"{type(algorithm).__name__}'s client work is not a ClientUpdate loop"
    phased = type(update).__call__ is PhasedUpdate.__call__
    loops = update.loops() if phased else [update]
    if phased and any(type(u).without_loop is not ClientUpdate.without_loop for u in loops):
        return f"{type(update).__name__} has a phase that may answer without training (without_loop)"
    reason = next((r for r in map(_loop_reason, loops) if r), None)
    if reason:
        return reason
    return _norm_reason(model) or _random_module(model) or (_probe(model, sample) if sample is not None else None)


def _norm_reason(model: nn.Module) -> str | None:
    """Why the model's BatchNorm cannot keep per-client running statistics as stacked buffers: a
    cumulative average (``momentum=None``) reads ``num_batches_tracked`` as a Python number."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats \
                and m.momentum is None:
            return (f"the model's {type(m).__name__} has momentum=None (a cumulative average that reads "
                    "num_batches_tracked on the host, once per client)")
    return None


def running_names(model: nn.Module) -> list[str]:
    """The buffers a training-mode forward updates in place: the running statistics (running_mean,
    running_var, num_batches_tracked) of a BatchNorm, or of an InstanceNorm that tracks them, by
    state-dict name."""
    names = []
    for prefix, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            names += [f"{prefix}.{n}" if prefix else n for n, b in m.named_buffers(recurse=False) if b is not None]
    return names


def _loop_reason(update: ClientUpdate) -> str | None:
    """Why one local loop cannot run as a cohort step: a hook the batched step does not carry,
    or its own stated reason."""
    if update.cohort_refusal:
        return update.cohort_refusal
    for hook in ("parts", "backward"):
        if getattr(type(update), hook) is not getattr(ClientUpdate, hook):
            return (f"{type(update).__name__} overrides ClientUpdate.{hook} (a second forward, a module hook "
                    "or a two-pass step that the batched forward does not carry)")
    # work around the loop (FedYoYo's, FedReLa's)
    for hook in ("__call__", "loop"):
        if getattr(type(update), hook) is not getattr(ClientUpdate, hook):
            return f"{type(update).__name__} overrides ClientUpdate.{hook}, which the cohort's step does not run"
    return None


def _same_schedule(tasks: Sequence[ClientTask]) -> str | None:
    first = tasks[0].schedule
    keys = ("lr", "momentum", "weight_decay", "clip", "precision", "augment")
    for t in tasks[1:]:
        if any(getattr(t.schedule, k) != getattr(first, k) for k in keys):
            return "the participants' optimisers differ (lr, momentum, weight decay, clip, precision or augmentation)"
    return None


def offset_of(objective: Any, num_classes: int) -> torch.Tensor | None:
    """o (float64, length C) when ``objective`` is exactly CE(z + o, y) with a finite o — one term of
    weight 1 that declares its ``ce_offset`` and needs no teacher, parameters or state — else None."""
    if objective.needs_teacher or objective.needs_params or objective.state_dict():
        return None
    flat = objective.flat_terms() if hasattr(objective, "flat_terms") else [(1.0, objective)]
    if len(flat) != 1 or flat[0][0] != 1.0 or not hasattr(flat[0][1], "ce_offset"):
        return None
    offset = flat[0][1].ce_offset(num_classes)
    # −inf (FedLC's absent classes) stays on the objective's own path, whose checks name a bad target
    return offset if offset is not None and bool(torch.isfinite(offset).all()) else None


@dataclass
class _Client:
    """One participant inside a cohort: what ``ClientUpdate.__call__`` keeps in locals."""

    task: ClientTask
    objective: Any
    augment: Any
    local: Any
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]]
    rng: dict[str, torch.Tensor]
    parts: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    steps: int = 0


class _Seeded:
    """Runs a client's code in its own stream of torch's generator, carried between calls."""

    def __init__(self, client: _Client) -> None:
        self.client = client

    def __enter__(self) -> None:
        self.ctx = client_rng(self.client.task, self.client.rng)
        self.after = self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.ctx.__exit__(*exc)
        if exc[0] is None:
            self.client.rng = dict(self.after)


def _open(update: ClientUpdate, task: ClientTask, model: nn.Module, names: list[str],
          rng: dict[str, torch.Tensor] | None) -> _Client:
    """A participant's round set up exactly as ``ClientUpdate.loop`` does, in its own stream
    (continued from ``rng``, a previous phase's, when given)."""
    with client_rng(task, rng) as after:
        model.load_state_dict(task.weights)
        model.train()
        objective = build_objective(task.objective, task.context, task.cid, task.data.class_counts,
                                    [task.weights[n] for n in names], task.state.get("loss"))
        generator = update.generator(task)
        augment = fedlt.augment.build(task.schedule.augment)
        local = update.begin(task, model, [task.weights[n].detach().clone() for n in names])
        stream = task.data.batches(task.schedule.batches(len(task.data), generator, task.data.index_device))
    return _Client(task, objective, augment, local, stream, dict(after))


class _ClientForward:
    """``StepForward``'s interface (fedlt.algorithms.fedavg_family) over one client's slice ``j``
    of a cohort's batched forward: its logits and h, its weights (``params``: name → stacked
    over the group) for a submodule's call, and a reference forward of its own."""

    def __init__(self, model: nn.Module, prefixes: dict[int, str], params: dict[str, torch.Tensor], j: int,
                 x: torch.Tensor, logits: torch.Tensor, features: torch.Tensor | None) -> None:
        self.model, self.prefixes, self.params, self.j = model, prefixes, params, j
        self.x, self.logits, self.features = x, logits, features

    def _weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        prefix = self.prefixes[id(module)]
        return {n[len(prefix):]: t[self.j] for n, t in self.params.items() if n.startswith(prefix)}

    def call(self, module: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        return functional_call(module, self._weights(module), inputs)

    def param(self, module: nn.Module, name: str) -> torch.Tensor:
        return self._weights(module)[name]

    @torch.no_grad()
    def reference(self, weights: dict[str, torch.Tensor]) -> torch.Tensor:
        with features_of(self.model) as seen, eval_mode(self.model):
            functional_call(self.model, weights, (self.x,))
        return seen[0]


class Cohort:
    """N participants' round as one vmapped loop (see the module); ``run()`` returns their results
    in the order of ``tasks``. ``rng``: each client's random stream to continue (a later phase of
    a round, :class:`fedlt.algorithms.fedavg_family.PhasedUpdate`); afterwards ``streams()``."""

    def __init__(self, update: ClientUpdate, tasks: Sequence[ClientTask], model: nn.Module,
                 rng: Sequence[dict[str, torch.Tensor]] | None = None) -> None:
        self.update, self.model = update, model
        self.tasks = [update.start(t) for t in tasks]
        self.rng = list(rng) if rng is not None else [None] * len(self.tasks)

    def run(self) -> list[ClientResult]:
        with frozen(self.model, self.update.frozen_keys(self.model)):
            self._setup()
            while True:
                batches = self._draw()
                if not batches:
                    break
                for shape in dict.fromkeys(tuple(x.shape) for _, x, _ in batches):
                    self._step([b for b in batches if tuple(b[1].shape) == shape])
            return [self._finish(k, c) for k, c in enumerate(self.clients)]

    def streams(self) -> list[dict[str, torch.Tensor | None]]:
        """Each client's random stream where its round stopped (the next phase continues it)."""
        return [c.rng for c in self.clients]

    def _setup(self) -> None:
        model = self.model
        self.names = trainable_names(model)
        self.prefixes = {id(m): f"{name}." if name else "" for name, m in model.named_modules()}
        self.clients = [_open(self.update, t, model, self.names, r) for t, r in zip(self.tasks, self.rng)]
        self.schedule = self.tasks[0].schedule
        # BatchNorm's running statistics: each client's own, stacked; a step passes its group's
        # rows to the vmapped forward, whose in-place updates (one per client, on that client's
        # batch statistics) are written back after the step's terms
        self.running = {n: torch.stack([t.weights[n] for t in self.tasks])
                        for n in running_names(model) if n in self.tasks[0].weights}
        moving = set(self.names) | set(self.running)
        # frozen parameters and the other buffers: the same for every step, stacked once (a
        # non-persistent buffer, outside the state dict, is the module's own for every client: FedETF's ETF)
        self.fixed = {n: torch.stack([t.weights[n] for t in self.tasks])
                      for n, _ in [*model.named_parameters(), *model.named_buffers()]
                      if n not in moving and n in self.tasks[0].weights}
        self.weights = [torch.stack([t.weights[n].detach() for t in self.tasks]) for n in self.names]
        self.momentum = [torch.zeros_like(w) for w in self.weights] if self.schedule.momentum else []
        # per parameter, the clients whose momentum buffer has started (torch starts it at the first
        # d_p): known from the loop itself, so kept on the host
        self.started: list[set[int]] = [set() for _ in self.weights]
        self.indices: dict[tuple[int, ...], torch.Tensor] = {}
        # --graphs: the plain step captured per (group size, batch shape) and replayed (None: eager, said)
        self.graphs = cohort_graphs.open(self) if self.schedule.graphs is not None else None
        # --compile: the vmapped forward (and its backward) through torch.compile (fedlt.algorithms.compiled),
        # for the variants whose sequential step compiles too (step_reason); inductor's own CUDA
        # graphs where ours never capture the step (they cannot nest in ours)
        backend = self.schedule.compile if step_reason(type(self.update)) is None else None
        self.vmapped = vmap(self._forward) if backend is None else \
            compiled.vmapped(model, backend, cudagraphs=self.graphs is None)

    def _draw(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """The next minibatch (augmented) of every client that has one; the others are masked."""
        out = []
        for k, c in enumerate(self.clients):
            if not c.augment:  # no augmentation draws nothing from torch's generator: no stream to swap in
                batch = next(c.stream, None)
                if batch is not None:
                    out.append((k, batch[0], batch[1]))
                continue
            with _Seeded(c):
                batch = next(c.stream, None)
                if batch is not None:
                    out.append((k, c.augment(batch[0]), batch[1]))
        return out

    def _forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, params, (x,))

    def _with_features(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and the representation h (``features_of``), captured inside the vmapped call."""
        with features_of(self.model) as seen:
            logits = functional_call(self.model, params, (x,))
        return logits, seen[0]

    def _index(self, ks: list[int]) -> torch.Tensor:
        """The group's rows as a device index, made once per group of a cohort (groups repeat
        step after step), pinned and copied without a wait."""
        key = tuple(ks)
        if key not in self.indices:
            self.indices[key] = to_device(torch.tensor(ks), self.weights[0].device)
        return self.indices[key]

    def _leaves(self, index: torch.Tensor, full: bool) -> tuple[list[torch.Tensor], dict, dict]:
        """The group's weights as leaves of this step's backward, its running statistics and its
        fixed tensors (``full``: every client steps, so the stacks themselves, no gather and scatter)."""
        if full:
            leaves = [w.detach().requires_grad_(True) for w in self.weights]
            running = self.running  # BatchNorm updates its statistics in the stacks themselves
            return leaves, running, self.fixed | running
        leaves = [w.index_select(0, index).requires_grad_(True) for w in self.weights]
        running = {n: t.index_select(0, index) for n, t in self.running.items()}
        return leaves, running, {n: t.index_select(0, index) for n, t in self.fixed.items()} | running

    def _step(self, group: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        ks = [k for k, _, _ in group]
        replayed = self.graphs.step(ks, group) if self.graphs is not None else None
        if replayed is not None:
            self._record(group, replayed)
            return
        index = self._index(ks)
        leaves, running, fixed = self._leaves(index, len(ks) == len(self.clients))
        x = torch.stack([x for _, x, _ in group])
        self._backward(group, index, leaves, fixed, x, record=True)
        if type(self.update).ascent is not ClientUpdate.ascent:  # a second forward: the statistics move again
            self._again_at_ascent(group, index, leaves, fixed, x)
        if running is not self.running:  # a part of the clients stepped: their statistics' rows written back
            for name, rows in running.items():
                self.running[name].index_copy_(0, index, rows)
        grads = self._corrected(ks, leaves)
        self._clip(grads)
        self._sgd(ks, index, leaves, grads)
        if type(self.update).stepped is not ClientUpdate.stepped:
            self._stepped(group)

    def _backward(self, group: list[tuple[int, torch.Tensor, torch.Tensor]], index: torch.Tensor,
                  leaves: list[torch.Tensor], fixed: dict[str, torch.Tensor], x: torch.Tensor, record: bool) -> None:
        """One batched forward of the group's clients on their ``step_input`` (each drawn in its
        stream), their step losses, one backward of their sum into ``leaves``; ``record``: the
        parts are the step's (its loss, its count), not a second pass's."""
        params = dict(zip(self.names, leaves)) | fixed
        inputs = x
        if type(self.update).step_input is not ClientUpdate.step_input:
            inputs = []
            for j, (k, _, _) in enumerate(group):
                with _Seeded(self.clients[k]):
                    inputs.append(self.update.step_input(self.clients[k].local, x[j]))
            inputs = torch.stack(inputs)
        with forward_precision(self.schedule.precision, x.device):
            if self.update.features:
                logits, features = vmap(self._with_features)(params, inputs)
            else:
                logits, features = self.vmapped(params, inputs), None
            offsets = self._offsets(logits.shape[-1])
            if offsets is not None:
                total = [self._offset_ce(group, index, offsets, logits, record)]
            else:
                total = self._terms(group, leaves, params, x, inputs, logits, features, record)
        with backward_precision(x.device):
            torch.stack(total).sum().backward()

    def _again_at_ascent(self, group: list[tuple[int, torch.Tensor, torch.Tensor]], index: torch.Tensor,
                         leaves: list[torch.Tensor], fixed: dict[str, torch.Tensor], x: torch.Tensor) -> None:
        """``ClientUpdate.backward``'s second pass for the group, on ``leaves`` in place as the
        sequential step does: each client's ε from its own gradients (``ascent``: its own norm),
        the leaves moved to w + ε, their gradients taken again there, the leaves moved back by −ε."""
        with torch.no_grad():
            ascent = self.update.ascent([leaf.new_zeros(leaf.shape) if leaf.grad is None else leaf.grad
                                         for leaf in leaves])
            for leaf, e in zip(leaves, ascent):
                leaf.add_(e)
        for leaf in leaves:
            leaf.grad = None
        self._backward(group, index, leaves, fixed, x, record=False)
        with torch.no_grad():
            for leaf, e in zip(leaves, ascent):
                leaf.sub_(e)

    def _offsets(self, num_classes: int) -> torch.Tensor | None:
        """Every participant's offset o_k (K×C, float64) when each one's step loss is the plain
        ``terms`` of one offset cross-entropy CE(z + o_k, y) of weight 1 — ``ce``, ``logit_adjust``,
        a finite ``fedlc`` — else None: then the step's loss is computed for all of them at once."""
        if not hasattr(self, "offsets"):
            self.offsets, self.offsets_on = None, {}
            if type(self.update).terms is ClientUpdate.terms and not self.update.features and \
                    type(self.update).step_input is ClientUpdate.step_input:
                found = [offset_of(c.objective, num_classes) for c in self.clients]
                if all(o is not None for o in found):
                    self.offsets = torch.stack(found)
        return self.offsets

    def _offset_ce(self, group: list[tuple[int, torch.Tensor, torch.Tensor]], index: torch.Tensor,
                   offsets: torch.Tensor, logits: torch.Tensor, record: bool) -> torch.Tensor:
        """Σ_k CE(z_k + o_k, y_k) over the group as one cross-entropy over its G·B rows (each
        client's own mean), instead of G objective calls: a step's loss in a fixed handful of
        operators for any G. Each client's part is recorded as its objective's would be."""
        losses = self._offset_losses(index, offsets, logits, torch.stack([y for _, _, y in group]))
        if record:
            self._record(group, losses.detach())
        return losses.sum()

    def _offset_losses(self, index: torch.Tensor, offsets: torch.Tensor, logits: torch.Tensor,
                       y: torch.Tensor) -> torch.Tensor:
        """CE(z_k + o_k, y_k), each client's mean over its rows (G)."""
        z = upcast(logits)
        key = (z.device, z.dtype)
        if key not in self.offsets_on:  # once per cohort: no copy to the device per step
            self.offsets_on[key] = offsets.to(device=z.device, dtype=z.dtype)
        o = self.offsets_on[key].index_select(0, index)
        rows = F.cross_entropy((z + o.unsqueeze(1)).flatten(0, 1), y.flatten(), reduction="none")
        return rows.view(len(index), -1).mean(1)

    def _record(self, group: list[tuple[int, torch.Tensor, torch.Tensor]], losses: torch.Tensor) -> None:
        """Each client's step loss (``losses``: the group's, detached) recorded as its objective's part."""
        for j, (k, _, _) in enumerate(group):
            self.clients[k].parts.setdefault(OBJECTIVE, []).append(losses[j])
            self.clients[k].steps += 1

    def plain_step(self, ks: list[int], index: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The step of a cohort whose loss is a plain offset cross-entropy and whose variant adds
        nothing to the step (what ``--graphs`` captures, fedlt.algorithms.cohort_graphs): the same
        operators as :meth:`_step` then takes, in its order, from the group's stacked minibatch.
        Returns the group's step losses (detached)."""
        leaves, _, fixed = self._leaves(index, len(ks) == len(self.clients))
        params = dict(zip(self.names, leaves)) | fixed
        with forward_precision(self.schedule.precision, x.device):
            losses = self._offset_losses(index, self.offsets, self.vmapped(params, x), y)
            total = [losses.sum()]
        with backward_precision(x.device):
            torch.stack(total).sum().backward()
        grads = [leaf.grad for leaf in leaves]
        self._clip(grads)
        self._sgd(ks, index, leaves, grads)
        return losses.detach()

    def _terms(self, group: list[tuple[int, torch.Tensor, torch.Tensor]], leaves: list[torch.Tensor],
               params: dict[str, torch.Tensor], x: torch.Tensor, inputs: torch.Tensor, logits: torch.Tensor,
               features: torch.Tensor | None, record: bool) -> list[torch.Tensor]:
        """Each client's step loss from the variant's ``terms`` on its slice of the batched forward
        (on ``inputs``, the clients' ``step_input`` of their minibatches ``x``)."""
        ks = [k for k, _, _ in group]
        teacher = self._teacher(ks, x) if any(self.clients[k].objective.needs_teacher for k in ks) else None
        total = []
        for j, (k, _, y) in enumerate(group):
            c = self.clients[k]
            extra: dict[str, Any] = {}
            if c.objective.needs_teacher:
                extra["teacher_logits"] = teacher[j]
            if c.objective.needs_params:
                extra["params"] = [leaf[j] for leaf in leaves]
            forward = _ClientForward(self.model, self.prefixes, params, j, inputs[j], logits[j],
                                     None if features is None else features[j])
            with _Seeded(c):
                parts = self.update.terms(c.local, forward, c.objective, y, extra)
            if record:
                for name, value in parts.items():
                    c.parts.setdefault(name, []).append(value.detach())
                c.steps += 1
            total.append(sum(parts.values()))
        return total

    def _stepped(self, group: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """The variant's ``stepped`` hook (APFL's personal model v and α), client by client after
        the batched step, on the work module holding that client's weights just stepped: the
        second model's step is the client's own, as sequentially."""
        tensors = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        for k, x, y in group:
            c = self.clients[k]
            with torch.no_grad():
                for i, name in enumerate(self.names):
                    tensors[name].copy_(self.weights[i][k])
                for name, stacked in [*self.fixed.items(), *self.running.items()]:
                    tensors[name].copy_(stacked[k])
            with _Seeded(c):
                self.update.stepped(c.local, self.model, x, y, c.steps - 1)
            with torch.no_grad():  # a training-mode forward in the hook (APFL's w(x)) moved the statistics
                for name, stacked in self.running.items():
                    stacked[k].copy_(tensors[name])

    @torch.no_grad()
    def _teacher(self, ks: list[int], x: torch.Tensor) -> torch.Tensor:
        """Each client's received global model on its batch, as evaluated (``teacher_logits``)."""
        received = {n: torch.stack([self.tasks[k].weights[n] for k in ks]) for n in self.tasks[ks[0]].weights}
        with eval_mode(self.model):
            return upcast(vmap(self._forward)(received, x))

    def _corrected(self, ks: list[int], leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The stacked gradients after each client's ``correct`` hook (SCAFFOLD, FedDyn), which
        edits per-client parameter views whose ``.grad`` is that client's slice."""
        grads = [leaf.grad for leaf in leaves]
        if type(self.update).correct is ClientUpdate.correct:
            return grads
        per_client = []
        for j, k in enumerate(ks):
            params = []
            for leaf, g in zip(leaves, grads):
                p = leaf.detach()[j]
                p.grad = None if g is None else g[j].clone()
                params.append(p)
            self.update.correct(self.clients[k].local, params)
            per_client.append([p.grad for p in params])
        out = []
        for i in range(len(leaves)):
            column = [pc[i] for pc in per_client]
            if all(g is None for g in column):
                out.append(None)
            elif any(g is None for g in column):
                raise RuntimeError(f"parameter {self.names[i]} has a gradient for some clients only")
            else:
                out.append(torch.stack(column))
        return out

    def _clip(self, grads: list[torch.Tensor | None]) -> None:
        """``clip_grad_norm_`` per client: each client's gradients scaled to its own total norm."""
        if self.schedule.clip is None:
            return
        present = [g for g in grads if g is not None]
        # per client (row), over every entry of each parameter (a scalar too: FedETF's temperature)
        coef = torch.clamp(self.schedule.clip / (client_norms(present) + 1e-6), max=1.0)
        for g in present:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))

    @torch.no_grad()
    def _sgd(self, ks: list[int], index: torch.Tensor, leaves: list[torch.Tensor],
             grads: list[torch.Tensor | None]) -> None:
        """``torch.optim.SGD`` (momentum, dampening 0, weight decay) on each client's slice, every
        parameter at once (``torch._foreach_*``: a few multi-tensor kernels, not a dozen per
        parameter); the first step of a parameter starts its momentum buffer at d_p, as torch does."""
        s = self.schedule
        live = [i for i, g in enumerate(grads) if g is not None]  # torch's SGD skips a parameter without one
        if not live:
            return
        full = len(ks) == len(self.clients)
        params = [leaves[i].detach() for i in live]
        d_p = list(torch._foreach_add([grads[i] for i in live], params, alpha=s.weight_decay)) if s.weight_decay \
            else [grads[i] for i in live]
        if s.momentum:
            d_p = self._momentum(ks, index, live, d_p, full)
        if full:  # the leaves are the stacks
            torch._foreach_add_([self.weights[i] for i in live], d_p, alpha=-s.lr)
            return
        for i, p, step in zip(live, params, d_p):
            self.weights[i].index_copy_(0, index, p.add(step, alpha=-s.lr))

    def _momentum(self, ks: list[int], index: torch.Tensor, live: list[int], d_p: list[torch.Tensor],
                  full: bool) -> list[torch.Tensor]:
        """buf ← μ·buf + d_p for the group's clients whose buffer started, buf ← d_p for the others;
        the new buffers (the group's rows)."""
        mu = self.schedule.momentum
        bufs = [self.momentum[i] if full else self.momentum[i].index_select(0, index) for i in live]
        continuing = []  # (buffer, step) of the parameters every one of whose clients has started
        for i, buf, step in zip(live, bufs, d_p):
            started = [k in self.started[i] for k in ks]
            if all(started):
                continuing.append((buf, step))
            elif not any(started):
                buf.copy_(step)
            else:
                first = to_device(torch.tensor([not s for s in started]), buf.device)
                buf.copy_(torch.where(first.view(-1, *([1] * (buf.dim() - 1))), step, buf.mul(mu).add(step)))
            self.started[i].update(ks)
        if continuing:
            torch._foreach_mul_([b for b, _ in continuing], mu)
            torch._foreach_add_([b for b, _ in continuing], [d for _, d in continuing])
        if not full:
            for i, buf in zip(live, bufs):
                self.momentum[i].index_copy_(0, index, buf)
        return bufs

    def _finish(self, k: int, c: _Client) -> ClientResult:
        """The client's result as the loop's end gives it: its trained weights loaded into the
        work module, so ``end`` and ``upload`` read the model they would read sequentially."""
        task = c.task
        train_loss = check_parts(c.parts, c.steps, task)
        params = [w[k] for w in self.weights]
        trained = dict(zip(self.names, params)) | {n: r[k] for n, r in self.running.items()}
        self.model.load_state_dict({n: trained.get(n, t) for n, t in task.weights.items()})
        with _Seeded(c):
            own, extras = self.update.end(c.local, task, self.model, params, c.steps)
            weights = self.update.upload(c.local, task, self.model, own)
        state = ({"loss": c.objective.state_dict()} if c.objective.state_dict() else {}) | own
        return ClientResult(task.cid, weights, len(task.data), c.steps, train_loss, state, extras=extras)


def _answered_or_trained(update: ClientUpdate, tasks: Sequence[ClientTask], model: nn.Module,
                         rng: Sequence[dict[str, torch.Tensor]] | None = None) -> list[ClientResult]:
    """Each task the update answers without training (``without_loop``, in the client's stream
    as sequentially), the others trained as one :class:`Cohort` (their streams continued from
    ``rng``); in the order of ``tasks``."""
    answered, streams = [], list(rng) if rng is not None else [None] * len(tasks)
    for task, stream in zip(tasks, streams):
        with client_rng(task, stream):
            answered.append(update.without_loop(task, model))
    rest = [t for t, a in zip(tasks, answered) if a is None]
    kept = [r for r, a in zip(streams, answered) if a is None]
    trained = iter(Cohort(update, rest, model, kept).run() if rest else [])
    return [a if a is not None else next(trained) for a in answered]


def train_around(arounds: Sequence[AroundUpdate], update: ClientUpdate, tasks: Sequence[ClientTask],
                 model: nn.Module, rng: Sequence[dict[str, torch.Tensor]] | None = None) -> list[ClientResult]:
    """:func:`train_cohort` inside the updates run around it (outermost first): each one's ``before``
    and ``after`` client by client, in the client's stream (``rng``: where it stands), carried into
    the training as sequentially."""
    if not arounds:
        return train_cohort(update, tasks, model, rng)
    outer, prepared, streams = arounds[0], [], []
    for task, stream in zip(tasks, rng or [None] * len(tasks)):
        with client_rng(task, stream) as after:
            prepared.append(outer.before(task, model))
        streams.append(dict(after))
    trained = train_around(arounds[1:], update, prepared, model, streams)
    return [outer.after(p, r) for p, r in zip(prepared, trained)]


def train_cohort(update: ClientUpdate, tasks: Sequence[ClientTask], model: nn.Module,
                 rng: Sequence[dict[str, torch.Tensor]] | None = None) -> list[ClientResult]:
    """The participants' round as one :class:`Cohort`; a :class:`PhasedUpdate`'s round as one
    cohort per phase, each client's random stream carried from phase to phase (``rng``: where
    each stream starts; None: at its beginning)."""
    if not isinstance(update, PhasedUpdate):
        return _answered_or_trained(update, tasks, model, rng)
    done: list[list[ClientResult]] = [[] for _ in tasks]
    streams = rng
    while True:
        steps = [update.phase(len(d), t, d) for t, d in zip(tasks, done)]
        if steps[0] is None:
            return [update.join(t, d) for t, d in zip(tasks, done)]
        cohort = Cohort(steps[0][0], [task for _, task in steps], model, streams)
        for d, result in zip(done, cohort.run()):
            d.append(result)
        streams = cohort.streams()


class CohortRunner:
    """A ClientRunner that trains a FedAvg-family round's participants ``size`` at a time as one
    cohort each (:class:`Cohort`), around ``transport`` (this process's ``LocalRunner``), which
    runs everything else: split-learning sessions, a round with an injected fault, an algorithm
    or model :func:`cohort_reason` refuses (``fallback`` keeps the last reason). With a
    transport that tolerates failures, a cohort that raises is rerun client by client, so the
    failure is charged to the client that caused it."""

    def __init__(self, transport: ClientRunner, size: int) -> None:
        self.transport, self.size = transport, size
        self.fallback: str | None = None
        self.first_fallback: str | None = None  # the first round that fell back, and why (the run's summary)

    @property
    def tolerate(self) -> bool:
        return bool(getattr(self.transport, "tolerate", False))

    def reason(self, algorithm: Any, tasks: Sequence[ClientTask]) -> str | None:
        if any(t.fault for t in tasks):
            return "a participant has an injected fault (run one by one)"
        if any(t.upload is not None and t.upload.sample_level is not None for t in tasks):
            return SAMPLE_LEVEL
        model = getattr(algorithm, "_work", None)
        if model is None:
            return f"{type(algorithm).__name__} has no work module"
        sample = tasks[0].data.take(torch.zeros(1, dtype=torch.long, device=tasks[0].data.index_device))[0] \
            if tasks and tasks[0].data is not None and len(tasks[0].data) else None
        return cohort_reason(algorithm, model, sample) or (_same_schedule(tasks) if tasks else None)

    def call(self, algorithm: Any, tasks: Sequence[ClientTask]) -> list[ClientResult | ClientFailure]:
        self.fallback = self.reason(algorithm, tasks)
        if self.fallback is not None and self.first_fallback is None and tasks:
            self.first_fallback = f"round {tasks[0].round_index + 1}: {self.fallback}"
        if self.fallback is not None or self.size <= 1:
            return self.transport.call(algorithm, tasks)
        update, arounds, out = client_variant(algorithm), around(algorithm), []
        for start in range(0, len(tasks), self.size):
            chunk = tasks[start:start + self.size]
            try:
                trained = train_around(arounds, update, [isolated(t) for t in chunk], algorithm._work)
                out += [uploaded(t, r) for t, r in zip(chunk, trained)]
            except Exception:  # noqa: BLE001  (rerun one by one: the transport names the failing client)
                if not self.tolerate:
                    raise
                out += self.transport.call(algorithm, chunk)
        return out

    def exchange(self, algorithm: Any, tasks: Sequence[ClientTask]) -> Sessions:
        return self.transport.exchange(algorithm, tasks)

    def each(self, job: str, algorithm: Any, tasks: Sequence[Any]) -> list[Any]:
        """Other kinds of one-call work (``Runner.each``): the transport's, one client at a time."""
        return self.transport.each(job, algorithm, tasks)


SAMPLE_LEVEL = ("sample-level DP vmaps each client's step over its samples (per-sample gradients), "
                "which the cohort's vmap over clients does not nest")


def cohort_fallback(runner: Any, algorithm: Any, size: int, sample_level: bool = False) -> str | None:
    """Why a run asking for cohorts of ``size`` trains its clients one at a time, as known before
    its first round (the algorithm, the model, the engine); None when the cohort runs (or none
    was asked). A round can still fall back on its own (an injected fault): ``first_fallback``."""
    if size <= 1:
        return None
    if sample_level:
        return SAMPLE_LEVEL
    if not isinstance(runner, CohortRunner):
        return f"{type(runner).__name__} runs each client on its own (workers > 1 or Flower)"
    return runner.reason(algorithm, [])


def graphs_notice(algorithm: Any, device: torch.device) -> str:
    """The line a run with ``--graphs --cohort N`` starts with (the cohort runs): one client's
    notice (fedlt.algorithms.fedavg_family.graphs_notice), or the reason every phase of the
    algorithm's cohort steps stays eager whatever its objective (a hook of the variant's)."""
    update = client_variant(algorithm)
    loops = [] if update is None else update.loops() if type(update).__call__ is PhasedUpdate.__call__ else [update]
    reasons = [cohort_graphs.hook_reason(u) for u in loops]
    return sequential_graphs_notice(algorithm, device, reasons[0] if reasons and all(reasons) else None)


def with_cohort(transport: ClientRunner, size: int) -> ClientRunner:
    """``transport`` itself for ``size`` 1 (the default), else a :class:`CohortRunner` around it."""
    return transport if size <= 1 else CohortRunner(transport, size)


__all__ = ["Cohort", "CohortRunner", "train_cohort", "cohort_fallback", "cohort_reason", "graphs_notice", "with_cohort"]

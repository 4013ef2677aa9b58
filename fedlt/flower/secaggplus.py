"""Secure aggregation on the Flower engine: Flower's own SecAgg+ (Bell et al. 2020, CCS) — flwr's
``SecAggPlusWorkflow`` on the server, ``secaggplus_mod`` on each ClientApp — not fedlt's simulated
masking (docs/privacy.md).

A round's training call under ``--secure-aggregation`` (the upload plan's ``secure``) goes through
the workflow instead of plain ``train`` messages. Its four stages — setup (public keys), share keys
(encrypted Shamir shares of each client's mask seed and key), collect masked vectors (the fedlt
task, trained by the ClientApp, whose update the mod quantises and masks) and unmask (the shares
that remove the masks) — are ``train`` messages carrying the record ``secaggplus_configs``, which
the ClientApp passes through the mod (fedlt.flower.client_app). The workflow is written for the
legacy Strategy API: it asks ``configure_fit`` for each participant's FitIns and hands
``aggregate_fit`` each FitRes, its parameters replaced by the unmasked weighted mean.
:class:`TaskStrategy` is that strategy: a FitIns carries fedlt's task and the run (its config), a
FitRes the client's result without its update (its metrics) and the update (its parameters, which
only the mod reads). The server then reads the mean as the local engine's secure path reads its
unmasked sum (fedlt.uploads, fedlt.privacy.upload.secaggplus_sum).

What the mod quantises (flwr.common.secure_aggregation.quantization): x_k = [Δ_k, b_k] — the
client's chain-applied update and whether it was under the DP clip norm — weighted by
r_k = num_examples / max_weight (1 under client-level DP, else |D_k|), clipped to ±c, and rounded
stochastically to T levels: q = round((clip(r_k·x_k, −c, c) + c)·T / (2c)). Each rounding is within
one step 2c/T, so the mean the server reads is within n·(2c/T) / Σ r_k of the exact mean of the n
uploads (:func:`tolerance`; 2c/T under uniform weights). The settings (:func:`settings`):

- c: the DP clip norm C (every coordinate of an update clipped to norm C lies in ±C; at least 1,
  for b_k; plus 8 standard deviations of local DP's noise), else SecAgg+'s default 8. A client whose
  r_k·x_k leaves ±c refuses in one line instead of being clipped silently.
- T: the largest power of two with n·T ≤ 2^31 (the modulus is 2^32, SecAgg+'s largest: the sum of
  n quantised vectors must not wrap; T ≤ 2^30 keeps the mod's int32 rounding exact).
- max_weight: 1 (uniform), else the power of two at or above the largest participant's |D_k|, so
  that r_k is exact in the mod's fixed point.
- SecAgg+'s graph: each client shares with 2 neighbours (``num_shares=3``), 2 of them needed to
  recover its keys (``reconstruction_threshold=2``), as Flower's SecAgg+ example.

The stochastic rounding draws from numpy's global generator: the ClientApp seeds it from the
client's stream for the round after its work (``rounding_seed``), so a resumed round quantises as
the first did; the masks (fresh keys each round) cancel exactly mod 2^32, so the unmasked mean —
and the run — does not depend on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, FitRes, Parameters, parameters_to_ndarrays
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

from fedlt.algorithms.protocol import ClientFailure, ClientResult, ClientTask, travelling
from fedlt.errors import FedltError
from fedlt.flower import codec, error_line
from fedlt.privacy.upload import UploadPlan

NUM_SHARES, RECONSTRUCTION_THRESHOLD = 3, 2  # Flower's SecAgg+ example (examples/secaggplus-mt)
MODULUS_RANGE = 1 << 32  # SecAgg+'s largest
DEFAULT_CLIPPING_RANGE = 8.0  # SecAgg+'s default, for an update with no clip norm
LOCAL_NOISE_STDS = 8.0  # local DP's noise: c covers C + 8σC (a coordinate beyond it: probability ~1e-15)


@dataclass(frozen=True)
class Settings:
    """SecAgg+'s quantisation of one round (see the module): c, T and max_weight."""

    clipping_range: float
    quantization_range: int
    max_weight: float


def settings(plan: UploadPlan, participants: int, largest: int) -> Settings:
    """The round's settings for ``participants`` uploads, the largest from ``largest`` samples."""
    c = DEFAULT_CLIPPING_RANGE if plan.clip is None else max(plan.clip + LOCAL_NOISE_STDS * (plan.noise_std or 0.0), 1.0)
    levels = 1 << min(31 - math.ceil(math.log2(max(participants, 2))), 30)
    return Settings(float(c), levels, 1.0 if plan.uniform else float(1 << math.ceil(math.log2(max(largest, 1)))))


def tolerance(found: Settings, weights: Sequence[float]) -> float:
    """How far (per coordinate) the mean SecAgg+ gives can be from the exact weighted mean of
    uploads with these weights (|D_k|, or 1 each): one rounding step 2c/T each, n of them over Σ r_k."""
    ratios = [w / found.max_weight for w in weights]
    return len(ratios) * 2 * found.clipping_range / found.quantization_range / sum(ratios)


def rounding_seed(sampling_seed: int, round_index: int, cid: int) -> int:
    """The seed of numpy's generator, from which the mod draws the client's stochastic rounding."""
    return int(np.random.SeedSequence([sampling_seed, round_index, cid, 0x5EC4]).generate_state(1)[0])


class TaskStrategy(Strategy):
    """The legacy strategy SecAggPlusWorkflow drives: each participant's FitIns (fedlt's task) and,
    after the workflow, the FitRes of those that arrived and the unmasked mean (``aggregate``)."""

    def __init__(self, grid: Any, fit_ins: dict[int, FitIns]) -> None:
        self.grid, self.fit_ins = grid, fit_ins
        self.results: dict[int, FitRes] = {}  # node -> its FitRes
        self.aggregate: np.ndarray | None = None

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return [(GridClientProxy(node, self.grid, 0), ins) for node, ins in self.fit_ins.items()]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        self.results = {proxy.node_id: res for proxy, res in results}
        if results:
            self.aggregate = np.concatenate([a.reshape(-1) for a in parameters_to_ndarrays(results[0][1].parameters)])
        return None, {}

    # the workflow asks for fit only; evaluation is fedlt's own (FlowerRunner.evaluate)
    def initialize_parameters(self, client_manager: Any) -> None:
        return None

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return []

    def aggregate_evaluate(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


class ErrorsSeen:
    """The grid as the workflow sees it, keeping each node's error reply (the workflow keeps only
    the errors, not whose they were): a client's refusal is then named in the round's failure."""

    def __init__(self, grid: Any) -> None:
        self.grid, self.errors = grid, {}

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            if reply.has_error():
                self.errors.setdefault(reply.metadata.src_node_id, str(reply.error.reason))
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)


def largest_client(tasks: Sequence[ClientTask]) -> int:
    """The most training samples among the round's participants (its context's per-class counts)."""
    ctx = tasks[0].context
    rows = [ctx.participants.index(t.cid) for t in tasks]
    return int(ctx.participant_counts[rows].sum(dim=1).max())


def fit_ins(task: ClientTask, run: ConfigRecord, found: Settings) -> FitIns:
    """A participant's fit instruction: its task (the plan asking for the dense update), the run,
    and the round's quantisation (the client checks its update against it)."""
    sent = replace(travelling(task), upload=replace(task.upload, secaggplus=True))
    config = codec.scalars(sent, f"task of client {task.cid}") | {
        "fedlt.cid": task.cid, "fedlt.config": str(run["config"]), "fedlt.partition": str(run["partition"]),
        "fedlt.clipping_range": found.clipping_range, "fedlt.max_weight": found.max_weight}
    return FitIns(Parameters(tensors=[], tensor_type="numpy.ndarray"), config)


def run_workflow(grid: Any, instructions: dict[int, FitIns], found: Settings, server_round: int,
                 timeout: float | None = None) -> TaskStrategy:
    """Flower's SecAggPlusWorkflow over ``grid`` for one round: each node its FitIns; the strategy
    holds what came back (``aggregate``: None when the workflow halted)."""
    strategy = TaskStrategy(grid, instructions)
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: server_round}),
                        MAIN_PARAMS_RECORD: ArrayRecord()})
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}), strategy=strategy)
    SecAggPlusWorkflow(NUM_SHARES, RECONSTRUCTION_THRESHOLD, max_weight=found.max_weight,
                       clipping_range=found.clipping_range, quantization_range=found.quantization_range,
                       modulus_range=MODULUS_RANGE, timeout=timeout)(grid, context)
    return strategy


def secure_round(runner: Any, tasks: Sequence[ClientTask]) -> list[ClientResult | ClientFailure]:
    """The round's training through SecAgg+ (``runner``: a FlowerRunner): each participant's result
    (without its update) carrying the unmasked mean in ``packed["aggregate"]``, or its failure."""
    nodes, r = runner.nodes(), tasks[0].round_index
    out: dict[int, Any] = {t.cid: ClientFailure(t.cid, "unavailable (no SuperNode holds its partition)")
                           for t in tasks if t.cid not in nodes}
    live = [t for t in tasks if t.cid in nodes]
    if len(live) < 2:
        return _failed(runner, tasks, out, live, f"Flower's SecAgg+ needs 2 or more participants; round {r + 1} has {len(live)}")
    found = settings(tasks[0].upload, len(live), largest_client(live))
    grid = ErrorsSeen(runner.grid)
    strategy = run_workflow(grid, {nodes[t.cid]: fit_ins(t, runner.run, found) for t in live}, found, r + 1,
                            runner.reply_wait)
    runner.exchanges += 4
    if strategy.aggregate is None:
        reasons = sorted({error_line(e) for e in grid.errors.values()})
        return _failed(runner, tasks, out, live, f"Flower's SecAgg+ round {r + 1} halted (too few participants "
                       f"left to unmask){': ' + '; '.join(reasons) if reasons else ''}")
    mean = torch.from_numpy(strategy.aggregate.astype(np.float64))
    for t in live:
        node = nodes[t.cid]
        if node in strategy.results:
            result = codec.from_scalars(strategy.results[node].metrics, runner.device)
            out[t.cid] = replace(result, packed={"aggregate": mean, "keys": result.packed["keys"]})
        else:
            out[t.cid] = _lost(runner, t.cid, node, grid.errors.get(node), r)
    return [out[t.cid] for t in tasks]


def _lost(runner: Any, cid: int, node: int, error: str | None, r: int) -> ClientFailure:
    reason = f"failed: {error_line(error)}" if error else "late (no masked upload in Flower's SecAgg+ round)"
    if not runner.tolerate:
        raise FedltError(f"round {r + 1}: node {node} (client {cid}) {reason}")
    return ClientFailure(cid, reason)


def _failed(runner: Any, tasks: Sequence[ClientTask], out: dict[int, Any], live: Sequence[ClientTask],
            reason: str) -> list[ClientFailure]:
    if not runner.tolerate:
        raise FedltError(f"secure aggregation: {reason}")
    out.update({t.cid: ClientFailure(t.cid, f"failed: {reason}") for t in live})
    return [out[t.cid] for t in tasks]

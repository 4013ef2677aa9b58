"""fedlt's side of a replay: a real run's parts (``fedlt.run.parts.prepare`` from a RunConfig) driven
round by round with ``parts.train_round``, exactly as the engine's loop drives them, recording
after every round the global weights, each participant's result (its new weights, its mean loss,
its loss-term state) and, for Fed-GraB, the gates SGB drew at every step — so the authors' code can
be handed the same things and compared with it.

Also the replay's small synthetic data set (an ``arrays`` file: long-tailed, 8×8 images whose
class is a noisy pattern) and the comparison and fixture helpers every adapter shares. Nothing here
is the authors' code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from fedlt.algorithms.base import ClientData, client_generator
from fedlt.algorithms import personal
from fedlt.algorithms.personal import EvalTask, evaluate_client, stream_seed
from fedlt.algorithms.protocol import CLIENT_CALLS, ClientStates
from fedlt.config import RunConfig
from fedlt.losses import fedgrab as fedgrab_losses
from fedlt.models import eval_mode
from fedlt.run import parts

CLASSES = 10
COUNTER = "num_batches_tracked"  # BatchNorm's step counters (never read with momentum set)


def write_data(path: Path, n_train: int = 240, n_test: int = 100, size: int = 8, seed: int = 0) -> Path:
    """The replay's data set as an ``arrays`` .npz: class c has ⌈n·0.6^c⌉-proportional samples
    (long-tailed, class 0 the head), each image a fixed per-class pattern plus noise (uint8)."""
    rng = np.random.default_rng(seed)
    share = 0.6 ** np.arange(CLASSES)
    counts = np.maximum(np.round(n_train * share / share.sum()).astype(int), 2)
    y_train = np.repeat(np.arange(CLASSES), counts)
    y_test = np.arange(n_test) % CLASSES
    patterns = rng.integers(0, 256, (CLASSES, size, size))

    def images(y: np.ndarray) -> np.ndarray:
        noise = rng.normal(0, 60, (len(y), size, size))
        return np.clip(patterns[y] + noise, 0, 255).astype(np.uint8)

    np.savez(path, x_train=images(y_train), y_train=y_train, x_test=images(y_test), y_test=y_test)
    return path


def replay_config(algorithm: str, data: Path, out: Path, **overrides: Any) -> RunConfig:
    """A small run of ``algorithm`` with its authors' settings (``preset authors``) on the replay data."""
    base = dict(dataset="arrays", data_root=str(data), partition={"name": "dirichlet", "beta": 0.5, "min_size": 2},
                clients=4, participation=1.0, model="mlp", algorithm=algorithm, preset="authors", rounds=3,
                out=str(out), seeds={"data": 0, "model": 0, "sampling": 0})
    return RunConfig.model_validate({**base, **overrides})


@dataclasses.dataclass
class RoundRecord:
    round: int
    participants: list[int]
    global_weights: dict[str, torch.Tensor]
    results: dict[int, Any]  # cid -> ClientResult
    gates: dict[int, list[torch.Tensor]]  # cid -> one bool vector per step (Fed-GraB)
    priors: dict[int, torch.Tensor]  # cid -> the DPA prior SGB gated with (Fed-GraB)


class Recorder:
    """Patches, for the duration of a ``with``: the per-participant client call (``CLIENT_CALLS
    ["work"]``, what every runner calls once per participant: to know whose steps run and to keep
    its whole result — FedRep's two phases and Ditto's two passes inside it are one result) and
    SGB's call (to record the gates it draws: the same ``torch.rand`` from a copy of its generator,
    compared with its prior, as the call itself does)."""

    def __init__(self) -> None:
        self.cid: int | None = None
        self.results: dict[int, Any] = {}
        self.gates: dict[int, list[torch.Tensor]] = {}
        self.priors: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def patched(self) -> Iterator["Recorder"]:
        work, sgb_call = CLIENT_CALLS["work"], fedgrab_losses.SGB.__call__
        recorder = self

        def client_work(algorithm, task):
            recorder.cid = task.cid
            result = work(algorithm, task)
            # the training call (CCVR's second call only collects); its train_loss may be a PendingLoss the
            # local runner reads after the round's last client: float() reads it (recorded_difference)
            recorder.results.setdefault(task.cid, result)
            return result

        def sgb(term, logits, targets, **kw):
            if term._prior is not None:
                copy = torch.Generator()
                copy.set_state(term.generator.get_state())
                r = torch.rand(logits.shape[1], generator=copy, dtype=torch.float64)
                recorder.gates.setdefault(recorder.cid, []).append(r <= term._prior.vec)
                recorder.priors[recorder.cid] = term._prior.vec.clone()
            return sgb_call(term, logits, targets, **kw)

        CLIENT_CALLS["work"], fedgrab_losses.SGB.__call__ = client_work, sgb
        try:
            yield self
        finally:
            CLIENT_CALLS["work"], fedgrab_losses.SGB.__call__ = work, sgb_call

    def take(self) -> tuple[dict, dict, dict]:
        out = self.results, self.gates, self.priors
        self.results, self.gates, self.priors = {}, {}, {}
        return out


class FedltSide:
    """A run's parts, prepared once; ``rounds()`` yields a RoundRecord after each round."""

    def __init__(self, config: RunConfig, dtype: torch.dtype = torch.float32) -> None:
        self.config, self.dtype = config, dtype
        with default_dtype(dtype):
            self.prep = parts.prepare(config)
        if dtype != torch.float32:  # the data in the models' dtype (the loader gives float32)
            data = self.prep.data
            self.prep = dataclasses.replace(self.prep, data=dataclasses.replace(
                data, x_train=data.x_train.to(dtype), x_test=data.x_test.to(dtype)))
            server = self.prep.ctx.server_data  # held-out images (FEDIC), in place: the algorithm holds this context
            if server is not None:
                self.prep.ctx.server_data = dataclasses.replace(server, x=server.x.to(dtype))
        self.states = ClientStates()
        self.device = torch.device("cpu")

    def initial_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.prep.algorithm.global_model().state_dict().items()}

    def client(self, cid: int):
        return parts.client_data(self.prep, cid, self.device)

    def batches(self, cid: int, round_index: int, stream: str = "", epochs: int | None = None) -> list[torch.Tensor]:
        """The minibatch indices client ``cid`` trains on in ``round_index``: the round's schedule
        and stream, or a phase's own (``stream``, as ``stream_seed`` names it: FedRep's
        "fedrep-head", a fine-tune's "finetune") over ``epochs`` epochs."""
        data = self.client(cid)
        schedule = self.prep.ctx.schedule(self.config.batch_size)
        if stream:
            schedule = dataclasses.replace(schedule, epochs=epochs, iters=None)
            seed = stream_seed(self.config.seeds.sampling, round_index, cid, stream)
            generator = torch.Generator().manual_seed(seed % (2**63))
        else:
            generator = client_generator(self.config.seeds.sampling, round_index, cid)
        return list(schedule.batches(len(data), generator))

    def personal_scores(self, cid: int, round_index: int) -> tuple[int, torch.Tensor]:
        """Client ``cid``'s personal model after ``round_index`` on the replay's test set, as
        fedlt's per-client evaluation builds and scores it (``evaluate_client``, mode
        ``personal``): its correct count and its logits."""
        algorithm, prep = self.prep.algorithm, self.prep
        x, y = prep.data.x_test, prep.data.y_test
        test = ClientData(cid, x, y, torch.bincount(y, minlength=CLASSES))
        probe = ClientData(cid, torch.empty(0), torch.empty(0), prep.counts[cid])
        task = EvalTask(cid, prep.ctx.round(round_index, [probe]), self.initial_weights(), self.states.get(cid),
                        "personal", data=self.client(cid), test=test, eval_batch=self.config.eval_batch)
        built: list[Any] = []  # the personal model evaluate_client builds (a fine-tune trains it once)
        build = personal.MODEL_OF["personal"]
        personal.MODEL_OF["personal"] = lambda algo, t: built.append(build(algo, t)) or built[-1]
        try:
            with default_dtype(self.dtype):
                correct = int(evaluate_client(algorithm, task).correct.sum())
        finally:
            personal.MODEL_OF["personal"] = build
        model = built[0]
        with eval_mode(*[m for m in (model, algorithm.global_model()) if isinstance(m, torch.nn.Module)]), \
                torch.no_grad():
            return correct, model(x).detach()

    def rounds(self) -> Iterator[RoundRecord]:
        recorder = Recorder()
        c = self.config
        for r in range(c.rounds):
            chosen = parts.sample_clients(c.clients, c.participation, c.seeds.sampling, r)
            clients = [self.client(cid) for cid in chosen]
            with default_dtype(self.dtype), recorder.patched():
                parts.train_round(self.prep.algorithm, self.prep.ctx, r, clients, self.states)
            results, gates, priors = recorder.take()
            yield RoundRecord(r, chosen, self.initial_weights(), results, gates, priors)


class EpochLoader:
    """A DataLoader's stand-in for one client's round on the authors' side: each iteration (their
    ``for epoch: for x, y in loader``) is the next epoch of the minibatches fedlt's schedule drew."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], epochs: int) -> None:
        self.per = per = len(batches) // epochs
        self.epochs = [[(x[i], y[i]) for i in batches[e * per:(e + 1) * per]] for e in range(epochs)]

    def __iter__(self):
        return iter(self.epochs.pop(0))

    def __len__(self) -> int:  # a DataLoader's len: the batches of an epoch
        return self.per


def check_mode(mode: str, modes: tuple[str, ...]) -> None:
    """A replay's ``--mode`` (or protocol variant) refused in one line unless its adapter has it."""
    if mode not in modes:
        raise SystemExit(f"--mode must be one of {', '.join(modes)}, got {mode!r}")


def cuda_as_cpu() -> None:
    """The authors' ``.cuda()`` calls made no-ops in this process (the harness's own; offline)."""
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


# -- comparison ---------------------------------------------------------------------------------
SGB_KEYS = ("pos", "neg", "u", "e1", "e2")


def quantities(method: str, result: Any) -> dict[str, dict[str, torch.Tensor]]:
    """What a participant's round produced on fedlt's side, in groups the adapters name alike: its
    uploaded weights, Fed-GraB's SGB state, a personalised method's own part (``personal``: PFLlib's
    methods, FedProto's), APFL's mixing weight, FedProto's prototypes,
    FedLoGe's local head, FedReLa's labels and FedLF's class centres."""
    out = {"weights": result.weights} if result.weights else {}  # FedProto uploads no weights
    if method == "fedgrab":
        out["sgb"] = {k: result.state["loss"][f"fedgrab.{k}"] for k in SGB_KEYS}
    if "personal" in result.state:
        out["personal"] = result.state["personal"]
    if method in ("fedloge", "fedrela"):
        out["l_head"] = result.state["fedloge"]["l_head"]
    if "fedrela" in result.state:  # the labels a FedReLa client trained on: first, what its weights follow from
        out = {"labels": {"labels": result.state["fedrela"]}, **out}
    if method == "fedlf":
        out["centres"] = {"centres": result.extras["centres"]}
    if method == "creff":  # the per-class classifier gradients it uploads
        up = result.extras["server_step"]
        out["gradients"] = {f"{c}.{name}": up[f"grad_{name}"][i] for i, c in enumerate(up["classes"].tolist())
                            for name in ("weight", "bias")}
    if method == "fednh":  # the class prototypes it uploads
        up = result.extras["server_step"]
        out["prototypes"] = {"scaled": up["scaled_prototype"], "counts": up["counts"]}
    if "alpha" in result.state:
        out["alpha"] = {"alpha": result.state["alpha"]}
    if method == "fedproto":  # the classes it holds: their prototypes are a dict over those
        held = result.extras["present"].bool()
        out["prototypes"] = {str(c): result.extras["prototypes"][c] for c in held.nonzero().flatten().tolist()}
    return out


def group_difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """The largest relative difference over a group of tensors; inf when the two name other tensors."""
    if set(ours) != set(theirs):
        return math.inf
    return max((relative_difference(ours[k], theirs[k]) for k in ours), default=0.0)


def recorded_difference(method: str, result: Any, recorded: dict[str, Any]) -> float:
    """The largest relative difference between a participant's round and a fixture's record of it."""
    worst = 0.0 if recorded.get("loss") is None else abs(float(result.train_loss) - recorded["loss"]) / abs(recorded["loss"])
    for group, tensors in quantities(method, result).items():
        for name, theirs in recorded[group].items():
            if name.endswith(COUNTER):  # BatchNorm's step counters: not judged (run.py)
                continue
            if isinstance(theirs, dict):
                worst = max(worst, fingerprint_difference(tensors[name], theirs))
            else:
                worst = max(worst, relative_difference(tensors[name], torch.tensor(theirs, dtype=torch.float64)))
    return worst

def scores_difference(side: "FedltSide", round_index: int, recorded: dict[str, Any], kind: str) -> float:
    """The largest relative difference between fedlt's personal models after ``round_index`` and
    a fixture's record of the authors' scoring of them (``kind``: their scores are the logits or
    their softmax); inf where a correct count differs."""
    worst = 0.0
    for cid, theirs in recorded.items():
        correct, logits = side.personal_scores(int(cid), round_index)
        if correct != theirs["correct"]:
            return math.inf
        outputs = torch.softmax(logits, 1) if kind == "softmax" else logits
        worst = max(worst, fingerprint_difference(outputs, theirs["outputs"]))
    return worst


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |a − b| / max(max |a|, max |b|): one number per quantity, scale-free (0 for two zeros)."""
    a, b = ours.detach().double().flatten(), theirs.detach().double().flatten()
    if a.shape != b.shape:
        return math.inf
    if not a.numel():
        return 0.0
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-300)
    return float((a - b).abs().max()) / scale


def fingerprint(t: torch.Tensor, picks: int = 8) -> dict[str, Any]:
    """A tensor as a few numbers that a different tensor is very unlikely to share: its sum, the
    sum of its squares, and ``picks`` entries at fixed, spread positions (a fixture's record);
    the sum of magnitudes is the scale its sum is compared at (a sum may cancel to near 0)."""
    flat = t.detach().double().flatten()
    at = np.linspace(0, flat.numel() - 1, min(picks, flat.numel())).round().astype(int).tolist()
    return {"shape": list(t.shape), "sum": float(flat.sum()), "abssum": float(flat.abs().sum()),
            "sumsq": float((flat * flat).sum()),
            "at": at, "values": [float(flat[i]) for i in at]}


def fingerprint_difference(ours: torch.Tensor, record: dict[str, Any]) -> float:
    """The largest relative difference between ``ours`` and a recorded fingerprint."""
    mine = fingerprint(ours, len(record["at"]))
    if mine["shape"] != record["shape"]:
        return math.inf
    worst = max(abs(mine["sum"] - record["sum"]) / max(record["abssum"], 1e-300),
                abs(mine["sumsq"] - record["sumsq"]) / max(record["sumsq"], 1e-300))
    scale = max(max(abs(v) for v in record["values"]), 1e-300)
    return max(worst, max(abs(a - b) / scale for a, b in zip(mine["values"], record["values"])))

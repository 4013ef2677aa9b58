"""FedReLa's adapter: the authors' client loop with its relabelling, and their server aggregation
(github.com/guangzhengh/FedReLa, read from a git snapshot at COMMIT, executed verbatim) beside
fedlt's ``fedrela``. FedReLa is FedLoGe with relabelling: this adapter is ``fedloge.py``'s, with
their repository's own copies of the pieces.

Their pieces, as they are: ``LocalUpdate.update_weights_gaux`` (util/update_baseline.py:364-504:
the lr × 0.1 from ``relabel_start`` on, the relabelling stored in the client's first relabelled
round and read back after it, the labels replaced batch by batch, FedLoGe's three optimisers and
three backward passes), ``LocalUpdate.relabel_local_data`` (:58-83) and the whole of
util/FedReLa.py's relabelling (``collect_Q``, ``compute_normalized_priors``,
``compute_classwise_statistics``, ``zscore``, ``compute_adaptive_threshold``,
``get_rho_with_tanh_norm``, ``relabel_local_data``: its pickle is written and read in a temporary
working directory); ``FedAvg_noniid`` and ``FedAvg_noniid_classifier`` (util/fedavg.py). The
server loop of fedloge.py:303-345 (a ``__main__`` block) is restated as in ``fedloge.py``'s adapter.

What the harness hands them: the initial weights, fedlt's SSE-C as g_head and each client's first
l_head (as FedLoGe's adapter); a loader of ``(index, x, y)`` that yields fedlt's minibatches for
training and, for ``collect_Q``'s five prediction passes, the client's samples in order (theirs:
five shuffled passes; a sample's prediction does not depend on its batch, and the order makes
their ``pred_dict`` — whose order is the order of their draws — the samples' order); and fedlt's
relabelling draws (``fedlt.algorithms.fedrela.Relabelled.new_labels``' stream): their
``np.random.rand(class_num)`` per sample (FedReLa.py:250) answers with the sample's row of them.

Modes. ``released``: their code as it is. Their fedloge.py forces every client into every round
(``args.frac = 1``, fedloge.py:222), so a client first sampled after ``relabel_start`` never
arises there; at partial participation their loop reads a relabelling that was never stored
(``read`` = 1 outside the start round, update_baseline.py:443-458), gets None and trains on its
own labels (at the scaled lr). fedlt relabels such a client in its first round from the start on.
``matched`` (default): their ``args.relabel_start`` is, for such a client, the round it is first
sampled in from the start on — the same rule as fedlt's, through their own code's store branch.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import tempfile
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from authors_code import load as load_definitions
from fedloge import Authors as FedLoGeAuthors
from fedloge import linear
from fedlt.algorithms.personal import stream_seed
from fedlt_side import cuda_as_cpu
from golden_source import definitions, source

REPO = "github.com/guangzhengh/FedReLa"
COMMIT = "20a58bd75f48b3243f80adb35537b5b4ba252773"
MODES = ("matched", "released")
RELABEL_START = 1  # a round index from 0, as their rnd: round 2 relabels, round 3 reads it back (or relabels)
CONFIG = {"algorithm_params": {"head": {"name": "sse_c", "steps": 1000}, "relabel_start": RELABEL_START}}
RELABEL = ["collect_Q", "compute_normalized_priors", "compute_classwise_statistics", "zscore",
           "compute_adaptive_threshold", "get_rho_with_tanh_norm", "relabel_local_data"]

WHERE = {
    "labels": ("fedlt/algorithms/fedrela.py:95-116 (Relabelled: new labels in the client's first round from "
               "relabel_start on, kept in its state), :46-65 (relabel)",
               "util/update_baseline.py:443-473 (stored in round relabel_start, read back after it; the labels "
               "replaced batch by batch), util/FedReLa.py:14-343"),
    "weights": ("fedlt/algorithms/fedrela.py:104 (lr × lr_scale), fedlt/algorithms/longtail.py:451-487 "
                "(FedLoGeUpdate)",
                "util/update_baseline.py:364-504 (update_weights_gaux: lr × 0.1 from relabel_start, :366)"),
    "l_head": ("fedlt/algorithms/longtail.py:459-464, 475-487 (l_head from the client's state, its own step)",
               "util/update_baseline.py:375, 493-496 with fedloge.py:250-253, 322 (l_heads[client_id])"),
    "global": ("fedlt/algorithms/longtail.py:499-521 (FedLoGeStrategy.aggregate: weights n_k / Σ n)",
               "util/fedavg.py FedAvg_noniid, FedAvg_noniid_classifier with fedloge.py:335-342"),
    "loss": ("fedlt/algorithms/fedavg_family.py:318 (check_parts: mean over steps of the parts' sum)",
             "util/update_baseline.py:498-504 (mean of per-epoch means of the three losses' sum)"),
}
REASONS = {
    "released": {
        "labels": "their loop relabels a client only in round relabel_start (or every relabel_period rounds) and "
                  "reads the stored labels after it (update_baseline.py:443-458); with every client in every round "
                  "(fedloge.py:222, args.frac = 1) each one has stored them, but a client first sampled after "
                  "relabel_start reads none and keeps its own labels. fedlt relabels it in its first round from "
                  "relabel_start on (docs/algorithms.md)",
    },
}


def load(git_dir: str) -> dict[str, Any]:
    """Their LocalUpdate methods in one namespace, FedReLa.py's functions (the module their
    ``fedrela_relabel_local_data`` is imported from, update_baseline.py:19) in another."""
    relabelling: dict[str, Any] = {"torch": torch, "F": F, "np": np, "os": os, "pickle": pickle}
    load_definitions(git_dir, COMMIT, "util/FedReLa.py", RELABEL, relabelling)
    ns: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "np": np, "copy": copy,
                          "fedrela_relabel_local_data": relabelling["relabel_local_data"], "relabelling": relabelling}
    load_definitions(git_dir, COMMIT, "util/fedavg.py", ["FedAvg_noniid", "FedAvg_noniid_classifier"], ns)
    text = source(git_dir, COMMIT, "util/update_baseline.py")
    methods = definitions(text, ["LocalUpdate.relabel_local_data", "LocalUpdate.update_weights_gaux"], {**ns})
    ns["method_relabel_local_data"] = methods["LocalUpdate.relabel_local_data"]
    ns["update_weights_gaux"] = methods["LocalUpdate.update_weights_gaux"]
    return ns


class ClientLoader:
    """Their ``ldr_train`` (``DataLoader`` of ``DatasetSplit``: ``(index, image, label)``): each
    iteration the next epoch of fedlt's minibatches; ``in_order()`` the samples in order, for
    ``collect_Q``'s passes. ``index`` holds the client's sample positions (their keys:
    ``str(index[i])``, the same on both of their paths)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], epochs: int,
                 batch_size: int) -> None:
        self.per = per = len(batches) // epochs
        self.epochs = [[(i.clone(), x[i], y[i]) for i in batches[e * per:(e + 1) * per]] for e in range(epochs)]
        order = torch.arange(len(y)).split(batch_size)
        self.ordered = [(i.clone(), x[i], y[i]) for i in order]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return iter(self.epochs.pop(0))

    def __len__(self) -> int:
        return self.per

    def in_order(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return self.ordered


@contextlib.contextmanager
def draws_from(uniform: torch.Tensor) -> Iterator[None]:
    """numpy's ``np.random.rand(C)`` answering, call by call, with the rows of ``uniform`` (fedlt's
    draws, in the samples' order); every row must be taken, and nothing else drawn."""
    rows, rand = iter(uniform.double().numpy()), np.random.rand
    taken = []

    def rand_row(*shape):
        if shape != (uniform.shape[1],):
            raise AssertionError(f"np.random.rand{shape}: the harness answers rand({uniform.shape[1]}) only")
        taken.append(next(rows))
        return taken[-1].copy()

    np.random.rand = rand_row
    try:
        yield
    finally:
        np.random.rand = rand
    if taken and len(taken) != len(uniform):
        raise AssertionError(f"their relabelling drew {len(taken)} rows of {len(uniform)}")


class Authors(FedLoGeAuthors):
    """Their side of the run: FedLoGe's (global backbone, g_head, g_aux, an l_head per client) with
    their FedReLa's ``update_weights_gaux`` and its relabelling files in a working directory."""

    CODE = staticmethod(load)

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        super().__init__(git_dir, "matched", initial, config, seed, side=side)
        self.mode = mode
        cuda_as_cpu()  # collect_Q's x.cuda(args.gpu)
        params = config.algorithm_params
        self.start, self.thre = int(params["relabel_start"]), float(params.get("thre", 5.0))
        self.sampling, self.classes, self.batch_size = config.seeds.sampling, 10, config.batch_size
        self.workdir = tempfile.mkdtemp(prefix="fedrela-authors-")
        self.round = -1
        self.first_relabelled: dict[int, int] = {}

    def client_args(self, cid: int) -> SimpleNamespace:
        """Their ``args`` for one client's call; ``relabel_start`` per client in the matched mode."""
        start = self.start
        if self.mode == "matched" and self.round >= self.start:
            start = self.first_relabelled.setdefault(cid, self.round)
        return SimpleNamespace(lr=self.args.lr, momentum=self.args.momentum, device="cpu", gpu=None, id="replay",
                               relabel_start=start, relabel_period=0, thre=self.thre, num_classes=self.classes)

    def begin_round(self, participants: list[int], data: dict[int, Any]) -> None:
        self.round += 1

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        if cid not in self.l_heads:
            self.l_heads[cid] = linear(self.first_l_heads[cid])
        args = self.client_args(cid)
        loader = ClientLoader(x, y.clone(), batches, self.epochs, self.batch_size)
        me = SimpleNamespace(args=args, ldr_train=loader)
        relabel = self.ns["method_relabel_local_data"]
        me.relabel_local_data = lambda *a, **k: relabel(me, *a, **k)
        collect = self.ns["relabelling"]["collect_Q"]
        self.ns["relabelling"]["collect_Q"] = lambda g_head, net, ldr, *a, **k: collect(g_head, net, ldr.in_order(),
                                                                                       *a, **k)
        seed = stream_seed(self.sampling, self.round, cid, "fedrela")  # Relabelled.new_labels' draws
        uniform = torch.rand((len(y), self.classes), generator=torch.Generator().manual_seed(seed % (2**63)),
                             dtype=torch.float64)
        try:
            with contextlib.chdir(self.workdir), contextlib.redirect_stdout(open(os.devnull, "w")), \
                    draws_from(uniform):
                w, g_aux, self.l_heads[cid], loss, _ = self.ns["update_weights_gaux"](
                    me, net=copy.deepcopy(self.net), g_head=copy.deepcopy(self.g_head),
                    g_aux=copy.deepcopy(self.g_aux), l_head=self.l_heads[cid], epoch=self.epochs, args=args,
                    loss_switch="None", net_id=cid, rnd=self.round)
        finally:
            self.ns["relabelling"]["collect_Q"] = collect
        weights = {k: v.detach().clone() for k, v in w.items()}
        weights.update({f"{self.classifier_key}.{k}": v.detach().clone() for k, v in g_aux.state_dict().items()})
        out = {"weights": weights, "g_aux": g_aux, "loss": float(loss),
               "l_head": {k: v.detach().clone() for k, v in self.l_heads[cid].state_dict().items()}}
        if self.round >= self.start:  # the labels their loop trained on this round
            out["labels"] = {"labels": self.labels(cid, y)}
        return out

    def labels(self, cid: int, y: torch.Tensor) -> torch.Tensor:
        """``y`` with their stored relabelling of client ``cid`` applied (their own labels where none)."""
        path = os.path.join(self.workdir, "output", "relabels", f"replay_net_{cid}_relabel_info.pkl")
        out = y.clone()
        if os.path.exists(path):
            with open(path, "rb") as f:
                flags = pickle.load(f)["relabel_flag"]
            for key, label in flags.items():  # keys 'tensor(i)': str of a 0-d tensor (FedReLa.py:45)
                out[int(key[len("tensor("):-1])] = int(label)
        return out

"""FedLoGe's adapter: the authors' client loop and server aggregation (github.com/ZackZikaiXiao/FedLoGe,
read from a git snapshot at COMMIT, executed verbatim) beside fedlt's ``fedloge``.

Their pieces, as they are: ``LocalUpdate.update_weights_gaux`` (util/update_baseline.py:334-458),
the local loop — the backbone stepped by CE through the fixed SSE-C ``g_head``, then ``g_aux`` and
the client's ``l_head`` each by CE on the detached features, three SGD optimisers built fresh each
round — called with a stand-in for ``self`` whose ``ldr_train`` yields fedlt's minibatches;
``FedAvg_noniid`` and ``FedAvg_noniid_classifier`` (util/fedavg.py), the aggregation of the
backbone and of g_aux; ``globaltest`` and ``globaltest_calibra`` (util/update_baseline.py:1416,
1478: the global model with g_head, and with g_aux re-aligned, GA-FR). The server loop of
fedloge.py:291-315 (a ``__main__`` block, not importable) is restated below in its lines: each
round's participants trained on copies of the global backbone, g_head and g_aux, with their own
``l_heads[client_id]`` carried across rounds (fedloge.py:299), then the two size-weighted
averages (fedloge.py:304-308).

What the harness hands them instead of building it: the initial weights — fedlt's backbone (their
``net``: the MLP without its classifier, ``forward(x, latent_output=True)`` returning the
features), fedlt's SSE-C as their ``g_head`` (an ``nn.Linear`` holding it: theirs is
``ETF_Classifier.gen_sparse_ETF``, compared piece by piece in tests/test_fedloge_golden.py),
fedlt's initial g_aux and each client's first l_head (theirs are drawn from torch's global stream
at fedloge.py:269-273; fedlt draws l_head from the client's stream). Nothing is aligned: there is
one mode.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from authors_code import load as load_definitions
from fedlt.algorithms.longtail import initial_local_head
from fedlt_side import EpochLoader
from golden_source import definitions, source

REPO = "github.com/ZackZikaiXiao/FedLoGe"
COMMIT = "f4cac5260b73236b1ec0afd855e7d0a6ccbeebbc"
MODES = ("matched", "released")
# the SSE-C's Adam spread cut from their 10 000 steps to keep the replay (and its fixture's test) to
# seconds: both sides receive the same g_head, whose generation is compared on its own
CONFIG = {"algorithm_params": {"head": {"name": "sse_c", "steps": 1000}}}

WHERE = {
    "weights": ("fedlt/algorithms/longtail.py:458-472 (FedLoGeUpdate.parts/backward: one optimiser over backbone "
                "and g_aux, the objective + g_aux's CE summed; l_head's own step)",
                "util/update_baseline.py:334-458 (update_weights_gaux: three optimisers, three backward passes)"),
    "l_head": ("fedlt/algorithms/longtail.py:451-456, 474-479 (l_head from the client's state, a fresh optimiser)",
               "util/update_baseline.py:344, 447-451 with fedloge.py:271-273, 299 (l_heads[client_id])"),
    "global": ("fedlt/algorithms/longtail.py:502-504 (Strategy.aggregate: weights n_k / Σ n)",
               "util/fedavg.py FedAvg_noniid, FedAvg_noniid_classifier with fedloge.py:304-308"),
    "loss": ("fedlt/algorithms/fedavg_family.py:254-268 (check_parts: mean over steps of the parts' sum)",
             "util/update_baseline.py:453-458 (mean of per-epoch means of the three losses' sum)"),
}


def load(git_dir: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "np": np, "copy": copy}
    load_definitions(git_dir, COMMIT, "util/fedavg.py", ["FedAvg_noniid", "FedAvg_noniid_classifier"], ns)
    ns.update(definitions(source(git_dir, COMMIT, "util/update_baseline.py"), ["LocalUpdate.update_weights_gaux"],
                          ns))
    return ns


class Backbone(nn.Sequential):
    """fedlt's MLP without its classifier, called as their ResNets are: ``net(x, latent_output=True)``."""

    def forward(self, x: torch.Tensor, latent_output: bool = True) -> torch.Tensor:  # noqa: ARG002
        return super().forward(x)


def their_heads(model: nn.Sequential) -> tuple[Backbone, nn.Linear, nn.Linear]:
    """(net, g_head, g_aux) from fedlt's FedLoGe model: the SSE-C in an nn.Linear as theirs."""
    head = model[-1]
    g_head = nn.Linear(head.g_head.in_features, head.g_head.weight.shape[0], dtype=head.g_head.weight.dtype)
    with torch.no_grad():
        g_head.weight.copy_(head.g_head.weight), g_head.bias.copy_(head.g_head.bias)
    return Backbone(*copy.deepcopy(list(model)[:-1])), g_head, copy.deepcopy(head.g_aux)


def linear(weights: dict[str, torch.Tensor]) -> nn.Linear:
    out = nn.Linear(weights["weight"].shape[1], weights["weight"].shape[0], dtype=weights["weight"].dtype)
    out.load_state_dict({k: v.detach().clone() for k, v in weights.items()})
    return out


class Authors:
    """Their side of the run: the global backbone, g_head and g_aux; an l_head per client."""

    CODE = staticmethod(load)  # their definitions (FedReLa's adapter: its repository's)

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 first_l_heads: dict[int, dict[str, torch.Tensor]] | None = None, side: Any = None) -> None:
        """``first_l_heads``: each client's l_head before its first round (default: fedlt's draw)."""
        self.ns = self.CODE(git_dir)
        self.net, self.g_head, self.g_aux = their_heads(initial)
        self.classifier_key = f"{len(initial) - 1}.g_aux"
        aux, sampling = initial[-1].g_aux, config.seeds.sampling
        self.first_l_heads = first_l_heads or {c: initial_local_head(aux, sampling, c) for c in range(config.clients)}
        self.l_heads: dict[int, nn.Linear] = {}
        self.args = SimpleNamespace(lr=config.optimiser.lr, momentum=config.optimiser.momentum, device="cpu")
        self.epochs = config.local_epochs

    @property
    def model(self) -> nn.Module:
        """The global weights under fedlt's keys (what run.py compares)."""
        state = dict(self.net.state_dict())
        state.update({f"{self.classifier_key}.{k}": v for k, v in self.g_aux.state_dict().items()})
        return SimpleNamespace(state_dict=lambda: state)

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        if cid not in self.l_heads:  # fedloge.py:271-273 builds every client's l_head before round 1
            self.l_heads[cid] = linear(self.first_l_heads[cid])
        me = SimpleNamespace(args=self.args, ldr_train=EpochLoader(x, y, batches, self.epochs))
        w, g_aux, self.l_heads[cid], loss = self.ns["update_weights_gaux"](  # fedloge.py:298-299
            me, net=copy.deepcopy(self.net), g_head=copy.deepcopy(self.g_head), g_aux=copy.deepcopy(self.g_aux),
            l_head=self.l_heads[cid], epoch=self.epochs, loss_switch="None")
        weights = {k: v.detach().clone() for k, v in w.items()}
        weights.update({f"{self.classifier_key}.{k}": v.detach().clone() for k, v in g_aux.state_dict().items()})
        return {"weights": weights, "g_aux": g_aux, "loss": float(loss),
                "l_head": {k: v.detach().clone() for k, v in self.l_heads[cid].state_dict().items()}}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        """fedloge.py:304-308: FedAvg_noniid of the backbones, FedAvg_noniid_classifier of the g_aux."""
        dict_len = [sizes[c] for c in participants]
        backbone = {k: v for k, v in results[participants[0]]["weights"].items()
                    if not k.startswith(self.classifier_key)}
        w_locals = [{k: results[c]["weights"][k] for k in backbone} for c in participants]
        self.net.load_state_dict(self.ns["FedAvg_noniid"](w_locals, dict_len))
        self.g_aux = self.ns["FedAvg_noniid_classifier"]([results[c]["g_aux"] for c in participants], dict_len)

    def classifier(self, head: str, scale: float = 1.7) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias) of the evaluated global head: ``g_head`` (their ``globaltest`` with g_head,
        fedloge.py's default), ``g_aux_plain`` (``global_test_head = 'g_aux'``) or ``g_aux``
        re-aligned to row norm ``scale`` (``globaltest_calibra``, util/update_baseline.py:1489-1502:
        W · 1.7/‖W_c‖)."""
        if head == "g_head":
            return self.g_head.weight, self.g_head.bias
        w = self.g_aux.weight
        return (w if head == "g_aux_plain" else w * (scale / torch.norm(w, dim=1)).view(-1, 1)), self.g_aux.bias

    def predictions(self, x: torch.Tensor, head: str) -> torch.Tensor | None:
        """The global model's logits' argmax on ``x`` (None when a logit is not finite)."""
        weight, bias = self.classifier(head)
        with torch.no_grad():
            self.net.eval()
            logits = torch.cat([F.linear(self.net(x[i:i + 2048]), weight, bias) for i in range(0, len(x), 2048)])
            self.net.train()
        return logits.argmax(1) if bool(torch.isfinite(logits).all()) else None

    def accuracy(self, x: torch.Tensor, y: torch.Tensor, head: str) -> float:
        pred = self.predictions(x, head)
        return float("nan") if pred is None else float((pred == y).double().mean())

    def per_class(self, x: torch.Tensor, y: torch.Tensor, head: str) -> list[float]:
        """Per-class accuracy (the protocol's many/medium/few split is read from it)."""
        pred = self.predictions(x, head)
        return [float("nan") if pred is None else float((pred[y == c] == c).double().mean())
                for c in range(int(y.max()) + 1)]

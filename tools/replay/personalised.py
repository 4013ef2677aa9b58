"""The personalised methods' adapters: PFLlib's own client and server classes (tools/replay/pfllib.py
runs them verbatim) beside fedlt's ``fedper``, ``fedrep``, ``fedbabu``, ``lg_fedavg``, ``fedrod``,
``ditto``, ``apfl`` and ``fedavg_ft``. Each names its classes, what its clients upload and keep,
and where both sides compute each compared quantity; the reasons for a difference the replay finds
are in ``REASONS`` (docs/replay.md).

Method constants fedlt keeps where PFLlib's main.py defaults differ (passed to their clients so the
replay compares the code, not the defaults): Ditto's λ = 1 (their ``-mu`` 0, main.py:449), APFL's
α₀ = 0.5 (their ``-al`` 1.0, main.py:465).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from fedlt_side import EpochLoader
from pfllib import CLIENTS, COMMIT, MODES, REPO, PFLlib

SERVERBASE = "system/flcore/servers/serverbase.py"
AGGREGATE = SERVERBASE + ":114-150 (receive_models, aggregate_parameters)"


class FedPer(PFLlib):
    CLIENT, SERVER = ("clientper.py", "clientPer"), ("serverper.py", "FedPer")
    UPLOADS, KEEPS = "model.base", "model.head"
    WHERE = {
        "weights": ("fedlt/algorithms/pfl.py:97-127, 239-244 (PartsUpdate: keep the head, send the body)",
                    "system/flcore/clients/clientper.py:10-47, servers/serverper.py:70-87"),
        "personal": ("fedlt/algorithms/pfl.py:120-123 (PartsUpdate.end: the head kept)", "clientper.py:45-47 (set_parameters: base only)"),
        "global": ("fedlt/algorithms/pfl.py:165-183 (SharedStrategy over the body)", AGGREGATE),
    }


class FedRep(PFLlib):
    CLIENT, SERVER = ("clientrep.py", "clientRep"), ("serverrep.py", "FedRep")
    UPLOADS, KEEPS = "model.base", "model.head"
    WHERE = {
        "weights": ("fedlt/algorithms/pfl.py:138-162 (RepUpdate: the head's epochs, then the body's)",
                    "system/flcore/clients/clientrep.py:24-74"),
        "personal": ("fedlt/algorithms/pfl.py:138-162", "clientrep.py:32-50 (the head's epochs)"),
        "global": ("fedlt/algorithms/pfl.py:173-191", AGGREGATE),
    }

    def params(self) -> dict[str, Any]:
        return super().params() | {"plocal_epochs": self.head_epochs}

    @property
    def head_epochs(self) -> int:
        return int(self.config.algorithm_params.get("head_epochs", 1))

    def loaders(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor]) -> list[Any]:
        """One loader for both phases (clientrep.py:25): its first ``plocal_epochs`` epochs are
        fedlt's head phase's minibatches (their own stream), the rest the round's."""
        head = self.side.batches(cid, self.round, "fedrep-head", self.head_epochs)
        return [EpochLoader(x, y, head + batches, self.head_epochs + self.config.local_epochs)]


class LGFedAvg(PFLlib):
    CLIENT, SERVER = ("clientlg.py", "clientLG"), ("serverlg.py", "LG_FedAvg")
    UPLOADS, KEEPS = "model.head", "model.base"
    WHERE = {
        "weights": ("fedlt/algorithms/pfl.py:126-145, 272-279 (keep the body, send the head)", "system/flcore/clients/clientlg.py:10-47"),
        "personal": ("fedlt/algorithms/pfl.py:120-123 (PartsUpdate.end: the body kept)", "clientlg.py:45-47 (set_parameters: head only)"),
        "global": ("fedlt/algorithms/pfl.py:165-183 (SharedStrategy over the head)",
                   "system/flcore/servers/serverlg.py:13, 71-93 and " + AGGREGATE),
    }

    def initial_global(self) -> nn.Module:
        return copy.deepcopy(self.initial.head)  # serverlg.py:13: the server holds the head only


class FineTuning(PFLlib):
    """A method whose personal model is the global one fine-tuned on the client's data: scored on
    a copy of the client after that fine-tune, fed fedlt's fine-tune minibatches."""

    def epochs(self) -> int:
        return int(self.config.algorithm_params.get("finetune_epochs", 10))

    def finetune_loader(self, client: Any) -> EpochLoader:
        x, y = self.feed.data[client.id]
        batches = self.side.batches(client.id, self.round - 1, "finetune", self.epochs())
        return EpochLoader(x, y, batches, self.epochs())


class FedBABU(FineTuning):
    CLIENT, SERVER = ("clientbabu.py", "clientBABU"), ("serverbabu.py", "FedBABU")
    UPLOADS = "model.base"
    WHERE = {
        "weights": ("fedlt/algorithms/pfl.py:312-319 (the head frozen), 126-145",
                    "system/flcore/clients/clientbabu.py:7-49"),
        "global": ("fedlt/algorithms/pfl.py:173-191", "system/flcore/servers/serverbabu.py:75-97 and " + AGGREGATE),
        "outputs": ("fedlt/algorithms/pfl.py:289-298 (FineTuned.personal_model: the global model fine-tuned)",
                    "system/flcore/servers/serverbabu.py:60-63, clients/clientbabu.py:55-84 (fine_tune)"),
    }
    REASONS = {"released": {
        "outputs": "their fine-tune (serverbabu.py:60-61, after the loop of :24-51) starts from each client's model "
                   "as it stands: a client trained in the last round fine-tunes its own body, the others the "
                   "previous round's global body; the last round's aggregate is never sent (fedlt fine-tunes the "
                   "final global model, the paper's 'global model fine-tuned' — kept)",
        "accuracy": "as for the outputs: their fine-tune starts from the client's own last model"}}

    def params(self) -> dict[str, Any]:
        return super().params() | {"fine_tuning_epochs": self.epochs()}

    def sends_before_scoring(self) -> bool:
        return self.mode == "matched"  # matched: the final global model fine-tuned, as fedlt does

    def personal(self, client: Any) -> Any:
        tuned = copy.deepcopy(client)  # their fine_tune changes the client: a copy, so training goes on
        self.feed.put(client.id, self.finetune_loader(client))
        tuned.fine_tune()
        return tuned


class FedAvgFT(FineTuning):
    """PFLlib has no FedAvg-FT method of its own: its fine-tuning of a global model on a client's
    data is ``Server.fine_tuning_new_clients`` (serverbase.py:337-355, for new clients, epochs
    ``-ften``), used here for every client with fedlt's ``finetune_epochs``."""

    CLIENT, SERVER = ("clientavg.py", "clientAVG"), ("serveravg.py", "FedAvg")
    WHERE = {
        "weights": ("fedlt/algorithms/fedavg_family.py:57-103 (the FedAvg family's loop)",
                    "system/flcore/clients/clientavg.py:12-44"),
        "global": ("fedlt/algorithms/fedavg_family.py:200-204", AGGREGATE),
        "outputs": ("fedlt/algorithms/pfl.py:289-298 (FineTuned.personal_model)",
                    "system/flcore/servers/serverbase.py:337-355 (fine_tuning_new_clients)"),
    }

    def personal(self, client: Any) -> Any:
        tuned = copy.deepcopy(client)
        self.feed.put(client.id, self.finetune_loader(client))
        self.server.new_clients, self.server.fine_tuning_epoch_new = [tuned], self.epochs()
        self.server.fine_tuning_new_clients()
        self.server.new_clients = []
        return tuned


class FedRoD(PFLlib):
    CLIENT, SERVER = ("clientrod.py", "clientROD"), ("serverrod.py", "FedROD")
    EXTRA = ((CLIENTS + "clientrod.py", ["balanced_softmax_loss"]),)
    UPLOADS, KEEPS = "model", "head"
    SCORES = "softmax"  # clientrod.py:96
    WHERE = {
        "weights": ("fedlt/algorithms/pfl.py:370-386 (RoDUpdate.parts), fedlt/losses/longtail.py:131-160",
                    "system/flcore/clients/clientrod.py:29-59, 142-156 (balanced_softmax_loss)"),
        "personal": ("fedlt/algorithms/pfl.py:379-386 (CE of z_g.detach() + p(h.detach()))", "clientrod.py:55-59"),
        "global": ("fedlt/algorithms/pfl.py:173-191 (all but the personal head)", AGGREGATE),
    }
    REASONS = {"released": {
        "weights": "their balanced softmax counts a client's classes over a DataLoader(drop_last=True, shuffle=True) "
                   "pass (clientrod.py:22-26, clientbase.py:59): up to batch−1 random samples are not counted (a "
                   "class may count 0: log 0 = −inf); fedlt counts the whole local set (its class_counts, SPEC §2)"}}


class Ditto(PFLlib):
    CLIENT, SERVER = ("clientditto.py", "clientDitto"), ("serverditto.py", "Ditto")
    EXTRA = (("system/flcore/optimizers/fedoptimizer.py", ["PerturbedGradientDescent"]),)
    UPLOADS, KEEPS, PERSONAL_FROM = "model", "model", "model_per"
    SCORES, SCORED_BY = "softmax", "test_metrics_personalized"  # clientditto.py:95-128
    UNTRAINED_DIFFER = True
    REASONS = {"released": {
        "accuracy": "a client not trained yet: PFLlib scores its personal model v as initialised (clientditto.py:19, "
                    "a copy of the initial model), fedlt the global model (fedlt/algorithms/pfl.py:221-222, "
                    "Personalised.personal_model: the global weights with whatever the client keeps) — kept: a "
                    "personal model that never trained is the global one",
        "outputs": "as for the accuracy: a client not trained yet (v as initialised in PFLlib, the global model in "
                   "fedlt)"}}
    WHERE = {
        "weights": ("fedlt/algorithms/pfl.py:447-454 (DittoUpdate: the FedAvg family's loop on w)",
                    "system/flcore/clients/clientditto.py:27-52 (clientDitto.train)"),
        "personal": ("fedlt/algorithms/pfl.py:416-437, 447-454 (ProximalUpdate on v, anchored at the received w)",
                     "system/flcore/clients/clientditto.py:64-89 with fedoptimizer.py:64-75"),
        "global": ("fedlt/algorithms/fedavg_family.py:200-204 (Strategy.aggregate: weights n_k / Σ n)",
                   "system/flcore/servers/serverbase.py:131-150"),
    }

    def params(self) -> dict[str, Any]:
        return super().params() | {"mu": float(self.config.algorithm_params.get("lam", 1.0)),
                                   "plocal_epochs": self.config.local_epochs}

    def loaders(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor]) -> list[Any]:
        # fedlt trains v on the same minibatches as w (Algorithm 1 leaves the order open); PFLlib
        # shuffles a new loader for each pass
        return [EpochLoader(x, y, batches, self.config.local_epochs) for _ in range(2)]

    def train(self, client: Any) -> None:
        client.ptrain()  # serverditto.py:38-40: the personal model first
        client.train()


class APFL(PFLlib):
    CLIENT, SERVER = ("clientapfl.py", "clientAPFL"), ("serverapfl.py", "APFL")
    UPLOADS, KEEPS, PERSONAL_FROM = "model", "model", "model_per"
    UNTRAINED_DIFFER = True
    WHERE = {
        "weights": ("fedlt/algorithms/pfl.py:514-561 (ApflUpdate: w's step on the objective)",
                    "system/flcore/clients/clientapfl.py:44-48"),
        "personal": ("fedlt/algorithms/pfl.py:533-556 (v stepped on CE(α·v(x) + (1 − α)·w(x)), α at the first step)",
                     "system/flcore/clients/clientapfl.py:50-59, 69-78 (v on CE(v(x)), α every step, "
                     "v ← (1 − α)·w + α·v at the end)"),
        "global": ("fedlt/algorithms/fedavg_family.py:200-204", AGGREGATE),
    }
    REASONS = {mode: {
        "personal": "PFLlib's APFL is not the APFL authors' code: it trains v on its own loss CE(v(x)) (clientapfl.py:"
                    "50-54) where the authors' FedTorch trains it on the mixed output's CE(α·v(x) + (1 − α)·w(x)); "
                    "it steps α at every step (:56) by the separate losses' gradients, not at the round's first by "
                    "the mixed loss's; and it replaces v by (1 − α)·w + α·v in parameter space at the round's end "
                    "(:58-59). fedlt follows FedTorch (docs/algorithms.md) — kept; w, the uploads and the global "
                    "model agree"} for mode in MODES}

    def params(self) -> dict[str, Any]:
        return super().params() | {"alpha": float(self.config.algorithm_params.get("alpha", 0.5))}

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        out = super().train_client(cid, x, y, batches, gates)
        return out | {"alpha": {"alpha": torch.tensor(float(self.server.clients[cid].alpha), dtype=torch.float64)}}


SCORING = {  # every method's personal models, scored after each round
    "accuracy": ("fedlt/algorithms/personal.py:255-272 (evaluate_client, mode personal: the method's personal_model)",
                 "system/flcore/clients/clientbase.py:80-120 (test_metrics; Ditto's test_metrics_personalized)"),
}
SCORING["outputs"] = SCORING["accuracy"]


def adapter(cls: type) -> SimpleNamespace:
    """A class above as run.py reads an adapter module."""
    return SimpleNamespace(Authors=cls, REPO=REPO, COMMIT=COMMIT, MODES=MODES, WHERE=SCORING | cls.WHERE,
                           REASONS=cls.REASONS)


ADAPTERS = {name: adapter(cls) for name, cls in {
    "fedper": FedPer, "fedrep": FedRep, "fedbabu": FedBABU, "lg_fedavg": LGFedAvg, "fedrod": FedRoD,
    "ditto": Ditto, "apfl": APFL, "fedavg_ft": FedAvgFT}.items()}

"""FedNPC's adapter for ``run.py fednpc``: the authors' whole run (github.com/JintongGao/FedNPC, read
from a git snapshot at COMMIT, executed verbatim) beside fedlt's ``fednpc``.

Their pieces, as they are (FedAvg-FedNPC.py): stage 1, ``Local`` (:97-140: a fresh client object,
its own plain SGD, per participant and round; ``local_train``) and ``Global``
(:48-94: ``initialize_for_model_fusion``, FedAvg by size; ``global_eval``; ``download_params``);
stage 2 after the last round, ``re_train_classifier`` with ``generate_noisy_batch`` (:143-189). The
round loop and the stage-2 call of ``FedNPC()`` (:248-272, :295-305) are restated in
``train_client`` / ``aggregate`` below, their lines named.

What the adapter writes itself: their ``ResNet_cifar`` is fedlt's MLP as their model
(``fednpc.SynModel``: ``forward -> (features, logits)``, the last layer named ``classifier``, which
their re-training selects by name, :156); weights cross between the sides with the names mapped
(``features.i.*`` / ``classifier.*`` ↔ fedlt's ``i.*``); ``args_parser`` returns the replay's
options (their ``Local.__init__`` calls it, :101); their ``DataLoader`` yields, in ``local_train``,
the next epoch of fedlt's minibatches, and in ``global_eval`` the replay's test set;
``transforms.Compose`` is the identity (their RandomCrop(32, padding 4) + flip, :115-117, is left
out on both sides); ``.cuda()`` is the identity. Stage 2's noise: fedlt's step draws it from
torch's global generator (``noisy_batch``: labels, then features, per step, as theirs); the
generator's state as fedlt's ``noise_retrain`` starts is handed to their ``re_train_classifier``
(``NoiseTorch``: their ``torch.randint`` / ``torch.randn`` draw from it, so they give fedlt's draws;
their global stream itself would not, as ``NoiseTorch`` says).
Their M = 10 000, E = 28 (27 steps), lr 0.1, momentum 0.9 are fedlt's step defaults.

Their re-training keeps the step with the best **test** accuracy and returns ``None`` when none
beats stage 1 (:183-189); fedlt does not select on the test set, so the replay compares the
classifier after their last step (read from the state their loop hands to ``global_eval``) and
prints the step their selection would keep.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from torch.optim import SGD
from torch.utils.data import DataLoader, TensorDataset

import fedlt.server_steps.fednpc as fedlt_fednpc
from authors_code import load
from fedic_golden.make_golden import Pairs
from fedlt_side import EpochLoader, cuda_as_cpu, default_dtype
from fednpc import COMMIT, REPO, SynModel

MODES = ("matched",)

WHERE = {
    "weights": ("fedlt/algorithms/fedavg_family.py (the FedAvg family's client loop)",
                "FedAvg-FedNPC.py:114-140 (Local.local_train)"),
    "loss": ("fedlt/algorithms/fedavg_family.py (the mean training loss)",
             "FedAvg-FedNPC.py:122-140 (local_avg_loss / total_steps)"),
    "global": ("fedlt/algorithms/recalibrate.py StepStrategy (FedAvg; after the last round the classifier of "
               "fedlt/server_steps/fednpc.py noise_retrain)",
               "FedAvg-FedNPC.py:67-76 (initialize_for_model_fusion); after the last round :148-189 "
               "(re_train_classifier, its last step)"),
}


class NoiseTorch:
    """Their ``torch`` in ``generate_noisy_batch``: ``randint`` / ``randn`` draw from a generator in the
    state torch's global one had as fedlt's re-training began, so they are fedlt's draws. Their own
    global stream would differ: each ``global_eval`` between steps (:179) iterates a DataLoader, which
    draws a base seed from the global generator (fedlt evaluates once, after the re-training)."""

    def __init__(self, state: torch.Tensor) -> None:
        self.generator = torch.Generator()
        self.generator.set_state(state)

    def randint(self, *args, **kwargs):
        return torch.randint(*args, generator=self.generator, **kwargs)

    def randn(self, *args, **kwargs):
        return torch.randn(*args, generator=self.generator, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class Authors:
    """Their ``Global`` (one for stage 1, a fresh one for stage 2 as their main builds it, :295) and
    a ``Local`` per participant and round."""

    def __init__(self, git_dir: str, mode: str, initial: nn.Module, config: Any, seed: int = 0,
                 side: Any = None) -> None:
        self.config, self.initial, self.loader = config, initial, None
        self.dtype = next(initial.parameters()).dtype
        self.last = str(len(list(initial.children())) - 1)  # fedlt's name of the classifier layer
        step = side.prep.algorithm.strategy.step
        self.args = SimpleNamespace(num_classes=10, device="cpu", lr_local_training=config.optimiser.lr,
                                    num_epochs_local_training=config.local_epochs,
                                    batch_size_local_training=config.batch_size, batch_size_test=500,
                                    lr=step.lr, E=step.steps + 1, M=step.size)  # :29-42
        assert step.momentum == 0.9  # hard-coded at :159
        self.test = TensorDataset(side.prep.data.x_test, side.prep.data.y_test)
        identity = SimpleNamespace(Compose=lambda steps: (lambda images: images), RandomCrop=lambda *a, **k: None,
                                   RandomHorizontalFlip=lambda *a, **k: None)
        self.ns: dict[str, Any] = {
            "torch": torch, "copy": copy, "logging": logging, "SGD": SGD, "CrossEntropyLoss": CrossEntropyLoss,
            "DataLoader": self.data_loader, "max": torch.max, "eq": torch.eq, "no_grad": torch.no_grad,
            "transforms": identity, "args_parser": lambda: self.args,
            "ResNet_cifar": lambda **kwargs: SynModel(copy.deepcopy(initial))}
        load(git_dir, COMMIT, "FedAvg-FedNPC.py", ["Global", "Local", "generate_noisy_batch", "re_train_classifier"],
             self.ns)
        cuda_as_cpu()  # their re-training calls .cuda() (:160, :169-170)
        with default_dtype(self.dtype):
            self.server = self.ns["Global"](num_classes=10, device="cpu", args=self.args)
        self.round, self.retrained, self.noise_state = 0, None, None
        self.choice: int | None = None
        self.watch_noise()

    def watch_noise(self) -> None:
        """Keeps the state of torch's global generator as fedlt's re-training starts drawing (its
        ``noise_retrain`` is called without a generator)."""
        original = fedlt_fednpc.noise_retrain

        def retrain(init, *, generator=None, **kwargs):
            assert generator is None, "fedlt's step now draws from its own generator: hand that over instead"
            self.noise_state = torch.get_rng_state()
            return original(init, generator=generator, **kwargs)

        fedlt_fednpc.noise_retrain = retrain  # this process's (the harness's own)

    def data_loader(self, dataset=None, batch_size=None, shuffle=False, **kwargs):
        """Their DataLoader: the test set in ``global_eval``; else a client's next epoch of fedlt's minibatches."""
        if dataset is self.test:
            return DataLoader(dataset, batch_size)
        return self.loader

    def theirs(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """fedlt's names → their model's (``SynModel``)."""
        return {(f"classifier.{k.split('.', 1)[1]}" if k.split(".")[0] == self.last else f"features.{k}"): v
                for k, v in weights.items()}

    def ours(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Their model's names → fedlt's."""
        return {(f"{self.last}.{k.split('.', 1)[1]}" if k.startswith("classifier.") else k.split(".", 1)[1]):
                v.detach().clone() for k, v in weights.items()}

    def train_client(self, cid: int, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor],
                     gates: Any = None) -> dict[str, Any]:
        self.loader = EpochLoader(x, y, batches, self.config.local_epochs)
        counts = torch.bincount(y, minlength=10).tolist()  # original_dict_per_client[client]
        with default_dtype(self.dtype):
            local = self.ns["Local"](data_client=Pairs(x, y), class_list=counts)  # :260
            params, loss = local.local_train(self.args, copy.deepcopy(self.server.download_params()))  # :263
        return {"weights": self.ours(params), "loss": loss}

    def aggregate(self, participants: list[int], results: dict[int, dict[str, Any]], sizes: dict[int, int]) -> None:
        with default_dtype(self.dtype):
            fedavg = self.server.initialize_for_model_fusion(  # :269
                [copy.deepcopy(self.theirs(results[c]["weights"])) for c in participants],
                [sizes[c] for c in participants])
            self.server.syn_model.load_state_dict(copy.deepcopy(fedavg))  # :272
            self.round += 1
            if self.round == self.config.rounds:
                self.stage2(fedavg)

    def stage2(self, fedavg: dict[str, torch.Tensor]) -> None:
        """:295-305 on the last round's FedAvg weights (their checkpoint, :286-299), fedlt's noise."""
        assert self.noise_state is not None, "fedlt's step did not re-train after the last round"
        fresh = self.ns["Global"](num_classes=10, device="cpu", args=self.args)  # :295
        accuracy = fresh.global_eval(fedavg, self.test, self.args.batch_size_test)  # :300
        steps: list[tuple[float, dict[str, torch.Tensor]]] = []
        evaluate = fresh.global_eval

        def global_eval(params, data, batch):  # each step's model as their loop scores it (:179)
            steps.append((evaluate(params, data, batch), copy.deepcopy(params)))
            return steps[-1][0]

        copied = copy.deepcopy(fresh)  # :304
        copied.global_eval = global_eval
        self.ns["torch"] = NoiseTorch(self.noise_state)
        try:
            best = self.ns["re_train_classifier"](self.args, accuracy, copied, None, self.test)  # :305
        finally:
            self.ns["torch"] = torch
        self.retrained = steps[-1][1]
        self.choice = None if best is None else 1 + max(range(len(steps)), key=lambda i: (steps[i][0], -i))
        print(f"their re_train_classifier: stage-1 test accuracy {accuracy:.3f}, the last step's "
              f"{steps[-1][0]:.3f}; their test-set selection keeps "
              + ("no step (stage 1's classifier)" if best is None else f"step {self.choice} of {len(steps)}"))

    def global_weights(self) -> dict[str, torch.Tensor]:
        """FedAvg's weights; after the last round with the classifier of their re-training's last step
        (fedlt's global_model(): the re-trained classifier on the aggregated backbone)."""
        return self.ours(self.retrained if self.retrained is not None else self.server.download_params())

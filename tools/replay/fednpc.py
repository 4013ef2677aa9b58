"""FedNPC's stage 2 on a study's protocol, run by the authors' own code (issue 41's FedNPC anomaly).

    python tools/replay/fednpc.py --git /work/.mirror/JintongGao+FedNPC/repo --seed 0 [--out FILE]

Stage 1 (FedAvg) is fedlt's run parts on the study's base settings (``longtail_mnist.yaml``; the
authors' stage 1 is FedAvg's loop, plain SGD on cross-entropy in their ``Local``; it is not
replayed here: ``run.py fednpc`` replays both stages step for step, ``fednpc_rounds.py``). Stage 2
is theirs, verbatim: ``re_train_classifier`` with its
``generate_noisy_batch`` (FedAvg-FedNPC.py:143-189) and ``Global.global_eval`` (:78-91), read from
a snapshot of github.com/JintongGao/FedNPC at COMMIT, on fedlt's stage-1 global model (its last
layer as their ``classifier``), their defaults M = 10000, E = 28, lr 0.1 (FedAvg-FedNPC.py:40-42),
torch seeded with the run's seed as their main does (:195). Their code keeps the re-training epoch
with the best **test** accuracy (:183-186) and returns ``None`` when none beats the accuracy before
re-training; the script records every epoch's test accuracy, their choice and the last epoch, and
fedlt's ``fednpc`` on the same protocol (the last epoch, no test-set selection). ``.cuda()`` is
made the identity for the call (a CPU run).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from golden_source import definitions, source  # noqa: E402
from fedlt_side import FedltSide  # noqa: E402
from protocol import accuracy, study_config  # noqa: E402

REPO = "github.com/JintongGao/FedNPC"
COMMIT = "48ad8d1d253bed81c47c8650aae8b454437a138b"


class SynModel(nn.Module):
    """fedlt's MLP as their ``syn_model``: ``(features, logits) = model(x)``, the last layer named
    ``classifier`` (their re-training freezes every parameter without 'classifier' in its name)."""

    def __init__(self, mlp: nn.Sequential) -> None:
        super().__init__()
        self.features, self.classifier = nn.Sequential(*list(mlp)[:-1]), mlp[-1]

    def forward(self, x):
        h = self.features(x)
        return h, self.classifier(h)


def their_stage2(git: str, model: nn.Sequential, x_test, y_test, seed: int) -> dict:
    ns = {"torch": torch, "copy": copy, "logging": logging, "DataLoader": DataLoader, "no_grad": torch.no_grad,
          "max": torch.max, "eq": torch.eq, "CrossEntropyLoss": nn.CrossEntropyLoss}
    text = source(git, COMMIT, "FedAvg-FedNPC.py")
    fns = definitions(text, ["generate_noisy_batch", "re_train_classifier", "Global.global_eval"], ns)
    curve: list[float] = []
    holder = SimpleNamespace(syn_model=SynModel(copy.deepcopy(model)), device="cpu")

    def global_eval(params, data, batch):
        curve.append(fns["Global.global_eval"](holder, params, data, batch))
        return curve[-1]

    holder.global_eval = global_eval
    args = SimpleNamespace(lr=0.1, E=28, M=10000, batch_size_test=500)  # FedAvg-FedNPC.py:30, 40-42
    data = TensorDataset(x_test, y_test)
    before = global_eval(holder.syn_model.state_dict(), data, 500)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # their CPU run
    try:
        torch.manual_seed(seed)
        best = fns["re_train_classifier"](args, before, holder, None, data)
    finally:
        torch.Tensor.cuda = cuda
    epochs = curve[1:]
    chosen = None if best is None else 1 + max(range(len(epochs)), key=lambda i: (epochs[i], -i))
    return {"before": before, "epochs": epochs, "their_choice_epoch": chosen,
            "their_choice_accuracy": before if best is None else epochs[chosen - 1], "last_epoch": epochs[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--git", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--study", type=Path, default=HERE.parents[1] / "benchmarks" / "studies" / "longtail_mnist.yaml")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.INFO)
    work = Path(tempfile.mkdtemp())
    stage1 = FedltSide(study_config(args.study, "fedavg", args.seed, work / "fedavg"))
    for _ in stage1.rounds():
        pass
    x, y = stage1.prep.data.x_test, stage1.prep.data.y_test
    result = {"seed": args.seed, "source": {"repo": REPO, "commit": COMMIT},
              "fedavg_final": accuracy(stage1.prep.algorithm.global_model(), x, y),
              "authors_stage2": their_stage2(args.git, stage1.prep.algorithm.global_model(), x, y, args.seed)}
    ours = FedltSide(study_config(args.study, "fednpc", args.seed, work / "fednpc"))
    for _ in ours.rounds():
        pass
    result["fedlt_fednpc_final"] = accuracy(ours.prep.algorithm.global_model(), x, y)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""A study's protocol run by the authors' own code (issue 41's anomalies; docs/benchmarks.md).

    python tools/replay/protocol.py fedgrab --git /work/.mirror/ZackZikaiXiao+FedGraB/repo --seed 0 \\
        [--study benchmarks/studies/longtail_mnist.yaml] [--variants released,classifier,fedlt] [--out FILE]

One seed of the study's ``base`` settings with ``algorithm = <method>`` (the seed sets the data,
model and sampling seeds, as a sweep does): fedlt prepares the run's parts — the same MNIST-LT
partition, the same initial model, each round's sampled clients and each client's minibatches — and
hands them to each variant, which trains the study's rounds and is evaluated after every round on
the test set (plain accuracy of the global model; ``nan`` once its weights are not finite):

* ``released``: the authors' client loop and aggregation as released (tools/replay/fedgrab.py);
* ``classifier``: the same with the classifier stepped (their loop leaves it out of the optimiser);
* ``fedlt``: fedlt's own run parts (equal to the authors' loop with fedlt's gates and a stepped
  classifier, step for step: ``run.py fedgrab``), stopped where fedlt stops (a non-finite loss).

The study's protocol samples 8 of 20 clients a round; their fed_grab.py:69 trains every client
every round: each variant trains the study's sampled clients. One thread, one process.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import fedgrab  # noqa: E402
from fedlt_side import FedltSide  # noqa: E402

from fedlt import safe_yaml  # noqa: E402
from fedlt.algorithms.base import NonFiniteLoss  # noqa: E402
from fedlt.config import RunConfig, merge  # noqa: E402
from fedlt.run import parts  # noqa: E402

ADAPTERS = {"fedgrab": fedgrab}


def study_config(study: Path, method: str, seed: int, out: Path) -> RunConfig:
    base = safe_yaml.load(study.read_text())["base"]
    return RunConfig.model_validate(merge(base, {"algorithm": method, "seeds": {"data": seed, "model": seed,
                                                                               "sampling": seed}, "out": str(out)}))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return math.nan
    with torch.no_grad():
        model.eval()
        logits = torch.cat([model(x[i:i + 2048]) for i in range(0, len(x), 2048)])
        model.train()
    if not bool(torch.isfinite(logits).all()):
        return math.nan
    return float((logits.argmax(1) == y).double().mean())


def run_authors(variant: str, side: FedltSide, git: str) -> list[float]:
    c, prep = side.config, side.prep
    authors = fedgrab.Authors(git, variant, prep.algorithm.global_model(), c, seed=c.seeds.sampling)
    curve = []
    for r in range(c.rounds):
        chosen = parts.sample_clients(c.clients, c.participation, c.seeds.sampling, r)
        results = {}
        for cid in chosen:
            data = side.client(cid)
            results[cid] = authors.train_client(cid, data.x, data.y, side.batches(cid, r), None)
        authors.aggregate(chosen, results, {cid: len(side.client(cid)) for cid in chosen})
        curve.append(accuracy(authors.model, prep.data.x_test, prep.data.y_test))
        print(f"{variant} round {r + 1}: accuracy {curve[-1]:.4f}", flush=True)
    return curve


def run_fedlt(side: FedltSide) -> tuple[list[float], str | None]:
    curve: list[float] = []
    try:
        for rec in side.rounds():
            curve.append(accuracy(side.prep.algorithm.global_model(), side.prep.data.x_test, side.prep.data.y_test))
            print(f"fedlt round {rec.round + 1}: accuracy {curve[-1]:.4f}", flush=True)
    except NonFiniteLoss as exc:
        return curve, f"round {len(curve) + 1}: {str(exc).splitlines()[0]}"
    return curve, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=sorted(ADAPTERS))
    parser.add_argument("--git", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--study", type=Path, default=HERE.parents[1] / "benchmarks" / "studies" / "longtail_mnist.yaml")
    parser.add_argument("--variants", default="released,classifier,fedlt")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    side = FedltSide(study_config(args.study, args.method, args.seed, Path(tempfile.mkdtemp()) / "run"))
    result: dict[str, Any] = {"method": args.method, "seed": args.seed, "study": str(args.study.name),
                              "source": {"repo": fedgrab.REPO, "commit": fedgrab.COMMIT}, "curves": {}}
    for variant in args.variants.split(","):
        started = time.process_time()
        if variant == "fedlt":
            side = FedltSide(side.config)  # fresh parts: the same partition and initial model
            curve, stopped = run_fedlt(side)
            result["fedlt_stopped"] = stopped
        else:
            curve = run_authors(variant, side, args.git)
        result["curves"][variant] = curve
        result.setdefault("cpu_seconds", {})[variant] = round(time.process_time() - started, 1)
    print(json.dumps({k: v for k, v in result.items() if k != "curves"}))
    for variant, curve in result["curves"].items():
        print(variant, " ".join("nan" if math.isnan(a) else f"{100 * a:.1f}" for a in curve))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""A study's protocol run by the authors' own code (issue 41's anomalies; docs/benchmarks.md).

    python tools/replay/protocol.py fedgrab --git /work/.mirror/ZackZikaiXiao+FedGraB/repo --seed 0 \\
        [--study benchmarks/studies/longtail_mnist.yaml] [--variants released,classifier,fedlt] [--out FILE]
    python tools/replay/protocol.py fedloge --git /work/.mirror/ZackZikaiXiao+FedLoGe/repo --seed 0 \\
        [--variants authors,fedlt] [--out FILE]

One seed of the study's ``base`` settings with ``algorithm = <method>`` (the seed sets the data,
model and sampling seeds, as a sweep does): fedlt prepares the run's parts — the same MNIST-LT
partition, the same initial model, each round's sampled clients and each client's minibatches — and
hands them to each variant, which trains the study's rounds and is evaluated after every round on
the test set (plain accuracy of the global model; ``nan`` once its weights are not finite):

* ``released``: the authors' client loop and aggregation as released (tools/replay/fedgrab.py);
* ``classifier``: the same with the classifier stepped (their loop leaves it out of the optimiser);
* ``fedlt``: fedlt's own run parts (equal to the authors' loop with fedlt's gates and a stepped
  classifier, step for step: ``run.py fedgrab``), stopped where fedlt stops (a non-finite loss).

FedLoGe (``authors``: their ``update_weights_gaux`` per client with its l_head carried across
rounds, their two averages; tools/replay/fedloge.py) is scored three ways after every round, as
their fedloge.py and realignment.py can: the backbone with g_head (the SSE-C: ``globaltest``,
fedloge.py's default and the study's ``fedloge`` row), with g_aux as aggregated (``global_test_head
= 'g_aux'``) and with g_aux re-aligned by GA-FR (``globaltest_calibra``: the study's
``fedloge(global_head=g_aux)`` row); fedlt's run is scored with g_head and GA-FR.

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
import fedloge  # noqa: E402
from fedlt_side import FedltSide, check_mode  # noqa: E402

from fedlt import safe_yaml  # noqa: E402
from fedlt.algorithms.base import NonFiniteLoss  # noqa: E402
from fedlt.config import RunConfig, merge  # noqa: E402
from fedlt.run import parts  # noqa: E402

ADAPTERS = {"fedgrab": fedgrab, "fedloge": fedloge}


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
    check_mode(variant, fedgrab.MODES)
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


def run_fedloge_authors(side: FedltSide, git: str) -> dict[str, list[float]]:
    c, prep = side.config, side.prep
    authors = fedloge.Authors(git, "matched", prep.algorithm.global_model(), c)
    curves: dict[str, list[float]] = {"authors (g_head)": [], "authors (g_aux)": [], "authors (GA-FR)": []}
    for r in range(c.rounds):
        chosen = parts.sample_clients(c.clients, c.participation, c.seeds.sampling, r)
        results = {cid: authors.train_client(cid, side.client(cid).x, side.client(cid).y, side.batches(cid, r))
                   for cid in chosen}
        authors.aggregate(chosen, results, {cid: len(side.client(cid)) for cid in chosen})
        for name, head in (("g_head", "g_head"), ("g_aux", "g_aux_plain"), ("GA-FR", "g_aux")):
            curves[f"authors ({name})"].append(authors.accuracy(prep.data.x_test, prep.data.y_test, head))
        print(f"authors round {r + 1}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in curves.items()), flush=True)
    curves["authors per class (g_head, last round)"] = authors.per_class(prep.data.x_test, prep.data.y_test, "g_head")
    curves["authors per class (GA-FR, last round)"] = authors.per_class(prep.data.x_test, prep.data.y_test, "g_aux")
    return curves


def realigned(model: torch.nn.Module, scale: float = 1.7) -> torch.nn.Module:
    """fedlt's FedLoGe global model scored with g_aux re-aligned (GA-FR), as ``global_head='g_aux'``."""
    from fedlt.algorithms.longtail import classifier
    copy_ = __import__("copy").deepcopy(model)
    classifier(copy_).realign_scale = scale
    return copy_


def run_fedlt(side: FedltSide, method: str = "fedgrab") -> tuple[dict[str, list[float]], str | None]:
    views = {"fedlt": lambda m: m}
    if method == "fedloge":
        views = {"fedlt (g_head)": lambda m: m, "fedlt (GA-FR)": realigned}
    curves: dict[str, list[float]] = {name: [] for name in views}
    x, y = side.prep.data.x_test, side.prep.data.y_test
    try:
        for rec in side.rounds():
            for name, view in views.items():
                curves[name].append(accuracy(view(side.prep.algorithm.global_model()), x, y))
            print(f"fedlt round {rec.round + 1}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in curves.items()),
                  flush=True)
    except NonFiniteLoss as exc:
        return curves, f"round {len(next(iter(curves.values()))) + 1}: {str(exc).splitlines()[0]}"
    return curves, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=sorted(ADAPTERS))
    parser.add_argument("--git", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--study", type=Path, default=HERE.parents[1] / "benchmarks" / "studies" / "longtail_mnist.yaml")
    parser.add_argument("--variants", help="default: released,classifier,fedlt (fedgrab); authors,fedlt (fedloge)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    side = FedltSide(study_config(args.study, args.method, args.seed, Path(tempfile.mkdtemp()) / "run"))
    adapter = ADAPTERS[args.method]
    variants = args.variants or ("authors,fedlt" if args.method == "fedloge" else "released,classifier,fedlt")
    result: dict[str, Any] = {"method": args.method, "seed": args.seed, "study": str(args.study.name),
                              "source": {"repo": adapter.REPO, "commit": adapter.COMMIT}, "curves": {}}
    for variant in variants.split(","):
        started = time.process_time()
        if variant == "fedlt":
            side = FedltSide(side.config)  # fresh parts: the same partition and initial model
            curves, stopped = run_fedlt(side, args.method)
            result["fedlt_stopped"] = stopped
        elif args.method == "fedloge":
            curves = run_fedloge_authors(side, args.git)
        else:
            curves = {variant: run_authors(variant, side, args.git)}
        result["curves"].update(curves)
        result.setdefault("cpu_seconds", {})[variant] = round(time.process_time() - started, 1)
    print(json.dumps({k: v for k, v in result.items() if k != "curves"}))
    for variant, curve in result["curves"].items():
        print(variant, " ".join("nan" if math.isnan(a) else f"{100 * a:.1f}" for a in curve))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

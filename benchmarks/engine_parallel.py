"""Clients in worker processes (``--workers``): round time against one process, and the weights equal.

For each setting, the same run with ``workers = 1`` (this process, torch's default threads: what
a user gets today), ``workers = 1`` with one thread, and ``workers = 2`` (two worker processes of
one thread each, evaluation overlapped with the next round; the main process on one thread):

ratio    : mean round time (round_s, rounds after the first) with 2 workers / with 1 (default
           threads). Targets (issue 24): FedAvg ≤ 0.6, SCALA ≤ 0.75.
equal    : the final checkpoints (global model, server and client states) of the 2-worker run and
           the one-thread run are bit-identical; ``equal_default`` against the default-thread run
           (where a different thread count may round differently: the clients' steps for FedAvg,
           the server side for split learning).
model16  : a model, not a measurement, of the round on 16 cores with 16 workers, from the measured
           per-client time t_c (train_s / participants of the one-thread run), the measured
           per-round overhead of the parallel runner o = train_s(2 workers) − ⌈m/2⌉·t_c, and the
           evaluation e (eval_s): round(16) ≈ max(⌈m/16⌉·t_c + o, e) (evaluation hidden behind
           the next round's training while it is shorter; the server side of split learning is in o).

Settings:
- fedavg-mlp: FedAvg, MLP, 10 clients, full participation, 1 epoch of batch 64.
- fedavg-pfllib: PFLlib's MNIST task: FedAvgCNN (``pfllib_cnn``), 100 clients, Dirichlet(0.1),
  10% participation, B = 10, E = 1, lr 0.005 plain SGD, evaluation every round.
- scala: SCALA (AlexNet s2, B = 320, T = 5), 10 of 100 clients.

Run: python benchmarks/engine_parallel.py [--rounds 5] [--only fedavg-mlp]
Each run is a fresh process (start-up outside the timed rounds, no state shared between runs).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import common  # noqa: F401  (sets TRITON_INTERPRET before timm is imported)

SETTINGS: dict[str, dict] = {
    "fedavg-mlp": dict(algorithm="fedavg", model="mlp", clients=10, participation=1.0, local_epochs=1, batch_size=64,
                       partition={"name": "dirichlet", "beta": 0.5}),
    "fedavg-pfllib": dict(algorithm="fedavg", model="pfllib_cnn", clients=100, participation=0.1, local_epochs=1,
                          batch_size=10, partition={"name": "dirichlet", "beta": 0.1},
                          optimiser={"lr": 0.005, "momentum": 0.0, "weight_decay": 0.0, "clip": None}),
    "scala": dict(algorithm="scala", model="alexnet", split="s2", clients=100, participation=0.1,
                  partition={"name": "quantity", "alpha": 2}),
}
# workers, main-process threads (the main process of a 2-worker run evaluates and, for split
# learning, runs the server side: one thread, beside the two workers on two cores)
VARIANTS = {"w1": (1, None), "w1-1thread": (1, 1), "w2": (2, 1)}

RUN = """
import json, sys, torch
settings, threads = json.loads(sys.argv[1]), json.loads(sys.argv[2])
if threads:
    torch.set_num_threads(threads)
from fedlt.config import RunConfig
from fedlt.engine import run
if __name__ == "__main__":
    run(RunConfig(**settings))
"""


def run_variant(settings: dict, workers: int, threads: int | None, out: Path) -> list[dict]:
    config = dict(settings, workers=workers, out=str(out))
    subprocess.run([sys.executable, "-c", RUN, json.dumps(config), json.dumps(threads)], check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def same_end(a: Path, b: Path) -> bool:
    from fedlt import io
    from fedlt.testing.engines import differences

    x, y = io.load_checkpoint(a / "checkpoint.pt"), io.load_checkpoint(b / "checkpoint.pt")
    return not (differences(x["algorithm"], y["algorithm"], 0.0, rtol=0.0)
                or differences(x["client_states"], y["client_states"], 0.0, rtol=0.0))


def mean(rows: list[dict], key: str) -> float:
    timed = rows[1:] or rows  # the first round pays one-off costs (allocations, caches)
    return sum(r[key] for r in timed) / len(timed)


def main() -> None:
    from common import report

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=list(SETTINGS), action="append")
    args = parser.parse_args()
    rows, meta = [], {"rounds": args.rounds, "model16": {}}
    with tempfile.TemporaryDirectory(prefix="fedlt-parallel-bench-") as tmp:
        for name in args.only or SETTINGS:
            settings = dict(SETTINGS[name], rounds=args.rounds, eval_every=1, checkpoint_every=args.rounds)
            got = {v: run_variant(settings, w, t, Path(tmp) / f"{name}-{v}") for v, (w, t) in VARIANTS.items()}
            round_s = {v: mean(r, "round_s") for v, r in got.items()}
            train_s = {v: mean(r, "train_s") for v, r in got.items()}
            eval_s = mean(got["w1-1thread"], "eval_s")
            m = got["w1"][0]["participants"]
            per_client = train_s["w1-1thread"] / m
            overhead = max(train_s["w2"] - math.ceil(m / 2) * per_client, 0.0)
            model16 = max(math.ceil(m / 16) * per_client + overhead, eval_s)
            meta["model16"][name] = {"participants": m, "per_client_s": per_client, "overhead_s": overhead,
                                     "eval_s": eval_s, "round16_s": model16}
            rows.append([name, m, round_s["w1"], round_s["w1-1thread"], round_s["w2"],
                         round_s["w2"] / round_s["w1"], round_s["w2"] / round_s["w1-1thread"],
                         eval_s, per_client, overhead, model16, model16 / round_s["w1"],
                         same_end(Path(tmp) / f"{name}-w2", Path(tmp) / f"{name}-w1-1thread"),
                         same_end(Path(tmp) / f"{name}-w2", Path(tmp) / f"{name}-w1")])
    report("engine_parallel",
           ["setting", "participants", "round_s w1", "round_s w1 1thr", "round_s w2", "ratio w2/w1",
            "ratio w2/w1-1thr", "eval_s", "per-client s", "overhead s", "model 16 cores s", "model 16/w1",
            "equal", "equal_default"], rows, meta)


if __name__ == "__main__":
    main()

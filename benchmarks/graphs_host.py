"""What a ``--graphs`` round asks of the host (issue 43), measured on the CPU: PFLlib's MNIST task
(FedAvgCNN, 100 clients, 10 % a round, one epoch of batch 10) with whole-step graphs whose replay
is a STUB (a no-op: the weights stop moving after each client's first steps, so the numbers
trained are meaningless — only the host's time is read). What is left is everything a round does
around its replays: each client's eager first step and the checked step + capture of a new batch
shape, the minibatch gathers, the copies into the static inputs, the loss's clone, the per-client
setup, the transfer of the client's objects, the aggregation. On a GPU a replay costs the host one
launch (~10 µs, docs/gpu.md), so this is close to the floor of a ``--graphs`` round there, on
this CPU's clock.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/graphs_host.py [--rounds 4] [--out FILE]

Prints (and writes as JSON) each round's training seconds and the mean µs of a stubbed replay
step (``ClientGraphs._replay``: the two copies in, the stub, the clone out).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fedlt.algorithms import graphs  # noqa: E402
from fedlt.config import RunConfig  # noqa: E402
from fedlt.engine import run  # noqa: E402

PFLLIB = dict(dataset="mnist", model="pfllib_cnn", algorithm="fedavg", clients=100, participation=0.1, local_epochs=1,
              batch_size=10, partition={"name": "dirichlet", "beta": 0.1, "min_size": 2}, optimiser={"lr": 0.005},
              device="cpu", threads=1)


class StubGraph:
    """Captures by running the step once (its outputs are the static parts); replays nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def warm_up(self, run, times: int) -> None:
        pass

    def capture(self, run):
        return run()

    def replay(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    graphs.make_backend = lambda backend, device: StubGraph(device)
    timing = {"steps": 0, "seconds": 0.0}
    replay = graphs.ClientGraphs._replay

    def timed(self, graph, x, y):
        began = time.perf_counter()
        out = replay(self, graph, x, y)
        timing["steps"] += 1
        timing["seconds"] += time.perf_counter() - began
        return out

    graphs.ClientGraphs._replay = timed
    with tempfile.TemporaryDirectory() as tmp, graphs.default_backend("recorded"):
        out = Path(tmp) / "run"
        run(RunConfig(**PFLLIB, rounds=args.rounds, eval_every=args.rounds, graphs=True, out=out))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {"round_train_s": [round(r["train_s"], 4) for r in rows],
              "mean_after_first_s": round(sum(r["train_s"] for r in rows[1:]) / max(len(rows) - 1, 1), 4),
              "replayed_steps": timing["steps"],
              "stub_replay_step_us": round(timing["seconds"] / max(timing["steps"], 1) * 1e6, 1),
              "note": "replay stubbed: host time only, on this CPU"}
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

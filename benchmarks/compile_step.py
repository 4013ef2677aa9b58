"""One local step of PFLlib's CNN, eager vs ``--compile``'s compiled forward (issue 43), in one
process: blocks of steps alternate between the two so that the machine's load, which moves on a
shared machine, falls on both alike. A step is what ``ClientUpdate.loop`` runs: zero_grad,
forward, cross-entropy, backward, SGD step; the compiled side's forward is
``fedlt.algorithms.compiled.forward`` (the batch dimension dynamic, the CPU backend's aten
max-pool), on its own copy of the same weights.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/compile_step.py [--batch 10] [--blocks 8] [--steps 40]

Prints and writes ``compile_step.json``: each side's median ms a step, and the median (range) of
compiled/eager over the block pairs.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=10, help="the minibatch (PFLlib's MNIST task: 10)")
    parser.add_argument("--blocks", type=int, default=8, help="pairs of alternated blocks")
    parser.add_argument("--steps", type=int, default=40, help="steps a block")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from fedlt.algorithms import compiled
    from fedlt.models.pfllib import FedAvgCNN

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    eager = FedAvgCNN()
    fast = copy.deepcopy(eager)
    x, y = torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    steps = {"eager": stepper(eager, eager, x, y), "compiled": stepper(compiled.forward(fast), fast, x, y)}
    for step in steps.values():  # the first compiled call compiles
        for _ in range(5):
            step()
    ms: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.blocks):
        for name, step in steps.items():
            start = time.process_time()
            for _ in range(args.steps):
                step()
            ms[name].append((time.process_time() - start) / args.steps * 1e3)
    ratios = [c / e for c, e in zip(ms["compiled"], ms["eager"])]
    row = [args.batch, statistics.median(ms["eager"]), statistics.median(ms["compiled"]),
           statistics.median(ratios), min(ratios), max(ratios)]
    common.report("compile_step", ["batch", "eager ms/step", "compiled ms/step", "compiled/eager (median)", "min", "max"],
                  [row], meta={"threads": args.threads, "blocks": args.blocks, "steps": args.steps, "raw_ms": ms})
    return {"eager_ms": row[1], "compiled_ms": row[2], "ratio": row[3], "ratio_range": row[4:]}


def stepper(forward, model, x, y):
    import torch

    optimiser = torch.optim.SGD(model.parameters(), lr=0.005)

    def step() -> None:
        optimiser.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        optimiser.step()

    return step


if __name__ == "__main__":
    main()

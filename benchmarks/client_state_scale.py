"""State that scales (issue 32): peak memory and checkpoint time with 1000 clients that keep a
model-sized state, against the same run with 10 clients.

Each row is one run in a fresh process: ``timm:resnet18`` (11.2 M parameters, a 45 MB state per
client, never pretrained) on MNIST (28×28), 10 participants per round — 10 clients at 100% or
1000 at 1% — 20 samples per client, 1 local step, 5 rounds, a checkpoint every round, one
evaluation at the end on 200 test images. SCAFFOLD keeps a control variate per client (its
trainable parameters); MOON keeps each client's whole previous model (the state Ditto keeps).

store      : the client-state store's mode at the end (``client_state_memory_mb``, default 512 MiB:
             10 states fit in memory, the 1000-client run's 50 do not, so it moves to files);
             ``memory (forced)`` is the 1000-client run with the budget raised: what the store
             did before it had a files mode.
peak MiB   : the process's peak RSS (``ru_maxrss``);
ckpt s     : mean wall time of ``Checkpoints.save`` per round (files mode: fsync of the round's
             new state files + the manifest; memory mode: every state into checkpoint.pt);
round s    : mean ``round_s`` of the metrics rows (training, state writes, evaluation);
ratios     : against the 10-client run of the same algorithm. Targets: peak <= 1.3, ckpt <= 1.5.

Run: taskset -c 0 python benchmarks/client_state_scale.py   (1 thread; about 10 minutes on one core)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import common

ONE_RUN = """
import json, resource, sys, time, torch
torch.set_num_threads(1)
import fedlt.run.resume as resume
from fedlt.config import RunConfig
from fedlt.engine import run
times, save = [], resume.Checkpoints.save
def timed(self, *args, **kwargs):
    start = time.perf_counter()
    save(self, *args, **kwargs)
    times.append(time.perf_counter() - start)
resume.Checkpoints.save = timed
config = RunConfig(**json.loads(sys.argv[1]))
run(config)
rows = [json.loads(line) for line in (config.out / "metrics.jsonl").read_text().splitlines()]
store = "files" if (config.out / "client_states").is_dir() else "memory"
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "ckpt_s": times,
                  "round_s": [r["round_s"] for r in rows], "store": store}))
"""


def one_run(algorithm: str, clients: int, rounds: int, out: Path, memory_mb: float | None) -> dict:
    config = dict(algorithm=algorithm, model="timm:resnet18", clients=clients, participation=10 / clients,
                  partition={"name": "iid"}, train_limit=20 * clients, test_limit=200, rounds=rounds,
                  eval_every=rounds, local_iters=1, server_batch=160, checkpoint_every=1,
                  out=str(out / f"{algorithm}-{clients}-{memory_mb}"))
    if memory_mb is not None:
        config["client_state_memory_mb"] = memory_mb
    done = subprocess.run([sys.executable, "-c", ONE_RUN, json.dumps(config)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--algorithms", default="scaffold,moon")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in args.algorithms.split(","):
            base = None
            for clients, memory_mb, label in ((10, None, ""), (1000, None, ""), (1000, 1e6, " (forced)")):
                got = one_run(algorithm, clients, args.rounds, Path(tmp), memory_mb)
                ckpt, round_s = sum(got["ckpt_s"]) / len(got["ckpt_s"]), sum(got["round_s"]) / len(got["round_s"])
                base = base or (got["peak_mib"], ckpt)
                rows.append([algorithm, clients, got["store"] + label, round(got["peak_mib"]),
                             round(got["peak_mib"] / base[0], 3), round(ckpt, 3), round(ckpt / base[1], 3),
                             round(round_s, 3)])
                print(rows[-1], flush=True)
    common.report("client_state_scale", ["algorithm", "clients", "store", "peak MiB", "peak ratio", "ckpt s/round",
                                         "ckpt ratio", "round s"],
                  rows, {"threads": 1, "rounds": args.rounds, "model": "timm:resnet18", "participants": 10,
                         "targets": {"peak ratio": 1.3, "ckpt ratio": 1.5}})


if __name__ == "__main__":
    main()

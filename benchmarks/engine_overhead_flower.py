"""The Flower engine (simulation) against the local engine: round time and where it goes.

For the two settings of engine_overhead.py — FedAvg (10 clients, all participating) and SCALA
(AlexNet s2, 10 participants of 100, B = 320, T = 5) — both engines run the same rounds; the
ratio is the median training time of a round (``train_s``) after the first (which on Flower
also starts the workers and loads the data in them). Where Flower's time goes:

- exchanges   : message round trips per round (FedAvg 1; SCALA T + 1: the activation
                gradients ride on the next forward message) and the median wall time of one;
- serialise   : encoding + decoding one round's messages in this process (codec: weights,
                activations, gradients to ArrayRecords and back), no transport;
- ping        : an empty message to every participant's node and back — Ray scheduling and
                the in-memory link, no work: the floor of each exchange.

Run: python benchmarks/engine_overhead_flower.py [--rounds 3] [--train-limit N] [--ray-cpus 1]   (torch 1 thread in
this process; Ray gives each ClientApp worker one CPU, so with every CPU Flower runs clients in parallel
where the local engine runs them one after another; ``--ray-cpus 1`` compares one core with one core)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import common
import torch
from engine_overhead import SETTINGS

from fedlt.config import RunConfig
from fedlt.engine import prepare, run, sample_clients


def median_after_first(rows: list[dict], key: str = "train_s") -> float:
    return statistics.median(r[key] for r in rows[1:]) if len(rows) > 1 else rows[0][key]


def serialise_s(config: RunConfig, repeat: int = 3) -> float:
    """Encode and decode one round's messages (no transport), best of ``repeat``."""
    from fedlt.algorithms.base import ClientData
    from fedlt.algorithms.protocol import ClientResult, ClientStates, LocalRunner
    from fedlt.algorithms.split import classifier_of
    from fedlt.flower import codec

    prep = prepare(config)
    chosen = sample_clients(config.clients, config.participation, config.seeds.sampling, 0)
    clients = []
    for cid in chosen:
        idx = torch.as_tensor(prep.partition.client_indices[cid], dtype=torch.long)
        clients.append(ClientData(cid, prep.data.x_train[idx], prep.data.y_train[idx], prep.counts[cid]))
    round_ctx = prep.ctx.round(0, clients, classifier_of(prep.algorithm.global_model()))
    tasks = prep.algorithm.strategy.configure(round_ctx, clients, ClientStates())
    split = hasattr(prep.algorithm, "open_session")  # what the algorithm declares, as the Flower app reads it
    if split:
        uploads = LocalRunner().exchange(prep.algorithm, tasks).forward()
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for task in tasks:
            codec.task_from(codec.task_content(task), task.data)
            codec.value(codec.content(ClientResult(task.cid, task.weights, len(task.data))))
        if split:  # T exchanges of activations up and gradients down
            for _ in range(config.local_iters):
                for up in uploads:
                    back = codec.value(codec.content(up))
                    codec.value(codec.content(back.activations))
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pings", type=int, default=10)
    parser.add_argument("--train-limit", type=int, default=None, help="first N training images (default: all)")
    parser.add_argument("--ray-cpus", type=int, default=None,
                        help="CPUs Ray may use (default: all; 1 runs one client at a time, like the local engine)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from flwr.app import Context, Message, RecordDict
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedlt.flower.client_app import app as client_app
    from fedlt.flower.server_app import FlowerRunner

    out = Path(tempfile.mkdtemp(prefix="fedlt-flower-bench-"))
    configs = {name: RunConfig(**settings, rounds=args.rounds, eval_every=args.rounds,
                               train_limit=args.train_limit, test_limit=1000)
               for name, settings in SETTINGS.items()}
    local, flower, pings = {}, {}, {}
    for name, config in configs.items():
        tag = name.split()[0]
        run(config.model_copy(update={"out": out / f"{tag}-local"}))
        local[name] = common_rows(out / f"{tag}-local")

    server_app = ServerApp()

    @server_app.main()
    def bench(grid: Grid, context: Context) -> None:
        for name, config in configs.items():
            tag = name.split()[0]
            config = config.model_copy(update={"out": out / f"{tag}-flower", "engine": "flower"})
            rounds = FlowerRunner(grid, config)
            run(config, runner=rounds)
            flower[name] = (common_rows(out / f"{tag}-flower"), rounds)
            nodes = rounds.nodes()
            chosen = sample_clients(config.clients, config.participation, config.seeds.sampling, 0)
            times = []
            for _ in range(args.pings):
                started = time.perf_counter()
                rounds._deliver([Message(RecordDict(), nodes[c], "query.partition") for c in chosen], "ping")
                times.append(time.perf_counter() - started)
            pings[name] = statistics.median(times)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    run_simulation(server_app, client_app, num_supernodes=max(c.clients for c in configs.values()),
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"include_dashboard": False, "logging_level": logging.ERROR}
                                   | ({} if args.ray_cpus is None else {"num_cpus": args.ray_cpus})})

    rows = []
    for name, config in configs.items():
        flower_rows, rounds = flower[name]
        local_s, flower_s = median_after_first(local[name]), median_after_first(flower_rows)
        per_round = rounds.exchanges // args.rounds
        exchange = statistics.median(rounds.exchange_s[per_round:])  # after the first round
        rows.append([name, local_s, flower_s, flower_s / local_s, per_round, exchange, pings[name],
                     serialise_s(config)])
    common.report("engine_overhead_flower" + ("" if args.ray_cpus is None else f"_{args.ray_cpus}cpu"),
                  ["setting", "local round s", "flower round s", "flower/local", "exchanges/round",
                   "exchange s", "ping s", "serialise s/round"], rows,
                  meta={"rounds": args.rounds, "train_limit": args.train_limit, "first round excluded": True, "torch_threads_server": 1,
                        "ray_cpus_per_client": 1, "ray_cpus": args.ray_cpus or "all"})


def common_rows(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    main()

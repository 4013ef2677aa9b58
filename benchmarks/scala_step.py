"""One SCALA local iteration: the single concatenated server forward vs. the authors' way.

fused   : fedlt's engine — ONE server forward of the concatenated activations, the server loss
          and every client's loss from the same logits, two backward passes.
authors : a server forward + backward per client for that client's activation gradient, plus a
          forward + backward on the concatenation for the server step (K+1 server passes).

Both run inside the same engine (only the server step differs) on the same data; the time is per
local iteration (client forward/backward and optimiser steps included, identical in both).
Run: python benchmarks/scala_step.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (sets TRITON_INTERPRET before timm is imported)
import torch

from fedlt.algorithms.base import ClientData, RunContext
from fedlt.context import ModelSpec
from fedlt.engine import train_round
from fedlt.algorithms.protocol import ClientStates
from fedlt.algorithms.split import SplitLearning
from fedlt.algorithms.split_server import ConcatServer


class AuthorsServer(ConcatServer):
    """The authors' way: a server forward + backward per client for that client's activation
    gradient, plus one on the concatenation for the server step (K+1 server passes)."""

    def forward_backward(self, server, group, uploads):
        grads = []
        for k in group:  # one server pass per client
            a = uploads[k].activations.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(self.client_objectives[k][1](server(a), uploads[k].labels), a)
            grads.append(g)
        labels = torch.cat([uploads[k].labels for k in group])
        logits = server(torch.cat([uploads[k].activations for k in group]))  # one more on the concatenation
        loss = self.server_objective(labels)(logits, labels)
        server.apply(list(torch.autograd.grad(loss, server.parameters())))
        self.server_losses.append(loss.detach())
        return grads


def time_iteration(model_name: str, split_at, image: tuple[int, int, int], num_clients: int, variant: str,
                   iters: int, repeats: int) -> float:
    torch.manual_seed(0)
    in_chans, size, _ = image[0], image[1], image[2]
    spec = ModelSpec(model_name, in_chans, 10, size)
    ctx = RunContext(num_classes=10, input_shape=image, build_model=spec.build,
                     split=split_at, server_batch=320, local_iters=iters, local_epochs=None, batch_size=0, lr=0.01,
                     momentum=0.9, weight_decay=5e-4, clip=10.0, sampling_seed=0, device=torch.device("cpu"), model=spec)
    algorithm = SplitLearning()
    algorithm.setup(ctx)
    if variant == "authors":
        algorithm.strategy.server.__class__ = AuthorsServer
    g = torch.Generator().manual_seed(1)
    clients = []
    for cid in range(num_clients):
        n = 600
        y = (torch.randint(0, 2, (n,), generator=g) + 2 * (cid % 5)) % 10  # two classes per client
        clients.append(ClientData(cid, torch.randn(n, *image, generator=g), y, torch.bincount(y, minlength=10)))
    states = ClientStates()
    train_round(algorithm, ctx, 0, clients, states)  # warm-up
    best = float("inf")
    for r in range(repeats):
        start = time.perf_counter()
        train_round(algorithm, ctx, r + 1, clients, states)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    settings = [("alexnet s2", "alexnet", "s2", (3, 32, 32)), ("resnet18 @2", "timm:resnet18", "2", (3, 32, 32))]
    rows = []
    for label, model, at, image in settings:
        for k in (10, 50):
            fused = time_iteration(model, at, image, k, "fused", args.iters, args.repeats)
            authors = time_iteration(model, at, image, k, "authors", args.iters, args.repeats)
            rows.append([label, k, round(fused * 1000, 1), round(authors * 1000, 1), round(authors / fused, 2)])
            print(rows[-1], flush=True)
    common.report("scala_step", ["model / split", "clients", "fused ms/iter", "authors ms/iter", "authors / fused"], rows,
                  {"server_batch": 320, "iters_per_round": args.iters, "repeats": args.repeats, "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()

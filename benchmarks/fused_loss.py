"""Forward+backward time of the fused loss path versus the reference, on this CPU (docs/fused.md).

    python benchmarks/fused_loss.py [--reps 7] [--threads 1] [--compile]

Objectives: ``logit_adjust``, the ``fedvls`` composite, SCALA's dual loss (server prior + every
client's prior from one set of server logits; 10 and 50 clients) and ``sgb`` (Fed-GraB: DPA
gating), for B ∈ {320, 4096} × C ∈ {10, 100, 1000}. Variants: ``reference`` (fused="off"),
``fused`` (the analytic CPU path, fused="on") and ``auto`` (what a run does by default); for
SCALA's pair also ``eager pair`` (``offset_ce_pair`` with ``fused="off"``: the vectorised eager
path that ``auto`` weighs the fused pass against). Each time is the best of ``--reps`` repetitions, the variants interleaved repetition by repetition so
a noisy neighbour on the shared machine hits all of them alike. ``bytes`` is what the objective
must move at the least (logits read once, gradient written once, the teacher's vacant columns,
targets and per-class vectors), and GB/s that over the measured time.

``--compile`` also times ``torch.compile`` of the reference fedvls at B=4096, C=1000 (compilation
included once, then the best run), the alternative fused CPU path the issue asks to weigh.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("COLUMNS", "160")  # the ratio table's eleven columns, untruncated

import torch

import fedlt.losses as L
from fedlt.losses.fused import CPU_AUTO_RULES, offset_ce_pair

try:
    from benchmarks.common import report
except ImportError:  # run as a script from the benchmarks folder
    from common import report

SIZES = [(320, 10), (320, 100), (320, 1000), (4096, 10), (4096, 100), (4096, 1000)]
OBJECTIVES = ["logit_adjust", "fedvls", "scala_pair_10", "scala_pair_50", "sgb"]


def client_counts(C: int, gen: torch.Generator) -> torch.Tensor:
    """A skewed client: half the classes vacant, the rest with 1..500 samples."""
    counts = torch.zeros(C)
    present = torch.randperm(C, generator=gen)[: max(2, C // 2)]
    counts[present] = torch.randint(1, 500, (len(present),), generator=gen).float()
    return counts


def setup(objective: str, B: int, C: int, seed: int = 0):
    """{variant: step()} doing one forward+backward, and the minimum bytes moved."""
    gen = torch.Generator().manual_seed(seed)
    counts = client_counts(C, gen)
    present = counts.nonzero().flatten()
    y = present[torch.randint(len(present), (B,), generator=gen)]
    z = (torch.randn(B, C, generator=gen) * 3).requires_grad_(True)
    t = torch.randn(B, C, generator=gen) * 3
    small = B * 8 + 4 * C * 4  # targets (int64) and a few per-class vectors
    logits_rw = 2 * B * C * 4  # logits read once, gradient written once (float32)

    if objective.startswith("scala_pair"):
        K = int(objective.rsplit("_", 1)[1])
        sizes = [B // K + (1 if k < B % K else 0) for k in range(K)]
        server = L.LogitAdjust(class_counts=torch.bincount(y, minlength=C))
        clients = []
        for rows in y.split(sizes):
            n = client_counts(C, gen)
            n[rows] += 1
            clients.append(L.LogitAdjust(class_counts=n))
        so = server.offset.vec
        co = torch.stack([c.offset.vec for c in clients])
        for term in (server, *clients):
            term.fused = "off"

        def reference():
            s = server(z, y)
            total = sum(c(r, yy) for c, r, yy in zip(clients, z.split(sizes), y.split(sizes)))
            torch.autograd.grad(s, z, retain_graph=True)
            torch.autograd.grad(total, z)

        def pair(mode):
            def step():
                s, per_client = offset_ce_pair(z, y, so, co, sizes, fused=mode)
                torch.autograd.grad(s, z, retain_graph=True)
                torch.autograd.grad(per_client.sum(), z)
            return step

        # one read of the logits, two gradients written, K×C client offsets
        return {"reference": reference, "fused": pair("on"), "auto": pair("auto"), "eager pair": pair("off")}, \
            3 * B * C * 4 + K * C * 4 + small

    if objective == "sgb":
        W = torch.randn(C, 64, generator=gen)
        objs = {}
        for mode, variant in (("off", "reference"), ("on", "fused"), ("auto", "auto")):
            objs[variant] = L.build("fedgrab", classifier_weight=W, num_classes=C, fused=mode)
    else:
        objs = {variant: L.build(objective, class_counts=counts, fused=mode)
                for mode, variant in (("off", "reference"), ("on", "fused"), ("auto", "auto"))}
    vacant = int((counts == 0).sum()) if objective == "fedvls" else 0

    def run(obj):
        def step():
            loss = obj(z, y, teacher_logits=t)
            torch.autograd.grad(loss, z)
        return step

    return {v: run(o) for v, o in objs.items()}, logits_rw + B * vacant * 4 + small


# -- the H100 traffic model of docs/fused.md ---------------------------------------------------------
HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
LAUNCH_S = 4e-6  # one eager kernel launch (CPU-side issue cost; small problems are launch-bound)
# objective -> (reference bytes per logit, reference launches, fused bytes per logit, fused launches),
# float32 logits, |O| = C/2 vacant classes, K = 10 clients; counted in docs/fused.md
TRAFFIC = {
    "logit_adjust": (32, 9, 12, 4),
    "fedvls": (190, 45, 16, 10),
    "scala_pair_10": (64, 88, 12, 7),
    "sgb": (150, 20, 8, 5),
}


def traffic_model() -> list[list]:
    rows = []
    for objective, (ref_b, ref_l, fused_b, fused_l) in TRAFFIC.items():
        for B in (320, 4096, 65536):
            for C in (10, 100, 1000):
                ref = ref_b * B * C / HBM_BYTES_PER_S + ref_l * LAUNCH_S
                fused = fused_b * B * C / HBM_BYTES_PER_S + fused_l * LAUNCH_S
                rows.append([objective, B, C, ref_b * B * C / 1e6, fused_b * B * C / 1e6, ref * 1e6, fused * 1e6,
                             ref / fused])
    return rows


def best_times(steps: dict, reps: int) -> dict[str, float]:
    for step in steps.values():  # warm-up (allocations, first-call caches)
        step()
    best = {v: float("inf") for v in steps}
    order = list(steps)
    for rep in range(reps):
        for v in order[rep % len(order):] + order[:rep % len(order)]:  # rotated: no variant always runs first
            t0 = time.perf_counter()
            steps[v]()
            best[v] = min(best[v], time.perf_counter() - t0)
    return best


def compiled_fedvls(reps: int) -> dict:
    B, C = 4096, 1000
    gen = torch.Generator().manual_seed(0)
    counts = client_counts(C, gen)
    present = counts.nonzero().flatten()
    y = present[torch.randint(len(present), (B,), generator=gen)]
    z = (torch.randn(B, C, generator=gen) * 3).requires_grad_(True)
    t = torch.randn(B, C, generator=gen) * 3
    obj = L.build("fedvls", class_counts=counts, fused="off")
    fn = torch.compile(lambda z_, t_: obj(z_, y, teacher_logits=t_))
    t0 = time.perf_counter()
    torch.autograd.grad(fn(z, t), z)
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.autograd.grad(fn(z, t), z)
        best = min(best, time.perf_counter() - t0)
    return {"first_call_s": first, "best_ms": best * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--objectives", nargs="*", default=OBJECTIVES)
    parser.add_argument("--traffic", action="store_true", help="print the H100 traffic model only")
    args = parser.parse_args()
    if args.traffic:
        report("fused_loss_h100_model", ["objective", "B", "C", "reference MB", "fused MB", "reference us",
                                         "fused us", "ratio"], traffic_model(),
               {"hbm_bytes_per_s": HBM_BYTES_PER_S, "launch_s": LAUNCH_S, "bytes_per_logit_and_launches": TRAFFIC})
        return
    torch.set_num_threads(args.threads)
    rows = []
    for objective in args.objectives:
        for B, C in SIZES:
            steps, nbytes = setup(objective, B, C)
            reps = args.reps if B * C < 1_000_000 else max(3, args.reps // 2 + 1)
            best = best_times(steps, reps)
            ref, fused, auto = best["reference"], best["fused"], best["auto"]
            eager = best.get("eager pair")  # SCALA's pair only: offset_ce_pair's eager path, what auto weighs fused against
            rows.append([objective, B, C, ref * 1e3, fused * 1e3, auto * 1e3, ref / fused, ref / auto,
                         nbytes / 1e6, nbytes / fused / 1e9, nbytes / ref / 1e9,
                         "-" if eager is None else eager * 1e3])
    meta = {"threads": args.threads, "reps": args.reps, "timing": "best of reps, variants interleaved in rotating order",
            "cpu_auto_min_elements": dict(CPU_AUTO_RULES), "torch": torch.__version__}
    if args.compile:
        meta["torch_compile_fedvls_4096x1000"] = compiled_fedvls(args.reps)
        print("torch.compile fedvls 4096x1000:", meta["torch_compile_fedvls_4096x1000"])
    report("fused_loss", ["objective", "B", "C", "reference ms", "fused ms", "auto ms", "ref/fused", "ref/auto",
                          "bytes MB", "fused GB/s", "reference GB/s", "eager pair ms"], rows, meta)


if __name__ == "__main__":
    main()

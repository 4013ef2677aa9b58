"""What one fused loss call asks of the host (issue 43): torch operators issued and Triton launches
per forward + backward, and µs of the call's Python (thread CPU time) with every Triton launch
replaced by a no-op STUB — measured on the CPU, no GPU needed. On a GPU a call of up to ~10^8
logits is bound by the host (the H200 took ~10 µs per torch operator and ~13–18 µs per Triton
launch, docs/gpu.md), so these counts are what decides its time there. "kernel operators" are the
operators that launch a kernel on a GPU (every aten operator but allocations and views, which cost
the host a few µs and launch nothing). The µs are this CPU's (noisy on a shared machine; the best
of ten batches); benchmarks/launch_overhead.py times the same calls on a GPU.

    python benchmarks/fused_host.py [--shape 4096x1000] [--calls 300] [--out FILE]

Each probe runs through the public entry point the training code calls: the loss object built
with ``fused="on"`` (``logit_adjust``, ``fedvls``, ``logit_suppression(variant='paper')``), SCALA's
``offset_ce_pair(..., fused="on")`` and ``sgb``; ``fused="off"`` (the eager reference) beside it.
The operator counts do not depend on the shape; the µs are timed at the shape given, where the
stubbed Triton launches compute nothing but the torch operators do (use a small shape, the default
10×10, so that the time is the host's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# operators that launch nothing on a GPU: allocation and aliasing (metadata only)
NO_KERNEL = {"empty", "empty_strided", "empty_like", "detach", "view", "_unsafe_view", "select", "slice", "unsqueeze",
             "squeeze", "expand", "as_strided", "t", "alias", "unbind", "split", "narrow", "reshape", "permute",
             "transpose", "lift_fresh", "_to_copy_noop", "set_", "resize_"}


class _Stub:
    """Counts Triton launches and launches nothing (the kernels' outputs stay uninitialised)."""

    def __init__(self) -> None:
        self.launches = 0

    def install(self) -> None:
        import triton.runtime.jit as jit

        stub = self

        def run(self, *args, grid, warmup, **kwargs):  # noqa: ARG001  (JITFunction.run's signature)
            stub.launches += 1

        jit.JITFunction.run = run


def probes(B: int, C: int, mode: str, device="cpu"):
    """(label, call) pairs: one forward + backward per call, through the public entry points
    (benchmarks/launch_overhead.py times the same calls on a GPU)."""
    import torch

    import fedlt.losses as L
    from fedlt.losses.fused import offset_ce_pair

    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 40, (C,), generator=gen).float()
    counts[C // 3: C // 2] = 0  # vacant classes: the KD and the suppression have work
    y = counts.nonzero().flatten()[torch.randint(int((counts > 0).sum()), (B,), generator=gen)].to(device)
    z = (torch.randn(B, C, generator=gen) * 3).to(device).requires_grad_(True)
    teacher = (torch.randn(B, C, generator=gen) * 3).to(device)
    for expr in ("logit_adjust", "fedvls", "logit_suppression(variant='paper')"):
        loss = L.build(expr, class_counts=counts, fused=mode)
        yield expr, lambda loss=loss: torch.autograd.grad(loss(z, y, teacher_logits=teacher), [z])
    sizes = [B // 3, B // 3, B - 2 * (B // 3)] if B >= 3 else [B]
    server = torch.log(counts / counts.sum() + 1e-12).to(device)
    clients = torch.log(torch.rand(len(sizes), C, generator=gen, dtype=torch.float64) + 1e-12).to(device)

    def pair():
        s, c = offset_ce_pair(z, y, server, clients, sizes, fused=mode)
        return torch.autograd.grad([s, c], [z], [torch.ones_like(s), torch.ones_like(c)])
    yield "offset_ce_pair", pair
    sgb = L.build("sgb", fused=mode)
    yield "sgb", lambda: torch.autograd.grad(sgb(z, y), [z])


def _count(call) -> tuple[int, int, Counter]:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        call()
    kernels = sum(n for op, n in seen.items() if op not in NO_KERNEL)
    return sum(seen.values()), kernels, seen


def _us(call, calls: int, batches: int = 10) -> float:
    """µs per call: the best of ``batches`` batches (the machine may be shared: the least disturbed one)."""
    for _ in range(5):
        call()
    best = float("inf")
    for _ in range(batches):
        began = time.thread_time()
        for _ in range(calls // batches):
            call()
        best = min(best, (time.thread_time() - began) / (calls // batches) * 1e6)
    return best


def measure(shape: tuple[int, int] = (10, 10), calls: int = 300) -> list[dict]:
    import torch

    from fedlt.losses.fused import dispatch

    torch.set_num_threads(1)
    stub = _Stub()
    stub.install()
    dispatch.TRITON_DEVICES = ("cuda", "cpu")  # CPU tensors take the Triton path (stubbed)
    rows = []
    for mode in ("on", "off"):
        for label, call in probes(*shape, mode):
            call()  # first call: caches
            stub.launches = 0
            total, kernels, seen = _count(call)
            launches = stub.launches
            python_us = _us(call, calls)
            rows.append({"probe": label, "path": "fused (Triton stubbed)" if mode == "on" else "eager",
                         "operators": total, "kernel_operators": kernels, "triton_launches": launches,
                         "python_us": round(python_us, 1),
                         "ops": dict(sorted(seen.items()))})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="10x10", help="BxC (default 10x10: the host's time, little arithmetic)")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"  # before triton's import: the compiled launch path, stubbed
    B, C = (int(v) for v in args.shape.lower().split("x"))
    rows = measure((B, C), args.calls)
    for r in rows:
        print(f"{r['probe']:40s} {r['path']:24s} ops {r['operators']:3d} (kernels {r['kernel_operators']:3d}) "
              f"triton {r['triton_launches']}  python {r['python_us']:7.1f} µs")
    if args.out:
        args.out.write_text(json.dumps({"shape": [B, C], "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()

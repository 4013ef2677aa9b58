"""What one call costs on a device before any arithmetic (issue 43): a kernel launch from torch,
a Triton launch, and the fused loss's forward+backward against the eager reference — the plain
objective (``logit_adjust``) at a tiny batch (PFLlib's 10×10, launch-bound), and at 4096×1000 every
probe of benchmarks/fused_host.py (``logit_adjust``, ``fedvls``, ``logit_suppression(paper)``,
SCALA's ``offset_ce_pair``, ``sgb``, each through its public entry point) — wall µs per call over
many calls, the device's own time per call (CUDA events), and torch.profiler's operators of the
4096×1000 ``logit_adjust`` calls.

    python benchmarks/launch_overhead.py [--device cuda] [--calls 200]

The device check runs it as its ``overheads`` section. On the CPU only the torch rows run
(there is no launch to time, and the Triton interpreter is not the compiled kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _per_call(fn, calls: int, device) -> dict:
    """Wall µs per call (host issue + whatever the device makes it wait) and device µs per call."""
    import torch

    cuda = device.type == "cuda"
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - began
    row = {"issue_us": issued / calls * 1e6}
    if cuda:
        end.record()
        torch.cuda.synchronize(device)
        row["device_us"] = start.elapsed_time(end) / calls * 1e3
    row["wall_us"] = (time.perf_counter() - began) / calls * 1e6
    return row


def _operators(fn, device, calls: int = 20) -> list[dict]:
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    fn()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    table = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:14]
    return [{"op": a.key, "calls": a.count, "self_cpu_us_per_call": a.self_cpu_time_total / calls,
             "device_us_per_call": getattr(a, "self_device_time_total", 0) / calls} for a in table]


def _triton_rows(device, calls: int) -> dict:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(16, device=device)
    return {"triton launch (a 2-argument kernel)": _per_call(lambda: _touch[(1,)](x, 16, BLOCK=16), calls, device)}


def measure(device, calls: int = 200, large: tuple[int, int] = (4096, 1000)) -> dict:
    """``large``: the shape of every probe's row (the device check's dry run takes a small one)."""
    import torch

    from fused_host import probes

    device = torch.device(device)
    x = torch.zeros(1, device=device)
    rows = {"torch launch (x.add_(1), 1 element)": _per_call(lambda: x.add_(1), calls, device)}
    if device.type == "cuda":
        rows |= _triton_rows(device, calls)
    modes = ("off", "on") if device.type == "cuda" else ("off",)
    for B, C in ((10, 10), large):
        for mode in modes:
            for label, call in probes(B, C, mode, device):
                if (B, C) != large and label != "logit_adjust":
                    continue  # at 10×10 the plain objective alone (PFLlib's shape)
                name = f"{label} fwd+bwd {B}x{C} {'fused' if mode == 'on' else 'eager'}"
                rows[name] = _per_call(call, calls if B * C < 10**6 else calls // 4, device)
    operators = {mode: _operators(next(probes(*large, mode, device))[1], device) for mode in modes}
    return {"per_call": rows, f"operators_{large[0]}x{large[1]} (logit_adjust)": operators}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        import common  # noqa: F401  (TRITON_INTERPRET before timm imports triton)
    found = measure(args.device, args.calls)
    print(json.dumps(found, indent=1))
    return found


if __name__ == "__main__":
    main()

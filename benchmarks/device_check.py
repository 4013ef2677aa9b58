"""fedlt on a GPU, in one command (issue 34, docs/gpu.md): what a lent GPU has to prove, in < 8 min
on one H100, written to ``benchmarks/results/device_check.json`` after every section.

    python benchmarks/device_check.py [--device cuda] [--dry-run]

Sections (each timed, each with its peak GPU memory; one that raises is recorded and the next runs):

1. ``doctor``: versions, the device, each fused kernel's check (``fedlt doctor``'s rows);
   ``overheads``: ``benchmarks/launch_overhead.py`` — µs per torch launch, per Triton launch and per
   loss call, fused and eager: ``logit_adjust`` at 10×10, and at 4096×1000 every probe of
   ``benchmarks/fused_host.py`` through its public entry point (SCALA's pair and ``sgb`` too),
   issued and on the device;
2. ``kernels``: every Triton kernel against the float64 reference, value and gradient, float32
   and bfloat16, at several shapes (``fedlt.losses.fused.check``'s probes);
3. ``fused_vs_eager``: forward+backward ms of the fused objective kernels against the eager
   reference at B×C = 4096×1000 and 65536×1000, beside the traffic model's floor (docs/fused.md);
4. ``algorithms``: one round of every registered algorithm on the device and on the CPU (tiny
   MNIST): test loss and accuracy side by side;
5. ``pfllib_mnist``: seconds per round of PFLlib's MNIST task (FedAvgCNN, 100 clients, 10 %,
   one local epoch of batch 10): sequential on the device, ``--cohort 10`` on the device, both
   again with ``--compile`` (CUDA graphs; the first round, which compiles, reported apart as
   ``first_round_s``), the CPU;
   ``graphs``: the same task over 10 rounds, eager vs ``--graphs`` (whole-step CUDA graphs; the
   first round, which captures, apart), one client after another and in cohorts of 10, with
   fedlt's SGD defaults and with PFLlib's own (no momentum, no clip, drop_last); every registered
   algorithm one round with and without ``--graphs`` on the device (test-loss gap, the fallback
   reason), one client at a time and in one cohort of 3; with ``--compile`` too (inductor's kernels
   inside the captured step; not in the dry run); ``fedlogit`` and ``fedvls`` again with
   ``fused="on"`` (per-client tables read by the Triton kernels inside the captured step).
   ``graphs_pfllib`` (``--only`` only): the task's rows alone, for a short lease;
6. ``scala_s2``: SCALA at the README's default (AlexNet cut at s2, MNIST) on the device;
7. ``bf16``: FedAvg on PFLlib's task, accuracy after 5 rounds in float32 and in bf16;
8. ``profile``: ``benchmarks/profile_round.py`` on the device — one round of PFLlib's task (one
   client after another, and ``--cohort 10``) and of SCALA s2 by phase (forward, backward, optimiser, clip, slicing, host syncs, evaluation,
   aggregation, checkpoint) and torch.profiler's operators; its tables go beside the JSON;
   ``graphs_profile``: the same for PFLlib's task under ``--graphs`` (one client at a time and in
   cohorts of 10), with the device's busy time and its kernels (a replayed round's floor);
9. ``resnet18_cifar``: a CIFAR-10-shaped round of ResNet-18 (``resnet18_cifar``), 100 clients at
   10 %, one local epoch of batch 32, on synthetic data of CIFAR's shape (nothing is downloaded),
   with the GPU's utilisation sampled every 0.2 s while it trains.

``--dry-run`` runs the same code on the CPU at tiny sizes (a test runs it in the suite) and
writes ``device_check_dry_run.json`` into a new temporary folder (``--out`` names the file), never
into the source tree. Every file the check writes goes into the directory of its JSON. Nothing is
downloaded: MNIST ships inside the package and
the script imports fedlt from this checkout when it is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a bare machine: this checkout, not an installed fedlt
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

# H100 SXM HBM3 and the bytes per logit of docs/fused.md's traffic model (benchmarks/fused_loss.py)
HBM_BYTES_PER_S = 3.35e12
FUSED_BYTES_PER_LOGIT = {"logit_adjust": 12, "fedvls": 16}

FULL = dict(kernel_shapes=[(48, 23), (1024, 100), (4096, 1000), (8192, 1000)], fused_sizes=[(4096, 1000), (16384, 1000), (65536, 1000)],
            reps=20, algorithms=None,
            pfllib=dict(train_limit=None, test_limit=None, clients=100, rounds=4, cpu_rounds=2, graphs_rounds=10),
            scala_rounds=3, bf16_rounds=5, resnet=dict(train=50_000, test=10_000, clients=100, rounds=3), compile=True,
            graphs_algorithms=None, graphs_fused_on=["fedlogit", "fedvls"])
DRY = dict(kernel_shapes=[(8, 5), (48, 23)], fused_sizes=[(64, 10)], reps=2, algorithms=["fedavg", "scala"],
           pfllib=dict(train_limit=200, test_limit=100, clients=10, rounds=2, cpu_rounds=1, graphs_rounds=2), scala_rounds=1,
           bf16_rounds=1, resnet=dict(train=200, test=50, clients=10, rounds=1),
           graphs_algorithms=["fedavg"], graphs_fused_on=["fedlogit"], compile=False)  # inductor's CPU compile of the CNN: ~30 s, beyond the suite's budget (tests/test_compile.py)
# an algorithm whose defaults need more data than TINY_RUN's 600 images (FEDIC holds 100 a class out)
SMALL_PARAMS = {"fedic": {"proxy_per_class": 5}}
TINY_RUN = dict(dataset="mnist", train_limit=600, test_limit=200, clients=6, participation=0.5, local_iters=2,
                server_batch=12, partition={"name": "dirichlet", "beta": 0.5, "min_size": 5})


def _memory(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    return {"peak_gpu_memory_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)}


def doctor(device, sizes) -> dict:
    import torch

    from fedlt.cli.doctor_cmd import versions
    from fedlt.losses.fused.check import report

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    dtypes = (torch.float32,) if sizes is DRY else (torch.float32, torch.bfloat16)  # the interpreter is slow
    rows = report(device, dtypes, size=sizes["fused_sizes"][0], reps=sizes["reps"])
    return {"versions": versions(), "device": f"{device} ({name})", "kernels": rows,
            "all_passed": all(r["passed"] for r in rows)}


def kernels(device, sizes) -> dict:
    import torch

    from fedlt.losses.fused import check
    from fedlt.losses.fused.dispatch import triton_backend

    impl = triton_backend()
    if impl is None:
        return {"skipped": "triton does not import"}
    rows = []
    for kernel in check.KERNELS:
        for dtype in (torch.float32, torch.bfloat16):
            for size in sizes["kernel_shapes"]:
                rows.append(_kernel_row(check, impl, kernel, device, dtype, size))
    return {"rows": rows, "all_passed": all(r["passed"] for r in rows)}


def _kernel_row(check, impl, kernel, device, dtype, size) -> dict:
    """One kernel's value and gradient against the float64 reference at one shape."""
    tol = check.TOLERANCE[dtype]
    try:
        if kernel == "sgb":
            runs = [(label, list(f()), list(r())) for label, f, r in check._sgb_runs(impl, device, dtype, size)]
        else:
            probes = check._objective_probes if kernel == "objective" else check._pair_probes
            runs = [(label, list(check._grad(f, z)), list(check._grad(r, z.double())))
                    for label, f, r, z in probes(impl, device, dtype, size)]
        worst = max(check._worst(f, r) for _, f, r in runs)
        return {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."), "B": size[0], "C": size[1],
                "relative_error": worst, "tolerance": tol, "passed": worst <= tol}
    except Exception as exc:  # noqa: BLE001  (a kernel that does not run here is a failed row)
        return {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."), "B": size[0], "C": size[1],
                "passed": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}


def fused_vs_eager(device, sizes) -> dict:
    import torch

    from fedlt.losses.fused import check

    rows = []
    for B, C in sizes["fused_sizes"]:
        for dtype in (torch.float32, torch.bfloat16):
            fused_ms, eager_ms = check.speed("objective", device, dtype, (B, C), sizes["reps"])
            floor_ms = sum(FUSED_BYTES_PER_LOGIT.values()) * B * C / HBM_BYTES_PER_S * 1e3
            rows.append({"B": B, "C": C, "dtype": str(dtype).removeprefix("torch."), "fused_ms": fused_ms,
                         "eager_ms": eager_ms, "speedup": eager_ms / fused_ms,
                         "traffic_floor_ms (H100, logit_adjust+fedvls)": floor_ms})
    return {"rows": rows, "note": "the 'objective' probes: logit_adjust, fedvls and logit_suppression(paper)",
            "per_probe": _per_probe(device, sizes)}


def _per_probe(device, sizes) -> list[dict]:
    """Each probe apart (float32): the sizes from which ``auto`` runs the kernels on CUDA
    (``CUDA_AUTO_RULES``) are read from these rows."""
    import torch

    from fedlt.losses.fused import check

    impl = check.triton_backend()
    if impl is None:
        return []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def ms(call) -> float:
        call()
        sync()
        began = time.perf_counter()
        for _ in range(sizes["reps"]):
            call()
        sync()
        return (time.perf_counter() - began) / sizes["reps"] * 1e3

    rows = []
    for B, C in sizes["fused_sizes"]:
        probes = [*check._objective_probes(impl, device, torch.float32, (B, C)),
                  *check._pair_probes(impl, device, torch.float32, (B, C))]
        for expr, fused, reference, z in probes:
            fused_ms, eager_ms = ms(lambda: check._grad(fused, z)), ms(lambda: check._grad(reference, z))
            rows.append({"probe": expr, "B": B, "C": C, "fused_ms": fused_ms, "eager_ms": eager_ms,
                         "speedup": eager_ms / fused_ms})
        for label, fused, reference in check._sgb_runs(impl, device, torch.float32, (B, C), torch.float32):
            fused_ms, eager_ms = ms(fused), ms(reference)
            rows.append({"probe": label, "B": B, "C": C, "fused_ms": fused_ms, "eager_ms": eager_ms,
                         "speedup": eager_ms / fused_ms})
    return rows


def _run(out: Path, **settings) -> tuple[dict, list[dict]]:
    from fedlt.config import RunConfig
    from fedlt.engine import run

    summary = run(RunConfig(**settings, out=out))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def algorithms(device, sizes, tmp: Path) -> dict:
    import fedlt.algorithms
    from fedlt.config import RunConfig
    from fedlt.testing.algorithms import split_model_for

    rows = []
    for name in sizes["algorithms"] or fedlt.algorithms.REGISTRY.list():
        base = dict(TINY_RUN, algorithm=name, rounds=1, eval_every=1, algorithm_params=SMALL_PARAMS.get(name, {}))
        row: dict = {"algorithm": name}
        try:  # one algorithm's failure is its row's, and the others still run
            base["model"] = row["model"] = split_model_for(RunConfig(**base, out=tmp / "probe"))
            for label, where in (("device", str(device)), ("cpu", "cpu")):
                began = time.perf_counter()
                final = _run(tmp / f"{name}-{label}", **base, device=where)[0]["final"]
                row[label] = {"loss": final["loss"], "accuracy": final["accuracy"],
                              "seconds": round(time.perf_counter() - began, 2)}
            row["loss_gap"] = abs(row["device"]["loss"] - row["cpu"]["loss"])
        except Exception as exc:  # noqa: BLE001  (recorded, with its last frames)
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            row["where"] = traceback.format_exc().strip().splitlines()[-4:]
        rows.append(row)
    gaps = [r["loss_gap"] for r in rows if "loss_gap" in r]
    return {"rows": rows, "largest_loss_gap": max(gaps, default=None),
            "failed": [r["algorithm"] for r in rows if "error" in r]}


def _pfllib(sizes) -> dict:
    p = sizes["pfllib"]
    return dict(dataset="mnist", model="pfllib_cnn", algorithm="fedavg", clients=p["clients"], participation=0.1
                if p["clients"] >= 100 else 0.3, local_epochs=1, batch_size=10, train_limit=p["train_limit"], test_limit=p["test_limit"],
                partition={"name": "dirichlet", "beta": 0.1, "min_size": 2}, optimiser={"lr": 0.005})


def _seconds_per_round(rows: list[dict]) -> float:
    timed = rows[1:] or rows  # the first round pays for warm-up (cuDNN autotuning, allocator)
    return sum(r["train_s"] for r in timed) / len(timed)


def pfllib_mnist(device, sizes, tmp: Path) -> dict:
    import torch

    import fedlt.algorithms
    from fedlt.algorithms.cohort import cohort_reason
    from fedlt.models import create as create_model

    base, p = _pfllib(sizes), sizes["pfllib"]
    out = {"task": {k: v for k, v in base.items() if k != "partition"} | {"partition": "dirichlet(beta=0.1)"}}
    reason = cohort_reason(fedlt.algorithms.create("fedavg"), create_model("pfllib_cnn"))
    out["cohort_fallback"] = reason
    for label, where, cohort, rounds, compile in (("device sequential", str(device), 1, p["rounds"], False),
                                                  ("device --cohort 10", str(device), 10, p["rounds"], False),
                                                  ("device sequential --compile", str(device), 1, p["rounds"], True),
                                                  ("device --cohort 10 --compile", str(device), 10, p["rounds"], True),
                                                  ("cpu sequential", "cpu", 1, p["cpu_rounds"], False)):
        if compile and not sizes["compile"]:
            out[label] = {"skipped": "not in the dry run (inductor's compile of the CNN takes ~30 s on a CPU)"}
            continue
        summary, rows = _run(tmp / f"pfllib-{label.replace(' ', '_')}", **base, rounds=rounds, eval_every=rounds,
                             device=where, cohort=cohort, compile=compile)
        out[label] = {"seconds_per_round": _seconds_per_round(rows), "rounds": rounds,
                      "accuracy": summary["final"]["accuracy"], "threads": torch.get_num_threads(),
                      "first_round_s": rows[0]["train_s"]}  # with --compile: the compilation, apart from the rounds
        if compile:
            out[label]["compile_fallback"] = summary["compile_fallback"]
    return out


def graphs(device, sizes, tmp: Path, pfllib_only: bool = False) -> dict:
    """``--graphs`` (docs/gpu.md#whole-step-cuda-graphs): PFLlib's task one client after another,
    eager vs whole-step graphs (s a round over rounds 2–4, the first round — the captures — apart);
    every registered algorithm one round on the device with and without ``--graphs`` (test-loss gap,
    the fallback reason). On the CPU (the dry run) the graphs are the stand-in's: correctness only."""
    from fedlt.algorithms import graphs as step_graphs

    backend = "cuda" if device.type == "cuda" else "recorded"
    out: dict = {"backend": backend + ("" if backend == "cuda" else " (the CPU stand-in: correctness, not speed)")}
    with step_graphs.default_backend(backend):
        out["pfllib_mnist"] = _graphs_pfllib(device, sizes, tmp)
        if not pfllib_only:
            out["algorithms"] = _graphs_algorithms(device, sizes, tmp)
    return out


def graphs_pfllib(device, sizes, tmp: Path) -> dict:
    """``graphs`` without the registry's rows: PFLlib's task only."""
    return graphs(device, sizes, tmp, pfllib_only=True)


def _graphs_pfllib(device, sizes, tmp: Path) -> dict:
    from fedlt.algorithms import graphs as step_graphs

    base, p = _pfllib(sizes), sizes["pfllib"]
    rounds = p["graphs_rounds"]  # more rounds than the other sections: new batch shapes are captured in early rounds
    out: dict = {}
    # the task with fedlt's SGD defaults (momentum 0.9, clip 10: the rows of every earlier lease), and
    # with PFLlib's own client (clientbase.py: SGD(lr) without momentum or clip, drop_last=True)
    pfllib_sgd = dict(optimiser={"lr": 0.005, "momentum": 0.0, "clip": None}, drop_last=True)
    # and inductor's fused kernels inside the captured step (the first round compiles: ~20-60 s)
    pfllib_own = [("PFLlib's SGD: device sequential", False, 1, pfllib_sgd),  # not in the dry run: the suite's time
                  ("PFLlib's SGD: device sequential --graphs", True, 1, pfllib_sgd),
                  ("PFLlib's SGD: device --cohort 10 --graphs", True, 10, pfllib_sgd)]
    with_compile = [("device sequential --compile --graphs", True, 1, {"compile": True}),
                ("device --cohort 10 --compile --graphs", True, 10, {"compile": True})] if sizes["compile"] else []
    for label, on, cohort, own in [("device sequential", False, 1, {}), ("device sequential --graphs", True, 1, {}),
                                   ("device --cohort 10", False, 10, {}), ("device --cohort 10 --graphs", True, 10, {}),
                                   *(pfllib_own if sizes["compile"] else []), *with_compile]:
        try:  # one run's failure is its row's
            before = step_graphs.totals()
            summary, rows = _run(tmp / f"graphs-pfllib-{on}-{cohort}-{bool(own)}", **(base | own), rounds=rounds,
                                 eval_every=rounds, device=str(device), graphs=on, cohort=cohort)
            after = step_graphs.totals()
            late = [r["train_s"] for r in rows[len(rows) // 2:]]
            out[label] = {"seconds_per_round": _seconds_per_round(rows), "rounds": rounds,
                          "later_half_s": sum(late) / len(late),
                          "first_round_s": rows[0]["train_s"], "round_s": [r["train_s"] for r in rows],
                          "accuracy": summary["final"]["accuracy"],
                          "loss": summary["final"]["loss"]}
            if own.get("compile"):
                out[label]["compile_fallback"] = summary["compile_fallback"]
            if on:
                out[label] |= {"graphs_fallback": summary["graphs_fallback"],
                               "captured": after["captured"] - before["captured"],
                               "replayed_steps": after["replays"] - before["replays"]}
        except Exception as exc:  # noqa: BLE001  (recorded, with its last frames)
            out[label] = {"error": f"{type(exc).__name__}: {exc}"[:400],
                          "where": traceback.format_exc().strip().splitlines()[-4:]}
    for eager, fast in (("device sequential", "device sequential --graphs"), ("device --cohort 10", "device --cohort 10 --graphs"),
                        ("PFLlib's SGD: device sequential", "PFLlib's SGD: device sequential --graphs"),
                        # inductor's kernels inside our captured step against the eager steps: the loss gap
                        # says whether the replayed compiled step trains as eager (review14)
                        ("device sequential", "device sequential --compile --graphs"),
                        ("device --cohort 10", "device --cohort 10 --compile --graphs")):
        if fast in out and "seconds_per_round" in out[eager] and "seconds_per_round" in out[fast]:
            out[fast]["speedup"] = out[eager]["seconds_per_round"] / out[fast]["seconds_per_round"]
            out[fast]["loss_gap"] = abs(out[eager]["loss"] - out[fast]["loss"])
    return out


def _graphs_algorithms(device, sizes, tmp: Path) -> dict:
    import fedlt.algorithms
    from fedlt.algorithms import graphs as step_graphs
    from fedlt.config import RunConfig
    from fedlt.testing.algorithms import split_model_for

    rows = []
    # the registry under fused="auto" (the reference at these sizes), then per-client offsets through
    # the Triton kernels under capture (fused="on": each client's table must be the one replayed)
    # and each one's cohort (3 clients a round, one cohort) eager vs --graphs (fedlt.algorithms.cohort_graphs)
    names = sizes["graphs_algorithms"] or fedlt.algorithms.REGISTRY.list()
    runs = [(name, {}) for name in names] + [(name, {"fused": "on"}) for name in sizes["graphs_fused_on"]]
    for name, extra in runs + [(name, {"cohort": 3}) for name in names]:
        # 6 steps a client: its first eager, the second checked and captured, the rest replayed
        base = dict(TINY_RUN, algorithm=name, rounds=1, eval_every=1, local_iters=6, device=str(device),
                    algorithm_params=SMALL_PARAMS.get(name, {})) | extra
        label = " (fused on)" if "fused" in extra else " (cohort 3)" if "cohort" in extra else ""
        tag = name + label.replace(" ", "-")
        row: dict = {"algorithm": name + label}
        try:
            base["model"] = row["model"] = split_model_for(RunConfig(**base, out=tmp / "probe"))
            eager = _run(tmp / f"graphs-{tag}-eager", **base)[0]
            before = step_graphs.totals()
            fast = _run(tmp / f"graphs-{tag}-graphs", **base, graphs=True)[0]
            after = step_graphs.totals()
            row |= {"eager_loss": eager["final"]["loss"], "graphs_loss": fast["final"]["loss"],
                    "loss_gap": abs(eager["final"]["loss"] - fast["final"]["loss"]),
                    "graphs_fallback": fast.get("graphs_fallback"),
                    "replayed_steps": after["replays"] - before["replays"]}
        except Exception as exc:  # noqa: BLE001  (recorded; the next algorithm still runs)
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            row["where"] = traceback.format_exc().strip().splitlines()[-4:]
        rows.append(row)
    gaps = [r["loss_gap"] for r in rows if "loss_gap" in r]
    return {"rows": rows, "largest_loss_gap": max(gaps, default=None),
            "replayed": [r["algorithm"] for r in rows if r.get("replayed_steps")],
            "failed": [r["algorithm"] for r in rows if "error" in r]}


def scala_s2(device, sizes, tmp: Path) -> dict:
    rounds = sizes["scala_rounds"]
    settings = dict(algorithm="scala", model="alexnet", split="s2", dataset="mnist", rounds=rounds, eval_every=rounds,
                    device=str(device))
    if sizes is DRY:
        settings.update(train_limit=600, test_limit=100, clients=10, participation=0.3, server_batch=24, local_iters=2)
    summary, rows = _run(tmp / "scala", **settings)
    return {"settings": settings, "seconds_per_round": _seconds_per_round(rows), "accuracy": summary["final"]["accuracy"],
            "loss": summary["final"]["loss"]}


def bf16(device, sizes, tmp: Path) -> dict:
    rounds, out = sizes["bf16_rounds"], {}
    for precision in ("fp32", "bf16"):
        summary, rows = _run(tmp / f"bf16-{precision}", **_pfllib(sizes), rounds=rounds, eval_every=rounds,
                             device=str(device), precision=precision)
        out[precision] = {"accuracy": summary["final"]["accuracy"], "loss": summary["final"]["loss"],
                          "seconds_per_round": _seconds_per_round(rows)}
    out["accuracy_gap"] = abs(out["bf16"]["accuracy"] - out["fp32"]["accuracy"])
    return out


def profile(device, sizes, out_dir: Path, task: str = "all", name: str = "device_check_profile") -> dict:
    """benchmarks/profile_round.py's phases and operators on ``device`` (its tables written beside the JSON)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_round", Path(__file__).with_name("profile_round.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = module.profile(task, str(device), None, sizes is DRY, out_dir, name=name)
    return {"threads": found["threads"], "tasks": {name: {k: v for k, v in task.items() if k != "settings"}
                                                   for name, task in found["tasks"].items()}}


def graphs_profile(device, sizes, out_dir: Path) -> dict:
    """The profile of PFLlib's task under ``--graphs``, one client after another and in cohorts of 10:
    what a round asks of the host and of the device once its steps replay."""
    return profile(device, sizes, out_dir, task="pfllib_graphs,pfllib_cohort_graphs", name="device_check_graphs_profile")


def _synthetic_cifar(root: Path, train: int, test: int) -> Path:
    """Random uint8 images of CIFAR-10's shape (32×32×3) and 10 balanced labels, as ``arrays`` reads them."""
    import numpy as np

    rng = np.random.default_rng(0)
    path = root / "cifar_shaped.npz"
    np.savez(path, x_train=rng.integers(0, 256, (train, 32, 32, 3), dtype=np.uint8), y_train=np.arange(train) % 10,
             x_test=rng.integers(0, 256, (test, 32, 32, 3), dtype=np.uint8), y_test=np.arange(test) % 10)
    return path


class _Utilisation:
    """The GPU's utilisation (%, ``torch.cuda.utilization``: NVML) sampled every ``period`` s in a thread."""

    def __init__(self, device, period: float = 0.2) -> None:
        import threading

        self.device, self.period, self.samples, self.error = device, period, [], None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import torch

        while not self.stop.wait(self.period):
            try:
                self.samples.append(torch.cuda.utilization(self.device))
            except Exception as exc:  # noqa: BLE001  (no NVML here: said in the result)
                self.error = f"{type(exc).__name__}: {exc}"[:200]
                return

    def __enter__(self) -> "_Utilisation":
        if self.device.type == "cuda":
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def summary(self) -> dict:
        if self.device.type != "cuda":
            return {"gpu_utilisation": "not sampled (not a GPU)"}
        if not self.samples:
            return {"gpu_utilisation": f"not sampled ({self.error or 'no sample'})"}
        return {"gpu_utilisation_mean_pct": sum(self.samples) / len(self.samples), "samples": len(self.samples)}


def resnet18_cifar(device, sizes, tmp: Path) -> dict:
    r = sizes["resnet"]
    settings = dict(dataset="arrays", data_root=_synthetic_cifar(tmp, r["train"], r["test"]), model="resnet18_cifar",
                    algorithm="fedavg", clients=r["clients"], participation=0.1, local_epochs=1, batch_size=32,
                    partition={"name": "dirichlet", "beta": 0.1, "min_size": 2}, rounds=r["rounds"],
                    eval_every=r["rounds"], device=str(device))
    with _Utilisation(device) as utilisation:
        summary, rows = _run(tmp / "resnet18", **settings)
    return {"settings": {k: str(v) for k, v in settings.items()} | {"data": "synthetic, CIFAR-10's shape"},
            "seconds_per_round": _seconds_per_round(rows), "eval_s": rows[-1].get("eval_s"),
            "accuracy": summary["final"]["accuracy"]} | utilisation.summary()


def overheads(device, sizes) -> dict:
    """``benchmarks/launch_overhead.py``: µs per torch and Triton launch and per loss call, issued
    and on the device, with the operators of the 4096×1000 calls."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_overhead", Path(__file__).with_name("launch_overhead.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure(device, calls=20 if sizes is DRY else 200, large=sizes["fused_sizes"][0])


SECTIONS = {"doctor": doctor, "overheads": overheads, "kernels": kernels, "fused_vs_eager": fused_vs_eager,
            "algorithms": algorithms,
            "pfllib_mnist": pfllib_mnist, "graphs": graphs, "graphs_pfllib": graphs_pfllib, "scala_s2": scala_s2, "bf16": bf16,
            "profile": profile, "graphs_profile": graphs_profile, "resnet18_cifar": resnet18_cifar}


OPTIONAL = {"graphs_pfllib"}  # a part of another section, for a short lease's --only; not in a full run


def results_path(dry_run: bool) -> Path:
    """Where the results go without ``--out``: a dry run's (a test, a rehearsal) never into the source tree."""
    if dry_run:
        return Path(tempfile.mkdtemp(prefix="fedlt-device-check-")) / "device_check_dry_run.json"
    return RESULTS / "device_check.json"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="the same code on the CPU at tiny sizes")
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run these sections only")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: benchmarks/results/device_check.json; "
                        "with --dry-run, a new temporary folder's)")
    args = parser.parse_args(argv)
    if not args.dry_run:
        os.environ["TRITON_INTERPRET"] = "0"  # the real kernels, compiled for the device
    import torch

    device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    sizes = DRY if args.dry_run else FULL
    path = args.out or results_path(args.dry_run)
    result = {"device": str(device), "dry_run": args.dry_run, "torch": torch.__version__,
              "python": platform.python_version(), "cpus": os.cpu_count(), "sections": {}}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedlt-device-check-") as tmp:
        for name in args.only or [n for n in SECTIONS if n not in OPTIONAL]:
            fn, started, cpu = SECTIONS[name], time.perf_counter(), time.process_time()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                extra = ((path.parent if fn in (profile, graphs_profile) else Path(tmp)),) if fn.__code__.co_argcount >= 3 else ()
                section = fn(device, sizes, *extra)
            except Exception as exc:  # noqa: BLE001  (recorded; the next section still runs)
                section = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            section.update(seconds=round(time.perf_counter() - started, 2),
                           cpu_seconds=round(time.process_time() - cpu, 2), **_memory(device))
            result["sections"][name] = section
            result["seconds"] = round(time.perf_counter() - began, 2)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2, default=str) + "\n")
            print(f"{name}: {section['seconds']} s ({section['cpu_seconds']} s CPU){' ERROR ' + section['error'][:300] if 'error' in section else ''}",
                  flush=True)
    print(f"wrote {path} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()

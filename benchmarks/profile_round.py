"""Where one round's time goes (issue 43): PFLlib's MNIST task and SCALA at s2, on the CPU (or
any device), as a table of phases (share of the round, CPU and wall seconds, calls) and the
operators' table of ``torch.profiler``.

Phases are timed *exclusively* (a phase nested in another is taken out of it) by wrapping the
functions that do each job — nothing in fedlt is changed to be profiled:

    forward + loss       ClientUpdate.parts (the model's forward and the objective); Replica.__call__
    backward             torch.Tensor.backward, torch.autograd.grad
    clip                 LocalSchedule.clip_ (clip_grad_norm_)
    optimiser            torch.optim SGD.step / zero_grad (and LocalSchedule.step where it exists)
    minibatch slicing    the client's batch stream (index permutation and gather)
    host sync            the clients' finiteness checks (check_parts, raise_first_non_finite; the
                         local runner reads them once a round: protocol.read_losses)
    client set-up        building the objective and the optimiser
    server step (split)  ServerSide.forward_backward less its backward (the server's forward, loss, step)
    aggregation          Strategy.aggregate / SplitStrategy.aggregate
    evaluation           the global model's test pass (scores_of), per-client evaluation
    checkpoint, record   Checkpoints.save, the metrics line
    other Python         the rest of the round: the step loop itself, tasks, states, sampling

Round 1 warms up; round 2 is timed by phase; round 3 runs under ``torch.profiler`` (operators
called from Python per step — each is a kernel launch or more on a GPU — and host
synchronisations, ``aten::_local_scalar_dense``).

    python benchmarks/profile_round.py [--task pfllib|scala|both] [--threads 1] [--out DIR] [--small]
    python benchmarks/profile_round.py --task pfllib --time 4     # no profiling: CPU and wall s a round
    python benchmarks/profile_round.py --task pfllib --time 4 --compile [--cohort 10]

Writes ``profile_round.json`` into ``--out`` (default benchmarks/results/). ``--time R`` runs R
rounds untouched and prints each round after the first (train + evaluation + checkpoint): the
A/B timing of docs/benchmarks.md, run alternately against another fedlt on ``PYTHONPATH``, or
with and without ``--compile`` (issue 43): the first round, which compiles, is reported apart
(``warmup_cpu_s``, and ``compile_s``: dynamo's and inductor's own compile seconds) from the
rounds after it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (sets TRITON_INTERPRET before timm is imported)

PFLLIB = dict(dataset="mnist", model="pfllib_cnn", algorithm="fedavg", clients=100, participation=0.1, local_epochs=1,
              batch_size=10, partition={"name": "dirichlet", "beta": 0.1, "min_size": 2}, optimiser={"lr": 0.005})
SCALA = dict(algorithm="scala", model="alexnet", split="s2", dataset="mnist")
SMALL = dict(train_limit=600, test_limit=200, clients=10, participation=0.3)  # --small: the dry run's sizes
SMALL_SCALA = dict(SMALL, server_batch=24, local_iters=2)


class PhaseTimer:
    """Exclusive wall and CPU seconds and call counts of wrapped functions (a call inside another
    wrapped call is taken out of the outer one)."""

    def __init__(self) -> None:
        self.stack: list[list[float]] = []
        self.reset()

    def reset(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def enter(self) -> None:
        self.stack.append([time.perf_counter(), time.process_time(), 0.0, 0.0])

    def leave(self, phase: str) -> None:
        began_wall, began_cpu, child_wall, child_cpu = self.stack.pop()
        wall, cpu = time.perf_counter() - began_wall, time.process_time() - began_cpu
        self.wall[phase] = self.wall.get(phase, 0.0) + wall - child_wall
        self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu - child_cpu
        self.calls[phase] = self.calls.get(phase, 0) + 1
        if self.stack:
            self.stack[-1][2] += wall
            self.stack[-1][3] += cpu

    def wrap(self, owner: Any, attr: str, phase: str, generator: bool = False) -> None:
        """Time ``owner.attr`` as ``phase``; ``generator``: its returned iterator's every ``next``."""
        fn = getattr(owner, attr, None)
        if fn is None:  # absent in this version of fedlt: nothing to time
            return
        timer = self

        def timed_iter(it):
            while True:
                timer.enter()
                try:
                    item = next(it)
                except StopIteration:
                    timer.leave(phase)
                    return
                timer.leave(phase)
                yield item

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            timer.enter()
            try:
                out = fn(*args, **kwargs)
            finally:
                timer.leave(phase)
            return timed_iter(iter(out)) if generator else out

        setattr(owner, attr, wrapped)


def instrument(timer: PhaseTimer) -> None:
    import torch

    import fedlt.io
    from fedlt.algorithms import base, cohort, fedavg_family, protocol, split, split_client, split_server
    from fedlt.run import evaluation, loop, resume

    for owner, attr, phase in [
        (fedavg_family.ClientUpdate, "parts", "forward + loss"),
        (split_client.Replica, "__call__", "forward + loss"),
        (torch.Tensor, "backward", "backward"),
        (torch.autograd, "grad", "backward"),
        (base.LocalSchedule, "clip_", "clip"),
        (base.LocalSchedule, "step", "optimiser"),  # a fused step (clip folded in), where it exists
        (torch.optim.SGD, "step", "optimiser"),
        (torch.optim.Optimizer, "zero_grad", "optimiser"),
        (fedavg_family, "check_parts", "host sync (loss check)"),
        (base, "raise_first_non_finite", "host sync (loss check)"),
        (protocol, "read_losses", "host sync (loss check)"),  # the round's one read of the clients' checks
        (fedavg_family, "build_objective", "client set-up"),
        (base.LocalSchedule, "optimiser", "client set-up"),
        (split_server.ServerSide, "forward_backward", "server step (split)"),
        (fedavg_family.Strategy, "aggregate", "aggregation"),
        (split.SplitStrategy, "aggregate", "aggregation"),
        (evaluation, "scores_of", "evaluation (global test pass)"),
        (evaluation.ClientEvaluation, "__call__", "evaluation (per client)"),
        (resume.Checkpoints, "save", "checkpoint"),
        # --cohort: the batched step's parts (its backward is torch.Tensor.backward's, above)
        (cohort.Cohort, "_draw", "minibatch slicing"),
        (cohort.Cohort, "_forward", "forward + loss"),
        (cohort.Cohort, "_offset_ce", "forward + loss"),  # the step's loss when each is an offset CE
        (fedavg_family.ClientUpdate, "terms", "forward + loss"),
        (cohort.Cohort, "_clip", "clip"),
        (cohort.Cohort, "_sgd", "optimiser"),
    ]:
        timer.wrap(owner, attr, phase)
    timer.wrap(base.ClientData, "batches", "minibatch slicing", generator=True)
    timer.wrap(split_client.BatchStream, "__next__", "minibatch slicing")
    loop.io = _Recorded(fedlt.io, timer)


class _Recorded:
    """fedlt.io as the round loop sees it, with ``append_line`` (the metrics line) timed."""

    def __init__(self, io: Any, timer: PhaseTimer) -> None:
        self._io, self._timer = io, timer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._io, name)

    def append_line(self, *args: Any) -> None:
        self._timer.enter()
        try:
            self._io.append_line(*args)
        finally:
            self._timer.leave("record (metrics line)")


def profile_task(name: str, settings: dict, device: str, timer: PhaseTimer, out: Path) -> dict:
    """Three rounds of ``settings``: warm-up, phases timed, operators profiled."""
    import torch

    from fedlt.config import RunConfig
    from fedlt.engine import run

    marks: dict[int, tuple[float, float]] = {}
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                  + ([torch.profiler.ProfilerActivity.CUDA] if device.startswith("cuda") else []))
    phases: dict[str, Any] = {}

    def on_round(done: int, row: dict) -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        marks[done] = (time.perf_counter(), time.process_time())
        if done == 1:
            timer.reset()
        elif done == 2:
            phases.update(wall=dict(timer.wall), cpu=dict(timer.cpu), calls=dict(timer.calls), row=row)
            prof.__enter__()
        elif done == 3:
            prof.__exit__(None, None, None)

    run(RunConfig(**settings, rounds=3, eval_every=1, device=device, out=out / name), on_round=on_round)
    round_wall = marks[2][0] - marks[1][0]
    round_cpu = marks[2][1] - marks[1][1]
    return {"settings": settings, "round_wall_s": round_wall, "round_cpu_s": round_cpu,
            "phases": phase_rows(phases, round_wall, round_cpu), "operators": operator_summary(prof, phases)}


def phase_rows(phases: dict, round_wall: float, round_cpu: float) -> list[dict]:
    wall, cpu, calls = phases["wall"], phases["cpu"], phases["calls"]
    rows = [{"phase": p, "cpu_s": cpu[p], "wall_s": wall[p], "share_cpu": cpu[p] / round_cpu, "calls": calls[p]}
            for p in sorted(cpu, key=lambda p: -cpu[p])]
    rest_cpu, rest_wall = round_cpu - sum(cpu.values()), round_wall - sum(wall.values())
    rows.append({"phase": "other Python (step loop, tasks, states, sampling)", "cpu_s": rest_cpu, "wall_s": rest_wall,
                 "share_cpu": rest_cpu / round_cpu, "calls": None})
    return rows


def operator_summary(prof: Any, phases: dict) -> dict:
    """Operators called from Python (top level: each at least one kernel launch on a GPU), host
    synchronisations, and the operators with the most self CPU time."""
    events = prof.events()
    top_level = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
    syncs = sum(1 for e in events if e.name in ("aten::_local_scalar_dense",))
    steps = phases["calls"].get("backward", 0) or 1
    averages = prof.key_averages()
    table = sorted(averages, key=lambda a: -a.self_cpu_time_total)[:12]
    found = {"python_ops": len(top_level), "backward_calls": steps, "python_ops_per_backward": len(top_level) / steps,
             "host_syncs": syncs,
             "top_self_cpu": [{"op": a.key, "calls": a.count, "self_cpu_ms": a.self_cpu_time_total / 1e3}
                              for a in table]}
    on_device = [a for a in averages if getattr(a, "self_device_time_total", 0) > 0]
    if on_device:  # a GPU's: how busy the device was in the round, and with what (kernels, copies)
        found["device_busy_ms"] = sum(a.self_device_time_total for a in on_device) / 1e3
        found["device_calls"] = sum(a.count for a in on_device)
        found["top_device"] = [{"op": a.key[:120], "calls": a.count, "device_ms": a.self_device_time_total / 1e3}
                               for a in sorted(on_device, key=lambda a: -a.self_device_time_total)[:20]]
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["pfllib", "pfllib_cohort", "pfllib_graphs", "pfllib_cohort_graphs", "scala", "both", "all"],
                        default="both", help="both: pfllib and scala; all: also pfllib_cohort (PFLlib's task with "
                        "--cohort 10); pfllib_graphs: PFLlib's task with --graphs (a GPU's, or the CPU stand-in's); "
                        "pfllib_cohort_graphs: with --cohort 10 --graphs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--small", action="store_true", help="tiny sizes (a check that the script works)")
    parser.add_argument("--out", type=Path, default=common.RESULTS, help="directory of profile_round.json")
    parser.add_argument("--name", default="profile_round", help="the JSON's name (e.g. profile_round_before)")
    parser.add_argument("--time", type=int, default=0, metavar="R", help="R rounds, timed only (no profile)")
    parser.add_argument("--compile", action="store_true", help="with --time: the run's --compile")
    parser.add_argument("--cohort", type=int, default=1, help="with --time: the run's --cohort")
    args = parser.parse_args(argv)
    if args.time:
        extra = ({"compile": True} if args.compile else {}) | ({"cohort": args.cohort} if args.cohort > 1 else {})
        return time_rounds(args.task, args.device, args.threads, args.small, args.time, extra)
    return profile(args.task, args.device, args.threads, args.small, args.out, args.name)


def time_rounds(task: str, device: str, threads: int | None, small: bool, rounds: int,
                extra: dict | None = None) -> dict:
    """CPU and wall seconds of each round after the first (train, evaluation, checkpoint, record);
    the first round's apart (``warmup_cpu_s``: with ``--compile``, its compilation, of which
    ``compile_s`` is dynamo's own account). ``extra``: more of the run's settings."""
    import torch

    import fedlt
    from fedlt.config import RunConfig
    from fedlt.engine import run

    if threads:
        torch.set_num_threads(threads)
    settings = dict(PFLLIB, **(SMALL if small else {})) if task == "pfllib" else dict(SCALA, **(SMALL_SCALA if small else {}))
    settings |= extra or {}
    marks: list[tuple[float, float]] = []
    mark = lambda *_: marks.append((time.process_time(), time.perf_counter()))  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="fedlt-time-") as tmp:
        summary = run(RunConfig(**settings, rounds=rounds, eval_every=1, device=device, out=Path(tmp) / "run"),
                      on_start=mark, on_round=mark)
    cpu = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    wall = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    result = {"fedlt": str(Path(fedlt.__file__).parent), "task": task, "settings": extra or {},
              "warmup_cpu_s": cpu[0], "warmup_wall_s": wall[0], "compile_s": compile_seconds(),
              "children_cpu_s": children_cpu(),
              "cpu_s": cpu[1:], "wall_s": wall[1:], "compile_fallback": summary.get("compile_fallback")}
    print(json.dumps(result))
    return result


def children_cpu() -> float:
    """CPU seconds of this process's finished child processes (inductor's C++ compiler runs)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def compile_seconds() -> float:
    """Seconds dynamo spent compiling frames in this process (its own account: tracing, AOTAutograd,
    the backend's code generation), 0 without --compile."""
    import torch._dynamo.utils

    return sum(sum(v) for k, v in torch._dynamo.utils.compilation_time_metrics.items() if k.endswith("compile_inner"))


def profile(task: str, device: str, threads: int | None, small: bool, out: Path, name: str = "profile_round") -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    timer = PhaseTimer()
    instrument(timer)
    pfllib = dict(PFLLIB, **(SMALL if small else {}))
    tasks = {"pfllib": pfllib, "scala": dict(SCALA, **(SMALL_SCALA if small else {})),
             "pfllib_cohort": dict(pfllib, cohort=10), "pfllib_graphs": dict(pfllib, graphs=True),
             "pfllib_cohort_graphs": dict(pfllib, cohort=10, graphs=True)}
    chosen = {"both": ["pfllib", "scala"], "all": ["pfllib", "pfllib_cohort", "scala"]}.get(task, task.split(","))
    result: dict[str, Any] = {"device": device, "threads": torch.get_num_threads(), "tasks": {}}
    with tempfile.TemporaryDirectory(prefix="fedlt-profile-") as tmp:
        for label in chosen:
            result["tasks"][label] = found = profile_task(label, tasks[label], device, timer, Path(tmp))
            rows = [[r["phase"], r["share_cpu"], r["cpu_s"], r["wall_s"], r["calls"] if r["calls"] is not None else ""]
                    for r in found["phases"]]
            rows.append(["round (round 2)", 1.0, found["round_cpu_s"], found["round_wall_s"], ""])
            ops = found["operators"]
            meta = {k: v for k, v in found.items() if k != "phases"} | {"device": device, "threads": result["threads"]}
            common.report(f"{name}_{label}", ["phase", "share of CPU", "CPU s", "wall s", "calls"], rows, meta, out_dir=out)
            print(f"{label}: {ops['python_ops']} operators called from Python in round 3 "
                  f"({ops['python_ops_per_backward']:.1f} per backward), {ops['host_syncs']} host syncs")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()

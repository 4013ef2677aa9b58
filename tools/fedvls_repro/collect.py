"""Side-by-side table of the curves run_fedlt.py and run_authors.py wrote under WORK, and a JSON copy.

    python collect.py --work /tmp/fedvls_repro [--json ../../benchmarks/results/fedvls_repro.json]

The JSON file is updated, not replaced: a run found under WORK replaces the entry of the same name,
entries of runs no longer under WORK (earlier sessions' /tmp folders) are kept as they were.

A curve file is WORK/authors-<Algo>-<beta>[-<tag>].json or WORK/fedlt-<algo>-<beta>[-<tag>]/curve.json.
For each: accuracy every 5 rounds, final and best-over-rounds (round) on the held-out set (``test``:
the 10k MNIST test set, or the authors' 17 500 held-out images for the ``-authorsdata`` runs) and on
the union of the clients' training sets (``train∪``, what the authors' code prints on MNIST).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from fedlt.partitioners import Partition


def load(work: Path) -> dict[str, dict]:
    """Finished runs from their curve files; a run still going (or stopped) from what it has
    written so far: the authors' side from its log's [harness] lines, fedlt's from metrics.jsonl."""
    curves = {}
    for path in sorted(work.glob("authors-*.log")):
        done = path.with_suffix(".json")
        if done.is_file():
            curves[path.stem] = json.loads(done.read_text())
            continue
        text = path.read_text()
        rows = [re.search(r"printed acc ([0-9.]+), held-out acc ([0-9.]+)", line)
                for line in text.splitlines() if line.startswith("[harness]")]
        algo = path.stem.split("-")[1]
        sha = re.search(r"\[harness\] partition sha256 ([0-9a-f]{64})", text)
        curves[path.stem] = {"side": "authors", "algo": algo, "partial": True, "partition_sha256": sha and sha[1],
                             "train_union_acc": [float(m[1]) for m in rows if m],
                             "test_acc": [float(m[2]) for m in rows if m]}
    for path in sorted(work.glob("fedlt-*/metrics.jsonl")):
        done = path.parent / "curve.json"
        if done.is_file():
            curves[path.parent.name] = json.loads(done.read_text())
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        log = work / f"{path.parent.name}.log"
        text = log.read_text() if log.is_file() else ""
        union = [float(m[1]) for m in re.finditer(r"train-union acc ([0-9.]+)", text)]
        command = re.search(r"^\[harness\] command: (.*)$", text, re.M)
        saved = path.parent / "partition.npz"  # the engine writes the partition it trains on
        sha = Partition.load(saved).sha256 if saved.is_file() else None
        curves[path.parent.name] = {"side": "fedlt", "algo": path.parent.name.split("-")[1], "partial": True,
                                    "partition_sha256": sha, "command": command and command[1],
                                    "test_acc": [r["accuracy"] for r in rows if "accuracy" in r],
                                    "train_union_acc": union}
    return curves


def summary(acc: list[float]) -> dict:
    best = max(range(len(acc)), key=lambda i: acc[i])
    return {"final": round(100 * acc[-1], 2), "best": round(100 * acc[best], 2), "best_round": best + 1,
            "rounds": len(acc)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedvls_repro"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    curves = load(args.work)
    out = {}
    print(f"{'run':<34} {'set':<7} {'final':>6} {'best':>6} {'@':>3}  every 5 rounds")
    for name, c in curves.items():
        out[name] = {"side": c["side"], "algo": c["algo"], "partition_sha256": c.get("partition_sha256"),
                     "command": c.get("command"), "partial": c.get("partial", False), "curves": {}}
        for key in ("harness_command", "data", "dataset", "data_root", "seed", "weight_decay", "fresh_optimiser",
                    "wall_time_s"):
            if c.get(key) is not None:  # what later harness versions record beside the curve
                out[name][key] = c[key]
        for key, label in (("test_acc", "test"), ("train_union_acc", "train∪")):
            acc = [a for a in c.get(key, []) if a is not None]
            if not acc:
                continue
            s = summary(acc)
            out[name]["curves"][key] = {**s, "per_round": [round(100 * a, 2) for a in acc]}
            every5 = " ".join(f"{100 * a:5.1f}" for a in acc[4::5])
            print(f"{name:<34} {label:<7} {s['final']:6.2f} {s['best']:6.2f} {s['best_round']:3d}  {every5}"
                  + (f"  (partial: {s['rounds']} rounds)" if c.get("partial") else ""))
    if args.json:
        earlier = json.loads(args.json.read_text()) if args.json.is_file() else {}
        kept = [name for name in earlier if name not in out]
        args.json.write_text(json.dumps({**{name: earlier[name] for name in kept}, **out}, indent=1))
        print(f"wrote {args.json} ({len(out)} runs from {args.work}, {len(kept)} earlier runs kept)")


if __name__ == "__main__":
    main()

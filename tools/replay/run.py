"""Replay a method's authors' code beside fedlt, round by round (issue 41; docs/replay.md).

    python tools/replay/run.py fedgrab --git /work/.mirror/ZackZikaiXiao+FedGraB/repo \\
        [--mode matched|released] [--dtype float64|float32] [--rounds 3] [--participation 0.5] \\
        [--record tests/golden/replay_fedgrab.json]
    python tools/replay/run.py ditto --git /work/.mirror/TsingZ0+PFLlib/repo [--mode released] ...
    (fedper, fedrep, fedbabu, lg_fedavg, fedrod, ditto, apfl, fedavg_ft: PFLlib, tools/replay/personalised.py)

The same initial weights, client data (fedlt's partition of the replay's small long-tailed data
set), minibatch order and hyper-parameters (the method's ``--preset authors``) go to the authors'
client and server code and to fedlt's run parts. After every round each quantity is compared —
per participant the gates, the loss-term state, the trained weights, its own part of the model and
the loss, then the global weights, then (PFLlib's methods) every client's personal model as both
sides score it on the test set — and the largest relative difference of each is printed. The first one over the tolerance
(1e-10 in float64, 1e-5 in float32) is named with where both sides compute it and, when known,
why they differ. Exit status 0: agreement within the tolerance; 1: a difference.

``--record`` writes the authors' side as a small fixture (fingerprints of the weights, the state
vectors, the losses) that tests/test_replay.py replays fedlt against without the authors' code.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the adapters; tools/ (golden_source, authors_code)

import ccvr  # noqa: E402
import creff  # noqa: E402
import fedetf  # noqa: E402
import fedgela  # noqa: E402
import fedgrab  # noqa: E402
import fedic  # noqa: E402
import fedlf  # noqa: E402
import fedloge  # noqa: E402
import fednh  # noqa: E402
import fednpc_rounds  # noqa: E402
import fedproto  # noqa: E402
import fedrela  # noqa: E402
import fedvls  # noqa: E402
import fedyoyo  # noqa: E402
import personalised  # noqa: E402
from fedlt_side import (COUNTER, FedltSide, check_mode, fingerprint, group_difference, quantities,  # noqa: E402
                        relative_difference, replay_config, write_data)

ADAPTERS = {"fedgrab": fedgrab, "fedvls": fedvls, **personalised.ADAPTERS, "fedproto": fedproto, "fedgela": fedgela,
            "fedyoyo": fedyoyo, "fedic": fedic, "creff": creff, "fednh": fednh, "ccvr": ccvr,
            "fedloge": fedloge, "fedrela": fedrela, "fedetf": fedetf, "fedlf": fedlf,
            "fednpc": fednpc_rounds}
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
# BatchNorm's step counters: printed as "counters", not judged (an adapter's COUNTERS says why they differ);
# with BatchNorm's momentum set they do not enter any computation (fedlt_side.COUNTER)


def compare_client(method: str, ours, theirs: dict[str, Any], gates: list[torch.Tensor]) -> dict[str, float]:
    """The largest relative difference of each quantity of one participant's round: each group of
    tensors (the trained weights, the loss-term state, the personal model), the loss where both
    sides report it, and the gates where the method draws them (a count of mismatched draws)."""
    out: dict[str, float] = {}
    if "gates" in theirs:
        out["gates"] = float(sum(int((a != b).sum()) for a, b in zip(gates, theirs["gates"]))
                             + abs(len(gates) - len(theirs["gates"])))
    for group, tensors in quantities(method, ours).items():
        mine = {k: v for k, v in tensors.items() if not k.endswith(COUNTER)}
        other = {k: v for k, v in theirs.get(group, {}).items() if not k.endswith(COUNTER)}
        out[group] = group_difference(mine, other)  # a key on one side only: inf
        counters = [k for k in tensors if k.endswith(COUNTER) and k in theirs.get(group, {})]
        if counters:
            out["counters"] = max(relative_difference(tensors[k], theirs[group][k]) for k in counters)
    if theirs.get("loss") is not None:
        out["loss"] = abs(float(ours.train_loss) - theirs["loss"]) / max(abs(theirs["loss"]), 1e-300)
    return out


def personal_scores(side, authors, round_index: int, method: str) -> dict[str, Any]:
    """Every client's personal model after the round, scored by both sides on the replay's test
    set: the difference of their correct counts (``accuracy``, in samples) and of their outputs
    (``outputs``: logits, or their softmax where the authors' evaluation collects that), and the
    authors' side as a fixture records it."""
    out: dict[str, Any] = {"accuracy": {}, "outputs": {}, "record": {}}
    x, y = side.prep.data.x_test, side.prep.data.y_test
    for cid in range(side.config.clients):
        theirs = authors.personal_scores(cid, x, y)
        if theirs is None:  # a client the mode leaves out (the adapter says why)
            continue
        their_correct, their_outputs = theirs
        correct, logits = side.personal_scores(cid, round_index)
        ours = torch.softmax(logits, 1) if authors.SCORES == "softmax" else logits
        out["accuracy"][cid] = float(abs(correct - their_correct))
        out["outputs"][cid] = relative_difference(ours, their_outputs)
        out["record"][str(cid)] = {"correct": their_correct, "outputs": fingerprint(their_outputs)}
    return out


def recorded(theirs: dict[str, Any]) -> dict[str, Any]:
    """One participant's round of the authors' side as a fixture holds it: short vectors whole,
    model weights as fingerprints."""
    out: dict[str, Any] = {"loss": theirs.get("loss")}
    for group, tensors in theirs.items():
        if isinstance(tensors, dict):
            out[group] = {k: v.tolist() if v.numel() <= 64 else fingerprint(v) for k, v in tensors.items()}
    return out


def replay(args: argparse.Namespace) -> dict[str, Any]:
    adapter = ADAPTERS[args.method]
    check_mode(args.mode, adapter.MODES)
    dtype = getattr(torch, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="fedlt-replay-"))
    atexit.register(shutil.rmtree, work, True)  # the replay's data and run folder: scratch, gone at exit
    data_size = {"n_train": 240, "n_test": 100, "size": 8, "seed": 0} | getattr(adapter, "DATA", {})
    data = write_data(work / "data.npz", **data_size)
    epochs = {} if args.epochs is None else {"local_epochs": args.epochs}
    # an adapter's own settings (FEDIC: 8 participants, as their gate's 1/8 weights hard-code) win
    config = replay_config(args.method, data, work / "run", **{"rounds": args.rounds, "participation": args.participation,
                                                               **epochs, **getattr(adapter, "SETTINGS", {}),
                                                               **getattr(adapter, "CONFIG", {})})
    side = FedltSide(config, dtype)
    initial = side.prep.algorithm.global_model()
    # every adapter gets fedlt's side as it is built; some read it there (FEDIC's proxy set, CReFF's
    # and FedNPC's server step, PFLlib's server building every client up front), the others ignore it
    authors = adapter.Authors(args.git, args.mode, initial, config, side=side)
    tol = TOLERANCE[args.dtype]
    rows, first, record_rounds = [], None, []
    for rec in side.rounds():
        theirs, worst = {}, {}
        if hasattr(authors, "begin_round"):  # a server phase before training (FedYoYo's prior)
            authors.begin_round(rec.participants, {c: (side.client(c).x, side.client(c).y) for c in rec.participants})
        for cid in rec.participants:
            client = side.client(cid)
            theirs[cid] = authors.train_client(cid, client.x, client.y, side.batches(cid, rec.round),
                                               rec.gates.get(cid))
            diffs = compare_client(args.method, rec.results[cid], theirs[cid], rec.gates.get(cid, []))
            for name, value in diffs.items():
                worst[name] = max(worst.get(name, 0.0), value)
                if first is None and name != "counters" and (value > tol if name != "gates" else value > 0):
                    first = {"round": rec.round + 1, "client": cid, "quantity": name, "difference": value}
        authors.aggregate(rec.participants, theirs, {c: len(side.client(c)) for c in rec.participants})
        glob = authors.global_weights() if hasattr(authors, "global_weights") else authors.model.state_dict()
        worst["global"] = group_difference({k: rec.global_weights[k] for k in glob if not k.endswith(COUNTER)},
                                           {k: v for k, v in glob.items() if not k.endswith(COUNTER)})
        if any(k.endswith(COUNTER) for k in glob):
            worst["counters"] = max(worst.get("counters", 0.0), *(relative_difference(rec.global_weights[k], glob[k])
                                                                   for k in glob if k.endswith(COUNTER)))
        if first is None and worst["global"] > tol:
            first = {"round": rec.round + 1, "client": None, "quantity": "global", "difference": worst["global"]}
        scores = personal_scores(side, authors, rec.round, args.method) if hasattr(authors, "personal_scores") else {}
        for name in ("accuracy", "outputs"):
            for cid, diff in scores.get(name, {}).items():
                worst[name] = max(worst.get(name, 0.0), diff)
                if first is None and (diff > 0 if name == "accuracy" else diff > tol):
                    first = {"round": rec.round + 1, "client": cid, "quantity": name, "difference": diff}
        rows.append({"round": rec.round + 1, "participants": rec.participants, **worst})
        record_rounds.append({"round": rec.round + 1, "participants": rec.participants,
                              "clients": {str(c): recorded(t) for c, t in theirs.items()},
                              "global": {k: fingerprint(v) for k, v in glob.items()},
                              **({"personal": scores["record"]} if scores else {})})
    if first is not None:
        q = first["quantity"]
        first["fedlt"], first["authors"] = adapter.WHERE.get(q, ("", ""))
        first["reason"] = getattr(adapter, "REASONS", {}).get(args.mode, {}).get(q, "not explained yet")
    settings = {k: v for k, v in config.model_dump(mode="json").items()
                if k in ("clients", "participation", "rounds", "local_epochs", "batch_size", "optimiser", "drop_last",
                         "partition", "seeds", "model", "algorithm")
                or (k == "algorithm_params" and v)}
    return {"method": args.method, "source": {"repo": adapter.REPO, "commit": adapter.COMMIT},
            "mode": args.mode, "dtype": args.dtype, "scores": getattr(authors, "SCORES", None), "tolerance": tol,
            "settings": settings, "data": data_size, "rounds": rows, "first_difference": first,
            "record": record_rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=sorted(ADAPTERS))
    parser.add_argument("--git", required=True, help="a git snapshot of the authors' repository (the fetch tool's)")
    parser.add_argument("--mode", default="matched", help="matched (default) or released (their code as released)")
    parser.add_argument("--dtype", default="float64", choices=sorted(TOLERANCE))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--participation", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, help="local epochs (default: the authors', as --preset authors sets)")
    parser.add_argument("--record", type=Path, help="write the authors' side as a fixture for tests/test_replay.py")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = replay(args)
    print(f"{args.method} ({out['source']['repo']}@{out['source']['commit'][:7]}), mode {args.mode}, {args.dtype}: "
          f"max relative difference per round (gates: mismatched draws)")
    names = list(dict.fromkeys(k for row in out["rounds"] for k in row if k not in ("round", "participants")))
    print("round  participants  " + "  ".join(f"{n:>9}" for n in names))
    for row in out["rounds"]:  # a quantity of some rounds only (FedReLa's labels from relabel_start): "-"
        print(f"{row['round']:>5}  {str(row['participants']):>12}  "
              + "  ".join(f"{row[n]:9.2e}" if n in row else f"{'-':>9}" for n in names))
    first = out["first_difference"]
    if "counters" in out["rounds"][-1]:
        print(f"counters (not judged): {getattr(ADAPTERS[args.method], 'COUNTERS', '')}")
    if first is None:
        print(f"agreement: every quantity within {out['tolerance']:g} relative over {len(out['rounds'])} rounds")
    else:
        print(f"first difference: round {first['round']}, client {first['client']}, {first['quantity']} "
              f"({first['difference']:.3g})\n  fedlt:   {first['fedlt']}\n  authors: {first['authors']}\n"
              f"  reason:  {first['reason']}")
    if args.record:
        args.record.write_text(json.dumps({k: v for k, v in out.items()}, indent=1) + "\n")
        print(f"wrote {args.record}")
    raise SystemExit(0 if first is None else 1)


if __name__ == "__main__":
    main()

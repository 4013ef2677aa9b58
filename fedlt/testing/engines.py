"""The engine contract: an algorithm gives one answer on every engine.

For each algorithm, two rounds on a tiny MNIST subset on the local engine and in Flower's
simulation must end with the same global weights, the same server-side state (aggregator
moments, control variates, server optimiser, ...), the same client states and the same
per-client numbers (``PERSONAL``: each client's matched test set under the global_local,
personal and finetune modes, run where the client's state lives — Flower's federated
evaluation; issue 32), contents compared
(floating tensors within 1e-6 + 1e-5·|value|: a client's work runs in another process, whose
kernels may round differently — measured up to 1.2e-6 on weights of SFL-LocalLoss; everything
else exactly); and the Flower run's directory as a kill after round 1 leaves it, resumed with
the same settings, must end exactly where the uninterrupted Flower run does (metrics rows and
checkpointed states, bit for bit; the first field that differs is named). All algorithms share
ONE simulation (Ray starts once); :class:`EngineCheck` lets several checks share one.

Flower runs each client in another process, which finds the algorithm by its registered name:
check a built-in or an installed plugin's entry point, not an object registered in this process.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import fedlt.algorithms
from fedlt import io
from fedlt.config import RunConfig
from fedlt.engine import run, sample_clients
from fedlt.flower.simulation import Job, simulate
from fedlt.testing.algorithms import TINY, probe, split_model_for
from fedlt.testing.base import Contract, cut_after, differences, metric_rows, run_differences

__all__ = ["EngineCheck", "check_engines", "differences", "drop_pattern"]  # differences: also imported from here by older code

Case = "str | tuple[str, dict[str, Any]]"

# the per-client evaluation every contract run makes (SPEC §7), cheap: half the clients, 20 test
# samples each; no fine-tune of AlexNet (a split algorithm's model: seconds a client on a CPU)
PERSONAL = {"client_test": "matched(size=20)", "client_eval": ["global_local", "personal", "finetune(epochs=1)"],
            "client_eval_fraction": 0.5}
NO_FINETUNE = ["global_local", "personal"]


def with_personal(base: dict[str, Any]) -> dict[str, Any]:
    """A contract run's settings (its ``model`` resolved) with ``PERSONAL``'s per-client
    evaluation where they set none; an AlexNet run without the fine-tune."""
    out = PERSONAL | base
    if out["model"] == "alexnet" and out["client_eval"] == PERSONAL["client_eval"]:
        out["client_eval"] = NO_FINETUNE
    return out
PERSONAL_PREFIXES = ("global_local_", "personal_", "finetune_", "new_clients_")  # new_clients: never trained


def per_client_fields(run_dir: Any) -> dict[str, Any]:
    """The per-client evaluation fields of a run's metrics rows, by round."""
    return {f"round {r['round']}": {k: v for k, v in r.items() if k.startswith(PERSONAL_PREFIXES)}
            for r in metric_rows(Path(run_dir))}


def _label(name: str, params: dict[str, Any]) -> str:
    return name + (f"({', '.join(f'{k}={v!r}' for k, v in params.items())})" if params else "")


def drop_pattern(config: Any) -> dict[str, Any]:
    """Settings that drop one sampled client in round 1 and another in round 2 (unavailable
    during the round: a split-learning client leaves mid-exchange) under ``on_failure="drop"``."""
    first, second = (sample_clients(config.clients, config.participation, config.seeds.sampling, r) for r in (0, 1))
    return {"availability": {"name": "scripted", "drops": [[1, first[0]], [2, second[-1]]], "when": "after"},
            "faults": {"on_failure": "drop", "min_results": 1}}


def check_engines(cases: Sequence[Any], *, atol: float = 1e-6, resume: bool | Collection[str] = True,
                  drops: bool = False, **settings: Any) -> None:
    """Check that every algorithm in ``cases`` — registered names, ``(name, params)`` pairs or
    ``(name, params, settings)`` triples — ends the same on the local engine and on Flower's
    simulation (see the module docstring). ``settings`` (for all cases, then a case's own)
    override :data:`fedlt.testing.algorithms.TINY`. With ``drops``, every run drops one sampled
    client in round 1 and another in round 2 (``drop_pattern``), and the client dropped in round 2
    must keep exactly the state it had after round 1. Every run evaluates each client (``PERSONAL``,
    unless ``settings`` say otherwise) and the per-client fields must agree too; an exact resume
    covers them. Runs evaluate after each round (TINY's ``eval_every=1``); ``eval_every=2`` in
    ``settings`` evaluates after round 2 only — cheaper (0.2-0.5 s a run) and the fields are still
    compared there and covered by the resume cut after round 1, but an evaluation between rounds
    (that it leaves round 2 as it was) is then not exercised. ``resume``: check exact resume on Flower
    for every case (True), none (False), or the algorithms named. Raises ContractError naming the
    algorithm, the property and the first differences. Several checks (and other Flower runs) can
    share one simulation through :class:`EngineCheck`."""
    with tempfile.TemporaryDirectory(prefix="fedlt-engines-") as tmp:
        check = EngineCheck(cases, Path(tmp), atol=atol, resume=resume, drops=drops, **settings)
        check.run_local()
        simulate(check.jobs)
        check.verify()


class EngineCheck:
    """``check_engines`` in its three steps, so that several checks — and other Flower runs —
    share ONE simulation (Ray and its client actors start once: most of a small check's time):
    build it (the runs' settings, in folders under ``root``), ``run_local()``, simulate ``jobs``
    together with whatever else, then ``verify()``."""

    def __init__(self, cases: Sequence[Any], root: Path, *, atol: float = 1e-6,
                 resume: bool | Collection[str] = True, drops: bool = False, **settings: Any) -> None:
        self.atol, self.drops = atol, drops
        root.mkdir(parents=True, exist_ok=True)
        self.cases = [(c, {}, {}) if isinstance(c, str) else (c[0], dict(c[1]), dict(c[2]) if len(c) > 2 else {})
                      for c in cases]
        self.runs: list[tuple[RunConfig, RunConfig, RunConfig, Path]] = []  # local, flower, resumed, local cut
        self.resumes: list[bool] = []
        self.jobs: list[Job] = []  # the Flower runs to simulate
        for k, (name, params, own) in enumerate(self.cases):
            fedlt.algorithms.get(name)  # an unknown name is a clear UnknownNameError
            base = dict(TINY, **{**settings, **own}, algorithm=name, algorithm_params=params, rounds=2)
            base.setdefault("model", split_model_for(probe(base, root / "probe")))
            base = with_personal(base)
            if drops:
                base.update(drop_pattern(RunConfig(**base, out=root / "probe")))
            make = lambda where, **more: RunConfig(**{**base, **more, "out": root / f"{k}-{where}"})  # noqa: E731
            local, flower, resumed = make("local"), make("flower", engine="flower"), make("resumed", engine="flower")
            self.runs.append((local, flower, resumed, root / f"{k}-local-cut"))
            self.resumes.append(resume if isinstance(resume, bool) else name in resume)
            # the Flower run's directory as a kill after round 1 leaves it, resumed with the same settings
            self.jobs.append(Job(flower, on_round=cut_after(1, flower.out, resumed.out) if self.resumes[-1] else None))
            if self.resumes[-1]:
                self.jobs.append(Job(resumed, resume=True))

    def run_local(self) -> None:
        for local, *_, cut in self.runs:
            run(local, on_round=cut_after(1, local.out, cut) if self.drops else None)

    def verify(self) -> None:
        """Raises ContractError for the first case that breaks a property (after ``run_local``
        and the simulation of ``jobs``)."""
        for case, runs, resume in zip(self.cases, self.runs, self.resumes):
            self._verify_case(case, runs, resume)

    def _verify_case(self, case: tuple[str, dict, dict], runs: tuple[RunConfig, RunConfig, RunConfig, Path],
                     resume: bool) -> None:
        (name, params, own), (local, flower, resumed, cut), atol = case, runs, self.atol
        c = Contract(f"algorithm {_label(name, params)!r}" + (f" with {own}" if own else ""))
        ends = {key: io.load_checkpoint(Path(cfg.out) / "checkpoint.pt") for key, cfg in (("local", local), ("flower", flower))}
        for part, what in (("algorithm", "global model and server state"), ("client_states", "client states")):
            found = differences(ends["local"][part], ends["flower"][part], atol)
            c.check(not found, "same answer on every engine",
                    f"{what} after 2 rounds differ between local and flower: {'; '.join(found[:3])}")
        found = differences(per_client_fields(local.out), per_client_fields(flower.out), atol)
        c.check(not found, "same per-client numbers on every engine",
                f"per-client evaluation fields differ between local and flower: {'; '.join(found[:3])}")
        if resume:
            found = run_differences(flower.out, resumed.out)
            c.check(not found, "exact resume on flower", "cut after round 1 (same settings) and resumed differs "
                    f"from the uninterrupted run: {'; '.join(found[:3])}")
        if self.drops:
            rows = [json.loads(line) for line in (Path(local.out) / "metrics.jsonl").read_text().splitlines()]
            c.check(all(len(r["dropped"]) == 1 for r in rows), "drops", f"dropped per round: {[r['dropped'] for r in rows]}")
            dropped = int(next(iter(rows[1]["dropped"])))
            before = io.load_checkpoint(cut / "checkpoint.pt")["client_states"].get(dropped, {})
            found = differences(before, ends["local"]["client_states"].get(dropped, {}), 0.0)
            c.check(not found, "no state change for a dropped client",
                    f"client {dropped}, dropped in round 2, changed its state: {'; '.join(found[:3])}")

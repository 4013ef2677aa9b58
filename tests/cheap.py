"""Cheap settings for the algorithms whose server-side work has published sizes far beyond what a
contract needs, shared by the registry-parametrised contracts (algorithm, engine, parallel,
device, cohort) and the study tests.

A contract checks placement, parity between runners, exact resume or cohort equality: each of
them holds for one iteration of a loop as it does for 300, because every iteration runs the same
code. The published sizes — CReFF's 100 gradient-matching steps and 300 re-training epochs a
round over 100 features a class (the authors' options.py), CCVR's 200 virtual features a class,
FedLoGe's SSE-C built by 10 000 Adam steps (~20 s in every process that builds it, each Flower
client and worker process included) — are checked against the authors' code in the golden tests
(tests/test_*_golden.py) and by tests/test_server_steps.py and tests/test_heads.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

CHEAP: dict[str, dict[str, Any]] = {
    "creff": {"step": {"name": "creff", "match_epochs": 2, "retrain_epochs": 1, "features_per_class": 2,
                       "repeats": 1}},
    "ccvr": {"step": {"name": "ccvr", "samples_per_class": 4}},
    "fedloge": {"head": {"name": "sse_c", "steps": 2}},
    "fedrela": {"head": {"name": "sse_c", "steps": 2}},  # FedLoGe's SSE-C under FedReLa's relabelling
    # FEDIC's 3 × 100 server steps a round on 100 proxy images a class (their main.py, options.py)
    "fedic": {"proxy_per_class": 3, "finetune_steps": 2, "calibration_steps": 2, "distill_steps": 2,
              "batch_unlabeled": 8},
}


def params(name: str) -> dict[str, Any]:
    """``name``'s cheap ``algorithm_params`` ({} for an algorithm without costly server-side work)."""
    return dict(CHEAP.get(name, {}))


def cases(names: Iterable[str]) -> list[Any]:
    """Contract cases for ``names``: ``(name, cheap params)`` for the costly ones, the bare name
    otherwise (so every name is still checked, with its own code)."""
    return [(name, params(name)) if name in CHEAP else name for name in names]

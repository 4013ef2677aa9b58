"""Checkpoints and the rules of a resume: what a run's state is (``RunState``), which settings
may change between a run and its resumption (``RESUMABLE_CHANGES``, ``config_digest``,
``config_changes``), reading a checkpoint back (``restore``) and writing one (``Checkpoints``).

May import: the bottom layer, the algorithms' client-state store and fedlt.config.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlt import io, rundir
from fedlt.algorithms.protocol import ClientStates
from fedlt.config import RunConfig, upgrade_config, with_defaults
from fedlt.errors import FedltError, first_line

CHECKPOINT_FORMAT = io.CHECKPOINT_FORMAT
# Settings that may differ between a run and its resumption: where it goes, how long it runs, and
# what does not change a single number (device placement aside, which users may move on purpose).
# The engine too: local and Flower runs give the same model (to float rounding across processes).
RESUMABLE_CHANGES = {"out", "rounds", "checkpoint_every", "client_state_memory_mb", "data_root", "download", "device", "fused", "eval_batch",
                     "engine", "workers", "loader_workers", "threads", "faults.min_results", "faults.on_failure",
                     "faults.on_short"}
# (how many clients a round needs and what a failure or a short round does decide whether the run
# goes on, not what a completed round computed: a run stopped below min_results may resume with a
# lower one)


@dataclass
class RunState:
    round: int  # rounds completed
    metrics: list[dict]  # every round's row (evaluated rounds carry the evaluation fields)
    wall_time: float
    client_states: ClientStates = field(default_factory=ClientStates)
    checkpoint_round: int | None = None  # the round of the checkpoint on disk, if any
    data_fingerprint: str = ""  # fedlt.datasets.fingerprint of the inputs the run trains on (checked on resume)
    uploads: dict = field(default_factory=dict)  # the server's upload state: DP accountant, adaptive clip (fedlt.uploads)
    stop_signal: int | None = field(default=None, repr=False)


def _known_to(settings: dict[str, Any], recorded: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with only the keys ``recorded`` (a run's config.json) has, tables of settings
    recursively: the settings a run written before later fields existed was digested over."""
    return {k: _known_to(v, recorded[k]) if isinstance(v, dict) and isinstance(recorded[k], dict) else v
            for k, v in settings.items() if k in recorded}


def config_digest(config: RunConfig, recorded: dict[str, Any] | None = None) -> str:
    """What must match for a resume: every setting that can change a number in the results.
    ``recorded``: the run's config.json as written, when it may predate some of this fedlt's
    fields (those are then left out: ``check_resumable`` has checked they are at their defaults)."""
    relevant = config.model_dump(mode="json")
    if recorded is not None:
        relevant = _known_to(relevant, recorded)
    for name in RESUMABLE_CHANGES:
        *parents, leaf = name.split(".")
        node = relevant
        for parent in parents:
            node = node.get(parent, {})
        node.pop(leaf, None)
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()


def _differences(a: Any, b: Any, prefix: str) -> Iterator[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            yield from _differences(a.get(key), b.get(key), f"{prefix}{key}.")
    elif a != b:
        yield prefix.rstrip(".")


def _resumable(name: str) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in RESUMABLE_CHANGES for i in range(1, len(parts) + 1))


def config_changes(saved: dict[str, Any], config: RunConfig) -> list[str]:
    """Settings (dotted names) whose value differs from ``saved`` (a config.json's settings; a
    field it lacks, written before the field existed, counts at its declared default), ignoring
    the ones a resume may change."""
    return [name for name in _differences(with_defaults(saved), config.model_dump(mode="json"), "")
            if not _resumable(name)]


def check_resumable(out: Path, config: RunConfig) -> dict[str, Any]:
    """``out`` holds a run that ``config`` may continue (raises FedltError naming what differs);
    returns its config.json's settings as written (brought to this fedlt's format version)."""
    if not (out / "config.json").is_file() or not (out / "partition.npz").is_file():
        raise FedltError(f"cannot resume {out}: it holds no run (config.json and partition.npz are missing)")
    saved = upgrade_config(io.read_json(out / "config.json", "run configuration", dict), out / "config.json")
    changed = config_changes(saved, config)
    if changed:
        raise FedltError(f"cannot resume {out} with changed settings: {', '.join(changed)} "
                         f"(only {', '.join(sorted(RESUMABLE_CHANGES))} may change)")
    return saved


def store(out: Path, config: RunConfig) -> ClientStates:
    """The run's client-state store: in memory up to ``client_state_memory_mb``, then one file
    per client in ``out/client_states`` (fedlt.algorithms.client_states)."""
    return ClientStates(Path(out) / rundir.STATE_DIR, config.client_state_memory_mb)


def restore(prep: Any, saved: dict, path: Path, config: RunConfig, data_fingerprint: str,
            recorded: dict[str, Any] | None = None) -> RunState:
    """The run's state from a checkpoint, its algorithm's state loaded into ``prep.algorithm``;
    ``recorded``: the run's config.json settings (``check_resumable``), for its digest."""
    kept = saved.get("data_fingerprint", data_fingerprint)  # checkpoints written before it have none
    if kept != data_fingerprint:
        raise FedltError(f"{path} was trained on other data: the inputs of {config.dataset} differ from those the run "
                         f"began with (fingerprint {str(kept)[:12]}…, now {data_fingerprint[:12]}…); "
                         "resume with the same data or start a new run")
    if saved["config_digest"] != config_digest(config, recorded):
        raise FedltError(f"{path} was written by a different configuration; resume it with the settings in its "
                         "config.json")
    if saved["partition_sha256"] != prep.partition.sha256:
        raise FedltError(f"{path} belongs to another partition (sha256 {saved['partition_sha256'][:12]}…, "
                         f"this run's is {prep.partition.sha256[:12]}…)")
    if not 0 <= saved["round"] <= config.rounds:
        raise FedltError(f"{path} is at round {saved['round']}, beyond rounds={config.rounds}")
    last = saved["metrics"][-1] if saved["metrics"] else {}
    if saved["round"] == config.rounds and (last.get("round") != config.rounds or "accuracy" not in last):
        raise FedltError(f"{path} is at round {saved['round']} but holds no evaluation of it; resume with "
                         f"--rounds above {saved['round']}")
    client_states = store(path.parent, config)
    try:
        prep.algorithm.load_state_dict(saved["algorithm"])
    except (KeyError, RuntimeError, ValueError, TypeError, FedltError) as exc:
        raise FedltError(f"{path} does not fit this run's model or algorithm ({first_line(exc)[:200]})") from None
    try:
        client_states.load_state_dict(saved["client_states"])
    except (KeyError, ValueError, TypeError, AttributeError, FedltError) as exc:
        raise FedltError(f"{path} holds damaged client states ({first_line(exc)[:200]})") from None
    client_states.check(path)
    return RunState(saved["round"], list(saved["metrics"]), saved["wall_time"], client_states,
                    checkpoint_round=saved["round"], data_fingerprint=data_fingerprint,
                    uploads=dict(saved.get("uploads", {})))


class Checkpoints:
    """Writes the run's checkpoint (``checkpoint.pt`` + ``checkpoint.json``) and says which one
    stands when a run ends early."""

    def __init__(self, out: Path, config: RunConfig, prep: Any, state: RunState, server: Any = None) -> None:
        """``server``: what else holds server state (fedlt.uploads' runner: DP accountant, clip norm)."""
        self.path = out / "checkpoint.pt"
        self.out, self.config, self.prep, self.state, self.server = out, config, prep, state, server

    def snapshot(self) -> dict[str, Any]:
        """The algorithm's, the clients' and the uploads' states as they are now."""
        return {"algorithm": self.prep.algorithm.state_dict(), "client_states": self.state.client_states.state_dict(),
                "uploads": self.server.state_dict() if self.server is not None else {}}

    def save(self, snapshot: dict[str, Any] | None = None) -> None:
        """The run at ``state.round``; ``snapshot``: the states as they were at that round's end,
        when later training has moved them on (an overlapped evaluation).

        With the client states in files, the checkpoint holds their manifest: the files written
        since the last checkpoint are made durable first, and the ones it supersedes are removed
        only once it is on disk — a kill at any point leaves a checkpoint whose files are all there."""
        state = self.state
        snapshot = snapshot or self.snapshot()
        state.client_states.sync()
        io.save_checkpoint(self.path, {
            "format": CHECKPOINT_FORMAT, "config_digest": config_digest(self.config),
            "partition_sha256": self.prep.partition.sha256, "data_fingerprint": state.data_fingerprint,
            "round": state.round, **snapshot,
            "metrics": state.metrics, "wall_time": float(state.wall_time),
        })
        state.checkpoint_round = state.round
        io.write_json(self.out / "checkpoint.json", {"round": state.round, "file": self.path.name,
                                                     "bytes": self.path.stat().st_size})
        state.client_states.collect(snapshot["client_states"])

    def due(self, round_done: int) -> bool:
        return round_done % self.config.checkpoint_every == 0 or round_done == self.config.rounds

    def kept(self) -> str:
        """What stands on disk, for the message of a run that ended early."""
        if self.state.checkpoint_round is None:
            return "no checkpoint had been written yet"
        return f"the last good checkpoint (round {self.state.checkpoint_round}) is kept in {self.path}"

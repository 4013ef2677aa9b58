"""What every contract shares: the failure type, resolving a component given by name or object,
comparing two runs' states field by field, and cutting a run after a round as a kill would."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fedlt import io
from fedlt.registry import Registry
from fedlt.rundir import LOCK_NAME


class ContractError(AssertionError):
    """A component breaks a property of its kind's contract; the message names the property."""


class Contract:
    """Collects the failure of one named property: ``with c.property("disjoint"): ...``."""

    def __init__(self, what: str) -> None:
        self.what = what

    def fail(self, prop: str, detail: str) -> ContractError:
        return ContractError(f"{self.what} breaks [{prop}]: {detail}")

    def check(self, ok: bool, prop: str, detail: str) -> None:
        if not ok:
            raise self.fail(prop, detail)

    @contextmanager
    def property(self, prop: str, where: str = "") -> Iterator[None]:
        """Any exception inside the block (other than a ContractError) fails ``prop``."""
        try:
            yield
        except ContractError:
            raise
        except Exception as exc:
            text = " ".join(str(exc).split()) or type(exc).__name__
            raise self.fail(prop, f"{where}{': ' if where else ''}{type(exc).__name__}: {text}") from exc


@contextmanager
def registered(registry: Registry, component: Any, fallback_name: str) -> Iterator[str]:
    """The registered name of ``component``: itself when it is a name, else the object registered
    temporarily (a plugin's component tested before it is installed)."""
    if isinstance(component, str):
        registry.get(component)  # an unknown name is a clear UnknownNameError, not a contract failure
        yield component
        return
    with registry.temporary(fallback_name, component):
        yield fallback_name


def differences(a: Any, b: Any, atol: float, path: str = "", rtol: float | None = None) -> list[str]:
    """Where two nested states differ, each named by its dotted path: keys, types, shapes, dtypes,
    values (floating tensors elementwise within ``atol + rtol·|b|``, ``rtol`` 10·atol by default;
    everything else exactly), in the order the states list them."""
    rtol = 10 * atol if rtol is None else rtol
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path or 'state'}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} in one only"]
        return [d for k in a for d in differences(a[k], b[k], atol, f"{path}.{k}" if path else str(k), rtol)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} and {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, atol, f"{path}[{i}]", rtol)]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        if a.is_floating_point():
            excess = (a.double() - b.double()).abs() - (atol + rtol * b.double().abs())
            if a.numel() and not float(excess.max()) <= 0:
                gap = float((a.double() - b.double()).abs().max())
                return [f"{path}: differs by up to {gap:.3g} (beyond {atol:g} + {rtol:g}·|value|)"]
            return []
        return [] if torch.equal(a, b) else [f"{path}: differs"]
    if isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= atol or a == b else [f"{path}: {a} vs {b}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def cut_after(round_done: int, run_dir: Path, copy_to: Path) -> Callable[[int, dict[str, Any]], None]:
    """An ``on_round`` callback that copies ``run_dir`` to ``copy_to`` once round ``round_done``
    is recorded and checkpointed: the directory a kill -9 at that moment leaves behind (its lock
    aside), to be resumed with the SAME settings. The run itself goes on to its last round, so
    one run gives both the uninterrupted reference and the cut (a run of fewer ``rounds``
    extended later is another run for every term that reads ``rounds``)."""

    def copy(done: int, row: dict[str, Any]) -> None:
        if done == round_done:
            shutil.copytree(run_dir, copy_to, ignore=shutil.ignore_patterns(LOCK_NAME))

    return copy


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without its wall-clock fields (train_s, eval_s, round_s)."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
            for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def run_differences(reference: Path, resumed: Path, summaries: tuple[dict, dict] | None = None,
                    parts: tuple[str, ...] = ("algorithm", "client_states")) -> list[str]:
    """Where a resumed run differs from the uninterrupted one, bit for bit, earliest first: every
    metrics row in round order (wall-clock fields aside), the checkpointed ``parts``, then the
    summary (``summaries``: reference's, resumed's; wall time aside)."""
    a, b = metric_rows(reference), metric_rows(resumed)
    found = differences({f"round {r['round']}": r for r in a}, {f"round {r['round']}": r for r in b}, 0.0,
                        "metrics.jsonl", rtol=0.0)
    ends = [io.load_checkpoint(Path(d) / "checkpoint.pt") for d in (reference, resumed)]
    for part in parts:
        found += differences(ends[0][part], ends[1][part], 0.0, f"checkpoint {part}", rtol=0.0)
    if summaries is not None:
        a, b = ({k: v for k, v in s.items() if k != "wall_time_s"} for s in summaries)
        found += differences(a, b, 0.0, "summary", rtol=0.0)
    return found

"""Evaluation of a global model (SPEC §5): accuracy, balanced and per-class accuracy, many/medium/few.

The whole test set is scored in large no-grad batches; every metric is derived from one confusion
count per class, so nothing is recomputed per metric.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedlt.datasets.source import Images, images
from fedlt.models import eval_mode


# On the CPU a forward of more rows than this runs slower per row: the activations of a
# convolutional model leave the cache (PFLlib's CNN 250 µs an image at 2048 rows, 165 at 256;
# AlexNet 1.6 ms vs 1.35 ms; an MLP is 1 µs slower at 256, over 10k images 10 ms)
CPU_ROWS = 256


def forward_rows(batch_size: int, device: str | torch.device) -> int:
    """Rows per no-grad forward: ``batch_size`` (``eval_batch``), at most CPU_ROWS on the CPU."""
    return min(batch_size, CPU_ROWS) if torch.device(device).type == "cpu" else batch_size


@torch.no_grad()
def predict(model: nn.Module, x: Images, batch_size: int = 2048, device: str | torch.device = "cpu") -> torch.Tensor:
    """Logits for every row of ``x`` (a tensor, or an image source decoded chunk by chunk), eval
    mode restored to the caller's mode afterwards; ``batch_size`` rows a forward (on the CPU at
    most ``CPU_ROWS``)."""
    rows = forward_rows(batch_size, device)
    with eval_mode(model):
        return torch.cat([model(chunk.to(device)).float().cpu() for chunk in images(x).chunks(rows)])


def class_groups(train_counts: np.ndarray, rule: Literal["count", "share"] = "count",
                 thresholds: tuple[int, int] = (100, 20), shares: tuple[float, float] = (0.75, 0.95)) -> dict[str, np.ndarray]:
    """Many / medium / few classes by global training count.

    ``count``: many > hi, few < lo, medium otherwise (defaults 100 / 20).
    ``share`` (Fed-GraB): classes sorted by count; many = the head holding the first 75% of the
    samples, medium = up to 95%, few = the rest.
    """
    counts = np.asarray(train_counts, dtype=np.int64)
    if rule == "count":
        hi, lo = thresholds
        many, few = counts > hi, counts < lo
        return {"many": np.flatnonzero(many), "medium": np.flatnonzero(~many & ~few), "few": np.flatnonzero(few)}
    order = np.argsort(-counts, kind="stable")
    share_before = np.concatenate([[0.0], np.cumsum(counts[order])[:-1]]) / max(counts.sum(), 1)
    return {
        "many": np.sort(order[share_before < shares[0]]),
        "medium": np.sort(order[(share_before >= shares[0]) & (share_before < shares[1])]),
        "few": np.sort(order[share_before >= shares[1]]),
    }


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, num_classes: int,
                           groups: dict[str, np.ndarray] | None = None) -> dict:
    """accuracy, balanced_accuracy (mean over classes present in the test set), per_class_accuracy,
    loss (mean CE over the test set, in float64) and, given ``groups``, ``<group>_accuracy`` (mean
    per-class accuracy in the group; None when no class of the group is in the test set)."""
    pred = logits.argmax(1)
    correct = torch.bincount(labels[pred == labels], minlength=num_classes).double()
    total = torch.bincount(labels, minlength=num_classes).double()
    present = total > 0
    per_class = torch.where(present, correct / total.clamp(min=1), torch.full_like(total, float("nan")))
    out = {
        "accuracy": float(correct.sum() / total.sum()),
        "balanced_accuracy": float(per_class[present].mean()),
        "loss": float(F.cross_entropy(logits.double(), labels)),
        "per_class_accuracy": [None if np.isnan(a) else round(float(a), 6) for a in per_class.tolist()],
    }
    for name, classes in (groups or {}).items():
        vals = per_class[torch.as_tensor(classes, dtype=torch.long)]
        vals = vals[~torch.isnan(vals)]
        out[f"{name}_accuracy"] = float(vals.mean()) if len(vals) else None
    return out


def client_metrics(per_class_accuracy: list[float | None], client_class_counts: np.ndarray) -> dict:
    """Each client's expected accuracy on test data following its own label distribution.

    a_k = Σ_c p_kc·acc_c / Σ_c p_kc, the sums over the classes present in the test set, with
    p_k = n_k / |D_k| the client's training label distribution and acc_c the global model's
    per-class test accuracy (so no client test set is needed, and a balanced test set estimates
    every class equally well). Returns the mean, minimum and standard deviation of a_k over all
    clients; a client none of whose classes are in the test set is left out.
    """
    acc = np.array([np.nan if a is None else a for a in per_class_accuracy], dtype=np.float64)
    counts = np.asarray(client_class_counts, dtype=np.float64)
    present = ~np.isnan(acc)
    weight = counts[:, present]
    held = weight.sum(1)
    scores = (weight @ acc[present])[held > 0] / held[held > 0]
    if scores.size == 0:
        return {"client_mean_accuracy": None, "client_min_accuracy": None, "client_std_accuracy": None}
    return {"client_mean_accuracy": float(scores.mean()), "client_min_accuracy": float(scores.min()),
            "client_std_accuracy": float(scores.std())}


def client_class_tallies(is_correct: np.ndarray, labels: np.ndarray, test_indices: list[np.ndarray],
                         num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """K×C tables (correct, total) of each client's test set, from one prediction per sample of the
    set the indices point into: the model is run once over the union, never once per client
    (clients of a matched protocol share test samples)."""
    sizes = np.fromiter((len(t) for t in test_indices), dtype=np.int64, count=len(test_indices))
    owner = np.repeat(np.arange(len(test_indices), dtype=np.int64), sizes)
    flat = np.concatenate(test_indices).astype(np.int64) if len(test_indices) else np.zeros(0, np.int64)
    cell = owner * num_classes + np.asarray(labels, dtype=np.int64)[flat]
    length = len(test_indices) * num_classes
    total = np.bincount(cell, minlength=length).reshape(-1, num_classes)
    correct = np.bincount(cell, weights=np.asarray(is_correct, dtype=np.float64)[flat], minlength=length)
    return correct.reshape(-1, num_classes).astype(np.int64), total


PER_CLIENT_KEYS = ("mean_weighted", "mean", "std", "min", "worst10", "many", "medium", "few")
PER_CLIENT_HIGHER = tuple(k for k in PER_CLIENT_KEYS if k != "std")  # accuracies: the best round is the highest


def best_of(rows: list[dict], key: str) -> tuple[float, int] | None:
    """(the highest value of ``key`` over the evaluated ``rows``, its round: the earliest on ties),
    or None when no row has one (SPEC §7: summaries give the best evaluated round and the last)."""
    found = [(row[key], row["round"]) for row in rows if isinstance(row.get(key), (int, float))]
    return max(found, key=lambda v: (v[0], -v[1])) if found else None


def per_client_summary(correct: np.ndarray, total: np.ndarray, train_counts: np.ndarray, prefix: str,
                       group_of: Callable[[np.ndarray], dict[str, np.ndarray]] = class_groups,
                       worst_share: float = 0.1) -> dict:
    """SPEC §7's per-client numbers from K×C tables of each client's correct and total test
    predictions per class (its own test set) and its K×C training class counts.

    a_k = Σ_c correct_kc / Σ_c total_kc over the clients with a test sample. Returns, each key
    prefixed ``<prefix>_``: ``mean_weighted`` (Σ correct / Σ total: weighted by test-set size),
    ``mean`` (unweighted over clients), ``std`` (population), ``min``, ``worst10`` (mean of the
    ⌈share·K⌉ lowest, at least one), ``clients`` (how many were scored), and ``many`` / ``medium`` /
    ``few``: for each client the mean per-class accuracy over the classes of that group *by its own
    training counts* (``group_of(n_k)``) present in its test set, averaged over the clients where it
    is defined (None where no client has one). Values are None when no client was scored.
    """
    correct, total = np.asarray(correct, np.float64), np.asarray(total, np.float64)
    sizes = total.sum(axis=1)
    scored = sizes > 0
    keys = ["mean_weighted", "mean", "std", "min", "worst10", "many", "medium", "few"]
    out: dict = {f"{prefix}_{key}": None for key in keys}
    out[f"{prefix}_clients"] = int(scored.sum())
    if not scored.any():
        return out
    acc = correct[scored].sum(axis=1) / sizes[scored]
    worst = np.sort(acc)[: max(1, math.ceil(worst_share * acc.size))]
    out.update({f"{prefix}_mean_weighted": float(correct.sum() / total.sum()), f"{prefix}_mean": float(acc.mean()),
                f"{prefix}_std": float(acc.std()), f"{prefix}_min": float(acc.min()),
                f"{prefix}_worst10": float(worst.mean())})
    per_class = np.divide(correct, total, out=np.full_like(correct, np.nan), where=total > 0)
    for group in ("many", "medium", "few"):
        values = []
        for k in np.flatnonzero(scored):
            members = group_of(np.asarray(train_counts[k]))[group]
            present = members[total[k, members] > 0]
            if present.size:
                values.append(per_class[k, present].mean())
        out[f"{prefix}_{group}"] = float(np.mean(values)) if values else None
    return out


def evaluate(model: nn.Module, x: Images, y: torch.Tensor, num_classes: int,
             groups: dict[str, np.ndarray] | None = None, batch_size: int = 2048,
             device: str | torch.device = "cpu", client_class_counts: np.ndarray | None = None) -> dict:
    """``classification_metrics`` of ``model`` on (x, y), plus ``client_metrics`` when the K×C
    ``client_class_counts`` are given."""
    out = classification_metrics(predict(model, x, batch_size, device), y, num_classes, groups)
    if client_class_counts is not None:
        out.update(client_metrics(out["per_class_accuracy"], client_class_counts))
    return out

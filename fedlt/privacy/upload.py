"""What a client's upload becomes on its way to the server (SPEC §9 "Order when composed"):

    Δ_k = θ_k − w  ─► clip(C) (DP) ─► the --upload transforms ─► noise(σC) (local DP)
        ─► wire form (the last transform's)  or, under secure aggregation, ─► w_k·Δ_k, w_k
           in fixed point, masked

``client_upload`` runs on the client (every engine: fedlt.algorithms.protocol calls it after the
client's work); ``open_upload`` / ``masked_sum`` are the server's side of it. The plan that says
what to do travels with the task (:class:`UploadPlan`, a wire type); the transforms' state (an
error-feedback residual) is the client's, kept in the client-state store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedlt import wire
from fedlt.privacy import secagg
from fedlt.transforms import Chain, Clip, Noise, build, global_norm, unpack

State = dict[str, torch.Tensor]


@wire.register
@dataclass(frozen=True)
class UploadPlan:
    """The round's instructions for every participant's training and upload.

    ``transforms``: the ``--upload`` chain's specs; ``clip``: DP's clip norm C of this round
    (applied first; the client reports whether it was under it); ``noise_std``: local DP's σC
    (applied last); ``secure``: mask the upload (weighted by ``|D_k|``, or 1 when ``uniform``);
    ``sample_level``: (C, σ) of DP-SGD in the client's local training (fedlt.privacy.dpsgd);
    ``secaggplus``: the transport masks it — Flower's SecAgg+ mod (fedlt.flower.secaggplus) — so
    the client hands over its dense update unweighted and unmasked, its weight beside it."""

    transforms: tuple = ()
    clip: float | None = None
    noise_std: float | None = None
    secure: bool = False
    uniform: bool = False
    sample_level: tuple | None = None
    secaggplus: bool = False

    @property
    def changes_upload(self) -> bool:
        """Whether the update is transformed, clipped, noised or masked on its way (not under
        sample-level DP alone: the trained weights go as they are)."""
        return bool(self.transforms or self.clip is not None or self.noise_std is not None or self.secure)

    def chain(self) -> Chain:
        head = [Clip(norm=self.clip)] if self.clip is not None else []
        tail = [Noise(std=self.noise_std)] if self.noise_std is not None else []
        return Chain([*head, *build(self.transforms).links, *tail])


def upload_seed(sampling_seed: int, round_index: int, cid: int) -> int:
    """The seed of the transforms' draws (QSGD's rounding, local noise): a stream of its own per
    (run, round, client), the same whichever way the client trained (one by one, in a cohort)."""
    words = np.random.SeedSequence([sampling_seed, round_index, cid, 0x0B10AD]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def float_keys(global_weights: State, weights: State) -> list[str]:
    """The entries that form the update: floating-point tensors the global model also has."""
    return [k for k in sorted(weights) if k in global_weights and weights[k].is_floating_point()]


def client_upload(plan: UploadPlan, global_weights: State, weights: State, state: dict[str, Any], *, cid: int,
                  participants: Sequence[int], seed: int, round_index: int,
                  num_samples: int) -> tuple[State, dict[str, Any], dict[str, Any]]:
    """(the entries sent as they are, the packed update, the chain's new state) of one client."""
    keys = float_keys(global_weights, weights)
    delta = {k: weights[k] - global_weights[k].to(weights[k]) for k in keys}
    kept = {k: v for k, v in weights.items() if k not in delta}
    unclipped = bool(global_norm(delta) <= plan.clip) if plan.clip is not None else None
    devices = [d for d in {v.device for v in delta.values()} if d.type == "cuda"]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(upload_seed(seed, round_index, cid))
        if not plan.secure:
            forms, new_state = plan.chain().encode(delta, state)
            return kept, {"forms": forms} | ({"unclipped": unclipped} if unclipped is not None else {}), new_state
        dense, new_state = plan.chain().apply(delta, state)
    weight = 1.0 if plan.uniform else float(num_samples)
    if plan.secaggplus:  # [Δ_k..., b_k]: SecAgg+ weights it by its num_examples (fedlt.flower.secaggplus)
        dense_flat = torch.cat([*(dense[k].double().reshape(-1).cpu() for k in keys),
                                torch.tensor([float(bool(unclipped))], dtype=torch.float64)])
        return kept, {"dense": dense_flat, "keys": keys, "weight": weight}, new_state
    flat = torch.cat([*(dense[k].double().reshape(-1).cpu() * weight for k in keys),
                      torch.tensor([weight, float(bool(unclipped))], dtype=torch.float64)])
    masked = secagg.mask(secagg.encode(flat, len(participants)), cid, participants, seed, round_index)
    return kept, {"masked": masked, "keys": keys}, new_state


def unflatten(global_weights: State, keys: Sequence[str], flat: torch.Tensor) -> tuple[State, torch.Tensor]:
    """The entries ``keys`` (shaped as the global model's) laid end to end at the start of ``flat``; what follows."""
    out, at = {}, 0
    for k in keys:
        like = global_weights[k]
        out[k] = flat[at:at + like.numel()].view(like.shape).to(like.device)
        at += like.numel()
    return out, flat[at:]


def open_upload(global_weights: State, kept: State, packed: dict[str, Any]) -> State:
    """A client's weights as the server reads them from a (not masked) packed upload: w + Δ'."""
    forms = packed["forms"]
    return kept | {k: global_weights[k] + unpack(form, global_weights[k]) for k, form in forms.items()}


def masked_sum(global_weights: State, keys: Sequence[str], masked: dict[int, torch.Tensor],
               participants: Sequence[int], seed: int, round_index: int) -> tuple[State, float, float]:
    """(Σ w_k·Δ_k by entry, Σ w_k, Σ b_k) over the uploads that arrived, unmasked (mask recovery
    for the participants that did not)."""
    total = secagg.decode(secagg.unmask_sum(masked, participants, seed, round_index))
    out, rest = unflatten(global_weights, keys, total)
    return out, float(rest[0]), float(rest[1])


def secaggplus_sum(global_weights: State, keys: Sequence[str], mean: torch.Tensor,
                   count: int) -> tuple[State, float, float]:
    """``masked_sum``'s answer from what Flower's SecAgg+ gives the server: the weighted mean
    Σ w_k·[Δ_k, b_k] / Σ w_k over the ``count`` uploads that arrived, read as that mean times
    ``count`` over a weight of ``count`` (under uniform weights, w_k = 1, exactly the sums)."""
    out, rest = unflatten(global_weights, keys, mean.double() * count)
    return out, float(count), float(rest[0])

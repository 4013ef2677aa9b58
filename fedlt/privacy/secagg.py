"""Secure aggregation by pairwise additive masking (Bonawitz et al. 2017, CCS, §4), simulated
exactly (SPEC §9).

Each participant i encodes its upload x_i (the weighted update w_i·Δ_i followed by w_i) in fixed
point, q_i = round(x_i · 2^F) mod 2^M, and adds, for every other participant j of the round, the
mask PRG(s_ij) when i < j and subtracts it when i > j (mod 2^M). The server sums the masked
uploads mod 2^M: the masks of every pair that both returned cancel; for a participant j that
dropped out, the survivors' shares of its pair seeds (Shamir shares in the protocol, simulated
here by the server drawing the same PRG) let the server remove the masks the survivors added for
j. The unmasked sum equals Σ_i q_i mod 2^M, i.e. the plain sum to the fixed-point step 2^−F,
as long as |Σ_i x_i| < 2^(M−F−1) (checked by each client against its share of that range).

The pair seeds s_ij stand in for the protocol's Diffie–Hellman agreed keys: derived from (run
secret = sampling seed, round, i, j), so a resumed round masks exactly as the first did.
The self-masks b_i (which protect a participant whose upload arrives after it was declared
dropped) are not simulated: every upload here arrives or not before unmasking.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedlt.errors import FedltError

MODULUS_BITS = 62  # M: two residues < 2^62 add without overflowing int64
FRACTION_BITS = 24  # F: the fixed-point step 2^-24 ≈ 6e-8
_MASK = (1 << MODULUS_BITS) - 1


def pair_generator(seed: int, round_index: int, i: int, j: int) -> torch.Generator:
    """The PRG of the pair {i, j} in one round (the same for both, whatever the order)."""
    lo, hi = min(i, j), max(i, j)
    words = np.random.SeedSequence([seed, round_index, lo, hi, 0x5EC]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed((int(words[0]) << 31) ^ int(words[1]))


def pair_mask(seed: int, round_index: int, i: int, j: int, length: int) -> torch.Tensor:
    return torch.randint(0, 1 << MODULUS_BITS, (length,), generator=pair_generator(seed, round_index, i, j),
                         dtype=torch.int64)


def encode(values: torch.Tensor, participants: int) -> torch.Tensor:
    """Fixed point mod 2^M (int64), refused when ``participants`` such values could wrap the sum."""
    limit = 2.0 ** (MODULUS_BITS - FRACTION_BITS - 1) / max(participants, 1)
    biggest = float(values.abs().max()) if values.numel() else 0.0
    if not biggest < limit:
        raise FedltError(f"secure aggregation: an upload value of {biggest:.3g} exceeds the fixed-point range "
                         f"±{limit:.3g} for {participants} participants (clip the update)")
    return torch.round(values.double().cpu() * 2.0 ** FRACTION_BITS).to(torch.int64) & _MASK


def decode(residues: torch.Tensor) -> torch.Tensor:
    """The signed float64 values of a fixed-point sum mod 2^M."""
    signed = torch.where(residues >= 1 << (MODULUS_BITS - 1), residues - (1 << MODULUS_BITS), residues)
    return signed.double() / 2.0 ** FRACTION_BITS


def mask(encoded: torch.Tensor, cid: int, participants: Sequence[int], seed: int, round_index: int) -> torch.Tensor:
    """Client ``cid``'s masked upload: + PRG(s_ij) for j > i, − for j < i, mod 2^M."""
    out = encoded.clone()
    for j in participants:
        if j != cid:
            m = pair_mask(seed, round_index, cid, j, len(encoded))
            out = (out + m if cid < j else out - m) & _MASK
    return out


def unmask_sum(masked: dict[int, torch.Tensor], participants: Sequence[int], seed: int,
               round_index: int) -> torch.Tensor:
    """Σ of the survivors' encoded uploads mod 2^M: their masked uploads summed, then the masks
    they added for each participant that dropped out removed (mask recovery)."""
    survivors = sorted(masked)
    if not survivors:
        raise FedltError("secure aggregation: no participant's upload arrived")
    total = torch.zeros_like(masked[survivors[0]])
    for cid in survivors:
        total = (total + masked[cid]) & _MASK
    for j in (p for p in participants if p not in masked):
        for i in survivors:
            m = pair_mask(seed, round_index, i, j, len(total))
            total = (total - m if i < j else total + m) & _MASK
    return total

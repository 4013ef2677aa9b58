"""The fused CPU path: each objective's value AND its gradient w.r.t. the logits, computed
analytically in one forward (no autograd graph, no backward re-read), in few passes over B×C.

Why this shape (measured in ``benchmarks/fused_loss.py``; torch.compile was slower here and costs
~30 s of compilation per objective): on a CPU these losses are bound by the number of B×C passes
and of exponentials, so every objective computes ONE softmax of the logits and derives the rest
from it:

- CE / logit adjustment: value from the row log-sum-exp, gradient (softmax − onehot)/B.
- logit suppression (a column log-sum-exp over the batch) reuses that softmax P: with u_i =
  e^{lse_i − R}, R = max_i lse_i, the masked column sum Σ_{i: y_i ≠ c} e^{z_ic + o_c − R} is the
  matrix-vector product Pᵀu with the B target entries zeroed (one read, BLAS), and its gradient is
  P ⊙ (u vᵀ) — no second exponential. A column whose sum falls below float range (logits ~1e4 apart)
  is recomputed exactly (rare; keeps the extreme cases equal to the reference).
- vacant KD: the student's vacant softmax read off the shared softmax (or, at T ≠ 1, its own over
  the vacant columns), the teacher's over the vacant columns only; KL(q‖p) per row =
  Σ_c q_c(t_c − z_c) − lse_t + lse_z (dot products, no per-element logarithm).
- SGB: one sigmoid (or softmax); the collector's column sums from the same buffer.

Inputs of any float dtype are read once into float32 (float64 stays float64); the value and the
gradient come back in that working dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fedlt.losses.fused.parts import OffsetCE, Part, Suppression, VacantKD


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float type (bfloat16, float16, float32) runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_lse(a: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """Row log-sum-exp of ``a`` from its softmax ``P``: lse = max a − log max P (the softmax is
    monotone, so both maxima sit in the same column; max P ≥ 1/C keeps the logarithm exact to
    rounding). No second exponential pass, and two value-only reductions (``amax`` is ~10× faster
    than a ``max`` that also returns the indices)."""
    return a.amax(1) - torch.log(P.amax(1))


def _softmax(zf: torch.Tensor, targets: torch.Tensor, offset: torch.Tensor | None, out: torch.Tensor | None = None):
    """(P, lse, a_y) for a = z + offset, P written into ``out`` if given: lse = a_y − log P_y from
    the target's probability (no extra pass); a row whose P_y underflows takes an exact
    log-sum-exp instead."""
    a = zf if offset is None else zf + offset
    P = torch.softmax(a, 1) if out is None else torch.softmax(a, 1, out=out)
    rows = torch.arange(a.shape[0], device=a.device)
    a_y, P_y = a[rows, targets], P[rows, targets]
    lse = a_y - torch.log(P_y)
    low = P_y < torch.finfo(P.dtype).tiny * 1e8
    if bool(low.any()):
        lse[low] = torch.logsumexp(a[low], 1)
    return P, lse, a_y


def _vec(part_vec, ref: torch.Tensor) -> torch.Tensor:
    return part_vec.get(ref.device, ref.dtype)


def objective(logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor | None,
              parts: Sequence[Part]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(Σ parts' values, G, s) with s·G = Σ their gradients w.r.t. the logits (working dtype).

    A lone CE returns G = softmax − onehot and s = weight/B: the backward's multiplication by the
    upstream gradient applies s, saving a pass."""
    zf = logits.detach().to(work_dtype(logits.dtype))
    if len(parts) == 1 and isinstance(parts[0], OffsetCE):
        ce = parts[0]
        P, lse, a_y = _softmax(zf, targets, None if ce.offset is None else _vec(ce.offset, zf))
        P[torch.arange(len(targets), device=P.device), targets] -= 1.0
        return (ce.weight * (lse - a_y).double().mean()).to(zf.dtype), P, ce.weight / len(targets)
    B = zf.shape[0]
    rows = torch.arange(B, device=zf.device)
    ces = [p for p in parts if isinstance(p, OffsetCE)]
    sups = [p for p in parts if isinstance(p, Suppression)]
    kds = [p for p in parts if isinstance(p, VacantKD)]
    value = zf.new_zeros((), dtype=torch.float64)

    # the shared softmax: the first CE's, if its offset is finite (fedlc's −inf columns cannot
    # carry the suppression's column sums), else one of z itself
    shared_ce = ces[0] if ces and (not sups or ces[0].finite_offset()) else None
    rest = [p for p in ces if p is not shared_ce]
    shared_offset = None if shared_ce is None or shared_ce.offset is None else _vec(shared_ce.offset, zf)
    grad: torch.Tensor | None = None
    if shared_ce is not None or sups:
        kd = next((k for k in kds if _shares_softmax(k, shared_offset)), None)
        kds = [k for k in kds if k is not kd]
        shared_value, grad = _shared_softmax_terms(zf, targets, teacher_logits, shared_ce, sups, kd, shared_offset)
        value = value + shared_value
    for part in rest:
        P, lse, a_y = _softmax(zf, targets, None if part.offset is None else _vec(part.offset, zf))
        value = value + part.weight * (lse - a_y).double().mean()
        P.mul_(part.weight / B)
        P[rows, targets] -= part.weight / B
        grad = P if grad is None else grad.add_(P)
    if grad is None:
        grad = torch.zeros_like(zf)
    for part in kds:
        if teacher_logits is None:
            raise ValueError("vacant_kd needs teacher_logits")
        value = value + _vacant_kd(zf, teacher_logits, part, grad)
    return value.to(zf.dtype), grad, 1.0


# Logits per row block of the shared-softmax terms: a block's few B×C-shaped temporaries (4 MiB
# each in float32) stay in the last-level cache, so each pass reads the logits from memory once
# rather than once per operation, while the per-operation overhead is paid only B·C / 2^20 times.
# Measured from 2^14 to one block in benchmarks/fused_loss.py's fedvls 4096×1000 case (docs/fused.md).
BLOCK_ELEMENTS = 1 << 20


def _shared_softmax_terms(zf, targets, teacher_logits, ce: OffsetCE | None, sups: list[Suppression],
                          kd: VacantKD | None, offset: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, gradient) of the terms that read the shared softmax P of a = z + offset: the CE
    ``ce`` (or None), the suppression parts ``sups`` and the vacant KD ``kd`` (or None).

    The gradient is G = P ⊙ (ce_w/B + u vᵀ + a maskᵀ) with the target entries and the KD's
    teacher part put right (see :func:`_suppression_finish` and :class:`_SharedKD`). Rows are
    processed in blocks. Pass 1 computes each block's softmax and the per-row quantities, adds the
    block to the suppression's column sums and leaves P in the gradient buffer; the column sums
    need every row, so pass 2 turns P into G in place. Without suppression pass 1 finishes each block.
    """
    B, C = zf.shape
    # off the CPU (CUDA without triton under "on") one block: each block synchronises a few times
    step = max(1, BLOCK_ELEMENTS // C) if zf.device.type == "cpu" else B
    ce_w = 0.0 if ce is None else ce.weight
    grad = torch.empty_like(zf)
    lse, P_y = zf.new_empty(B), zf.new_empty(B)
    value = zf.new_zeros((), dtype=torch.float64)
    columns = _ColumnSums(C, zf.device) if sups else None
    shared_kd = None if kd is None else _SharedKD(kd, teacher_logits, offset, zf, keep_q=bool(sups))
    blocks = [slice(i, min(i + step, B)) for i in range(0, B, step)]
    for sl in blocks:
        y = targets[sl]
        r = torch.arange(len(y), device=zf.device)
        # with suppression P stays in the gradient buffer until pass 2; else it is a block temporary
        P, lse[sl], a_y = _softmax(zf[sl], y, offset, grad[sl] if columns is not None else None)
        P_y[sl] = P[r, y]
        if ce is not None:
            value = value + (ce_w / B) * (lse[sl] - a_y).double().sum()
        q = None if shared_kd is None else shared_kd.add(sl, P, lse[sl], zf[sl])
        if columns is not None:
            columns.add(P, lse[sl], r, y, P_y[sl])
        else:
            _to_gradient(grad[sl], P, r, y, P_y[sl], ce_w / B, shared_kd, sl, None, None, q)
    exact = None
    if columns is not None:
        v, sup_value, exact = _suppression_finish(zf, targets, columns, offset, sups)
        value = value + sup_value
        for sl in blocks:
            y = targets[sl]
            G = grad[sl]
            _to_gradient(G, G, torch.arange(len(y), device=zf.device), y, P_y[sl], ce_w / B, shared_kd, sl,
                         torch.exp(lse[sl] - columns.R), v.to(zf.dtype), None if shared_kd is None else shared_kd.q[sl])
    if exact is not None:
        grad.index_add_(1, exact[0], exact[1])
    if shared_kd is not None:
        value = value + shared_kd.value
        shared_kd.apply_fixes(grad)
    return value, grad


def _to_gradient(out, P, r, y, P_y, base, kd, sl, u, v, teacher_part) -> None:
    """out = P ⊙ (base + u vᵀ + a maskᵀ) (``out`` may be ``P`` itself), target entries
    P_y·(base + a_i·mask_{y_i}) − base (the suppression's gradient is 0 there), plus the KD's
    ``teacher_part`` −(w/B)·q on the vacant columns."""
    U = [] if u is None else [u]
    V = [] if v is None else [v]
    if kd is not None:
        U.append(kd.a[sl])
        V.append(kd.mask)
    if U:
        coef = torch.addmm(torch.full((1, 1), base, dtype=P.dtype, device=P.device), torch.stack(U, 1),
                           torch.stack(V, 0))
        torch.mul(P, coef, out=out)
    else:
        torch.mul(P, base, out=out)
    on_target = base if kd is None else base + kd.a[sl] * kd.mask[y]
    out[r, y] = P_y * on_target - base
    if kd is not None:
        out.scatter_add_(1, kd.O.unsqueeze(0).expand(len(teacher_part), -1), teacher_part)


class _ColumnSums:
    """The suppression's masked column sums S_c = Σ_{i: y_i ≠ c} e^{a_ic − R} over row blocks, with
    R = max_i lse_i kept as a running maximum (earlier blocks rescaled in float64 when it rises):
    per block one matrix-vector product Pᵀu, u_i = e^{lse_i − R}, on the block's softmax."""

    def __init__(self, C: int, device: torch.device) -> None:
        self.S = torch.zeros(C, dtype=torch.float64, device=device)
        self.R = float("-inf")

    def add(self, P, lse, r, y, P_y) -> None:
        R = max(self.R, float(lse.max()))
        if R > self.R and self.R != float("-inf"):
            self.S.mul_(math.exp(self.R - R))
        self.R = R
        P[r, y] = 0.0
        self.S += (P.t() @ torch.exp(lse - R)).double()
        P[r, y] = P_y


def _suppression_finish(zf, targets, columns: _ColumnSums, offset, sups):
    """The suppression parts from the column sums of the shared softmax of a = z + offset.

    Returns v (length C, float64: the suppression gradient is P_ic·u_i·v_c off the targets), the
    value, and the exactly recomputed columns (indices, B×|J| gradient) or None.
    """
    B, C = zf.shape
    S, R = columns.S, columns.R
    o = torch.zeros(C, dtype=torch.float64, device=zf.device) if offset is None else offset.double()
    n = torch.bincount(targets, minlength=C).double()
    others = n < B
    tiny = torch.finfo(zf.dtype).tiny * 1e8  # below this the float sum has lost its leading digits
    risky = others & (S < tiny)
    logS = torch.where(S > 0, S, torch.ones_like(S)).log() + R - o
    v = torch.zeros(C, dtype=torch.float64, device=zf.device)
    value = torch.zeros((), dtype=torch.float64, device=zf.device)
    exact_cols, exact_grads = [], []
    for part in sups:
        p = part.p.get(zf.device, torch.float64)
        shift = part.shift(C).to(zf.device)
        col = logS + shift  # log Σ_{non-target} e^{A_ic}
        col = torch.where(others, col, torch.full_like(col, float("-inf")))
        if part.variant == "reference":  # the target entries are e^0 = 1 each
            lse_c = torch.logaddexp(col, n.log())
            keep = torch.ones_like(others)
        else:
            lse_c, keep = col, others
        ok = keep & ~risky
        s = torch.where(ok, lse_c - math.log(B), torch.zeros_like(lse_c))
        value = value + part.weight * part.scale * (p * s).sum()
        # off-target gradient scale·p_c·e^{A_ic − lse_c} = P_ic·u_i·e^{R + shift_c − o_c − lse_c}·scale·p_c
        expo = torch.where(ok, R + shift - o - lse_c, torch.full_like(lse_c, float("-inf")))
        v = v + part.weight * part.scale * p * torch.exp(expo)
        if bool(risky.any()):
            J = risky.nonzero().flatten()
            val, g = _suppression_exact(zf, targets, J, part, shift, p)
            value = value + val
            exact_cols.append(J)
            exact_grads.append(g)
    exact = None
    if exact_cols:
        exact = (torch.cat(exact_cols), torch.cat(exact_grads, dim=1))
    return v, value, exact


def _suppression_exact(zf, targets, J, part, shift, p):
    """The reference formula on the columns J only (their sums underflow the shared softmax)."""
    B = zf.shape[0]
    A = zf.index_select(1, J) + shift[J].to(zf.dtype)
    own = targets.unsqueeze(1) == J.unsqueeze(0)
    A = A.masked_fill(own, 0.0 if part.variant == "reference" else float("-inf"))
    lse = torch.logsumexp(A, 0)
    w = part.weight * part.scale * p[J]
    g = torch.softmax(A, 0).masked_fill(own, 0.0) * w.to(zf.dtype)
    return (w * (lse.double() - math.log(B))).sum(), g


def _shares_softmax(part: VacantKD, offset: torch.Tensor | None) -> bool:
    """Whether the student's vacant-class softmax can be read off the shared softmax P of z + offset:
    T = 1 and the offset equal on every vacant class (logit_adjust gives them all tau·log eps)."""
    if part.T != 1.0:
        return False
    if offset is None:
        return True
    o = offset[part.vacant.get(offset.device, torch.long)]
    return bool(torch.isfinite(o).all()) and bool(o.max() == o.min())


class _SharedKD:
    """Vacant KD (T = 1) with the student's side read off the shared softmax P of a = z + offset,
    block by block: S_i = Σ_{c∈O} P_ic (a matrix-vector product), p_ic = P_ic / S_i and
    lse_z = log S_i + lse_i − o_O; the teacher's softmax q runs over the vacant columns only. Per row
    KL(q‖p) = Σ_{c∈O} q_c(t_c − z_c) − lse_t + lse_z (two dot products, no per-element logarithm).
    The gradient is P ⊙ a maskᵀ − (w/B)·q on O with a_i = w/(B·S_i); a row whose S_i underflows
    (its vacant logits ~1e2 below its largest) gets its student part exactly (``apply_fixes``)."""

    def __init__(self, part: VacantKD, teacher_logits, offset, zf, keep_q: bool) -> None:
        if teacher_logits is None:
            raise ValueError("vacant_kd needs teacher_logits")
        B, C = zf.shape
        self.weight, self.B = part.weight, B
        self.w_over_B = part.weight / B  # w/B of the docstrings
        self.O = part.vacant.get(zf.device, torch.long)
        self.mask = torch.zeros(C, dtype=zf.dtype, device=zf.device)
        self.mask[self.O] = 1.0
        self.o_vacant = 0.0 if offset is None else float(offset[self.O[0]])
        self.teacher = teacher_logits.detach()
        self.a = zf.new_empty(B)
        self.q = zf.new_empty(B, len(self.O)) if keep_q else None  # pass 2 needs it
        self.value = zf.new_zeros((), dtype=torch.float64)
        self.fixes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, sl: slice, P: torch.Tensor, lse: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Adds the rows ``sl`` (their shared softmax P, lse and logits z); returns their −(w/B)·q,
        the teacher's part of the gradient on the vacant columns (kept for pass 2 if asked)."""
        S = P @ self.mask
        ok = S >= torch.finfo(z.dtype).tiny * 1e8
        S = torch.where(ok, S, torch.ones_like(S))
        lse_z = S.log() + lse - self.o_vacant
        tO = self.teacher[sl].index_select(1, self.O).to(z.dtype)
        q = torch.softmax(tO, 1)
        lse_t = _row_lse(tO, q)
        zO = z.index_select(1, self.O)
        cross = torch.dot(q.flatten(), tO.flatten()).double() - torch.dot(q.flatten(), zO.flatten()).double()
        self.a[sl] = torch.where(ok, self.w_over_B / S, torch.zeros_like(S))
        if not bool(ok.all()):
            bad = (~ok).nonzero().flatten()
            lse_z[bad] = torch.logsumexp(zO[bad], 1)
            self.fixes.append((bad + sl.start, torch.softmax(zO[bad], 1) * self.w_over_B))
        self.value += self.weight * (cross - (lse_t - lse_z).double().sum()) / self.B
        q = torch.mul(q, -self.w_over_B, out=None if self.q is None else self.q[sl])
        return q

    def apply_fixes(self, grad: torch.Tensor) -> None:
        for rows, values in self.fixes:
            grad.index_put_((rows.unsqueeze(1), self.O.unsqueeze(0)), values, accumulate=True)


def _vacant_kd(zf: torch.Tensor, teacher_logits: torch.Tensor, part: VacantKD,
               grad: torch.Tensor) -> torch.Tensor:
    """Adds the KD gradient (w·T/B)(p − q) on the vacant columns to ``grad``; returns the value."""
    B = zf.shape[0]
    O = part.vacant.get(zf.device, torch.long)
    zO = zf.index_select(1, O)
    tO = teacher_logits.detach().to(zf.dtype).index_select(1, O)
    if part.T != 1.0:
        zO.div_(part.T)
        tO.div_(part.T)
    p, q = torch.softmax(zO, 1), torch.softmax(tO, 1)
    lse_gap = (_row_lse(tO, q) - _row_lse(zO, p)).double().sum()
    # Σ_i Σ_c q_ic (t_ic − z_ic) as two BLAS dot products (no B×|O| temporary)
    cross = torch.dot(q.flatten(), tO.flatten()).double() - torch.dot(q.flatten(), zO.flatten()).double()
    grad.index_add_(1, O, p.sub_(q), alpha=part.weight * part.T / B)
    return part.weight * (cross - lse_gap) * (part.T * part.T / B)


def sgb(logits: torch.Tensor, targets: torch.Tensor, w_pos: torch.Tensor, w_neg: torch.Tensor,
        base: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGB's steps 4–6 (SPEC §2): the unweighted base loss, the re-weighted gradient g' and the
    collector's per-class sums Σ_{y_i=c}|g'_ic| and Σ_{y_i≠c}|g'_ic| (float64, before gating)."""
    zf = logits.detach().to(work_dtype(logits.dtype))
    B, C = zf.shape
    rows = torch.arange(B, device=zf.device)
    z_y = zf[rows, targets]
    if base == "sigmoid":
        value = (F.softplus(zf).sum(dtype=torch.float64) - z_y.double().sum()) / B
        s = torch.sigmoid(zf)
    else:
        s = torch.softmax(zf, 1)
        value = (_row_lse(zf, s) - z_y).double().mean()
    s_y = s[rows, targets].clone()
    s[rows, targets] = 0.0
    neg = s.sum(0, dtype=torch.float64) * (w_neg / B)
    grad = s.mul_((w_neg / B).to(zf.dtype))
    g_y = (s_y - 1.0) * (w_pos / B).to(zf.dtype)[targets]
    grad[rows, targets] = g_y
    pos = torch.zeros(C, dtype=torch.float64, device=zf.device).index_add_(0, targets, g_y.abs().double())
    return value.to(zf.dtype), grad, pos, neg


def offset_ce_pair(logits: torch.Tensor, targets: torch.Tensor, server_offset: torch.Tensor,
                   client_offsets: torch.Tensor, sizes: Sequence[int]):
    """SCALA's losses from one set of server logits (see :func:`fedlt.losses.fused.offset_ce_pair`):
    (server value, the K client values, saved tensors, state): the saved G_s, G_c with gradients
    G_s/B and s_c ⊙ G_c (s_c: 1/B_k per row), applied by :func:`offset_ce_pair_grad`."""
    zf = logits.detach().to(work_dtype(logits.dtype))
    B = zf.shape[0]
    rows = torch.arange(B, device=zf.device)
    P, lse, a_y = _softmax(zf, targets, server_offset.to(zf.dtype))
    server_value = (lse - a_y).double().mean()
    P[rows, targets] -= 1.0
    adjusted = torch.empty_like(zf)
    start = 0
    for n_k, offset in zip(sizes, client_offsets.to(zf.dtype)):
        torch.add(zf[start:start + n_k], offset, out=adjusted[start:start + n_k])
        start += n_k
    scale = torch.cat([torch.full((n_k,), 1.0 / n_k, dtype=zf.dtype, device=zf.device) for n_k in sizes])
    Pc, lse_c, a_y_c = _softmax(adjusted, targets, None)
    segment = torch.repeat_interleave(torch.arange(len(sizes), device=zf.device),
                                      torch.tensor(list(sizes), device=zf.device))
    client_value = torch.zeros(len(sizes), dtype=torch.float64, device=zf.device).index_add_(
        0, segment, ((lse_c - a_y_c) * scale).double())
    Pc[rows, targets] -= 1.0
    return server_value.to(zf.dtype), client_value.to(zf.dtype), (P, Pc, scale.unsqueeze(1), segment), 1.0 / B


def offset_ce_pair_grad(saved: tuple[torch.Tensor, ...], s_server: float, up_server: torch.Tensor | None,
                        up_clients: torch.Tensor | None) -> torch.Tensor | None:
    """up_server·s_server·G_s + (each row's client's upstream)·s_c ⊙ G_c; either upstream may be None."""
    g_server, g_clients, s_clients, segment = saved
    grad = None
    if up_server is not None:
        grad = g_server * (up_server.to(g_server.dtype) * s_server)
    if up_clients is not None:
        up = up_clients.to(g_clients.dtype)[segment].unsqueeze(1)  # each row: its client's upstream
        term = g_clients * (s_clients * up)
        grad = term if grad is None else grad.add_(term)
    return grad

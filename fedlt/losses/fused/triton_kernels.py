"""Triton kernels of the fused loss path, for CUDA tensors (docs/fused.md).

Same three entry points and returns as :mod:`.cpu` — ``objective``, ``sgb``, ``offset_ce_pair`` —
with the gradients w.r.t. the logits written in float32, already scaled (scale factors 1 / None). Every kernel takes BLOCK_B rows per
program (rows in grid dimension 0) and walks the classes in blocks of BLOCK_C with an online
log-sum-exp, so any C works; per-row and per-class results are tiny vectors finished in torch.

- ``objective`` (CE with offsets + vacant KD + logit suppression, one group of each): kernel
  ``_rows`` reads the logits (and the teacher's vacant columns) once for the row statistics and the
  suppression's per-block column (max, Σexp) partials; the column log-sum-exp over the whole batch
  must be known before any suppression gradient exists, so ``_grad`` reads the tile again and
  writes the summed gradient once. Two launches for ``fedvls`` instead of three terms' dozen.
- ``sgb``: one kernel: value, re-weighted gradient and the collector's column partials.
- ``offset_ce_pair``: one kernel: both row log-sum-exps (server prior and each row's client
  prior), then both gradients.

Tested on the CPU with ``TRITON_INTERPRET=1`` (tests/test_fused_triton.py). float64 logits go to
the torch path (:mod:`.cpu`), which runs on any device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fedlt.losses.fused import cpu
from fedlt.losses.fused.parts import OffsetCE, Part, Suppression, VacantKD

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))  # inside kernels
_NEG_INF = float("-inf")  # in the launchers
# elements per program tile: rows × class block (registers on a GPU; numpy arrays in the interpreter)
TILE = 8192


def blocks(B: int, C: int, block_c: int | None = None) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_C): the class block covers C up to 1024 (then loops), rows fill the tile."""
    bc = block_c or min(triton.next_power_of_2(C), 1024)
    return max(1, min(TILE // bc, triton.next_power_of_2(B))), bc


@triton.jit
def _online(m, s, x):
    """Fold the rows of block ``x`` (−inf = absent) into running (max, Σ e^{x − max})."""
    m_new = tl.maximum(m, tl.max(x, 1))
    shift = tl.where(m_new == NEG_INF, 0.0, m_new)
    s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), 1)
    return m_new, s


@triton.jit
def _rows(z_ptr, t_ptr, y_ptr, ce_off_ptr, vac_ptr, sup_shift_ptr,
          ce_lse_ptr, kd_lz_ptr, kd_lt_ptr, kd_cross_ptr, pmax_ptr, psum_ptr,
          B, C, stride_z, stride_t, inv_T,
          HAS_CE: tl.constexpr, HAS_KD: tl.constexpr, HAS_SUP: tl.constexpr, SUP_REF: tl.constexpr,
          BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    zero = tl.zeros([BLOCK_B], dtype=tl.float32)
    m_ce, s_ce = zero + NEG_INF, zero
    m_z, s_z, m_t, s_t, acc = zero + NEG_INF, zero, zero + NEG_INF, zero, zero
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        ok = row_ok[:, None] & col_ok[None, :]
        z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_CE:
            off = tl.load(ce_off_ptr + cols, mask=col_ok, other=0.0)
            m_ce, s_ce = _online(m_ce, s_ce, tl.where(ok, z + off[None, :], NEG_INF))
        if HAS_KD:
            vac = tl.load(vac_ptr + cols, mask=col_ok, other=0.0) > 0
            kd_ok = ok & vac[None, :]
            t = tl.load(t_ptr + rows[:, None] * stride_t + cols[None, :], mask=kd_ok, other=0.0).to(tl.float32)
            zz = tl.where(kd_ok, z * inv_T, NEG_INF)
            tt = tl.where(kd_ok, t * inv_T, NEG_INF)
            m_z, s_z = _online(m_z, s_z, zz)
            # Σ_c e^{tt − m_t}·(tt − zz), rescaled as the running max m_t moves
            m_new = tl.maximum(m_t, tl.max(tt, 1))
            shift = tl.where(m_new == NEG_INF, 0.0, m_new)
            e = tl.exp(tt - shift[:, None])
            scale = tl.exp(m_t - shift)
            acc = acc * scale + tl.sum(e * tl.where(kd_ok, tt - zz, 0.0), 1)
            s_t = s_t * scale + tl.sum(e, 1)
            m_t = m_new
        if HAS_SUP:
            k = tl.load(sup_shift_ptr + cols, mask=col_ok, other=0.0)
            own = y[:, None] == cols[None, :]
            if SUP_REF:  # the target's entry is e^0 = 1 (the published code)
                a = tl.where(own, 0.0, z + k[None, :])
            else:  # the paper: no entry for the target
                a = tl.where(own, NEG_INF, z + k[None, :])
            a = tl.where(ok, a, NEG_INF)
            bmax = tl.max(a, 0)
            shift = tl.where(bmax == NEG_INF, 0.0, bmax)
            bsum = tl.sum(tl.exp(a - shift[None, :]), 0)
            tl.store(pmax_ptr + pid * C + cols, bmax, mask=col_ok)
            tl.store(psum_ptr + pid * C + cols, bsum, mask=col_ok)
    if HAS_CE:
        tl.store(ce_lse_ptr + rows, m_ce + tl.log(s_ce), mask=row_ok)
    if HAS_KD:
        tl.store(kd_lz_ptr + rows, m_z + tl.log(s_z), mask=row_ok)
        tl.store(kd_lt_ptr + rows, m_t + tl.log(s_t), mask=row_ok)
        tl.store(kd_cross_ptr + rows, acc / s_t, mask=row_ok)


@triton.jit
def _grad(z_ptr, t_ptr, y_ptr, g_ptr, ce_off_ptr, vac_ptr, sup_shift_ptr, sup_coef_ptr, sup_lse_ptr,
          ce_lse_ptr, kd_lz_ptr, kd_lt_ptr,
          B, C, stride_z, stride_t, inv_T, ce_w, kd_w,
          HAS_CE: tl.constexpr, HAS_KD: tl.constexpr, HAS_SUP: tl.constexpr, ACCUMULATE: tl.constexpr,
          BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """g = ce_w·(softmax(z + o) − onehot) + kd_w·(p − q) on vacant columns
    + coef_c·e^{A_ic − lse_c} off the targets (ce_w, kd_w, coef already carry 1/B, T, p_c)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    if HAS_CE:
        lse = tl.load(ce_lse_ptr + rows, mask=row_ok, other=0.0)
    if HAS_KD:
        lz = tl.load(kd_lz_ptr + rows, mask=row_ok, other=0.0)
        lt = tl.load(kd_lt_ptr + rows, mask=row_ok, other=0.0)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        ok = row_ok[:, None] & col_ok[None, :]
        own = y[:, None] == cols[None, :]
        z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        g = tl.zeros([BLOCK_B, BLOCK_C], dtype=tl.float32)
        if HAS_CE:
            off = tl.load(ce_off_ptr + cols, mask=col_ok, other=0.0)
            g += ce_w * (tl.exp(z + off[None, :] - lse[:, None]) - tl.where(own, 1.0, 0.0))
        if HAS_KD:
            vac = tl.load(vac_ptr + cols, mask=col_ok, other=0.0) > 0
            kd_ok = ok & vac[None, :]
            t = tl.load(t_ptr + rows[:, None] * stride_t + cols[None, :], mask=kd_ok, other=0.0).to(tl.float32)
            d = tl.exp(z * inv_T - lz[:, None]) - tl.exp(t * inv_T - lt[:, None])
            g += tl.where(kd_ok, kd_w * d, 0.0)
        if HAS_SUP:
            k = tl.load(sup_shift_ptr + cols, mask=col_ok, other=0.0)
            coef = tl.load(sup_coef_ptr + cols, mask=col_ok, other=0.0)
            lse_c = tl.load(sup_lse_ptr + cols, mask=col_ok, other=0.0)
            sup = coef[None, :] * tl.exp(z + k[None, :] - lse_c[None, :])
            g += tl.where(own, 0.0, sup)
        ptrs = g_ptr + rows[:, None] * C + cols[None, :]
        if ACCUMULATE:
            g += tl.load(ptrs, mask=ok, other=0.0)
        tl.store(ptrs, g, mask=ok)


def _groups(parts: Sequence[Part]) -> list[tuple[OffsetCE | None, VacantKD | None, Suppression | None]]:
    """Parts in groups of at most one of each kind (fedvls is one group: one pair of launches)."""
    ces = [p for p in parts if isinstance(p, OffsetCE)]
    kds = [p for p in parts if isinstance(p, VacantKD)]
    sups = [p for p in parts if isinstance(p, Suppression)]
    n = max(len(ces), len(kds), len(sups), 1)
    pick = lambda xs, i: xs[i] if i < len(xs) else None  # noqa: E731
    return [(pick(ces, i), pick(kds, i), pick(sups, i)) for i in range(n)]


def objective(logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor | None,
              parts: Sequence[Part], block_c: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dtype == torch.float64:
        return cpu.objective(logits, targets, teacher_logits, parts)
    z = logits.detach().contiguous()
    B, C = z.shape
    dev = z.device
    BLOCK_B, BLOCK_C = blocks(B, C, block_c)
    grid = (triton.cdiv(B, BLOCK_B),)
    y = targets.contiguous()
    rows = torch.arange(B, device=dev)
    grad = torch.empty(B, C, dtype=torch.float32, device=dev)
    value = torch.zeros((), dtype=torch.float64, device=dev)
    f32 = lambda n: torch.empty(n, dtype=torch.float32, device=dev)  # noqa: E731
    dummy = f32(1)
    for i, (ce, kd, sup) in enumerate(_groups(parts)):
        ce_off = dummy if ce is None else (torch.zeros(C, dtype=torch.float32, device=dev) if ce.offset is None
                                           else ce.offset.get(dev, torch.float32))
        t = dummy
        vac = dummy
        inv_T = 1.0
        if kd is not None:
            if teacher_logits is None:
                raise ValueError("vacant_kd needs teacher_logits")
            t = teacher_logits.detach().contiguous()
            vac = torch.zeros(C, dtype=torch.float32, device=dev)
            vac[kd.vacant.get(dev, torch.long)] = 1.0
            inv_T = 1.0 / kd.T
        shift = dummy if sup is None else sup.shift(C).to(device=dev, dtype=torch.float32)
        ce_lse, lz, lt, cross = f32(B), f32(B), f32(B), f32(B)
        pmax = torch.empty(grid[0], C, dtype=torch.float32, device=dev)
        psum = torch.empty_like(pmax)
        _rows[grid](z, t, y, ce_off, vac, shift, ce_lse, lz, lt, cross, pmax, psum,
                    B, C, z.stride(0), t.stride(0) if kd is not None else 0, inv_T,
                    HAS_CE=ce is not None, HAS_KD=kd is not None, HAS_SUP=sup is not None,
                    SUP_REF=sup is not None and sup.variant == "reference", BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C)
        coef = lse_c = dummy
        if ce is not None:
            a_y = z[rows, y].float() + ce_off[y]
            value = value + ce.weight * (ce_lse - a_y).double().mean()
        if kd is not None:
            value = value + kd.weight * (kd.T * kd.T / B) * (cross - lt + lz).double().sum()
        if sup is not None:
            M = pmax.max(0).values
            Ms = torch.where(M == _NEG_INF, torch.zeros_like(M), M)
            lse_c = Ms + torch.log((psum * torch.exp(pmax - Ms)).sum(0))
            valid = torch.isfinite(lse_c)
            p = sup.p.get(dev, torch.float64)
            s = torch.where(valid, lse_c.double() - math.log(B), torch.zeros_like(p))
            value = value + sup.weight * sup.scale * (p * s).sum()
            coef = (sup.weight * sup.scale * p * valid).float()
            lse_c = torch.where(valid, lse_c, torch.zeros_like(lse_c))
        _grad[grid](z, t, y, grad, ce_off, vac, shift, coef, lse_c, ce_lse, lz, lt,
                    B, C, z.stride(0), t.stride(0) if kd is not None else 0, inv_T,
                    0.0 if ce is None else ce.weight / B, 0.0 if kd is None else kd.weight * kd.T / B,
                    HAS_CE=ce is not None, HAS_KD=kd is not None, HAS_SUP=sup is not None, ACCUMULATE=i > 0,
                    BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C)
    return value.float(), grad, 1.0


@triton.jit
def _sgb(z_ptr, y_ptr, wpos_ptr, wneg_ptr, g_ptr, row_ptr, pos_ptr, neg_ptr, B, C, stride_z,
         SOFTMAX: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """g' = (σ(z) − onehot)/B re-weighted (w_pos/B at the target, w_neg/B elsewhere; softmax base:
    softmax(z)), the per-row Σ softplus (sigmoid base) or log-sum-exp (softmax base), and the
    column partials Σ_rows |g'| on and off the targets."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    zero = tl.zeros([BLOCK_B], dtype=tl.float32)
    lse = zero
    if SOFTMAX:
        m, s = zero + NEG_INF, zero
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            ok = row_ok[:, None] & (cols < C)[None, :]
            z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=NEG_INF).to(tl.float32)
            m, s = _online(m, s, z)
        lse = m + tl.log(s)
        tl.store(row_ptr + rows, lse, mask=row_ok)
    softplus = zero
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        ok = row_ok[:, None] & col_ok[None, :]
        own = y[:, None] == cols[None, :]
        z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        # ``prob``, not ``s``: the softmax pass above carries ``s`` (B,) through its loop, and a
        # compiled Triton loop may not re-type a carried name (B×C here); the interpreter allows it
        if SOFTMAX:
            prob = tl.exp(z - lse[:, None])
        else:
            prob = 1.0 / (1.0 + tl.exp(-z))
            sp = tl.maximum(z, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(z)))
            softplus += tl.sum(tl.where(ok, sp, 0.0), 1)
        wpos = tl.load(wpos_ptr + cols, mask=col_ok, other=0.0)
        wneg = tl.load(wneg_ptr + cols, mask=col_ok, other=0.0)
        g = tl.where(own, (prob - 1.0) * wpos[None, :], prob * wneg[None, :])
        g = tl.where(ok, g, 0.0)
        tl.store(g_ptr + rows[:, None] * C + cols[None, :], g, mask=ok)
        tl.store(pos_ptr + pid * C + cols, tl.sum(tl.where(own, tl.abs(g), 0.0), 0), mask=col_ok)
        tl.store(neg_ptr + pid * C + cols, tl.sum(tl.where(own, 0.0, tl.abs(g)), 0), mask=col_ok)
    if not SOFTMAX:
        tl.store(row_ptr + rows, softplus, mask=row_ok)


def sgb(logits: torch.Tensor, targets: torch.Tensor, w_pos: torch.Tensor, w_neg: torch.Tensor, base: str,
        block_c: int | None = None):
    if logits.dtype == torch.float64:
        return cpu.sgb(logits, targets, w_pos, w_neg, base)
    z = logits.detach().contiguous()
    B, C = z.shape
    BLOCK_B, BLOCK_C = blocks(B, C, block_c)
    grid = (triton.cdiv(B, BLOCK_B),)
    grad = torch.empty(B, C, dtype=torch.float32, device=z.device)
    row = torch.empty(B, dtype=torch.float32, device=z.device)
    pos = torch.empty(grid[0], C, dtype=torch.float32, device=z.device)
    neg = torch.empty_like(pos)
    _sgb[grid](z, targets.contiguous(), (w_pos / B).float(), (w_neg / B).float(), grad, row, pos, neg,
               B, C, z.stride(0), SOFTMAX=base == "softmax", BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C)
    z_y = z[torch.arange(B, device=z.device), targets].double()
    value = (row.double() - z_y).sum() / B  # Σ softplus − z_y (sigmoid) or lse − z_y (softmax), mean
    return value.float(), grad, pos.sum(0, dtype=torch.float64), neg.sum(0, dtype=torch.float64)


@triton.jit
def _pair_tile(z_ptr, so_ptr, co_ptr, rows, row_ok, seg, c0, C, stride_z, BLOCK_C: tl.constexpr):
    """One class block of the pair's rows: its columns, mask, logits, server offsets and each
    row's client offsets (both passes of ``_pair`` read the same tile)."""
    cols = c0 + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    ok = row_ok[:, None] & col_ok[None, :]
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    so = tl.load(so_ptr + cols, mask=col_ok, other=0.0)
    co = tl.load(co_ptr + seg[:, None] * C + cols[None, :], mask=ok, other=0.0)
    return cols, ok, z, so, co


@triton.jit
def _pair(z_ptr, y_ptr, seg_ptr, so_ptr, co_ptr, scale_ptr, gs_ptr, gc_ptr, lse_s_ptr, lse_c_ptr,
          B, C, stride_z, inv_B, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row log-sum-exps of z + o_server and z + o_client(row), then both gradients:
    (softmax − onehot)/B for the server, (softmax − onehot)/B_k for the row's client."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    seg = tl.load(seg_ptr + rows, mask=row_ok, other=0)
    zero = tl.zeros([BLOCK_B], dtype=tl.float32)
    m_s, s_s, m_c, s_c = zero + NEG_INF, zero, zero + NEG_INF, zero
    for c0 in range(0, C, BLOCK_C):
        cols, ok, z, so, co = _pair_tile(z_ptr, so_ptr, co_ptr, rows, row_ok, seg, c0, C, stride_z, BLOCK_C)
        m_s, s_s = _online(m_s, s_s, tl.where(ok, z + so[None, :], NEG_INF))
        m_c, s_c = _online(m_c, s_c, tl.where(ok, z + co, NEG_INF))
    lse_s = m_s + tl.log(s_s)
    lse_c = m_c + tl.log(s_c)
    tl.store(lse_s_ptr + rows, lse_s, mask=row_ok)
    tl.store(lse_c_ptr + rows, lse_c, mask=row_ok)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    for c0 in range(0, C, BLOCK_C):
        cols, ok, z, so, co = _pair_tile(z_ptr, so_ptr, co_ptr, rows, row_ok, seg, c0, C, stride_z, BLOCK_C)
        onehot = tl.where(y[:, None] == cols[None, :], 1.0, 0.0)
        ptrs = rows[:, None] * C + cols[None, :]
        tl.store(gs_ptr + ptrs, (tl.exp(z + so[None, :] - lse_s[:, None]) - onehot) * inv_B, mask=ok)
        tl.store(gc_ptr + ptrs, (tl.exp(z + co - lse_c[:, None]) - onehot) * scale[:, None], mask=ok)


def offset_ce_pair(logits: torch.Tensor, targets: torch.Tensor, server_offset: torch.Tensor,
                   client_offsets: torch.Tensor, sizes: Sequence[int], block_c: int | None = None):
    if logits.dtype == torch.float64:
        return cpu.offset_ce_pair(logits, targets, server_offset, client_offsets, sizes)
    z = logits.detach().contiguous()
    B, C = z.shape
    dev = z.device
    BLOCK_B, BLOCK_C = blocks(B, C, block_c)
    counts = torch.tensor(list(sizes), device=dev)
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=dev), counts).to(torch.int32)
    scale = torch.repeat_interleave(1.0 / counts.float(), counts)
    so = server_offset.to(device=dev, dtype=torch.float32).contiguous()
    co = client_offsets.to(device=dev, dtype=torch.float32).contiguous()
    gs = torch.empty(B, C, dtype=torch.float32, device=dev)
    gc = torch.empty_like(gs)
    lse_s = torch.empty(B, dtype=torch.float32, device=dev)
    lse_c = torch.empty_like(lse_s)
    y = targets.contiguous()
    _pair[(triton.cdiv(B, BLOCK_B),)](z, y, seg, so, co, scale, gs, gc, lse_s, lse_c, B, C, z.stride(0), 1.0 / B,
                                     BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C)
    z_y = z[torch.arange(B, device=dev), y].float()
    server = (lse_s - z_y - so[y]).double().mean()
    clients = torch.zeros(len(sizes), dtype=torch.float64, device=dev).index_add_(
        0, seg.long(), ((lse_c - z_y - co[seg.long(), y]) * scale).double())
    return server.float(), clients.float(), gs, gc, 1.0, None

"""Triton kernels of the fused loss path, for CUDA tensors (docs/fused.md).

Same entry points as :mod:`.cpu` — ``objective``, ``sgb``, ``offset_ce_pair`` (+ its backward
``offset_ce_pair_grad``) — with the gradients already scaled (scale factor 1). Every kernel takes
BLOCK_B rows per program (rows in grid dimension 0) and walks the classes in blocks of BLOCK_C with
an online log-sum-exp, so any C works.

A call is bound by the host up to ~10^8 logits on an H200 (~10 µs per torch operator, ~20 µs per
Triton launch, docs/fused.md), so each entry point issues as few of both as the math allows, and
everything derivable from the parts and the shape is made once (``_recipe``, ``_segments``):

- ``objective``: without a suppression ONE launch per group of parts (``_rows``: each row's
  log-sum-exps and value, then its gradient from the same program — the second read of the row hits
  the cache); the value is one ``sum`` over the rows' values. With a suppression the column
  log-sum-exp over the whole batch must exist before any suppression gradient does: ``_rows``
  (row statistics, values, per-block column (max, Σexp) partials), ``_cols`` (merges the partials:
  column log-sum-exps, coefficients, column values) and ``_grad`` (the summed gradient).
- ``sgb``: one launch: value per row, re-weighted gradient, the collector's column partials.
- ``offset_ce_pair``: one launch for both losses' row statistics and values (one ``mv`` sums them
  into the server's loss and each client's); the backward recomputes the gradient from the logits
  in one launch, reading the upstream gradients on the device.

Tested on the CPU with ``TRITON_INTERPRET=1`` (tests/test_fused_triton.py). float64 logits go to
the torch path (:mod:`.cpu`), which runs on any device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fedlt.losses.fused import cpu
from fedlt.losses.fused.parts import OffsetCE, Part, Suppression, VacantKD

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))  # inside kernels
_NEG_INF = float("-inf")  # in the launchers
# elements per program tile: rows × class block (registers on a GPU; numpy arrays in the interpreter)
TILE = 8192
COL_BLOCK = 16  # columns per program of ``_cols`` (it merges every row block's partials of its columns)


def _pow2(n: int) -> int:
    """The least power of 2 ≥ n (triton.next_power_of_2 without its per-call cost)."""
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=256)
def blocks(B: int, C: int, block_c: int | None = None) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_C): the class block covers C up to 1024 (then loops), rows fill the tile."""
    bc = block_c or min(_pow2(C), 1024)
    return max(1, min(TILE // bc, _pow2(B))), bc


@triton.jit
def _online(m, s, x):
    """Fold the rows of block ``x`` (−inf = absent) into running (max, Σ e^{x − max})."""
    m_new = tl.maximum(m, tl.max(x, 1))
    shift = tl.where(m_new == NEG_INF, 0.0, m_new)
    s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), 1)
    return m_new, s


@triton.jit
def _ce_kd_grad(z, t, y, cols, ok, col_ok, tab_ptr, C, lse, lz, lt, inv_T, ce_w, kd_gw,
                HAS_CE: tl.constexpr, HAS_KD: tl.constexpr):
    """One tile's CE and KD gradient: ce_w·(softmax(z + o) − onehot) + kd_gw·(p − q) on the vacant
    columns (the weights already carry 1/B and T)."""
    g = tl.zeros_like(z)
    if HAS_CE:
        off = tl.load(tab_ptr + cols, mask=col_ok, other=0.0)
        own = y[:, None] == cols[None, :]
        g += ce_w * (tl.exp(z + off[None, :] - lse[:, None]) - tl.where(own, 1.0, 0.0))
    if HAS_KD:
        vac = tl.load(tab_ptr + C + cols, mask=col_ok, other=0.0) > 0
        kd_ok = ok & vac[None, :]
        d = tl.exp(z * inv_T - lz[:, None]) - tl.exp(t * inv_T - lt[:, None])
        g += tl.where(kd_ok, kd_gw * d, 0.0)
    return g


@triton.jit
def _tile(z_ptr, t_ptr, tab_ptr, rows, row_ok, c0, C, stride_z, stride_t, HAS_KD: tl.constexpr,
          BLOCK_C: tl.constexpr):
    """One class block of the rows: its columns and masks, the logits and, for the KD, the
    teacher's vacant columns (float32)."""
    cols = c0 + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    ok = row_ok[:, None] & col_ok[None, :]
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    t = z
    if HAS_KD:
        vac = tl.load(tab_ptr + C + cols, mask=col_ok, other=0.0) > 0
        t = tl.load(t_ptr + rows[:, None] * stride_t + cols[None, :], mask=ok & vac[None, :], other=0.0).to(tl.float32)
    return cols, col_ok, ok, z, t


@triton.jit
def _store_grad(g_ptr, g, rows, cols, ok, C, ACCUMULATE: tl.constexpr):
    """Write a tile of the gradient (added to what an earlier group wrote, with ``ACCUMULATE``)."""
    ptrs = g_ptr + rows[:, None] * C + cols[None, :]
    if ACCUMULATE:
        g += tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptrs, g, mask=ok)


@triton.jit
def _rows(z_ptr, t_ptr, y_ptr, tab_ptr, g_ptr, val_ptr, work_ptr,
          B, C, stride_z, stride_t, inv_T, ce_w, kd_gw, kd_vw,
          HAS_CE: tl.constexpr, HAS_KD: tl.constexpr, HAS_SUP: tl.constexpr, SUP_REF: tl.constexpr,
          GRAD: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """Each row's log-sum-exps (online over class blocks) and its value ce_w·(lse − a_y) +
    kd_vw·KL; with ``GRAD`` (no suppression) the same program then writes the row's gradient (its
    second read of the row hits the cache); with the suppression, its column (max, Σexp) partials
    and the row statistics ``_grad`` needs (``work``: 3·B statistics, then 2·P·C partials).
    ``tab``: per class, the CE offset, the vacant mask, the suppression's shift and coefficient."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    zero = tl.zeros([BLOCK_B], dtype=tl.float32)
    m_ce, s_ce = zero + NEG_INF, zero
    m_z, s_z, m_t, s_t, acc = zero + NEG_INF, zero, zero + NEG_INF, zero, zero
    for c0 in range(0, C, BLOCK_C):
        cols, col_ok, ok, z, t = _tile(z_ptr, t_ptr, tab_ptr, rows, row_ok, c0, C, stride_z, stride_t, HAS_KD, BLOCK_C)
        if HAS_CE:
            off = tl.load(tab_ptr + cols, mask=col_ok, other=0.0)
            m_ce, s_ce = _online(m_ce, s_ce, tl.where(ok, z + off[None, :], NEG_INF))
        if HAS_KD:
            vac = tl.load(tab_ptr + C + cols, mask=col_ok, other=0.0) > 0
            kd_ok = ok & vac[None, :]
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
            k = tl.load(tab_ptr + 2 * C + cols, mask=col_ok, other=0.0)
            own = y[:, None] == cols[None, :]
            if SUP_REF:  # the target's entry is e^0 = 1 (the published code)
                a = tl.where(own, 0.0, z + k[None, :])
            else:  # the paper: no entry for the target
                a = tl.where(own, NEG_INF, z + k[None, :])
            a = tl.where(ok, a, NEG_INF)
            bmax = tl.max(a, 0)
            shift = tl.where(bmax == NEG_INF, 0.0, bmax)
            bsum = tl.sum(tl.exp(a - shift[None, :]), 0)
            part = work_ptr + 3 * B + pid * C + cols
            tl.store(part, bmax, mask=col_ok)
            tl.store(part + tl.num_programs(0) * C, bsum, mask=col_ok)
    value = zero
    lse = m_ce + tl.log(s_ce)
    lz = m_z + tl.log(s_z)
    lt = m_t + tl.log(s_t)
    if HAS_CE:
        a_y = tl.load(z_ptr + rows * stride_z + y, mask=row_ok, other=0.0).to(tl.float32) \
            + tl.load(tab_ptr + y, mask=row_ok, other=0.0)
        value += ce_w * (lse - a_y)
    if HAS_KD:
        value += kd_vw * (acc / s_t - lt + lz)
    if ACCUMULATE:
        value += tl.load(val_ptr + rows, mask=row_ok, other=0.0)
    tl.store(val_ptr + rows, value, mask=row_ok)
    if GRAD:
        for c0 in range(0, C, BLOCK_C):
            cols, col_ok, ok, z, t = _tile(z_ptr, t_ptr, tab_ptr, rows, row_ok, c0, C, stride_z, stride_t, HAS_KD,
                                           BLOCK_C)
            g = _ce_kd_grad(z, t, y, cols, ok, col_ok, tab_ptr, C, lse, lz, lt, inv_T, ce_w, kd_gw, HAS_CE, HAS_KD)
            _store_grad(g_ptr, g, rows, cols, ok, C, ACCUMULATE)
    else:
        tl.store(work_ptr + rows, lse, mask=row_ok)
        tl.store(work_ptr + B + rows, lz, mask=row_ok)
        tl.store(work_ptr + 2 * B + rows, lt, mask=row_ok)


@triton.jit
def _cols(work_ptr, tab_ptr, val_ptr, P, B, C, log_B,
          ACCUMULATE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """The suppression's column log-sum-exps from ``_rows``' P per-program (max, Σexp) partials
    (merged exactly), its coefficients (0 where a column is empty) and per-column values
    coef_c·(lse_c − log B), written after the B row values. Its lse and coef go after the partials."""
    part_ptr = work_ptr + 3 * B
    col_ptr = part_ptr + 2 * P * C
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    m = tl.zeros([BLOCK_C], dtype=tl.float32) + NEG_INF
    s = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        ok = (ps < P)[:, None] & col_ok[None, :]
        at = part_ptr + ps[:, None] * C + cols[None, :]
        pmax = tl.load(at, mask=ok, other=NEG_INF)
        psum = tl.load(at + P * C, mask=ok, other=0.0)
        m_new = tl.maximum(m, tl.max(pmax, 0))
        shift = tl.where(m_new == NEG_INF, 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(psum * tl.exp(pmax - shift[None, :]), 0)
        m = m_new
    valid = s > 0
    lse = tl.where(valid, m + tl.log(s), 0.0)
    coef = tl.where(valid, tl.load(tab_ptr + 3 * C + cols, mask=col_ok, other=0.0), 0.0)
    tl.store(col_ptr + cols, lse, mask=col_ok)
    tl.store(col_ptr + C + cols, coef, mask=col_ok)
    value = coef * (lse - log_B)
    if ACCUMULATE:
        value += tl.load(val_ptr + B + cols, mask=col_ok, other=0.0)
    tl.store(val_ptr + B + cols, value, mask=col_ok)


@triton.jit
def _grad(z_ptr, t_ptr, y_ptr, tab_ptr, g_ptr, work_ptr, P,
          B, C, stride_z, stride_t, inv_T, ce_w, kd_gw,
          HAS_CE: tl.constexpr, HAS_KD: tl.constexpr, ACCUMULATE: tl.constexpr,
          BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """With the suppression: the CE and KD gradient of ``_ce_kd_grad`` + coef_c·e^{A_ic − lse_c}
    off the targets, from ``_rows``' row statistics and ``_cols``' column log-sum-exps."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    col_ptr = work_ptr + 3 * B + 2 * P * C
    lse = tl.load(work_ptr + rows, mask=row_ok, other=0.0)
    lz = tl.load(work_ptr + B + rows, mask=row_ok, other=0.0)
    lt = tl.load(work_ptr + 2 * B + rows, mask=row_ok, other=0.0)
    for c0 in range(0, C, BLOCK_C):
        cols, col_ok, ok, z, t = _tile(z_ptr, t_ptr, tab_ptr, rows, row_ok, c0, C, stride_z, stride_t, HAS_KD, BLOCK_C)
        g = _ce_kd_grad(z, t, y, cols, ok, col_ok, tab_ptr, C, lse, lz, lt, inv_T, ce_w, kd_gw, HAS_CE, HAS_KD)
        k = tl.load(tab_ptr + 2 * C + cols, mask=col_ok, other=0.0)
        lse_c = tl.load(col_ptr + cols, mask=col_ok, other=0.0)
        coef = tl.load(col_ptr + C + cols, mask=col_ok, other=0.0)
        sup = coef[None, :] * tl.exp(z + k[None, :] - lse_c[None, :])
        g += tl.where(y[:, None] == cols[None, :], 0.0, sup)
        _store_grad(g_ptr, g, rows, cols, ok, C, ACCUMULATE)


class _Launch(NamedTuple):
    """One group of parts (at most one of each kind) as the kernels take it at one batch size."""

    table: torch.Tensor  # float32 (4, C): CE offset, vacant mask, suppression shift, suppression coefficient
    scalars: tuple[float, float, float, float]  # 1/T, the CE's weight/B, the KD's gradient and value weights
    rows: dict  # ``_rows``' constexpr arguments
    cols: dict | None  # ``_cols``' constexpr arguments (a suppression), else None
    grad: dict  # ``_grad``'s constexpr arguments


class _Recipe(NamedTuple):
    """Everything one call of :func:`objective` derives from its parts and shape, made once."""

    launches: tuple[_Launch, ...]
    P: int  # programs of ``_rows`` and ``_grad`` (row blocks)
    kd: bool  # reads the teacher
    sup: bool  # some group has a suppression: column values, work buffer
    work: int  # float32 elements of the suppression's work buffer
    log_B: float


def _groups(parts: Sequence[Part]) -> list[tuple[OffsetCE | None, VacantKD | None, Suppression | None]]:
    """Parts in groups of at most one of each kind (fedvls is one group)."""
    ces = [p for p in parts if isinstance(p, OffsetCE)]
    kds = [p for p in parts if isinstance(p, VacantKD)]
    sups = [p for p in parts if isinstance(p, Suppression)]
    n = max(len(ces), len(kds), len(sups), 1)
    pick = lambda xs, i: xs[i] if i < len(xs) else None  # noqa: E731
    return [(pick(ces, i), pick(kds, i), pick(sups, i)) for i in range(n)]


def _table(ce: OffsetCE | None, kd: VacantKD | None, sup: Suppression | None, C: int, device) -> torch.Tensor:
    table = torch.zeros(4, C, dtype=torch.float64)
    if ce is not None and ce.offset is not None:
        table[0] = ce.offset.vec
    if kd is not None:
        table[1, kd.vacant.vec] = 1.0
    if sup is not None:
        table[2] = sup.shift(C)
        table[3] = sup.weight * sup.scale * sup.p.vec
    return table.to(device=device, dtype=torch.float32)


@functools.lru_cache(maxsize=64)
def _recipe(parts: tuple[Part, ...], B: int, C: int, device: torch.device, block_c: int | None) -> _Recipe:
    """What the kernels need of ``parts`` at B×C on ``device``, derived once: a training loop calls
    the same objective on the same shape every step, so a step pays one cache look-up."""
    BLOCK_B, BLOCK_C = blocks(B, C, block_c)
    P = -(-B // BLOCK_B)
    launches, seen_sup = [], False
    for i, (ce, kd, sup) in enumerate(_groups(parts)):
        inv_T = 1.0 if kd is None else 1.0 / kd.T
        kd_gw = 0.0 if kd is None else kd.weight * kd.T / B  # the KD's gradient weight; its value's is ·T
        common = dict(HAS_CE=ce is not None, HAS_KD=kd is not None, ACCUMULATE=i > 0, BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C)
        rows = common | dict(HAS_SUP=sup is not None, SUP_REF=sup is not None and sup.variant == "reference",
                             GRAD=sup is None)
        cols = None if sup is None else dict(ACCUMULATE=seen_sup, BLOCK_P=TILE // 2 // COL_BLOCK, BLOCK_C=COL_BLOCK)
        launches.append(_Launch(_table(ce, kd, sup, C, device),
                                (inv_T, 0.0 if ce is None else ce.weight / B, kd_gw, kd_gw * (1.0 if kd is None else kd.T)),
                                rows, cols, common))
        seen_sup = seen_sup or sup is not None
    return _Recipe(tuple(launches), P, any(g.rows["HAS_KD"] for g in launches), seen_sup,
                   3 * B + 2 * P * C + 2 * C, math.log(B))


def objective(logits: torch.Tensor, targets: torch.Tensor, teacher_logits: torch.Tensor | None,
              parts: Sequence[Part], block_c: int | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(value, gradient, 1.0). Per group ONE launch, ``_rows`` (values and gradient), or with a
    suppression three (``_rows``, ``_cols``, ``_grad``); the value is one sum over the rows' (and
    the columns') values. The gradient comes in the logits' dtype (float32 when groups add up)."""
    if logits.dtype == torch.float64:
        return cpu.objective(logits, targets, teacher_logits, parts)
    z = logits if logits.stride(1) == 1 else logits.contiguous()
    B, C = z.shape
    dev = z.device
    r = _recipe(tuple(parts), B, C, dev, block_c)
    t, stride_t = z, 0
    if r.kd:
        if teacher_logits is None:
            raise ValueError("vacant_kd needs teacher_logits")
        t = teacher_logits if teacher_logits.stride(1) == 1 else teacher_logits.contiguous()
        stride_t = t.stride(0)
    grad = torch.empty((B, C), dtype=z.dtype if len(r.launches) == 1 else torch.float32, device=dev)
    values = torch.empty(B + C if r.sup else B, dtype=torch.float32, device=dev)
    # the suppression's row statistics (3·B), column partials (2·P·C), column lse and coefficients (2·C)
    work = torch.empty(r.work, dtype=torch.float32, device=dev) if r.sup else values
    y = targets if targets.is_contiguous() else targets.contiguous()
    for g in r.launches:
        inv_T, ce_w, kd_gw, kd_vw = g.scalars
        _rows[(r.P,)](z, t, y, g.table, grad, values, work, B, C, z.stride(0), stride_t, inv_T, ce_w, kd_gw, kd_vw,
                      **g.rows)
        if g.cols is not None:
            _cols[(-(-C // COL_BLOCK),)](work, g.table, values, r.P, B, C, r.log_B, **g.cols)
            _grad[(r.P,)](z, t, y, g.table, grad, work, r.P, B, C, z.stride(0), stride_t, inv_T, ce_w, kd_gw, **g.grad)
    return values.sum(), grad, 1.0


@triton.jit
def _sgb(z_ptr, y_ptr, wpos_ptr, wneg_ptr, g_ptr, row_ptr, part_ptr, B, C, stride_z, inv_B,
         SOFTMAX: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """g' = (σ(z) − onehot)/B re-weighted (w_pos/B at the target, w_neg/B elsewhere; softmax base:
    softmax(z)), each row's value (Σ softplus − z_y, or lse − z_y)/B, and the column partials
    Σ_rows |g'| on (``part``: P·C) and off (the next P·C) the targets."""
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
        wpos = tl.load(wpos_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * inv_B
        wneg = tl.load(wneg_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * inv_B
        g = tl.where(own, (prob - 1.0) * wpos[None, :], prob * wneg[None, :])
        g = tl.where(ok, g, 0.0)
        tl.store(g_ptr + rows[:, None] * C + cols[None, :], g, mask=ok)
        part = part_ptr + pid * C + cols
        tl.store(part, tl.sum(tl.where(own, tl.abs(g), 0.0), 0), mask=col_ok)
        tl.store(part + tl.num_programs(0) * C, tl.sum(tl.where(own, 0.0, tl.abs(g)), 0), mask=col_ok)
    row = softplus
    if SOFTMAX:
        row = lse
    z_y = tl.load(z_ptr + rows * stride_z + y, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(row_ptr + rows, (row - z_y) * inv_B, mask=row_ok)


def sgb(logits: torch.Tensor, targets: torch.Tensor, w_pos: torch.Tensor, w_neg: torch.Tensor, base: str,
        block_c: int | None = None):
    """(value, gradient in the logits' dtype, pos, neg) of :func:`.cpu.sgb`: one launch, the value
    one sum of the rows' values, pos and neg one float64 sum of the row blocks' column partials."""
    if logits.dtype == torch.float64:
        return cpu.sgb(logits, targets, w_pos, w_neg, base)
    z = logits if logits.stride(1) == 1 else logits.contiguous()
    B, C = z.shape
    BLOCK_B, BLOCK_C = blocks(B, C, block_c)
    P = -(-B // BLOCK_B)
    grad = torch.empty((B, C), dtype=z.dtype, device=z.device)
    row = torch.empty(B, dtype=torch.float32, device=z.device)
    partials = torch.empty((2, P, C), dtype=torch.float32, device=z.device)
    _sgb[(P,)](z, targets if targets.is_contiguous() else targets.contiguous(), w_pos, w_neg, grad, row, partials,
               B, C, z.stride(0), 1.0 / B, SOFTMAX=base == "softmax", BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C)
    pos, neg = partials.sum(1, dtype=torch.float64).unbind()
    return row.sum(), grad, pos, neg


@triton.jit
def _pair_tile(z_ptr, so_ptr, co_ptr, rows, row_ok, seg, c0, C, stride_z, BLOCK_C: tl.constexpr):
    """One class block of the pair's rows: its columns, mask, logits, server offsets and each
    row's client offsets (float32; the offsets may come in float64)."""
    cols = c0 + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    ok = row_ok[:, None] & col_ok[None, :]
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    so = tl.load(so_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    co = tl.load(co_ptr + seg[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    return cols, ok, z, so, co


@triton.jit
def _pair_rows(z_ptr, y_ptr, seg_ptr, so_ptr, co_ptr, scale_ptr, stat_ptr, val_ptr, B, C, stride_z, inv_B,
               BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row log-sum-exps of z + o_server and z + o_client(row) (``stat``: B, then B) and the rows'
    values (``val``: (lse_s − a_y)/B, then (lse_c − a_y)/B_k), one read of the logits."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    y = tl.load(y_ptr + rows, mask=row_ok, other=0)
    seg = tl.load(seg_ptr + rows, mask=row_ok, other=0)
    zero = tl.zeros([BLOCK_B], dtype=tl.float32)
    m_s, s_s, m_c, s_c = zero + NEG_INF, zero, zero + NEG_INF, zero
    for c0 in range(0, C, BLOCK_C):
        cols, ok, z, so, co = _pair_tile(z_ptr, so_ptr, co_ptr, rows, row_ok, seg, c0, C, stride_z, BLOCK_C)
        m_s, s_s = _online(m_s, s_s, tl.where(ok, z + so[None, :], NEG_INF))
        m_c, s_c = _online(m_c, s_c, tl.where(ok, z + co, NEG_INF))
    lse_s = m_s + tl.log(s_s)
    lse_c = m_c + tl.log(s_c)
    z_y = tl.load(z_ptr + rows * stride_z + y, mask=row_ok, other=0.0).to(tl.float32)
    so_y = tl.load(so_ptr + y, mask=row_ok, other=0.0).to(tl.float32)
    co_y = tl.load(co_ptr + seg * C + y, mask=row_ok, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    tl.store(stat_ptr + rows, lse_s, mask=row_ok)
    tl.store(stat_ptr + B + rows, lse_c, mask=row_ok)
    tl.store(val_ptr + rows, (lse_s - z_y - so_y) * inv_B, mask=row_ok)
    tl.store(val_ptr + B + rows, (lse_c - z_y - co_y) * scale, mask=row_ok)


@triton.jit
def _pair_grad(z_ptr, y_ptr, seg_ptr, so_ptr, co_ptr, scale_ptr, stat_ptr, up_s_ptr, up_c_ptr, g_ptr,
               B, C, stride_z, stride_up, inv_B, SERVER: tl.constexpr, CLIENTS: tl.constexpr,
               BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """The backward, recomputed from the logits and ``_pair_rows``' log-sum-exps: u_s·(softmax_s −
    onehot)/B + u_k·(softmax_c − onehot)/B_k, each term only when its loss was backpropagated
    (the upstream gradients are read on the device: no host sync)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    seg = tl.load(seg_ptr + rows, mask=row_ok, other=0)
    lse_s = tl.load(stat_ptr + rows, mask=row_ok, other=0.0)
    lse_c = tl.load(stat_ptr + B + rows, mask=row_ok, other=0.0)
    if SERVER:
        u_s = tl.load(up_s_ptr).to(tl.float32) * inv_B
    if CLIENTS:
        u_c = tl.load(up_c_ptr + seg * stride_up, mask=row_ok, other=0.0).to(tl.float32) \
            * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    for c0 in range(0, C, BLOCK_C):
        cols, ok, z, so, co = _pair_tile(z_ptr, so_ptr, co_ptr, rows, row_ok, seg, c0, C, stride_z, BLOCK_C)
        onehot = tl.where(y[:, None] == cols[None, :], 1.0, 0.0)
        g = tl.zeros_like(z)
        if SERVER:
            g += (tl.exp(z + so[None, :] - lse_s[:, None]) - onehot) * u_s
        if CLIENTS:
            g += (tl.exp(z + co - lse_c[:, None]) - onehot) * u_c[:, None]
        tl.store(g_ptr + rows[:, None] * C + cols[None, :], g, mask=ok)


@functools.lru_cache(maxsize=8)  # the matrix is (K+1)·2B floats: 0.4 MB at K = 10, B = 4096
def _segments(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (client sizes, device), made once: each row's client (int32), each row's 1/B_k, and the
    (K+1)×2B matrix that sums the rows' values into the server's loss and each client's."""
    B, K = sum(sizes), len(sizes)
    counts = torch.tensor(sizes)
    seg = torch.repeat_interleave(torch.arange(K), counts)
    sums = torch.zeros(K + 1, 2 * B)
    sums[0, :B] = 1.0
    sums[1 + seg, B + torch.arange(B)] = 1.0
    to = dict(device=device)
    return seg.to(dtype=torch.int32, **to), (1.0 / counts.float()).repeat_interleave(counts).to(**to), sums.to(**to)


class PairState(NamedTuple):
    """What the pair's backward needs beside the saved logits, targets and row statistics."""

    server_offset: torch.Tensor
    client_offsets: torch.Tensor
    seg: torch.Tensor
    scale: torch.Tensor
    block_c: int | None


def offset_ce_pair(logits: torch.Tensor, targets: torch.Tensor, server_offset: torch.Tensor,
                   client_offsets: torch.Tensor, sizes: Sequence[int], block_c: int | None = None):
    """(server value, client values, saved tensors, state) of the pair (the protocol of
    :func:`.cpu.offset_ce_pair`): ONE launch reads the logits for both losses' row statistics and
    values; the backward (:func:`offset_ce_pair_grad`) reads them again and writes the gradient —
    nothing B×C is written or kept between the two."""
    if logits.dtype == torch.float64:
        return cpu.offset_ce_pair(logits, targets, server_offset, client_offsets, sizes)
    z = logits if logits.stride(1) == 1 else logits.contiguous()
    B, C = z.shape
    dev = z.device
    BLOCK_B, BLOCK_C = blocks(B, C, block_c)
    seg, scale, sums = _segments(tuple(sizes), dev)
    so = server_offset if server_offset.is_contiguous() else server_offset.contiguous()
    co = client_offsets if client_offsets.is_contiguous() else client_offsets.contiguous()
    y = targets if targets.is_contiguous() else targets.contiguous()
    stats = torch.empty(2 * B, dtype=torch.float32, device=dev)
    values = torch.empty(2 * B, dtype=torch.float32, device=dev)
    _pair_rows[(-(-B // BLOCK_B),)](z, y, seg, so, co, scale, stats, values, B, C, z.stride(0), 1.0 / B,
                                   BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C)
    losses = torch.mv(sums, values)  # [server, client 1..K]: a fixed summation order (deterministic)
    return losses[0], losses[1:], (z, y, stats), PairState(so, co, seg, scale, block_c)


def offset_ce_pair_grad(saved: tuple[torch.Tensor, ...], state: PairState, up_server: torch.Tensor | None,
                        up_clients: torch.Tensor | None) -> torch.Tensor:
    """The gradient w.r.t. the logits of up_server·server + up_clients·clients (either may be None),
    in the logits' dtype: one launch."""
    if not isinstance(state, PairState):  # float64 logits ran the torch path
        return cpu.offset_ce_pair_grad(saved, state, up_server, up_clients)
    z, y, stats = saved
    B, C = z.shape
    BLOCK_B, BLOCK_C = blocks(B, C, state.block_c)
    grad = torch.empty_like(z)
    _pair_grad[(-(-B // BLOCK_B),)](z, y, state.seg, state.server_offset, state.client_offsets, state.scale, stats,
                                   stats if up_server is None else up_server,
                                   stats if up_clients is None else up_clients, grad, B, C, z.stride(0),
                                   0 if up_clients is None else up_clients.stride(0), 1.0 / B,
                                   SERVER=up_server is not None, CLIENTS=up_clients is not None,
                                   BLOCK_B=BLOCK_B, BLOCK_C=BLOCK_C)
    return grad

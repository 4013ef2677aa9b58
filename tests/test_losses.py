"""Loss terms of SPEC §2: properties, float64 loop references, the registry and composition.

The references below are written independently of fedlt's vectorised code, as explicit Python
loops over samples and classes on float64 scalars; their gradients come from autograd through
those loops.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_problems import loss_problems, value_and_grad

import fedlt.losses as L
from fedlt.errors import FedltError

SETTINGS = settings(deadline=None, max_examples=50)
F64 = torch.float64


# -- random problems ------------------------------------------------------------------------------
@st.composite
def problems(draw, counts_kind=None, min_classes=2):
    """Random (logits, teacher, targets, counts): zero counts, a single present class, ±1e4."""
    logits, teacher, targets, counts = draw(loss_problems(counts_kind, min_classes))
    return logits, teacher, targets, torch.tensor(counts, dtype=F64)



def close(a, b, tol=1e-8):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# -- float64 loop references ---------------------------------------------------------------------
def lse(xs):
    m = max(float(x.detach()) if torch.is_tensor(x) else float(x) for x in xs)
    return m + torch.log(sum(torch.exp(x - m) for x in xs))


def ref_ce_offset(Z, y, offsets, keep=None):
    """(1/B) Σ_i [log Σ_{c∈keep} e^{z_ic+o_c} − (z_iy+o_y)]."""
    B, C = Z.shape
    keep = range(C) if keep is None else keep
    total = 0
    for i in range(B):
        row = [Z[i, c] + offsets[c] for c in keep]
        total = total + lse(row) - (Z[i, int(y[i])] + offsets[int(y[i])])
    return total / B


def ref_ce(Z, y):
    return ref_ce_offset(Z, y, [0.0] * Z.shape[1])


def ref_logit_adjust(Z, y, n, tau=1.0, eps=1e-12):
    total = float(sum(n))
    return ref_ce_offset(Z, y, [tau * math.log(float(nc) / total + eps) for nc in n])


def ref_fedlc(Z, y, n, tau=0.5, form="code"):
    B, C = Z.shape
    present = [c for c in range(C) if n[c] > 0]
    off = {c: -tau * float(n[c]) ** -0.25 for c in present}
    total = 0
    for i in range(B):
        yi = int(y[i])
        pool = present if form == "code" else [c for c in present if c != yi]
        if not pool:
            continue  # paper form: an empty denominator contributes 0
        total = total + lse([Z[i, c] + off[c] for c in pool]) - (Z[i, yi] + off[yi])
    return total / B if not isinstance(total, int) else Z.sum() * 0


def ref_vacant_kd(Z, Tl, n, T=1.0):
    B, C = Z.shape
    vac = [c for c in range(C) if n[c] == 0]
    if len(vac) <= 1:
        return Z.sum() * 0
    total = 0
    for i in range(B):
        lz = lse([Z[i, c] / T for c in vac])
        lt = lse([Tl[i, c] / T for c in vac])
        for c in vac:
            log_q = float(Tl[i, c] / T - lt)
            total = total + math.exp(log_q) * (log_q - (Z[i, c] / T - lz))
    return total * T * T / B


def ref_logit_suppression(Z, y, n, variant="reference"):
    B, C = Z.shape
    p = [float(nc) / float(sum(n)) for nc in n]
    total = 0
    for c in range(C):
        if variant == "reference":
            A = [Z[i, c] - math.log(p[c] + 1e-9) + math.log(1 / C) if int(y[i]) != c
                 else torch.zeros((), dtype=F64) for i in range(B)]
            total = total + 0.005 * p[c] * (lse(A) - math.log(B))
        else:
            others = [Z[i, c] for i in range(B) if int(y[i]) != c]
            if others:
                total = total + p[c] * (lse(others) - math.log(B))
    return total if not isinstance(total, int) else Z.sum() * 0


CASES = {
    "ce": (lambda n: L.CE(), lambda Z, T, y, n: ref_ce(Z, y)),
    "logit_adjust": (lambda n: L.LogitAdjust(class_counts=n),
                     lambda Z, T, y, n: ref_logit_adjust(Z, y, n)),
    "logit_adjust(tau=0.7,eps=1e-9)": (
        lambda n: L.LogitAdjust(class_counts=n, tau=0.7, eps=1e-9),
        lambda Z, T, y, n: ref_logit_adjust(Z, y, n, 0.7, 1e-9)),
    "fedlc": (lambda n: L.FedLC(class_counts=n), lambda Z, T, y, n: ref_fedlc(Z, y, n)),
    "fedlc(tau=2,paper)": (lambda n: L.FedLC(class_counts=n, tau=2.0, form="paper"),
                           lambda Z, T, y, n: ref_fedlc(Z, y, n, 2.0, "paper")),
    "vacant_kd": (lambda n: L.VacantKD(class_counts=n),
                  lambda Z, T, y, n: ref_vacant_kd(Z, T, n)),
    "vacant_kd(T=3)": (lambda n: L.VacantKD(class_counts=n, T=3.0),
                       lambda Z, T, y, n: ref_vacant_kd(Z, T, n, 3.0)),
    "logit_suppression": (lambda n: L.LogitSuppression(class_counts=n),
                          lambda Z, T, y, n: ref_logit_suppression(Z, y, n)),
    "logit_suppression(paper)": (
        lambda n: L.LogitSuppression(class_counts=n, variant="paper"),
        lambda Z, T, y, n: ref_logit_suppression(Z, y, n, "paper")),
    "fedvls(lam=0.3)": (
        lambda n: L.FedVLS(class_counts=n, lam=0.3),
        lambda Z, T, y, n: ref_logit_adjust(Z, y, n, 1.0, 1e-9) + 0.3 * ref_vacant_kd(Z, T, n)
        + ref_logit_suppression(Z, y, n)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@SETTINGS
@given(problem=problems())
def test_term_matches_float64_loop_reference(case, problem):
    logits, teacher, y, n = problem
    make, ref = CASES[case]
    term = make(n)
    got_v, got_g = value_and_grad(term, logits, y, teacher_logits=teacher)
    exp_v, exp_g = value_and_grad(lambda Z: ref(Z, teacher, y, n.tolist()), logits)
    close(got_v, exp_v)
    close(got_g, exp_g)


# -- properties ---------------------------------------------------------------------------------
@pytest.mark.parametrize("term", [L.LogitAdjust, L.FedLC])
@SETTINGS
@given(problem=problems(counts_kind="equal"), tau=st.floats(0.0, 3.0))
def test_logit_adjust_and_fedlc_with_equal_counts_are_ce(term, problem, tau):
    logits, _, y, n = problem
    ce = value_and_grad(L.CE(), logits, y)
    got = value_and_grad(term(class_counts=n, tau=tau), logits, y)
    close(got[0], ce[0], 1e-10)
    close(got[1], ce[1], 1e-10)


SHIFT_INVARIANT = {
    "ce": lambda n: L.CE(),
    "logit_adjust": lambda n: L.LogitAdjust(class_counts=n, tau=0.8),
    "fedlc": lambda n: L.FedLC(class_counts=n),
    "vacant_kd": lambda n: L.VacantKD(class_counts=n, T=2.0),
}


@pytest.mark.parametrize("name", sorted(SHIFT_INVARIANT))
@SETTINGS
@given(problem=problems(), seed=st.integers(0, 2**31 - 1))
def test_row_constant_shift_invariance(name, problem, seed):
    logits, teacher, y, n = problem
    term = SHIFT_INVARIANT[name](n)
    shift = torch.randn(logits.shape[0], 1, generator=torch.Generator().manual_seed(seed),
                        dtype=F64) * 100
    a = value_and_grad(term, logits, y, teacher_logits=teacher)
    b = value_and_grad(term, logits + shift, y, teacher_logits=teacher)
    tol = 1e-9 * (1 + float(logits.abs().max()))
    close(a[0], b[0], tol)
    close(a[1], b[1], tol)


def test_shift_invariance_test_can_fail():
    # logit_suppression is not shift invariant; the same comparison must notice.
    n = torch.tensor([3.0, 1.0, 0.0])
    z = torch.randn(4, 3, dtype=F64)
    y = torch.tensor([0, 1, 0, 0])
    term = L.LogitSuppression(class_counts=n)
    assert not torch.allclose(term(z, y), term(z + 5.0, y))


@SETTINGS
@given(problem=problems())
def test_vacant_kd_zero_when_at_most_one_vacant_or_student_is_teacher(problem):
    logits, teacher, y, n = problem
    kd = L.VacantKD(class_counts=n, T=1.5)
    if int((n == 0).sum()) <= 1:
        assert not kd.needs_teacher
        assert kd(logits, y).item() == 0.0
        assert kd(logits, y, teacher_logits=teacher).item() == 0.0
    else:
        assert kd.needs_teacher
    v, g = value_and_grad(kd, logits, y, teacher_logits=logits.clone())
    assert v.item() == 0.0
    close(g, torch.zeros_like(g), 1e-12)  # zero up to rounding in Σq = 1


def test_vacant_kd_positive_when_student_differs():
    n = torch.tensor([5.0, 0, 0, 0])
    z, t = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    assert L.VacantKD(class_counts=n)(z, torch.zeros(3, dtype=torch.long), teacher_logits=t) > 0


@SETTINGS
@given(problem=problems(), form=st.sampled_from(["code", "paper"]))
def test_fedlc_zero_count_classes_get_probability_exactly_zero(problem, form):
    logits, _, y, n = problem
    term = L.FedLC(class_counts=n, tau=0.5, form=form)
    absent = n == 0
    probs = torch.softmax(term.adjusted_logits(logits), dim=1)
    assert bool((probs[:, absent] == 0).all())
    assert bool(torch.isfinite(probs).all())
    _, g = value_and_grad(term, logits, y)
    assert bool((g[:, absent] == 0).all())


def test_fedlc_rejects_target_of_a_zero_count_class():
    term = L.FedLC(class_counts=[4, 0, 2])
    with pytest.raises(FedltError, match="class_counts 0"):
        term(torch.zeros(2, 3), torch.tensor([0, 1]))


def test_logit_adjust_zero_count_offset_is_finite():
    term = L.LogitAdjust(class_counts=[10, 0])
    off = term.adjusted_logits(torch.zeros(1, 2, dtype=F64))[0]
    assert math.isclose(off[1].item(), math.log(1e-12), rel_tol=1e-9)  # ≈ −27.6
    assert torch.isfinite(off).all()


LOGIT_TERMS = {
    "ce": lambda n: L.CE(),
    "logit_adjust": lambda n: L.LogitAdjust(class_counts=n),
    "fedlc": lambda n: L.FedLC(class_counts=n),
    "fedlc_paper": lambda n: L.FedLC(class_counts=n, form="paper"),
    "vacant_kd": lambda n: L.VacantKD(class_counts=n),
    "logit_suppression": lambda n: L.LogitSuppression(class_counts=n),
    "logit_suppression_paper": lambda n: L.LogitSuppression(class_counts=n, variant="paper"),
    "fedvls": lambda n: L.FedVLS(class_counts=n),
    "sgb_sigmoid": lambda n: L.SGB(num_classes=len(n)),
    "sgb_softmax": lambda n: L.SGB(base="softmax", num_classes=len(n)),
}


@SETTINGS
@given(problem=problems(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_every_loss_and_gradient_is_finite(problem, dtype):
    logits, teacher, y, n = problem
    for name, make in LOGIT_TERMS.items():
        term = make(n)
        for _ in range(3):  # stateful terms move away from their initial weights
            v, g = value_and_grad(term, logits.to(dtype), y, teacher_logits=teacher.to(dtype))
            assert torch.isfinite(v), name
            assert bool(torch.isfinite(g).all()), name


# -- parameter validation -----------------------------------------------------------------------
@pytest.mark.parametrize("make, match", [
    (lambda: L.LogitAdjust(class_counts=[1, 2], tau=-1), "tau must be >= 0"),
    (lambda: L.LogitAdjust(class_counts=[1, 2], eps=0), "eps must be > 0"),
    (lambda: L.LogitAdjust(class_counts=[0, 0]), "all 0"),
    (lambda: L.LogitAdjust(class_counts=[1, -2]), ">= 0"),
    (lambda: L.LogitAdjust(class_counts=[[1, 2]]), "1-D"),
    (lambda: L.LogitAdjust(), "class_counts"),
    (lambda: L.FedLC(class_counts=[1, 2], form="printed"), "'code', 'paper'"),
    (lambda: L.FedLC(class_counts=[1, 2], tau=float("nan")), "finite"),
    (lambda: L.VacantKD(class_counts=[1, 0], T=0), "T must be > 0"),
    (lambda: L.LogitSuppression(class_counts=[1, 2], variant="ref"), "'reference', 'paper'"),
    (lambda: L.FedVLS(class_counts=[1, 2], lam=-0.1), "lam must be >= 0"),
    (lambda: L.SGB(base="focal"), "'sigmoid', 'softmax'"),
    (lambda: L.SGB(gamma=0), "gamma must be > 0"),
    (lambda: L.SGB(prior=[0.5, 1.5]), r"\[0, 1\]"),
    (lambda: L.SGB(prior=[0.5, 0.5], num_classes=3), "length 2"),
    (lambda: L.FedProx(global_params=[torch.zeros(2)], mu=-1), "mu must be >= 0"),
    (lambda: L.FedProx(global_params=None), "global_params"),
    (lambda: L.FedLC(class_counts=[1, 2], tua=1), "unexpected keyword argument 'tua'"),
])
def test_bad_parameters_raise_one_line_fedlt_errors(make, match):
    with pytest.raises(FedltError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_wrong_batch_shapes_raise_fedlt_errors():
    term = L.LogitAdjust(class_counts=[1, 2, 3])
    with pytest.raises(FedltError, match="logits have 4 classes"):
        term(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(FedltError, match="targets"):
        term(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(FedltError, match="teacher_logits"):
        L.VacantKD(class_counts=[1, 0, 0])(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))


# -- the registry ---------------------------------------------------------------------------------
def _setup(C=6, d=5):
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([40.0, 7, 0, 1, 0, 0])[:C]
    return dict(class_counts=counts, num_classes=C, classifier_weight=torch.randn(C, d, generator=gen),
                global_params=[torch.randn(3, 4, generator=gen), torch.randn(4, generator=gen)],
                seed=3, global_counts=torch.tensor([60.0, 30, 12, 5, 2, 1])[:C])


@pytest.mark.parametrize("name", L.list())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_registered_name_is_finite_on_extreme_inputs(name, dtype):
    setup = _setup()
    if name == "dpa":  # the prior analyzer: a function, not a loss term
        prior = L.create("dpa", classifier_weight=setup["classifier_weight"] * 1e4)
        assert torch.isfinite(prior).all() and math.isclose(prior.sum().item(), 1.0)
        return
    sig = inspect.signature(L.get(name)).parameters
    created = L.create(name, **{k: v for k, v in setup.items() if k in sig})
    assert isinstance(created, L.LossTerm)
    term = L.build(name, **setup)
    gen = torch.Generator().manual_seed(1)
    y = torch.tensor([0, 1, 3, 0, 0, 1, 3, 0])
    params = [(p + 1e2).requires_grad_(True) for p in setup["global_params"]]
    for _ in range(4):
        z = (torch.randint(0, 2, (8, 6), generator=gen) * 2e4 - 1e4).to(dtype).requires_grad_(True)
        t = (torch.randint(0, 2, (8, 6), generator=gen) * 2e4 - 1e4).to(dtype)
        value = term(z, y, teacher_logits=t, params=params)
        assert value.ndim == 0 and torch.isfinite(value)
        value.backward()
        grads = [g for g in [z.grad, *(p.grad for p in params)] if g is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert (z.grad is None) == (name == "fedprox")  # only fedprox ignores the logits

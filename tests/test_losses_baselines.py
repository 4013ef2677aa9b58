"""The papers' baseline loss terms (fedrs, fedntd, fedlmd, fedir, ldam, balanced_softmax, focal,
eqlv2, gcl) and post-hoc tau_norm, against independent float64 references written as explicit
Python loops over samples and classes (gradients by autograd through the loops)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_problems import loss_problems, value_and_grad

import fedlt.losses as L
import fedlt.posthoc
from fedlt.errors import FedltError

SETTINGS = settings(deadline=None, max_examples=15)
F64 = torch.float64


# -- random problems ------------------------------------------------------------------------------
@st.composite
def problems(draw, counts_kind=None):
    """(logits, teacher, targets, counts, global_counts): zero counts, one present class, ±1e4."""
    logits, teacher, targets, counts = draw(loss_problems(counts_kind, max_classes=6, max_batch=5))
    # The federation holds at least what this client holds, and may miss classes entirely.
    extra = draw(st.lists(st.integers(0, 200), min_size=len(counts), max_size=len(counts)))
    return logits, teacher, targets, counts, [n + e for n, e in zip(counts, extra)]



def close(a, b, tol=1e-8):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# -- float64 loop references ---------------------------------------------------------------------
def lse(xs):
    m = max(float(x.detach()) if torch.is_tensor(x) else float(x) for x in xs)
    return m + torch.log(sum(torch.exp(x - m) for x in xs))


def ref_ce_row(row, y):
    """−log softmax(row)[y] for a list of scalar tensors."""
    return lse(row) - row[y]


def ref_fedrs(Z, T, y, n, G, alpha=0.5, form="code"):
    B, C = Z.shape
    s = [alpha + (1 - alpha) * n[c] / max(n) if form == "code" else (1.0 if n[c] > 0 else alpha)
         for c in range(C)]
    return sum(ref_ce_row([s[c] * Z[i, c] for c in range(C)], int(y[i])) for i in range(B)) / B


def ref_distill(Z, T, y, tau, beta, major=()):
    """CE + beta·tau²·(1/B)·Σ_i KL over the teacher's pool (c ≠ y_i, c ∉ major) against the
    student's softmax over c ≠ y_i."""
    B, C = Z.shape
    ce, kl = 0, 0
    for i in range(B):
        yi = int(y[i])
        ce = ce + ref_ce_row([Z[i, c] for c in range(C)], yi)
        student = [c for c in range(C) if c != yi]
        teacher = [c for c in student if c not in major]
        if not teacher:
            continue
        lz = lse([Z[i, c] / tau for c in student])
        lt = lse([T[i, c] / tau for c in teacher])
        for c in teacher:
            log_q = float(T[i, c] / tau - lt)
            kl = kl + math.exp(log_q) * (log_q - (Z[i, c] / tau - lz))
    return ce / B + beta * tau * tau * kl / B


def ref_fedntd(Z, T, y, n, G, tau=1.0, beta=1.0):
    return ref_distill(Z, T, y, tau, beta)


def ref_fedlmd(Z, T, y, n, G, tau=1.0, beta=1.0):
    mean = sum(n) / len(n)
    return ref_distill(Z, T, y, tau, beta, major=[c for c in range(len(n)) if n[c] > mean])


def ref_weighted_mean(losses, weights, normalise):
    num = sum(w * l for w, l in zip(weights, losses))
    den = sum(weights) if normalise else len(losses)
    return num / den


def ref_fedir(Z, T, y, n, G, form="code"):
    B, C = Z.shape
    smallest = min(v for v in n if v > 0)
    w = [(G[c] / sum(G)) / ((n[c] if n[c] > 0 else smallest) / sum(n)) for c in range(C)]
    losses = [ref_ce_row([Z[i, c] for c in range(C)], int(y[i])) for i in range(B)]
    return ref_weighted_mean(losses, [w[int(y[i])] for i in range(B)], form == "code")


def ref_ldam(Z, T, y, n, G, max_margin=0.5, s=30.0, reweight=False, beta=0.9999):
    B, C = Z.shape
    present = [c for c in range(C) if n[c] > 0]
    biggest = max(n[c] ** -0.25 for c in present)
    m = [n[c] ** -0.25 * max_margin / biggest if n[c] > 0 else max_margin for c in range(C)]
    losses = []
    for i in range(B):
        yi = int(y[i])
        losses.append(ref_ce_row([s * (Z[i, c] - (m[c] if c == yi else 0.0)) for c in range(C)], yi))
    if not reweight:
        return sum(losses) / B
    raw = {c: (1 - beta) / (1 - beta ** n[c]) for c in present}
    total = sum(raw.values())
    w = {c: raw[c] / total * len(present) for c in present}
    return ref_weighted_mean(losses, [w[int(y[i])] for i in range(B)], True)


def ref_balanced_softmax(Z, T, y, n, G):
    B, C = Z.shape
    present = [c for c in range(C) if n[c] > 0]
    total = 0
    for i in range(B):
        yi = int(y[i])
        total = total + lse([Z[i, c] + math.log(n[c]) for c in present]) - (Z[i, yi] + math.log(n[yi]))
    return total / B


def ref_focal(Z, T, y, n, G, gamma=2.0):
    B, C = Z.shape
    total = 0
    for i in range(B):
        ce = ref_ce_row([Z[i, c] for c in range(C)], int(y[i]))
        total = total + (1 - torch.exp(-ce)) ** gamma * ce
    return total / B


CASES = {
    "fedrs": (lambda n, G: L.FedRS(class_counts=n), ref_fedrs),
    "fedrs(alpha=0.2,paper)": (lambda n, G: L.FedRS(class_counts=n, alpha=0.2, form="paper"),
                               lambda *a: ref_fedrs(*a, alpha=0.2, form="paper")),
    "fedntd": (lambda n, G: L.FedNTD(), ref_fedntd),
    "fedntd(tau=3,beta=0.1)": (lambda n, G: L.FedNTD(tau=3.0, beta=0.1),
                               lambda *a: ref_fedntd(*a, tau=3.0, beta=0.1)),
    "fedlmd": (lambda n, G: L.FedLMD(class_counts=n), ref_fedlmd),
    "fedlmd(tau=2,beta=0.5)": (lambda n, G: L.FedLMD(class_counts=n, tau=2.0, beta=0.5),
                               lambda *a: ref_fedlmd(*a, tau=2.0, beta=0.5)),
    "fedir": (lambda n, G: L.FedIR(class_counts=n, global_counts=G), ref_fedir),
    "fedir(paper)": (lambda n, G: L.FedIR(class_counts=n, global_counts=G, form="paper"),
                     lambda *a: ref_fedir(*a, form="paper")),
    "ldam": (lambda n, G: L.LDAM(class_counts=n), ref_ldam),
    "ldam(reweight)": (lambda n, G: L.LDAM(class_counts=n, reweight=True),
                       lambda *a: ref_ldam(*a, reweight=True)),
    "ldam(m=1,s=2,reweight,beta=0.9)": (
        lambda n, G: L.LDAM(class_counts=n, max_margin=1.0, s=2.0, reweight=True, beta=0.9),
        lambda *a: ref_ldam(*a, max_margin=1.0, s=2.0, reweight=True, beta=0.9)),
    "balanced_softmax": (lambda n, G: L.BalancedSoftmax(class_counts=n), ref_balanced_softmax),
    "focal": (lambda n, G: L.Focal(), ref_focal),
    "focal(gamma=0)": (lambda n, G: L.Focal(gamma=0.0), lambda *a: ref_focal(*a, gamma=0.0)),
    "focal(gamma=1)": (lambda n, G: L.Focal(gamma=1.0), lambda *a: ref_focal(*a, gamma=1.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@SETTINGS
@given(problem=problems())
def test_term_matches_float64_loop_reference(case, problem):
    logits, teacher, y, n, G = problem
    make, ref = CASES[case]
    got_v, got_g = value_and_grad(make(n, G), logits, y, teacher_logits=teacher)
    exp_v, exp_g = value_and_grad(lambda Z: ref(Z, teacher, y, n, G), logits)
    # The loops add up to ~1e4·s in different orders: compare relative to the logits' scale.
    tol = 1e-9 * (1 + float(logits.abs().max()))
    close(got_v, exp_v, tol)
    close(got_g, exp_g, tol)


# -- GCL: the same documented noise draw, then a loop reference ----------------------------------
def ref_gcl(Z, y, n, noise, m=0.0, s=30.0, noise_mul=0.5):
    B, C = Z.shape
    present = [c for c in range(C) if n[c] > 0]
    top = max(math.log(n[c]) for c in present)
    delta = {c: top - math.log(n[c]) for c in present}
    biggest = max(delta.values())
    r = [(delta[c] / biggest if biggest > 0 else 0.0) if n[c] > 0 else 1.0 for c in range(C)]
    total = 0
    for i in range(B):
        yi = int(y[i])
        row = []
        for c in range(C):
            eps = min(1.0, max(-1.0, float(noise[i, c])))
            row.append(s * (Z[i, c] - noise_mul * abs(eps) * r[c] - (m if c == yi else 0.0)))
        total = total + ref_ce_row(row, yi)
    return total / B


@SETTINGS
@given(problem=problems(), params=st.sampled_from([(0.0, 30.0, 0.5), (0.5, 2.0, 1.0)]),
       seed=st.integers(0, 2**31 - 1))
def test_gcl_matches_loop_reference_with_the_documented_draw(problem, params, seed):
    logits, _, y, n, _ = problem
    m, s, noise_mul = params
    term = L.GCL(class_counts=n, m=m, s=s, noise_mul=noise_mul, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):  # a fresh draw per call
        noise = torch.randn(logits.shape, generator=gen, dtype=F64) / 3.0
        got = value_and_grad(term, logits, y)
        want = value_and_grad(lambda Z: ref_gcl(Z, y, n, noise, m, s, noise_mul), logits)
        tol = 1e-9 * (1 + float(logits.abs().max()))
        close(got[0], want[0], tol)
        close(got[1], want[1], tol)


def test_gcl_state_round_trips_and_continues_identically():
    z, y = torch.randn(4, 3, dtype=F64), torch.tensor([0, 1, 2, 0])
    a = L.build("gcl(m=0.2)", class_counts=[9, 3, 1], seed=5)
    a(z, y)
    b = L.build("gcl(m=0.2)", class_counts=[9, 3, 1], seed=99)
    b.load_state_dict(a.state_dict())
    close(a(z, y), b(z, y), 0.0)
    assert not torch.equal(a(z, y), a(z, y))  # the cloud is redrawn every step
    with pytest.raises(FedltError, match="state must have keys"):
        L.GCL(class_counts=[1, 2]).load_state_dict({"steps": torch.tensor(1)})


def test_gcl_without_noise_is_ldam_like_margin_ce():
    n = [9, 3, 1]
    z, y = torch.randn(5, 3, dtype=F64), torch.tensor([0, 1, 2, 2, 0])
    got = L.GCL(class_counts=n, m=0.3, s=2.0, noise_mul=0.0)(z, y)
    shifted = z - 0.3 * torch.nn.functional.one_hot(y, 3).to(F64)
    close(got, torch.nn.functional.cross_entropy(2.0 * shifted, y), 1e-12)


# -- EQLv2: an independent stateful reference -------------------------------------------------------
def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class RefEQLv2:
    """Tan et al.'s EQLv2 (sigmoid, no background class) on Python lists, step by step."""

    def __init__(self, C, gamma=12.0, mu=0.8, alpha=4.0):
        self.pos, self.neg, self.pos_neg = [0.0] * C, [0.0] * C, [100.0] * C
        self.gamma, self.mu, self.alpha = gamma, mu, alpha

    def step(self, Z, y):
        B, C = Z.shape
        w_neg = [sigmoid(self.gamma * (self.pos_neg[c] - self.mu)) for c in range(C)]
        w_pos = [1 + self.alpha * (1 - w_neg[c]) for c in range(C)]
        total = 0
        for i in range(B):
            for c in range(C):
                t = 1.0 if int(y[i]) == c else 0.0
                z = Z[i, c]
                bce = torch.clamp(z, min=0) - z * t + torch.log1p(torch.exp(-z.abs()))
                w = w_pos[c] if t else w_neg[c]
                total = total + w * bce
                g = abs(sigmoid(float(z.detach())) - t) * w
                if t:
                    self.pos[c] += g
                else:
                    self.neg[c] += g
        self.pos_neg = [self.pos[c] / (self.neg[c] + 1e-10) for c in range(C)]
        return total / B


@st.composite
def step_sequences(draw):
    C = draw(st.integers(2, 5))
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        B = draw(st.integers(1, 5))
        y = torch.tensor(draw(st.lists(st.integers(0, C - 1), min_size=B, max_size=B)))
        scale = draw(st.sampled_from([1.0, 5.0, 1e4]))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        steps.append((torch.randn(B, C, generator=gen, dtype=F64) * scale, y))
    return C, steps, draw(st.sampled_from([(12.0, 0.8, 4.0), (3.0, 0.5, 1.0)]))


@SETTINGS
@given(seq=step_sequences())
def test_eqlv2_matches_stateful_loop_reference_step_by_step(seq):
    C, steps, (gamma, mu, alpha) = seq
    term, ref = L.EQLv2(gamma=gamma, mu=mu, alpha=alpha), RefEQLv2(C, gamma, mu, alpha)
    for Z, y in steps:
        got = value_and_grad(term, Z, y)
        want = value_and_grad(lambda z: ref.step(z, y), Z)
        tol = 1e-9 * (1 + float(Z.abs().max()))
        close(got[0], want[0], tol)
        close(got[1], want[1], tol)
    state = term.state_dict()
    assert int(state["steps"]) == len(steps)
    for key, values in (("pos", ref.pos), ("neg", ref.neg), ("pos_neg", ref.pos_neg)):
        torch.testing.assert_close(state[key], torch.tensor(values, dtype=F64), rtol=1e-9, atol=1e-9)


def test_eqlv2_first_step_is_plain_sigmoid_bce_and_then_reweights():
    z = torch.tensor([[2.0, -1.0, 0.5], [0.1, 0.3, -2.0]], dtype=F64)
    y = torch.tensor([0, 0])
    term = L.EQLv2()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        z, torch.nn.functional.one_hot(y, 3).to(F64), reduction="sum") / 2
    close(term(z, y), bce)
    # Classes 1 and 2 never had a positive: pos/neg = 0, so their negatives are damped and
    # their (future) positives boosted.
    w_pos, w_neg = L.longtail.eqlv2_weights(term.state_dict()["pos_neg"], 12.0, 0.8, 4.0)
    assert float(w_neg[1]) < 1e-3 and float(w_pos[1]) > 4.9
    assert not torch.allclose(term(z, y), bce)


def test_eqlv2_state_round_trips_and_continues_identically():
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 5, generator=gen, dtype=F64), torch.randint(0, 5, (4,), generator=gen))
               for _ in range(6)]
    a = L.build("eqlv2 + 0.5*ce", num_classes=5)
    for z, y in batches[:3]:
        a(z, y)
    saved = a.state_dict()
    assert sorted(saved) == ["eqlv2.neg", "eqlv2.pos", "eqlv2.pos_neg", "eqlv2.steps"]
    b = L.build("eqlv2 + 0.5*ce", num_classes=5)
    b.load_state_dict(saved)
    for z, y in batches[3:]:
        close(a(z, y), b(z, y), 0.0)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    saved["eqlv2.pos"] += 1  # a snapshot, not a view of the live state
    assert not torch.equal(saved["eqlv2.pos"], a.state_dict()["eqlv2.pos"])


@pytest.mark.parametrize("state, match", [
    ({"steps": torch.tensor(0), "pos": torch.zeros(3)}, "state must have keys"),
    ({"steps": torch.tensor(0), "pos": torch.zeros(4), "neg": torch.zeros(4),
      "pos_neg": torch.zeros(4)}, "state is for 4 classes"),
])
def test_eqlv2_rejects_bad_state(state, match):
    with pytest.raises(FedltError, match=match):
        L.EQLv2(num_classes=3).load_state_dict(state)


# -- properties: the special cases that collapse to simpler losses ---------------------------------
def _ce(n, G):
    return L.CE()


@pytest.mark.parametrize("make, counts_kind", [
    (lambda n, G: L.FedRS(class_counts=n, alpha=1.0), None),
    (lambda n, G: L.FedRS(class_counts=n, form="paper", alpha=0.3), "equal"),
    (lambda n, G: L.FedIR(class_counts=n, global_counts=[3 * v for v in n]), None),
    (lambda n, G: L.FedIR(class_counts=n, global_counts=[3 * v for v in n], form="paper"), None),
    (lambda n, G: L.LDAM(class_counts=n, max_margin=0.0, s=1.0, reweight=True), "equal"),
    (lambda n, G: L.BalancedSoftmax(class_counts=n), "equal"),
    (lambda n, G: L.Focal(gamma=0.0), None),
    (lambda n, G: L.FedNTD(beta=0.0), None),
])
@settings(deadline=None, max_examples=20)
@given(data=st.data())
def test_special_cases_are_cross_entropy(make, counts_kind, data):
    logits, teacher, y, n, G = data.draw(problems(counts_kind=counts_kind))
    got = value_and_grad(make(n, G), logits, y, teacher_logits=teacher)
    want = value_and_grad(L.CE(), logits, y)
    close(got[0], want[0], 1e-10)
    close(got[1], want[1], 1e-10)


@SETTINGS
@given(problem=problems(counts_kind="equal"), tau=st.sampled_from([0.5, 1.0, 4.0]))
def test_fedlmd_with_no_major_class_is_fedntd(problem, tau):
    logits, teacher, y, n, _ = problem
    a = value_and_grad(L.FedLMD(class_counts=n, tau=tau), logits, y, teacher_logits=teacher)
    b = value_and_grad(L.FedNTD(tau=tau), logits, y, teacher_logits=teacher)
    close(a[0], b[0], 1e-12)
    close(a[1], b[1], 1e-12)


def test_fedntd_distillation_vanishes_when_student_is_teacher():
    z = torch.randn(5, 4, dtype=F64)
    y = torch.tensor([0, 1, 2, 3, 0])
    ntd = value_and_grad(L.FedNTD(beta=3.0), z, y, teacher_logits=z.clone())
    ce = value_and_grad(L.CE(), z, y)
    close(ntd[0], ce[0], 1e-12)
    close(ntd[1], ce[1], 1e-12)
    assert L.FedNTD()(z, y, teacher_logits=z + torch.randn(5, 4, dtype=F64)) > ce[0]


def test_fedlmd_masks_major_labels_from_the_teacher():
    # Class 0 is major (6 > mean 2.5): the teacher's mass on it must not matter.
    n = [6, 2, 2, 0]
    z = torch.randn(3, 4, dtype=F64)
    y = torch.tensor([1, 2, 1])
    t = torch.randn(3, 4, dtype=F64)
    t2 = t.clone()
    t2[:, 0] += 50.0
    term = L.FedLMD(class_counts=n)
    assert term.major.tolist() == [True, False, False, False]
    close(term(z, y, teacher_logits=t), term(z, y, teacher_logits=t2), 1e-12)
    assert not torch.allclose(L.FedNTD()(z, y, teacher_logits=t), L.FedNTD()(z, y, teacher_logits=t2))


@SETTINGS
@given(problem=problems())
def test_balanced_softmax_absent_classes_get_probability_and_gradient_zero(problem):
    logits, _, y, n, _ = problem
    term = L.BalancedSoftmax(class_counts=n)
    absent = torch.tensor(n) == 0
    probs = torch.softmax(term.adjusted_logits(logits), dim=1)
    assert bool((probs[:, absent] == 0).all()) and bool(torch.isfinite(probs).all())
    _, g = value_and_grad(term, logits, y)
    assert bool((g[:, absent] == 0).all())


def test_balanced_softmax_rejects_target_of_an_absent_class():
    with pytest.raises(FedltError, match="class_counts 0"):
        L.BalancedSoftmax(class_counts=[3, 0])(torch.zeros(1, 2), torch.tensor([1]))


def test_fedrs_code_form_scales_by_share_of_the_largest_class():
    term = L.FedRS(class_counts=[8, 2, 0], alpha=0.5)
    z = torch.ones(1, 3, dtype=F64)
    assert term.adjusted_logits(z)[0].tolist() == [1.0, 0.625, 0.5]
    assert L.FedRS(class_counts=[8, 2, 0], form="paper").adjusted_logits(z)[0].tolist() == [1.0, 1.0, 0.5]


def test_ldam_margins_follow_the_inverse_fourth_root():
    term = L.LDAM(class_counts=[16, 1, 0, 81], max_margin=0.6)
    m = term.margin.vec.tolist()
    assert m[1] == pytest.approx(0.6) and m[0] == pytest.approx(0.3) and m[3] == pytest.approx(0.2)
    assert m[2] == pytest.approx(0.6)  # absent: the largest margin


def test_fedir_weights_are_global_over_local_frequency():
    term = L.FedIR(class_counts=[6, 2, 0], global_counts=[10, 30, 60])
    # q = [6, 2, 2(smallest)]/8, P = [0.1, 0.3, 0.6]
    assert term.weight.tolist() == pytest.approx([0.1 / 0.75, 0.3 / 0.25, 0.6 / 0.25])


@settings(deadline=None, max_examples=15)
@given(problem=problems(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_every_baseline_term_is_finite(problem, dtype):
    logits, teacher, y, n, G = problem
    terms = [make(n, G) for make, _ in CASES.values()] + [L.Focal(gamma=0.5), L.GCL(class_counts=n)]
    for term in terms:
        v, g = value_and_grad(term, logits.to(dtype), y, teacher_logits=teacher.to(dtype))
        assert torch.isfinite(v), term
        assert bool(torch.isfinite(g).all()), term
    eqlv2 = L.EQLv2()
    for _ in range(3):  # it moves away from its initial weights
        v, g = value_and_grad(eqlv2, logits.to(dtype), y)
        assert torch.isfinite(v) and bool(torch.isfinite(g).all())


# -- registry, expressions, errors -----------------------------------------------------------------
NAMES = ["fedrs", "fedntd", "fedlmd", "fedir", "ldam", "balanced_softmax", "focal", "eqlv2", "gcl"]


@pytest.mark.parametrize("name", NAMES)
def test_each_term_works_inside_an_expression(name):
    counts, G = [40.0, 7, 0, 1, 0], [50.0, 20, 10, 5, 1]
    gen = torch.Generator().manual_seed(0)
    z, t = torch.randn(6, 5, generator=gen, dtype=F64), torch.randn(6, 5, generator=gen, dtype=F64)
    y = torch.tensor([0, 1, 3, 0, 0, 1])
    setup = dict(class_counts=counts, global_counts=G, num_classes=5, seed=0)
    obj = L.build(f"0.1*vacant_kd + 2*{name} - 0.5*ce", **setup)
    alone = L.build(name, **setup)
    assert obj.needs_teacher
    want = 0.1 * L.VacantKD(class_counts=counts)(z, y, teacher_logits=t) \
        + 2 * alone(z, y, teacher_logits=t) - 0.5 * L.CE()(z, y)
    close(obj(z, y, teacher_logits=t), want, 1e-12)
    L.validate(f"{name} + 0.1*vacant_kd")  # config-time checks pass with placeholder setup


def test_ldam_plus_vacant_kd_from_the_issue():
    obj = L.build("ldam + 0.1*vacant_kd", class_counts=[5, 0, 0, 2])
    assert repr(obj) == "ldam(max_margin=0.5, s=30, reweight=False, beta=0.9999) + 0.1*vacant_kd(T=1)"
    assert obj.needs_teacher


def test_builtin_focal_wins_over_the_example_plugin():
    assert L.get("focal") is L.Focal


def test_fedir_without_global_counts_is_one_clear_line():
    with pytest.raises(FedltError, match="fedir.*needs global_counts") as info:
        L.build("ce + fedir", class_counts=[1, 2])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("make, match", [
    (lambda: L.FedRS(class_counts=[1, 2], alpha=1.5), "alpha must be <= 1"),
    (lambda: L.FedRS(class_counts=[1, 2], form="soft"), "'code', 'paper'"),
    (lambda: L.FedNTD(tau=0), "tau must be > 0"),
    (lambda: L.FedLMD(class_counts=[1, 2], beta=-1), "beta must be >= 0"),
    (lambda: L.FedIR(class_counts=[1, 2], global_counts=[1, 2, 3]), "length 3"),
    (lambda: L.FedIR(class_counts=[1, 2], global_counts=[0, 0]), "not all 0"),
    (lambda: L.LDAM(class_counts=[1, 2], beta=1.0), "beta must be < 1"),
    (lambda: L.LDAM(class_counts=[1, 2], reweight="yes"), "reweight must be True or False"),
    (lambda: L.LDAM(class_counts=[1, 2], s=0), "s must be > 0"),
    (lambda: L.Focal(gamma=-1), "gamma must be >= 0"),
    (lambda: L.EQLv2(num_classes=0), "num_classes"),
    (lambda: L.BalancedSoftmax(class_counts=[0, 0]), "all 0"),
    (lambda: L.GCL(class_counts=[1, 2], noise_mul=-1), "noise_mul must be >= 0"),
    (lambda: L.GCL(class_counts=[1, 2], seed=1.5), "seed must be an int"),
])
def test_bad_parameters_raise_one_line_fedlt_errors(make, match):
    with pytest.raises(FedltError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_distillation_terms_need_teacher_logits():
    for term in (L.FedNTD(), L.FedLMD(class_counts=[3, 1])):
        assert term.needs_teacher
        with pytest.raises(FedltError, match="teacher_logits"):
            term(torch.zeros(2, 2), torch.tensor([0, 1]))


# -- post-hoc tau_norm ------------------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(3, 2)
        self.head = torch.nn.Linear(2, 3)

    def forward(self, x):
        return self.head(self.body(x))

    def get_classifier(self):
        return self.head


def _net():
    net = _Net().double()
    with torch.no_grad():
        net.head.weight.copy_(torch.tensor([[3.0, 4.0], [0.0, 2.0], [0.0, 0.0]]))
        net.head.bias.copy_(torch.tensor([1.0, -1.0, 0.5]))
    return net


def test_tau_norm_against_a_hand_computation():
    net = _net()
    out = fedlt.posthoc.tau_norm(net)  # tau=1: unit rows, bias dropped (Kang et al.'s code)
    assert out.head.weight.tolist() == [[0.6, 0.8], [0.0, 1.0], [0.0, 0.0]]
    assert out.head.bias.tolist() == [0.0, 0.0, 0.0]
    half = fedlt.posthoc.create("tau_norm", model=net, tau=0.5, bias="keep")
    r5 = math.sqrt(5.0)  # ‖(3,4)‖^0.5
    torch.testing.assert_close(half.head.weight,
                               torch.tensor([[3 / r5, 4 / r5], [0.0, 2 / math.sqrt(2)], [0.0, 0.0]],
                                            dtype=F64), rtol=1e-15, atol=0)
    assert half.head.bias.tolist() == [1.0, -1.0, 0.5]
    # The input model is untouched and the body is shared in value, not in storage.
    assert net.head.weight.tolist() == [[3.0, 4.0], [0.0, 2.0], [0.0, 0.0]]
    assert torch.equal(out.body.weight, net.body.weight) and out.body.weight is not net.body.weight
    x = torch.randn(4, 3, dtype=F64)
    torch.testing.assert_close(out(x), net.body(x) @ out.head.weight.T)


def test_tau_norm_zero_is_identity_and_bad_input_is_one_line():
    net = _net()
    same = fedlt.posthoc.tau_norm(net, tau=0.0, bias="keep")
    assert torch.equal(same.head.weight, net.head.weight) and torch.equal(same.head.bias, net.head.bias)
    assert "tau_norm" in fedlt.posthoc.list()
    for kwargs, match in (({"tau": -1}, "tau must be"), ({"bias": "zero"}, "bias must be")):
        with pytest.raises(FedltError, match=match):
            fedlt.posthoc.tau_norm(net, **kwargs)
    with pytest.raises(FedltError, match="get_classifier"):
        fedlt.posthoc.tau_norm(torch.nn.Linear(2, 2))

"""Fed-GraB's SGB and DPA, and FedProx (SPEC §2), against independent re-implementations."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fedlt.losses as L
from fedlt.errors import FedltError

SETTINGS = settings(deadline=None, max_examples=50)
F64 = torch.float64
C = 4


# -- an independent SGB: plain Python lists and loops, following SPEC §2 step by step -----------
def ref_phi(x, gamma=10.0, delta=9.0, zeta=0.5):
    arg = -zeta * x
    return 0.0 if arg > 700 else gamma / (1.0 + delta * math.exp(arg))


class RefSGB:
    def __init__(self, num_classes, prior=None, seed=0, kp=10.0, ki=0.01, kd=0.1):
        self.C = num_classes
        self.pos, self.neg = [0.0] * num_classes, [0.0] * num_classes
        self.u, self.e1, self.e2 = [0.0] * num_classes, [0.0] * num_classes, [0.0] * num_classes
        self.prior = prior
        self.gen = torch.Generator().manual_seed(seed)  # the documented draw: rand(C, float64)
        self.kp, self.ki, self.kd = kp, ki, kd

    def step(self, Z, y, base="sigmoid"):
        """Returns the expected B×C gradient weights and which classes were gated."""
        B, C = Z.shape
        for j in range(C):
            e = 0.0 - (self.pos[j] - self.neg[j])
            self.u[j] += (self.kp * (e - self.e1[j]) + self.ki * e
                          + self.kd * (e - 2 * self.e1[j] + self.e2[j]))
            self.e2[j], self.e1[j] = self.e1[j], e
        w_pos = [ref_phi(self.u[j]) for j in range(C)]
        w_neg = [ref_phi(-self.u[j]) for j in range(C)]
        gated = [False] * C
        if self.prior is not None:
            r = torch.rand(C, generator=self.gen, dtype=F64).tolist()
            gated = [r[j] <= self.prior[j] for j in range(C)]
        weights = [[1.0 if gated[c] else (w_pos[c] if int(y[i]) == c else w_neg[c])
                    for c in range(C)] for i in range(B)]
        for c in range(C):
            if gated[c]:
                continue
            for i in range(B):
                if base == "sigmoid":
                    prob = 1.0 / (1.0 + math.exp(-float(Z[i, c])))
                else:
                    row = [float(v) for v in Z[i]]
                    m = max(row)
                    prob = math.exp(row[c] - m) / sum(math.exp(v - m) for v in row)
                g = abs((prob - (1.0 if int(y[i]) == c else 0.0)) / B * weights[i][c])
                if int(y[i]) == c:
                    self.pos[c] += g
                else:
                    self.neg[c] += g
        return torch.tensor(weights, dtype=F64), gated


def base_value_and_grad(Z, y, base="sigmoid"):
    """The unweighted base loss and its gradient, by plain autograd."""
    z = Z.detach().clone().requires_grad_(True)
    if base == "sigmoid":
        v = F.binary_cross_entropy_with_logits(z, F.one_hot(y, Z.shape[1]).to(Z.dtype),
                                               reduction="sum") / Z.shape[0]
    else:
        v = F.cross_entropy(z, y)
    v.backward()
    return v.detach(), z.grad


def term_value_and_grad(term, Z, y):
    z = Z.detach().clone().requires_grad_(True)
    v = term(z, y)
    v.backward()
    return v.detach(), z.grad


def imbalanced_stream(steps, B=12, seed=0):
    """A fixed class-imbalanced stream: class 0 is the head, class 3 a rare tail."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.tensor([0.7, 0.2, 0.08, 0.02])
    for _ in range(steps):
        y = torch.multinomial(probs, B, replacement=True, generator=gen)
        yield torch.randn(B, C, generator=gen, dtype=F64) * 2, y


def close(a, b, tol=1e-8):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# -- SGB --------------------------------------------------------------------------------------
def test_phi_of_zero_is_one():
    assert L.phi(torch.tensor(0.0, dtype=F64)).item() == 1.0
    assert L.phi(torch.tensor(0.0)).item() == 1.0
    big = L.phi(torch.tensor([-1e6, 1e6], dtype=F64))
    assert big.tolist() == [0.0, 10.0]


@pytest.mark.parametrize("base", ["sigmoid", "softmax"])
def test_first_step_reweights_nothing(base):
    Z, y = next(imbalanced_stream(1))
    v, g = term_value_and_grad(L.SGB(base=base), Z, y)
    bv, bg = base_value_and_grad(Z, y, base)
    close(v, bv, 1e-12)
    close(g, bg, 1e-12)


@pytest.mark.parametrize("base", ["sigmoid", "softmax"])
@pytest.mark.parametrize("prior", [None, [0.9, 0.5, 0.1, 0.0]])
def test_gradient_is_base_gradient_times_documented_weights(base, prior):
    sgb = L.SGB(base=base, prior=prior, seed=7)
    ref = RefSGB(C, prior=prior, seed=7)
    moved, gated_seen = False, set()
    for Z, y in imbalanced_stream(10):
        v, g = term_value_and_grad(sgb, Z, y)
        weights, gated = ref.step(Z, y, base)
        bv, bg = base_value_and_grad(Z, y, base)
        close(v, bv, 1e-12)  # the VALUE stays the unweighted base loss
        close(g, bg * weights)
        state = sgb.state_dict()
        close(state["pos"], torch.tensor(ref.pos, dtype=F64))  # the collector rule
        close(state["neg"], torch.tensor(ref.neg, dtype=F64))
        close(state["u"], torch.tensor(ref.u, dtype=F64))
        moved |= bool(((weights - 1).abs() > 1e-3).any())
        gated_seen.update(gated)
    assert moved, "the stream must drive the weights away from 1 for this test to mean anything"
    if prior is not None:
        assert gated_seen == {True, False}


def test_gating_probability_one_reweights_nothing():
    stream = list(imbalanced_stream(8))
    warm = L.SGB(num_classes=C)
    for Z, y in stream[:6]:
        term_value_and_grad(warm, Z, y)
    state = warm.state_dict()
    Z, y = stream[6]
    _, reweighted = term_value_and_grad(warm, Z, y)
    _, base = base_value_and_grad(Z, y)
    assert not torch.allclose(reweighted, base)  # without gating this step IS re-weighted

    gated = L.SGB(prior=torch.ones(C), num_classes=C)
    gated.load_state_dict(state)
    for Z, y in stream[6:]:
        _, g = term_value_and_grad(gated, Z, y)
        close(g, base_value_and_grad(Z, y)[1], 1e-12)
    after = gated.state_dict()
    assert torch.equal(after["pos"], state["pos"]) and torch.equal(after["neg"], state["neg"])


def _run(term, batches):
    return [term_value_and_grad(term, Z, y) for Z, y in batches]


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("make", [
    lambda seed: L.SGB(prior=[0.6, 0.3, 0.3, 0.0], seed=seed),
    lambda seed: L.build("fedgrab + 0.1*ce + 0.5*sgb", seed=seed, num_classes=C,
                         classifier_weight=torch.arange(1.0, 1.0 + 2 * C).reshape(C, 2)),
])
def test_state_roundtrip_continues_exactly(make):
    batches = list(imbalanced_stream(8))
    never_stopped = make(3)
    expected = _run(never_stopped, batches)

    first = make(3)
    _run(first, batches[:4])
    resumed = make(12345)  # a different seed: everything must come from the loaded state
    resumed.load_state_dict(_roundtrip(first.state_dict()))
    got = _run(resumed, batches[4:])
    for (v1, g1), (v2, g2) in zip(expected[4:], got):
        assert torch.equal(v1, v2) and torch.equal(g1, g2)
    a, b = never_stopped.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_without_the_rng_state_would_differ():
    # guards the round-trip test above: the gates really depend on the generator
    batches = list(imbalanced_stream(6))
    a = _run(L.SGB(prior=[0.5] * C, seed=1), batches)
    b = _run(L.SGB(prior=[0.5] * C, seed=2), batches)
    assert any(not torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_state_dict_is_a_snapshot_and_load_checks_shapes():
    sgb = L.SGB(num_classes=C)
    Z, y = next(imbalanced_stream(1))
    term_value_and_grad(sgb, Z, y)
    snap = sgb.state_dict()
    saved = {k: v.clone() for k, v in snap.items()}
    term_value_and_grad(sgb, Z, y)
    assert all(torch.equal(snap[k], saved[k]) for k in snap)
    assert int(snap["steps"]) == 1
    with pytest.raises(FedltError, match="state is for 4 classes"):
        L.SGB(num_classes=3).load_state_dict(snap)
    with pytest.raises(FedltError, match="keys"):
        L.SGB().load_state_dict({"pos": snap["pos"]})


def test_lazy_num_classes_state_roundtrip():
    sgb = L.SGB()
    fresh = sgb.state_dict()
    assert set(fresh) == {"steps", "rng"}
    other = L.SGB(seed=9)
    other.load_state_dict(fresh)
    batches = list(imbalanced_stream(3))
    for (v1, g1), (v2, g2) in zip(_run(sgb, batches), _run(other, batches)):
        assert torch.equal(g1, g2)


def test_weight_in_a_composition_scales_the_gradient_not_the_collector():
    batches = list(imbalanced_stream(5))
    alone, half = L.SGB(num_classes=C), L.build("0.5*sgb", num_classes=C)
    for (v1, g1), (v2, g2) in zip(_run(alone, batches), _run(half, batches)):
        close(v2, 0.5 * v1, 1e-12)
        close(g2, 0.5 * g1, 1e-12)
    a, b = alone.state_dict(), half.state_dict()
    assert torch.equal(a["pos"], b["sgb.pos"]) and torch.equal(a["u"], b["sgb.u"])


# -- DPA --------------------------------------------------------------------------------------
def ref_norms(W):
    return [math.sqrt(sum(float(w) ** 2 for w in row)) for row in W]


@SETTINGS
@given(C_=st.integers(1, 10), d=st.integers(1, 6), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-3, 1.0, 1e4]))
def test_dpa_sums_to_one_and_is_monotone_in_the_norms(C_, d, seed, scale):
    W = torch.randn(C_, d, generator=torch.Generator().manual_seed(seed)) * scale
    P = L.dpa(W)
    m = ref_norms(W)
    assert P.shape == (C_,) and bool((P >= 0).all())
    assert math.isclose(float(P.sum()), 1.0, rel_tol=1e-12)
    for i in range(C_):
        for j in range(C_):
            if m[i] < m[j]:
                assert P[i] <= P[j]
    spread = [mi - min(m) for mi in m]
    if max(spread) > 1e-6 * max(m):
        close(P, torch.tensor([s / sum(spread) for s in spread], dtype=F64), 1e-6)


@SETTINGS
@given(C_=st.integers(1, 10), d=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_dpa_is_uniform_for_equal_norms(C_, d, seed):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=gen, dtype=F64)
    # each row a signed permutation of v: equal norms, summed in different orders
    rows = [v[torch.randperm(d, generator=gen)] * torch.where(torch.rand(d, generator=gen) < 0.5,
                                                              -1.0, 1.0) for _ in range(C_)]
    P = L.dpa(torch.stack(rows))
    assert torch.equal(P, torch.full((C_,), 1.0 / C_, dtype=F64))
    assert torch.equal(L.dpa(torch.zeros(C_, d)), torch.full((C_,), 1.0 / C_, dtype=F64))


def test_dpa_rejects_bad_input_and_fedgrab_uses_it():
    with pytest.raises(FedltError, match="C×d"):
        L.dpa(torch.zeros(3))
    with pytest.raises(FedltError, match="classifier_weight"):
        L.FedGraB(classifier_weight=None)
    W = torch.randn(5, 3)
    fg = L.FedGraB(classifier_weight=W)
    assert fg.base == "sigmoid" and torch.equal(fg.prior, L.dpa(W))
    assert torch.equal(L.create("dpa", classifier_weight=W), L.dpa(W))


# -- FedProx ------------------------------------------------------------------------------------
@SETTINGS
@given(shapes=st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3), min_size=1,
                       max_size=4),
       mu=st.floats(0.0, 10.0), seed=st.integers(0, 2**31 - 1))
def test_fedprox_value_and_gradient_match_the_formula(shapes, mu, seed):
    gen = torch.Generator().manual_seed(seed)
    anchors = [torch.randn(tuple(s), generator=gen, dtype=F64) for s in shapes]
    params = [torch.randn(tuple(s), generator=gen, dtype=F64).requires_grad_(True) for s in shapes]
    term = L.FedProx(global_params=anchors, mu=mu)
    value = term(None, None, params=params)
    value.backward()
    expected = 0.0
    for w, a in zip(params, anchors):
        for wi, ai in zip(w.detach().flatten().tolist(), a.flatten().tolist()):
            expected += (wi - ai) ** 2
    assert math.isclose(value.item(), mu / 2 * expected, rel_tol=1e-10, abs_tol=1e-12)
    for w, a in zip(params, anchors):
        close(w.grad, mu * (w.detach() - a), 1e-12)


def test_fedprox_copies_its_anchor_and_checks_params():
    g = [torch.ones(3)]
    term = L.FedProx(global_params=g, mu=2.0)
    g[0].add_(5.0)  # training a model that shares storage with the anchor must not move it
    w = [torch.full((3,), 2.0, requires_grad=True)]
    assert term(None, None, params=w).item() == pytest.approx(3.0)
    assert term.needs_params and not term.needs_teacher
    with pytest.raises(FedltError, match="needs params"):
        term(None, None)
    with pytest.raises(FedltError, match="2 params but 1"):
        term(None, None, params=w * 2)
    with pytest.raises(FedltError, match="shape"):
        term(None, None, params=[torch.zeros(4)])

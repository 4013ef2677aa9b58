"""Composition of loss terms: build(), the expression parser, arithmetic, namespaced state."""

from __future__ import annotations

import pytest
import torch

import fedlt.losses as L
from fedlt.errors import FedltError

F64 = torch.float64
COUNTS = torch.tensor([30.0, 5.0, 0.0, 2.0, 0.0, 0.0])
C = 6


def batch(seed=0, B=5):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B, C, generator=gen, dtype=F64)
    t = torch.randn(B, C, generator=gen, dtype=F64)
    y = torch.tensor([0, 1, 3, 0, 0][:B])
    return z, t, y


def value_and_grad(term, z, y, **kw):
    z = z.detach().clone().requires_grad_(True)
    v = term(z, y, **kw)
    v.backward()
    return v.detach(), z.grad


def close(a, b, tol=1e-12):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_build_equals_the_weighted_sum_of_separately_built_terms():
    z, t, y = batch()
    built = L.build("logit_adjust(tau=0.5) + 0.1*vacant_kd(T=2) - logit_suppression/4",
                    class_counts=COUNTS)
    la = L.create("logit_adjust", class_counts=COUNTS, tau=0.5)
    kd = L.create("vacant_kd", class_counts=COUNTS, T=2)
    ls = L.create("logit_suppression", class_counts=COUNTS)
    v, g = value_and_grad(built, z, y, teacher_logits=t)
    parts = [value_and_grad(term, z, y, teacher_logits=t) for term in (la, kd, ls)]
    close(v, parts[0][0] + 0.1 * parts[1][0] - 0.25 * parts[2][0])
    close(g, parts[0][1] + 0.1 * parts[1][1] - 0.25 * parts[2][1])
    assert parts[1][0] > 0 and parts[2][0] != 0  # every part contributes something
    # the same objective from Python arithmetic and from compose()
    for other in (la + 0.1 * kd - ls / 4, L.compose(la, (0.1, kd), (-0.25, ls))):
        close(value_and_grad(other, z, y, teacher_logits=t)[1], g)


def test_fedvls_preset_is_its_definition():
    z, t, y = batch(1)
    preset = L.build("fedvls(lam=0.3)", class_counts=COUNTS)
    spelled = L.build("logit_adjust(tau=1, eps=1e-9) + 0.3*vacant_kd(T=1) "
                      "+ logit_suppression(variant='reference')", class_counts=COUNTS)
    a = value_and_grad(preset, z, y, teacher_logits=t)
    b = value_and_grad(spelled, z, y, teacher_logits=t)
    close(a[0], b[0])
    close(a[1], b[1])
    # eps really is 1e-9 in the preset: with large vacant-class logits (where eps matters) the
    # default logit_adjust (eps=1e-12) gives another value
    z = z + 20.0 * (COUNTS == 0)
    other = L.build("logit_adjust + 0.3*vacant_kd + logit_suppression", class_counts=COUNTS)
    assert not torch.allclose(value_and_grad(other, z, y, teacher_logits=t)[0],
                              value_and_grad(preset, z, y, teacher_logits=t)[0])


def test_needs_flags_follow_the_terms():
    assert not L.build("ce").needs_teacher and not L.build("ce").needs_params
    assert L.build("ce + vacant_kd", class_counts=COUNTS).needs_teacher
    assert not L.build("vacant_kd", class_counts=[3, 0, 1]).needs_teacher  # one vacant: always 0
    assert not L.build("ce + 0*vacant_kd", class_counts=COUNTS).needs_teacher
    prox = L.build("ce + fedprox(mu=0.1)", global_params=[torch.zeros(2)], class_counts=COUNTS)
    assert prox.needs_params and not prox.needs_teacher
    z, _, y = batch()
    # a weight-0 term is not called, so no teacher is needed
    L.build("ce + 0*vacant_kd", class_counts=COUNTS)(z, y)


def test_setup_filtering_and_expression_parameters_win():
    gp = [torch.zeros(3)]
    obj = L.build("ce + fedlc + fedprox + sgb(seed=5)", class_counts=COUNTS, num_classes=C,
                  global_params=gp, classifier_weight=None, seed=1)
    rng = obj.state_dict()["sgb.rng"]
    assert torch.equal(rng, L.SGB(seed=5).generator.get_state())
    assert not torch.equal(rng, L.SGB(seed=1).generator.get_state())
    assert obj.terms[3][1].num_classes == C  # num_classes reached sgb from the setup


def test_build_accepts_a_built_term_and_repr_parses_back():
    z, t, y = batch(2)
    la = L.LogitAdjust(class_counts=COUNTS, tau=0.5)
    close(L.build(la)(z, y), la(z, y))
    obj = L.build("fedlc(tau=0.25, form='paper') - 2*vacant_kd(T=3) + fedvls(lam=0.5)",
                  class_counts=COUNTS)
    again = L.build(repr(obj), class_counts=COUNTS)
    assert repr(again) == repr(obj)
    close(again(z, y, teacher_logits=t), obj(z, y, teacher_logits=t))


def test_parse_structure():
    assert L.parse("-(0.5*a) + b/4 - 2*c(x='s', y=-1, z=None) + 1e-2*d*3") == [
        (-0.5, "a", {}), (0.25, "b", {}), (-2.0, "c", {"x": "s", "y": -1, "z": None}),
        (pytest.approx(0.03), "d", {}),
    ]


@pytest.mark.parametrize("expr, match", [
    ("ce +", "invalid syntax"),
    ("", "non-empty"),
    ("foo", "unknown loss 'foo'"),
    ("logit_ajust", "did you mean 'logit_adjust'"),
    ("ce(tau=1)", "'ce'.*unexpected keyword argument 'tau'"),
    ("logit_adjust(0.5)", "keyword arguments only"),
    ("logit_adjust(tau=-1)", "tau must be >= 0"),
    ("fedlc(form='printed')", "form must be one of 'code', 'paper'"),
    ("vacant_kd(T=0)", "T must be > 0"),
    ("fedprox(mu=-0.1)", "mu must be >= 0"),
    ("logit_suppression(variant='x')", "variant"),
    ("2**ce", "unexpected"),
    ("ce*fedlc", "multiplies two terms"),
    ("ce/0", "non-zero number"),
    ("0.5", "not attached to a term"),
    ("ce + 1", "not attached to a term"),
    ("fedlc(tau=x)", "must be a literal"),
    ("ce(**{'a': 1})", r"'\*\*' is not allowed"),
    ("__import__('os').system('true')", "unexpected"),
    ("os.system", "unexpected"),
    ("dpa", "not a loss term"),
    ("fedgrab", "needs the setup value.*classifier_weight"),
    ("1e400*ce", "not finite"),
])
def test_bad_expressions_raise_one_line_fedlt_errors(expr, match):
    with pytest.raises(FedltError, match=match) as info:
        L.build(expr, class_counts=COUNTS, global_params=[torch.zeros(1)])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("expr, match", [
    ("fedlc(tau=-1)", "tau must be >= 0"),
    ("fedgrab(kp='a')", "kp must be a finite number"),
    ("vacant_kd(t=2)", "unexpected keyword argument 't'"),
    ("nope + ce", "unknown loss 'nope'"),
    ("dpa", "not a loss term"),
])
def test_validate_checks_names_and_parameters_without_setup(expr, match):
    with pytest.raises(FedltError, match=match):
        L.validate(expr)


def test_validate_accepts_every_preset_and_returns_the_parse():
    expr = "fedvls(lam=0.2) + fedgrab(kp=2) + 0.5*fedprox(mu=0.1) + sgb(prior=[0.1, 0.2, 0.3])"
    assert L.validate(expr) == L.parse(expr)


def test_bad_setup_raises():
    with pytest.raises(FedltError, match="unknown argument.*class_count"):
        L.build("ce", class_count=COUNTS)
    with pytest.raises(FedltError, match="num_classes is 4"):
        L.build("ce", class_counts=COUNTS, num_classes=4)
    with pytest.raises(FedltError, match="classifier_weight"):
        L.build("fedgrab", classifier_weight=None)


def test_composite_state_is_namespaced_and_round_trips():
    W = torch.randn(C, 3, generator=torch.Generator().manual_seed(0))
    make = lambda: L.build("sgb + fedgrab + 0.5*sgb(base='softmax') + ce",  # noqa: E731
                           classifier_weight=W, num_classes=C, seed=4)
    a = make()
    keys = set(a.state_dict())
    for prefix in ("sgb.", "fedgrab.", "sgb#1."):
        assert {prefix + k for k in ("pos", "neg", "u", "e1", "e2", "steps", "rng")} <= keys
    z, _, y = batch(3)
    for s in range(3):
        value_and_grad(a, *batch(s)[::2])
    b = make()
    b.load_state_dict(a.state_dict())
    for s in range(3, 6):
        za, _, ya = batch(s)
        assert torch.equal(value_and_grad(a, za, ya)[1], value_and_grad(b, za, ya)[1])
    with pytest.raises(FedltError, match="matches no term"):
        b.load_state_dict({"focal.pos": torch.zeros(C)})
    with pytest.raises(FedltError, match="stateless"):
        L.CE().load_state_dict({"x": torch.zeros(1)})
    assert L.build("ce + fedlc", class_counts=COUNTS).state_dict() == {}


def test_register_your_own_term():
    class Focal(L.LossTerm):
        name = "focal_test"

        def __init__(self, *, class_counts, gamma: float = 2.0):
            self.gamma = gamma

        def __call__(self, logits, targets, *, teacher_logits=None, params=None):
            logp = torch.log_softmax(logits, 1).gather(1, targets[:, None]).squeeze(1)
            return (-(1 - logp.exp()) ** self.gamma * logp).mean()

    with L.REGISTRY.temporary("focal_test", Focal):
        z, _, y = batch()
        obj = L.build("ce + 2*focal_test(gamma=1)", class_counts=COUNTS)
        close(obj(z, y), L.CE()(z, y) + 2 * Focal(class_counts=COUNTS, gamma=1)(z, y))
        with pytest.raises(FedltError, match="focal_test.*unexpected keyword argument 'alpha'"):
            L.build("focal_test(alpha=1)", class_counts=COUNTS)

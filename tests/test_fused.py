"""The fused loss path (docs/fused.md) against the reference path, on inputs drawn by hypothesis.

``fused="on"`` runs the analytic CPU path of ``fedlt.losses.fused.cpu``; ``fused="off"`` the eager
reference, evaluated in float64 on the same (float32-valued) inputs: never another float32 path,
whose own rounding at logits of 1e4 exceeded the tolerance (7.4e-6) while the fused path was within
2.4e-9 of float64. Values and gradients must agree within 1e-5 relative (plus float32 rounding of
inputs of magnitude up to 1e4), SGB's state updates must agree, and no output may be NaN or inf
where the reference is finite.
"""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fedlt.losses as L
from fedlt.errors import FedltError
from fedlt.losses.fused import FusedFallbackWarning, cpu, dispatch, offset_ce_pair, pair_offsets

SETTINGS = settings(deadline=None, max_examples=60)
EPS32 = torch.finfo(torch.float32).eps

EXPRESSIONS = [
    "ce", "logit_adjust", "logit_adjust(tau=0.5, eps=1e-9)", "fedlc(tau=0.5)", "vacant_kd(T=2)",
    "logit_suppression", "logit_suppression(variant='paper')", "fedvls", "fedvls(lam=0.5) + ce",
    "logit_adjust - 0.3*logit_suppression(variant='paper') + 0.1*vacant_kd",
    "fedlc + logit_suppression", "2*ce + logit_adjust",
    "balanced_softmax", "balanced_softmax(absent='one') + 0.1*vacant_kd",  # FedETF's objective (issue 33)
]


@st.composite
def problems(draw, max_classes=40):
    """(logits, teacher, targets, counts) in float32: zero counts, one label, magnitudes up to 1e4."""
    C = draw(st.sampled_from([2, 3, draw(st.integers(2, max_classes)), 1000]))
    B = draw(st.integers(1, 48 if C < 1000 else 6))
    kind = draw(st.sampled_from(["random", "single", "many_vacant", "all_present"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "single":
        counts = torch.zeros(C)
        counts[draw(st.integers(0, C - 1))] = 7
    elif kind == "many_vacant":
        counts = torch.zeros(C)
        counts[torch.randperm(C, generator=gen)[: max(1, C // 5)]] = torch.randint(1, 60, (max(1, C // 5),), generator=gen).float()
    elif kind == "all_present":
        counts = torch.randint(1, 60, (C,), generator=gen).float()
    else:
        counts = torch.randint(0, 3, (C,), generator=gen).float() * torch.randint(1, 60, (C,), generator=gen)
        if counts.sum() == 0:
            counts[0] = 1
    present = counts.nonzero().flatten()
    if draw(st.booleans()):  # every row shares one label
        targets = present[torch.randint(len(present), (1,), generator=gen)].repeat(B)
    else:
        targets = present[torch.randint(len(present), (B,), generator=gen)]
    scale = draw(st.sampled_from([1.0, 8.0, 1e4]))
    logits = torch.randn(B, C, generator=gen) * scale
    teacher = torch.randn(B, C, generator=gen) * scale
    if draw(st.booleans()):
        teacher = logits + 0.01 * torch.randn(B, C, generator=gen)  # a teacher close to the student
    return logits, teacher, targets, counts


def value_and_grad(objective, logits, targets, teacher):
    z = logits.detach().clone().requires_grad_(True)
    value = objective(z, targets, teacher_logits=teacher)
    (grad,) = torch.autograd.grad(value, z, allow_unused=True)
    return value.detach(), torch.zeros_like(z) if grad is None else grad


def reference64(expr, counts, logits, targets, teacher):
    """(value, gradient) of the eager reference path in float64: the ground truth both paths meet."""
    objective = L.build(expr, class_counts=counts.double(), fused="off")
    return value_and_grad(objective, logits.double(), targets, teacher.double())


def assert_agree(fused: torch.Tensor, ref: torch.Tensor, magnitude: float, what: str) -> None:
    """Within 1e-5 relative of the reference's largest entry, plus the float32 rounding of inputs
    of size ``magnitude`` (a loss of logits 1e4 carries ±1e-3 from its inputs alone)."""
    assert torch.isfinite(fused).all() or not torch.isfinite(ref).all(), f"{what}: non-finite {fused}"
    ref = ref.double()
    tol = 1e-5 * max(float(ref.abs().max()), 1e-6) + 64 * EPS32 * magnitude
    err = float((fused.double() - ref).abs().max())
    assert err <= tol, f"{what}: fused {fused} vs reference {ref} (max error {err:.3g} > {tol:.3g})"


@SETTINGS
@given(problems(), st.sampled_from(EXPRESSIONS))
def test_fused_composites_match_the_reference(problem, expr):
    logits, teacher, targets, counts = problem
    fused = L.build(expr, class_counts=counts, fused="on")
    with mock.patch.object(cpu, "objective", wraps=cpu.objective) as spy:
        value, grad = value_and_grad(fused, logits, targets, teacher)
    value_ref, grad_ref = reference64(expr, counts, logits, targets, teacher)
    contributes = bool(fused.fused_parts(logits, targets, teacher, 1.0))  # vacant_kd with |O| ≤ 1 is 0
    assert spy.call_count == int(contributes), "a composite of covered terms runs as ONE fused function"
    weights = sum(abs(w) * getattr(t, "T", 1.0) for w, t in fused.flat_terms())
    assert_agree(value, value_ref, float(logits.abs().max()) * (1 + weights), f"{expr} value")
    # a gradient entry is a difference of probabilities times weight/B: float32 rounds each to ~eps
    assert_agree(grad, grad_ref, 2 * weights / len(targets), f"{expr} gradient")


@SETTINGS
@given(problems(), st.sampled_from(EXPRESSIONS + ["ce + vacant_kd", "logit_adjust + 0.5*vacant_kd"]),
       st.integers(1, 5))
def test_row_blocks_give_the_reference_result(problem, expr, rows_per_block):
    """The shared-softmax terms run over row blocks (``cpu.BLOCK_ELEMENTS``). Blocks of 1 to 5 rows
    exercise what one block never does: the suppression's column sums rescaled as the running
    maximum of the row log-sum-exps rises, the KD's exact rows in later blocks (global row
    indices), the teacher's part kept for pass 2."""
    logits, teacher, targets, counts = problem
    fused = L.build(expr, class_counts=counts, fused="on")
    with mock.patch.object(cpu, "BLOCK_ELEMENTS", rows_per_block * logits.shape[1]):
        value, grad = value_and_grad(fused, logits, targets, teacher)
    value_ref, grad_ref = reference64(expr, counts, logits, targets, teacher)
    weights = sum(abs(w) * getattr(t, "T", 1.0) for w, t in fused.flat_terms())
    assert_agree(value, value_ref, float(logits.abs().max()) * (1 + weights), f"{expr} value")
    assert_agree(grad, grad_ref, 2 * weights / len(targets), f"{expr} gradient")


@pytest.mark.parametrize("rows_per_block", [1, 2, 8])
def test_vacant_rows_beyond_float_range_are_exact_in_every_block(rows_per_block):
    """Rows 2 and 5 put their vacant classes 200 below their largest logit: their vacant softmax
    mass underflows the shared softmax and their KD part is recomputed exactly, wherever their
    block starts."""
    C = 6
    logits = torch.randn(7, C, generator=torch.Generator().manual_seed(1))
    logits[[2, 5], 0] = 200.0
    targets = torch.tensor([0, 1, 0, 2, 5, 1, 0])
    counts = torch.tensor([3.0, 2, 1, 0, 0, 5])  # classes 3 and 4 are vacant
    teacher = torch.randn(7, C, generator=torch.Generator().manual_seed(2))
    for expr in ["fedvls", "ce + vacant_kd", "logit_adjust + 2*vacant_kd"]:
        with mock.patch.object(cpu, "BLOCK_ELEMENTS", rows_per_block * C):
            value, grad = value_and_grad(L.build(expr, class_counts=counts, fused="on"), logits, targets, teacher)
        value_ref, grad_ref = reference64(expr, counts, logits, targets, teacher)
        assert_agree(value, value_ref, 200.0, expr)
        assert_agree(grad, grad_ref, 1e-3, expr)


@pytest.mark.parametrize("expr", ["fedvls", "logit_adjust + 0.5*vacant_kd", "logit_suppression"])
def test_upstream_factors_and_a_retained_graph_reach_the_fused_gradient(expr):
    """The backward scales the saved gradient by the upstream factor (0.5·loss, a loss summed with
    another), and hands it on unchanged for a factor of exactly 1 — twice through a retained graph
    the gradients accumulate as the reference's do."""
    gen = torch.Generator().manual_seed(3)
    logits, teacher = torch.randn(9, 7, generator=gen) * 3, torch.randn(9, 7, generator=gen)
    targets = torch.tensor([0, 1, 2, 0, 1, 2, 5, 5, 0])
    counts = torch.tensor([4.0, 3, 2, 0, 0, 6, 0])
    results = {}
    for mode in ("on", "off"):
        loss = L.build(expr, class_counts=counts, fused=mode)
        z = logits.clone().requires_grad_(True)
        value = loss(z, targets, teacher_logits=teacher)
        (half,) = torch.autograd.grad(0.5 * value + value.detach(), z, retain_graph=True)
        value.backward(retain_graph=True)
        value.backward()
        results[mode] = (half, z.grad)
    assert_agree(results["on"][0], results["off"][0], 1e-3, f"{expr}: 0.5 × loss")
    assert_agree(results["on"][1], results["off"][1], 1e-3, f"{expr}: two backward passes")


@settings(deadline=None, max_examples=25)
@given(problems(max_classes=12), st.sampled_from(["fedvls", "logit_adjust", "logit_suppression(variant='paper')"]))
def test_bfloat16_inputs_accumulate_in_float32(problem, expr):
    """bfloat16 logits: the fused result stays finite and within bfloat16 rounding of the float64
    reference on the same (bfloat16-rounded) inputs; the gradient comes back in bfloat16."""
    logits, teacher, targets, counts = problem
    z16, t16 = logits.bfloat16(), teacher.bfloat16()
    value, grad = value_and_grad(L.build(expr, class_counts=counts, fused="on"), z16, targets, t16)
    value_ref, grad_ref = value_and_grad(L.build(expr, class_counts=counts, fused="off"),
                                         z16.double(), targets, t16.double())
    assert value.dtype == grad.dtype == torch.bfloat16
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    bf16 = 2.0 ** -7
    assert abs(float(value) - float(value_ref)) <= 2 * bf16 * max(abs(float(value_ref)), 1.0)
    assert float((grad.double() - grad_ref).abs().max()) <= 2 * bf16 * max(float(grad_ref.abs().max()), 1e-3)


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_suppression_columns_beyond_float_range_are_recomputed_exactly(scale):
    """Row 0's target logit is 1e4 above everything else: every other column's entries lie ~1e4
    below the batch's largest log-sum-exp, underflow the shared softmax and take the exact path;
    the result still equals the reference."""
    C = 6
    logits = torch.randn(4, C, generator=torch.Generator().manual_seed(0))
    logits[0, 0] = scale
    targets = torch.tensor([0, 1, 1, 2])
    counts = torch.tensor([3.0, 2, 1, 0, 0, 5])
    for expr in ["logit_suppression", "logit_suppression(variant='paper')", "fedvls"]:
        teacher = torch.randn(4, C)
        with mock.patch.object(cpu, "_suppression_exact", wraps=cpu._suppression_exact) as exact:
            value, grad = value_and_grad(L.build(expr, class_counts=counts, fused="on"), logits, targets, teacher)
        assert exact.called == (scale > 100), expr
        value_ref, grad_ref = reference64(expr, counts, logits, targets, teacher)
        assert_agree(value, value_ref, scale, expr)
        assert_agree(grad, grad_ref, 1e-3, expr)


# -- SGB ------------------------------------------------------------------------------------------
@settings(deadline=None, max_examples=30)
@given(st.integers(2, 60), st.integers(1, 40), st.sampled_from(["sigmoid", "softmax"]), st.booleans(),
       st.sampled_from([1.0, 30.0, 1e4]), st.integers(0, 2**31 - 1))
@example(C=2, B=1, base="sigmoid", with_prior=True, scale=30.0, seed=1)  # σ(z) − 1 in float32 at z ≈ 5
def test_sgb_fused_steps_and_states_match_the_reference(C, B, base, with_prior, scale, seed):
    """Each fused float32 step against the eager path in float64, the ground truth, from the same
    state: the same gates (drawn from the same generator), the same value, gradient and collected
    state. The reference restarts every step from the fused term's state: float32 rounding of
    what was collected feeds the PID controller, whose gain (kp = 10) would otherwise compound it
    over steps — a property of float32 training, not an error of the fused step."""
    gen = torch.Generator().manual_seed(seed)
    prior = L.dpa(torch.randn(C, 5, generator=gen)) if with_prior else None
    fused, ref = (L.SGB(base=base, prior=prior, num_classes=C, seed=seed) for _ in range(2))
    fused.fused, ref.fused = "on", "off"
    for step in range(3):
        logits = torch.randn(B, C, generator=gen) * scale
        targets = torch.randint(0, C, (B,), generator=gen) if step != 1 else torch.zeros(B, dtype=torch.long)
        ref.load_state_dict(fused.state_dict())
        v_on, g_on = value_and_grad(fused, logits, targets, None)
        v_ref, g_ref = value_and_grad(ref, logits.double(), targets, None)
        assert g_ref.dtype == torch.float64 and g_on.dtype == torch.float32
        assert_agree(v_on, v_ref, scale, f"sgb step {step} value")
        # an entry is (σ − onehot)·w/B with w ≤ gamma: float32 rounds σ − 1 to ~eps (as torch's own CE does)
        assert_agree(g_on, g_ref, 2 * fused.gamma / B, f"sgb step {step} gradient")
        s_on, s_ref = fused.state_dict(), ref.state_dict()
        assert torch.equal(s_on["rng"], s_ref["rng"]) and int(s_on["steps"]) == int(s_ref["steps"])
        # one step's collected |g'_ic| each carry float32's rounding of σ − onehot (≤ 2·eps·w/B, w ≤ gamma),
        # so a class's pos/neg sum moves ≤ 2·eps·gamma off; e = neg − pos and u (gain kp + ki + kd) follow
        sums_atol = 4 * 2 * EPS32 * fused.gamma
        pid_atol = (fused.kp + fused.ki + fused.kd) * 2 * sums_atol
        for key in ("pos", "neg", "u", "e1", "e2"):
            torch.testing.assert_close(s_on[key].double(), s_ref[key].double(), rtol=2e-6,
                                       atol=sums_atol if key in ("pos", "neg") else pid_atol, msg=f"state {key}")


def test_sgb_in_a_fused_composite_keeps_its_state_and_adds_its_value():
    counts = torch.tensor([5.0, 0, 3, 0, 0])
    on = L.build("logit_adjust + 0.5*sgb", class_counts=counts, fused="on")
    off = L.build("logit_adjust + 0.5*sgb", class_counts=counts, fused="off")
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        logits, targets = torch.randn(9, 5, generator=gen), torch.tensor([0, 2] * 4 + [0])
        (v1, g1), (v2, g2) = value_and_grad(on, logits, targets, None), value_and_grad(off, logits, targets, None)
        assert_agree(v1, v2, 1.0, "value")
        assert_agree(g1, g2, 0.0, "gradient")
    torch.testing.assert_close(on.state_dict()["sgb.pos"], off.state_dict()["sgb.pos"], rtol=2e-6, atol=0)


# -- SCALA's pair ---------------------------------------------------------------------------------
@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=6), st.integers(2, 30), st.sampled_from([1.0, 1e4]),
       st.integers(0, 2**31 - 1))
def test_offset_ce_pair_matches_logit_adjust_per_segment(sizes, C, scale, seed):
    """The server's loss (prior P_s of the joined batch) and Σ_k of each client's loss (its prior p_k,
    mean over its own rows) from one call, each gradient taken on its own as the split engine does."""
    gen = torch.Generator().manual_seed(seed)
    B = sum(sizes)
    targets = torch.randint(0, C, (B,), generator=gen)
    client_counts = [torch.randint(0, 2, (C,), generator=gen).float() * torch.randint(1, 50, (C,), generator=gen)
                     for _ in sizes]
    for k, y in enumerate(targets.split(sizes)):
        client_counts[k][y] += 1  # a client's counts cover its own rows
    server = L.LogitAdjust(class_counts=torch.bincount(targets, minlength=C))
    clients = [L.LogitAdjust(class_counts=n) for n in client_counts]
    for term in (server, *clients):
        term.fused = "off"
    logits = torch.randn(B, C, generator=gen) * scale

    z = logits.clone().requires_grad_(True)
    ref_server = server(z, targets)
    ref_total = sum(c(rows, y) for c, rows, y in zip(clients, z.split(sizes), targets.split(sizes)))
    ref_gs = torch.autograd.grad(ref_server, z, retain_graph=True)[0]
    ref_gc = torch.autograd.grad(ref_total, z)[0]

    for mode in ("on", "off"):
        z = logits.clone().requires_grad_(True)
        s, per_client = offset_ce_pair(z, targets, server.offset.vec, torch.stack([c.offset.vec for c in clients]),
                                       sizes, fused=mode)
        assert per_client.shape == (len(sizes),)
        for k, (c, rows, y) in enumerate(zip(clients, logits.split(sizes), targets.split(sizes))):
            assert_agree(per_client[k].detach(), c(rows, y), scale, f"{mode} client {k}")
        total = per_client.sum()
        gs = torch.autograd.grad(s, z, retain_graph=True)[0]
        gc = torch.autograd.grad(total, z)[0]
        assert_agree(s.detach(), ref_server.detach(), scale, f"{mode} server loss")
        assert_agree(total.detach(), ref_total.detach(), scale * len(sizes), f"{mode} client total")
        assert_agree(gs, ref_gs, 0.0, f"{mode} server gradient")
        assert_agree(gc, ref_gc, 0.0, f"{mode} client gradient")


def test_pair_offsets_recognise_scalas_objectives_and_refuse_the_rest():
    """The split engine's built objectives give the pair's offsets (SCALA: logit_adjust both sides,
    SplitFed: ce), equal to what the terms add; anything more than one offset CE gives None."""
    server_counts, clients = torch.tensor([4.0, 0, 2]), [torch.tensor([1.0, 3, 0]), torch.tensor([0.0, 0, 5])]
    server = L.build("logit_adjust", class_counts=server_counts)
    found = pair_offsets(server, [L.build("logit_adjust", class_counts=n) for n in clients], 3)
    assert found is not None
    so, co = found
    torch.testing.assert_close(so, torch.log(server_counts / 6 + 1e-12).double())
    torch.testing.assert_close(co[1], torch.log(clients[1] / 5 + 1e-12).double())
    so, co = pair_offsets(L.build("ce"), [L.build("ce")] * 2, 3)
    assert torch.equal(so, torch.zeros(3, dtype=torch.float64)) and co.shape == (2, 3)
    for other in ["fedvls", "2*logit_adjust", "logit_adjust + fedprox", "fedlc(form='paper')", "sgb"]:
        objective = L.build(other, class_counts=server_counts, global_params=[torch.zeros(1)])
        assert pair_offsets(server, [objective], 3) is None, other


def test_offset_ce_pair_both_losses_in_one_backward_and_bad_sizes():
    z = torch.randn(5, 4, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 0])
    s, c = offset_ce_pair(z, y, torch.zeros(4), torch.zeros(2, 4), [2, 3], fused="on")
    (s + 2 * c[0] - 0.5 * c[1]).backward()  # each client's loss weighted on its own
    ce = torch.nn.functional.cross_entropy
    expected = torch.autograd.grad(ce(z, y) + 2 * ce(z[:2], y[:2]) - 0.5 * ce(z[2:], y[2:]), z)[0]
    torch.testing.assert_close(z.grad, expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(FedltError, match="sizes must be positive and sum to B=5"):
        offset_ce_pair(z, y, torch.zeros(4), torch.zeros(2, 4), [2, 2])
    with pytest.raises(FedltError, match="client_offsets"):
        offset_ce_pair(z, y, torch.zeros(4), torch.zeros(3, 4), [2, 3])


# -- dispatch -------------------------------------------------------------------------------------
def test_modes_are_validated_with_one_line():
    with pytest.raises(FedltError, match="fused must be one of 'auto', 'on', 'off', got 'yes'"):
        L.build("ce", fused="yes")
    term = L.CE()
    with pytest.raises(FedltError, match="fused must be one of"):
        term.fused = True


def test_build_sets_the_mode_on_every_term_and_off_never_runs_the_fused_path():
    obj = L.build("fedvls + fedprox", class_counts=[1.0, 0, 0, 2], global_params=[torch.zeros(1)], fused="off")
    assert {t.fused for _, t in obj.flat_terms()} == {"off"} and obj.terms[0][1].fused == "off"
    with mock.patch.object(cpu, "objective", wraps=cpu.objective) as spy:
        value, _ = value_and_grad(lambda z, y, teacher_logits: obj(z, y, teacher_logits=teacher_logits,
                                                                   params=[torch.ones(1)]),
                                  torch.randn(3, 4), torch.tensor([0, 3, 0]), torch.randn(3, 4))
    assert spy.call_count == 0 and torch.isfinite(value)


def test_weight_space_terms_run_beside_the_fused_parts():
    counts = [1.0, 0, 0, 2]
    objs = {m: L.build("fedvls + fedprox(mu=0.5)", class_counts=counts, global_params=[torch.zeros(3)], fused=m)
            for m in ("on", "off")}
    z, y, t = torch.randn(5, 4), torch.tensor([0, 3, 0, 3, 3]), torch.randn(5, 4)
    w = torch.ones(3)
    with mock.patch.object(cpu, "objective", wraps=cpu.objective) as spy:
        on = objs["on"](z, y, teacher_logits=t, params=[w])
    off = objs["off"](z, y, teacher_logits=t, params=[w])
    assert spy.call_count == 1
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)


def test_uncovered_combination_falls_back_with_one_warning_naming_it(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned", set())
    obj = L.build("ce + fedlc(form='paper')", class_counts=[2.0, 3.0, 1.0], fused="on")
    ref = L.build("ce + fedlc(form='paper')", class_counts=[2.0, 3.0, 1.0], fused="off")
    z, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    with pytest.warns(FusedFallbackWarning, match=r"fedlc\(tau=0.5, form='paper'\).*reference"):
        value = obj(z, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the second call is silent
        again = obj(z, y)
    # term by term: the uncovered term runs its reference, the covered ones may still fuse alone
    torch.testing.assert_close(value, ref(z, y), rtol=1e-6, atol=1e-6)
    assert torch.equal(again, value)


def test_auto_follows_the_measured_cpu_rules(monkeypatch):
    obj = L.build("logit_adjust", class_counts=[1.0, 2.0, 3.0])
    assert obj.fused == "auto"
    monkeypatch.setitem(dispatch.CPU_AUTO_RULES, "ce", (3, 13))  # at least 3 classes and 13 logits
    with mock.patch.object(cpu, "objective", wraps=cpu.objective) as spy:
        obj(torch.randn(4, 3), torch.tensor([0, 1, 2, 1]))  # 12 logits: the reference
        assert spy.call_count == 0
        obj(torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0]))  # 15 logits: fused
        assert spy.call_count == 1
    monkeypatch.setitem(dispatch.CPU_AUTO_RULES, "ce", (4, 0))  # too few classes: the reference
    with mock.patch.object(cpu, "objective", wraps=cpu.objective) as spy:
        obj(torch.randn(50, 3), torch.zeros(50, dtype=torch.long))
        assert spy.call_count == 0
    monkeypatch.delitem(dispatch.CPU_AUTO_RULES, "ce")  # a family never measured faster
    with mock.patch.object(cpu, "objective", wraps=cpu.objective) as spy:
        obj(torch.randn(50, 3), torch.zeros(50, dtype=torch.long))
        assert spy.call_count == 0
    assert dispatch.family("OffsetCE+OffsetCE") == "ce" and dispatch.family("OffsetCE+Suppression") == "composite"



class _CudaLogits:
    """What ``dispatch.backend`` reads of CUDA logits (there is no GPU here): device and size."""

    def __init__(self, B: int, C: int) -> None:
        self.device, self.shape, self.ndim = torch.device("cuda"), (B, C), 2

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def test_auto_on_cuda_runs_the_reference_below_the_measured_sizes(monkeypatch):
    """Under ``auto`` a CUDA loss below its family's CUDA_AUTO_RULES size never reaches Triton (nor
    its trust check, which would launch kernels); ``on`` still asks for Triton; ``sgb``, measured
    level or faster at every size, is not held back."""
    asked = []
    monkeypatch.setattr(dispatch, "triton_backend", lambda: asked.append(1) or None)
    floor = dispatch.CUDA_AUTO_RULES["ce"]
    for kind in ("OffsetCE", "ce", "OffsetCE+VacantKD+Suppression", "composite", "pair"):
        assert dispatch.backend("auto", _CudaLogits(4095, 1000), kind) is None  # below every family's floor
    assert asked == []
    dispatch.backend("auto", _CudaLogits(floor // 1000 + 1, 1000), "OffsetCE")  # at the floor: Triton asked
    dispatch.backend("on", _CudaLogits(10, 10), "OffsetCE")
    dispatch.backend("auto", _CudaLogits(10, 10), "sgb")
    assert len(asked) == 3

def test_fused_value_without_gradient_and_input_errors_still_one_line():
    obj = L.build("fedvls", class_counts=[1.0, 0, 0, 2], fused="on")
    with torch.no_grad():
        value = obj(torch.randn(3, 4), torch.tensor([0, 3, 0]), teacher_logits=torch.randn(3, 4))
    assert value.ndim == 0 and torch.isfinite(value)
    with pytest.raises(FedltError, match="needs teacher_logits"):
        obj(torch.randn(3, 4), torch.tensor([0, 3, 0]))
    with pytest.raises(FedltError, match="logits have 5 classes"):
        obj(torch.randn(3, 5), torch.tensor([0, 3, 0]), teacher_logits=torch.randn(3, 5))
    with pytest.raises(FedltError, match="class_counts 0"):
        L.build("fedlc", class_counts=[1.0, 0], fused="on")(torch.randn(2, 2), torch.tensor([0, 1]))

"""The Triton kernels of the fused path (fedlt.losses.fused.triton_kernels) on CPU tensors through
``TRITON_INTERPRET=1`` (set in conftest.py before triton is imported), against the analytic CPU
path that tests/test_fused.py holds to the reference. Tiles hold many rows per program (the
interpreter's cost is per program); small class blocks exercise the online log-sum-exp across
blocks."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import fedlt.losses as L
from fedlt.losses.fused import cpu

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton interpreter must be enabled before triton is imported")
tk = pytest.importorskip("fedlt.losses.fused.triton_kernels")

EXPRESSIONS = ["fedvls", "logit_adjust", "ce + fedlc(tau=0.5)", "logit_suppression(variant='paper')",
               "vacant_kd(T=2) + 0.5*logit_suppression", "2*ce + logit_adjust - 0.2*vacant_kd",
               "balanced_softmax(absent='one')"]  # FedETF's objective (issue 33)


def problem(B, C, seed, scale=1.0, one_label=False):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 3, (C,), generator=gen).float() * torch.randint(1, 40, (C,), generator=gen)
    counts[0] = 5.0
    present = counts.nonzero().flatten()
    targets = present[torch.randint(len(present), (B,), generator=gen)]
    if one_label:
        targets[:] = present[0]
    return torch.randn(B, C, generator=gen) * scale, torch.randn(B, C, generator=gen) * scale, targets, counts


def close(a, b, scale, what):
    tol = 2e-5 * max(float(b.abs().max()), 1e-6) + 64 * torch.finfo(torch.float32).eps * scale
    assert float((a.double() - b.double()).abs().max()) <= tol, f"{what}: {a} vs {b}"


@pytest.mark.parametrize("expr", EXPRESSIONS)
@pytest.mark.parametrize("B,C,block_c,scale,one_label", [
    (37, 10, None, 1.0, False),   # one class block, a partial row tile
    (50, 70, 16, 8.0, False),     # five class blocks: the online log-sum-exp across blocks
    (24, 9, 4, 1e4, True),        # extreme logits, every row one label
])
def test_objective_kernels_match_the_cpu_path(expr, B, C, block_c, scale, one_label):
    logits, teacher, targets, counts = problem(B, C, seed=B + C, scale=scale, one_label=one_label)
    obj = L.build(expr, class_counts=counts, fused="on")
    parts = obj.fused_parts(logits, targets, teacher, 1.0)
    value, grad, scale = tk.objective(logits, targets, teacher, parts, block_c=block_c)
    value_ref, grad_ref, scale_ref = cpu.objective(logits, targets, teacher, parts)
    assert scale == 1.0
    grad_ref = grad_ref * scale_ref
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
    close(value, value_ref, scale * 4, f"{expr} value")
    close(grad, grad_ref, 4.0 / B, f"{expr} gradient")


def test_objective_kernels_take_bfloat16_and_a_thousand_classes():
    logits, teacher, targets, counts = problem(8, 1000, seed=5)
    parts = L.build("fedvls", class_counts=counts, fused="on").fused_parts(logits, targets, teacher, 1.0)
    value, grad, _ = tk.objective(logits.bfloat16(), targets, teacher.bfloat16(), parts)
    value_ref, grad_ref, _ = cpu.objective(logits.bfloat16(), targets, teacher.bfloat16(), parts)
    close(value, value_ref, 4.0, "value")
    # written in the logits' dtype (half the bytes, no conversion in the backward): within one
    # bfloat16 unit of the float32 gradient of the torch path
    assert grad.dtype == torch.bfloat16
    err = (grad.double() - grad_ref.double()).abs()
    assert bool((err <= 2.0**-7 * grad_ref.double().abs() + 1e-7).all()), float(err.max())


@pytest.mark.parametrize("base", ["sigmoid", "softmax"])
@pytest.mark.parametrize("B,C,block_c,scale", [(33, 12, None, 1.0), (20, 40, 16, 30.0)])
def test_sgb_kernel_matches_the_cpu_path(base, B, C, block_c, scale):
    gen = torch.Generator().manual_seed(C)
    logits = torch.randn(B, C, generator=gen) * scale
    targets = torch.randint(0, C, (B,), generator=gen)
    w_pos = L.phi(torch.randn(C, dtype=torch.float64, generator=gen) * 3)
    w_neg = L.phi(torch.randn(C, dtype=torch.float64, generator=gen) * 3)
    out = tk.sgb(logits, targets, w_pos, w_neg, base, block_c=block_c)
    ref = cpu.sgb(logits, targets, w_pos, w_neg, base)
    for a, b, what in zip(out, ref, ["value", "gradient", "pos", "neg"]):
        close(a, b, scale if what == "value" else 0.0, what)


@pytest.mark.parametrize("sizes,C,block_c", [([3, 9, 1, 20], 10, None), ([7, 5], 50, 16)])
def test_pair_kernel_matches_the_cpu_path(sizes, C, block_c):
    gen = torch.Generator().manual_seed(C)
    B = sum(sizes)
    logits = torch.randn(B, C, generator=gen) * 3
    targets = torch.randint(0, C, (B,), generator=gen)
    so = torch.log(torch.bincount(targets, minlength=C).double() / B + 1e-12)
    co = torch.log(torch.rand(len(sizes), C, generator=gen, dtype=torch.float64) + 1e-12)
    server, clients, saved, state = tk.offset_ce_pair(logits, targets, so, co, sizes, block_c=block_c)
    s_ref, c_ref, saved_ref, state_ref = cpu.offset_ce_pair(logits, targets, so, co, sizes)
    assert clients.shape == (len(sizes),)
    close(server, s_ref, 30.0, "server")
    close(clients, c_ref, 30.0, "clients")
    K = len(sizes)
    ups = [(torch.tensor(1.0), None), (None, torch.ones(K)), (torch.tensor(0.5), torch.rand(K, generator=gen)),
           (None, torch.tensor(2.0).expand(K))]  # the last: an expanded upstream (stride 0), as clients.sum() gives
    for up_s, up_c in ups:
        grad = tk.offset_ce_pair_grad(saved, state, up_s, up_c)
        ref = cpu.offset_ce_pair_grad(saved_ref, state_ref, up_s, up_c)
        close(grad, ref, 0.0, f"gradient (upstreams {up_s}, {up_c})")


def test_a_fused_call_issues_few_operators_and_launches(monkeypatch):
    """On a GPU a call is bound by the host (docs/fused.md): a forward + backward issues the few
    operators the math needs and one launch per kernel, whatever was derived once stays cached.
    The kernels are replaced by counting stubs (their results are not looked at)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fedlt.losses.fused import dispatch, offset_ce_pair

    launches: list[str] = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(self.name)

    for name in ("_rows", "_cols", "_grad", "_pair_rows", "_pair_grad"):
        monkeypatch.setattr(tk, name, Stub(name))
    monkeypatch.setattr(dispatch, "TRITON_DEVICES", ("cuda", "cpu"))

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    logits, teacher, targets, counts = problem(64, 30, seed=3)
    z = logits.requires_grad_(True)
    sizes = [20, 20, 24]
    server_offset = torch.log(counts / counts.sum() + 1e-12)
    client_offsets = server_offset.repeat(3, 1)
    up = (torch.tensor(1.0), torch.ones(3))
    calls = {  # (outputs, their upstream gradients: None = ones_like, which autograd issues)
        "logit_adjust": lambda loss=L.build("logit_adjust", class_counts=counts, fused="on"): (loss(z, targets), None),
        "fedvls": lambda loss=L.build("fedvls", class_counts=counts, fused="on"): (
            loss(z, targets, teacher_logits=teacher), None),
        "pair": lambda: (offset_ce_pair(z, targets, server_offset, client_offsets, sizes, fused="on"), up),
    }
    expected = {"logit_adjust": (["empty", "empty", "sum", "ones_like", "mul"], ["_rows"]),
                "fedvls": (["empty", "empty", "empty", "sum", "ones_like", "mul"], ["_rows", "_cols", "_grad"]),
                # the K + 1 losses: one mv, and a view each; the backward recomputes the gradient
                "pair": (["empty", "empty", "mv", "select", "slice", "empty_like"], ["_pair_rows", "_pair_grad"])}
    for name, call in calls.items():
        for counted in (False, True):  # the first call derives and caches what it can
            ops, launches[:] = [], []
            with Count() if counted else contextlib.nullcontext():
                outputs, upstream = call()
                torch.autograd.grad(outputs, [z], upstream)
        assert (sorted(ops), launches) == (sorted(expected[name][0]), expected[name][1]), name

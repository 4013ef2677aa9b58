"""Fused kernels checked on their device (issue 24, fedlt.losses.fused.check): under
``fused="auto"`` a Triton kernel runs on a device only after its value and gradient matched the
reference there. The CPU stands in for a GPU through the Triton interpreter (TRITON_INTERPRET=1,
conftest.py): a sound kernel passes and runs; a kernel made to return a wrong value, a wrong
gradient, or to fail to compile is not used — ONE warning names it and the reference's result
comes out. ``fedlt doctor`` reports it all, and on a CPU-only machine says no GPU kernel is
checked."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import fedlt.losses as L
from fedlt.losses.fused import FusedKernelWarning, check, dispatch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton interpreter must be enabled before triton is imported")
tk = pytest.importorskip("fedlt.losses.fused.triton_kernels")


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    """The CPU treated as a Triton device, with no check recorded yet."""
    monkeypatch.setattr(dispatch, "TRITON_DEVICES", ("cuda", "cpu"))
    check.forget()
    yield
    check.forget()


def problem(B=40, C=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 30, (C,), generator=gen).float()
    counts[2:4] = 0
    present = counts.nonzero().flatten()
    targets = present[torch.randint(len(present), (B,), generator=gen)]
    return torch.randn(B, C, generator=gen) * 2, torch.randn(B, C, generator=gen), targets, counts


def value_and_grad(loss, logits, targets, teacher):
    z = logits.clone().requires_grad_(True)
    value = loss(z, targets, teacher_logits=teacher)
    value.backward()
    return value.detach(), z.grad


def test_a_sound_kernel_passes_its_check_and_runs(cpu_as_gpu, monkeypatch):
    logits, teacher, targets, counts = problem()
    calls = []
    real = tk.objective
    monkeypatch.setattr(tk, "objective", lambda *a, **k: calls.append(1) or real(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedKernelWarning)
        fused = value_and_grad(L.build("fedvls", class_counts=counts, fused="auto"), logits, targets, teacher)
    reference = value_and_grad(L.build("fedvls", class_counts=counts, fused="off"), logits, targets, teacher)
    assert [(c.kernel, c.device, c.dtype, c.passed) for c in check.checks()] == [("objective", "cpu", "float32", True)]
    assert len(calls) > 3  # the probes (3 objectives) and then the loss itself ran the kernel
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("breakage", ["value", "gradient", "compile"])
def test_a_failing_objective_kernel_warns_once_and_the_reference_runs(cpu_as_gpu, monkeypatch, breakage):
    real = tk.objective

    def broken(logits, targets, teacher, parts, block_c=None):
        if breakage == "compile":
            raise RuntimeError("PassManager::run failed (simulated compilation error)")
        value, grad, scale = real(logits, targets, teacher, parts, block_c)
        return (value + 0.5, grad, scale) if breakage == "value" else (value, grad * 1.01, scale)

    monkeypatch.setattr(tk, "objective", broken)
    logits, teacher, targets, counts = problem()
    loss = L.build("logit_adjust + 0.5*vacant_kd", class_counts=counts, fused="auto")
    with pytest.warns(FusedKernelWarning) as caught:
        first = value_and_grad(loss, logits, targets, teacher)
        second = value_and_grad(loss, logits * 2, targets, teacher)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'objective'" in message and "cpu (float32)" in message and "running the reference" in message
    assert ("failed to run (RuntimeError: PassManager" in message) if breakage == "compile" else ("disagrees" in message)
    reference = L.build("logit_adjust + 0.5*vacant_kd", class_counts=counts, fused="off")
    for got, z in ((first, logits), (second, logits * 2)):
        for a, b in zip(got, value_and_grad(reference, z, targets, teacher)):
            assert torch.equal(a, b)  # the reference itself ran, not something close to it


def test_each_kernel_and_dtype_is_checked_on_its_own(cpu_as_gpu, monkeypatch):
    """A broken pair kernel leaves the objective kernel trusted; bfloat16 is checked apart."""
    real = tk.offset_ce_pair_grad

    def wrong_gradient(*args, **kwargs):
        return real(*args, **kwargs) * 0.9

    monkeypatch.setattr(tk, "offset_ce_pair_grad", wrong_gradient)
    logits, teacher, targets, counts = problem()
    offsets = torch.log(counts / counts.sum() + 1e-12)
    with pytest.warns(FusedKernelWarning, match="'pair' failed its check on cpu \\(float32\\): it disagrees"):
        server, clients = dispatch.offset_ce_pair(logits, targets, offsets, offsets.repeat(2, 1), [20, 20])
    ref_server, ref_clients = dispatch.offset_ce_pair(logits, targets, offsets, offsets.repeat(2, 1), [20, 20],
                                                      fused="off")
    assert torch.equal(server, ref_server) and torch.equal(clients, ref_clients)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedKernelWarning)
        value_and_grad(L.build("logit_adjust", class_counts=counts, fused="auto"), logits.bfloat16(), targets, None)
    assert {(c.kernel, c.dtype): c.passed for c in check.checks()} == {("pair", "float32"): False,
                                                                       ("objective", "bfloat16"): True}


def test_on_trusts_the_kernel_without_a_check(cpu_as_gpu, monkeypatch):
    """``fused="on"`` is the user's word: the kernel runs unchecked (docs/fused.md)."""
    real = tk.sgb
    monkeypatch.setattr(tk, "sgb", lambda *a, **k: (real(*a, **k)[0] + 1.0, *real(*a, **k)[1:]))
    logits, _, targets, counts = problem()
    on = L.build("sgb", fused="on")(logits, targets)
    off = L.build("sgb", fused="off")(logits, targets)
    assert check.checks() == [] and float(on - off) == pytest.approx(1.0, abs=1e-4)


def test_doctor_on_a_cpu_only_machine_says_no_gpu_kernel_is_checked(capsys, monkeypatch):
    from fedlt.cli import main

    main(["doctor"])  # the interpreter (set for the tests) is used only with an explicit --device cpu
    # a machine with a CUDA device checks its kernels there instead of saying none is checked
    assert ("no GPU kernel is checked" in capsys.readouterr().out) != torch.cuda.is_available()
    monkeypatch.delenv("TRITON_INTERPRET")
    main(["doctor", "--device", "cpu"])
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "triton " in out
    assert "no CUDA device" in out and "no GPU kernel is checked" in out


def test_doctor_reports_each_kernel_check_and_speed_through_the_interpreter(capsys, monkeypatch):
    from fedlt.cli import main

    real = tk.sgb
    monkeypatch.setattr(tk, "sgb", lambda *a, **k: (real(*a, **k)[0] * 2, *real(*a, **k)[1:]))
    main(["doctor", "--device", "cpu", "--dtype", "float32", "--size", "16x5", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    row = {line.split("│")[1].strip(): line for line in lines if line.count("│") > 5}
    assert set(row) == {"objective", "sgb", "pair"}
    assert "passed" in row["objective"] and "passed" in row["pair"] and "x" in row["pair"].split("│")[-2]
    assert "FAILED: not used" in row["sgb"] and "disagrees" in row["sgb"]


@pytest.mark.parametrize("argv", [["--dtype", "int8"], ["--size", "10"], ["--reps", "0"], ["--device", "tpu"]])
def test_doctor_bad_input_is_one_line(argv, capsys):
    from fedlt.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["doctor", *argv])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: ") and "\n" not in err

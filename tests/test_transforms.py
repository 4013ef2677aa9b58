"""Update transforms (fedlt.transforms, docs/transforms.md): the contract over the registry, each
built-in against an independent float64 reference, the wire forms' sizes, and a run whose
uploads are compressed (bytes per round, error feedback kept in the client-state store)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import fedlt.transforms as T
from fedlt import wire
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.testing import check_transform
from fedlt.testing.base import cut_after, run_differences

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REQUIRED = {"noise": {"std": 0.5}}  # parameters without a default


@pytest.mark.parametrize("name", T.list())
def test_every_registered_transform_meets_the_contract(name):
    check_transform(name, REQUIRED.get(name, {}))


@pytest.mark.parametrize("name", ["topk", "qsgd", "sign"])
def test_every_compressor_with_error_feedback_meets_the_contract(name):
    check_transform(name, {"error_feedback": True})


def _update(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20, 7, generator=g), "b": torch.randn(7, generator=g)}


def test_clip_is_exact_against_a_float64_reference():
    u = _update()
    norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in u.values()))
    out, _ = T.create("clip", norm=1.0).apply(u, {})
    for k, v in u.items():
        assert torch.allclose(out[k].double(), v.double() / norm, rtol=0, atol=1e-7)
    assert abs(float(T.global_norm(out)) - 1.0) < 1e-6
    small = {k: v * 1e-3 for k, v in u.items()}  # under C: unchanged, bit for bit
    same, _ = T.create("clip", norm=1.0).apply(small, {})
    assert all(torch.equal(same[k], small[k]) for k in small)


def test_topk_keeps_the_largest_and_error_feedback_loses_nothing():
    u = _update()
    t = T.create("topk", fraction=0.1, error_feedback=True)
    out, state = t.apply(u, {})
    for k, v in u.items():
        k_kept = math.ceil(0.1 * v.numel())
        assert int((out[k] != 0).sum()) == k_kept
        threshold = v.abs().reshape(-1).sort(descending=True).values[k_kept - 1]
        assert bool((out[k].abs()[out[k] != 0] >= threshold).all())
        assert torch.equal(out[k] + state[k], v)  # sent + residual = the update (first round)
    u2 = _update(1)
    out2, state2 = t.apply(u2, state)
    for k in u2:  # the next round sends from Δ + e, and keeps the rest
        assert torch.allclose(out2[k] + state2[k], u2[k] + state[k], atol=1e-6)


def test_qsgd_is_unbiased_within_a_confidence_interval():
    """E[Q(v)] = v (Alistarh et al. 2017, Lemma 3.1): the mean of n = 400 draws differs from v by
    less than 5 standard errors on every coordinate (Var Q_i ≤ ‖v‖²/(4s²) per draw)."""
    v = {"x": torch.randn(50, generator=torch.Generator().manual_seed(3), dtype=torch.float64)}
    t, n, s = T.create("qsgd", levels=4), 400, 4
    torch.manual_seed(0)
    mean = sum(t.apply(v, {})[0]["x"] for _ in range(n)) / n
    bound = 5 * float(v["x"].norm()) / (2 * s) / math.sqrt(n)
    assert float((mean - v["x"]).abs().max()) < bound
    levels = t.encode(v, {})[0]["x"]["levels"]
    assert levels.dtype == torch.int8 and int(levels.abs().max()) <= s


def test_noise_has_the_stated_standard_deviation():
    """Over 100 000 draws of N(0, 0.7²) the sample std lies within 0.7·(1 ± 5/√(2n)) (5 s.e.)."""
    torch.manual_seed(0)
    zero = {"x": torch.zeros(100_000, dtype=torch.float64)}
    draws = T.create("noise", std=0.7).apply(zero, {})[0]["x"]
    assert abs(float(draws.std()) - 0.7) < 0.7 * 5 / math.sqrt(2 * 100_000)
    assert abs(float(draws.mean())) < 5 * 0.7 / math.sqrt(100_000)


def test_sign_sends_one_bit_a_coordinate():
    u = {"x": torch.randn(1001)}
    forms, _ = T.create("sign").encode(u, {})
    assert forms["x"]["bits"].numel() == math.ceil(1001 / 8)
    dense = T.unpack(forms["x"], u["x"])
    assert torch.equal(dense.sign(), torch.where(u["x"] >= 0, 1.0, -1.0))
    assert torch.allclose(dense.abs(), u["x"].abs().mean().expand(1001))


def test_wire_forms_are_the_compact_ones():
    u = {"x": torch.randn(10_000)}
    dense = wire.size(u)
    sizes = {name: wire.size(T.build(T.parse_chain(name)).encode(u, {})[0])
             for name in ("topk(fraction=0.01)", "qsgd(levels=8)", "sign")}
    assert sizes["topk(fraction=0.01)"] < 0.03 * dense  # 100 × (4-byte index + 4-byte value)
    assert sizes["qsgd(levels=8)"] < 0.27 * dense  # 1 byte a coordinate
    assert sizes["sign"] < 0.05 * dense  # 1 bit a coordinate


def test_chains_compose_with_plus_and_parse_from_a_spec():
    chain = T.create("clip", norm=1.0) + T.create("topk", fraction=0.5)
    assert [type(t).name for t in chain.links] == ["clip", "topk"]
    assert T.parse_chain("clip(norm=1.0) + topk(fraction=0.01, error_feedback=true)") == [
        {"name": "clip", "norm": 1.0}, {"name": "topk", "fraction": 0.01, "error_feedback": True}]
    assert T.parse_chain("none") == []


def _config(out, **more):
    base = dict(algorithm="fedavg", model="mlp", dataset="mnist", clients=4, participation=0.5, rounds=2,
                local_epochs=1, batch_size=50, train_limit=200, test_limit=100, eval_every=2,
                partition={"name": "iid"}, out=out)
    return RunConfig(**(base | more))


def test_compressed_uploads_cut_bytes_up_and_resume_exactly(tmp_path):
    """fedavg with top-k 1% + error feedback: bytes_up under 3% of the plain run's, bytes_down the
    same; the residual lives in the client-state store and a run cut after round 1 resumes to
    the same rows and states, bit for bit."""
    plain = _config(tmp_path / "plain")
    run(plain)
    upload = "clip(norm=1.0) + topk(fraction=0.01, error_feedback=true)"
    cfg = _config(tmp_path / "topk", upload=upload)
    run(cfg, on_round=cut_after(1, tmp_path / "topk", tmp_path / "cut"))
    rows = [json.loads(x) for x in (tmp_path / "topk" / "metrics.jsonl").read_text().splitlines()]
    base = [json.loads(x) for x in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bytes_up"] < 0.03 * b["bytes_up"] for r, b in zip(rows, base))
    assert all(0 < r["bytes_down"] - b["bytes_down"] < 1000 for r, b in zip(rows, base))  # + the upload plan
    run(cfg.model_copy(update={"out": tmp_path / "cut"}), resume=True)
    assert not run_differences(tmp_path / "topk", tmp_path / "cut")

"""``precision="bf16"`` (docs/gpu.md): autocast for the forward and the loss, float32 master
weights and aggregation; the float32 path untouched."""

from pathlib import Path

import pytest
import torch

from fedlt import io
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.testing.algorithms import TINY

# 3 rounds of a tiny MNIST run: bf16 rounds the forward's matmuls to 8 mantissa bits; measured
# gaps were ~2e-5 in test loss and ~1e-3 relative in the weights, bounded here with a margin
LOSS_TOL, WEIGHT_TOL = 5e-3, 2e-2


def _final(tmp_path: Path, name: str, **settings) -> tuple[dict, dict]:
    config = RunConfig(**(TINY | dict(model="mlp", rounds=3) | settings), out=tmp_path / name)
    summary = run(config)
    return summary["final"], io.load_checkpoint(tmp_path / name / "checkpoint.pt")["algorithm"]["model"]


@pytest.mark.parametrize("algorithm", ["fedavg", "fedvls", "scaffold", "moon"])
def test_bf16_stays_within_tolerance_of_fp32(tmp_path, algorithm):
    fp32, w32 = _final(tmp_path, "fp32", algorithm=algorithm)
    bf16, w16 = _final(tmp_path, "bf16", algorithm=algorithm, precision="bf16")
    assert abs(bf16["loss"] - fp32["loss"]) < LOSS_TOL
    assert abs(bf16["accuracy"] - fp32["accuracy"]) <= 0.03
    assert all(w16[k].dtype == w32[k].dtype == torch.float32 for k in w32 if w32[k].is_floating_point())
    gaps = [float((w16[k] - w32[k]).norm() / w32[k].norm()) for k in w32 if w32[k].is_floating_point()]
    assert max(gaps) < WEIGHT_TOL
    assert max(gaps) > 0  # bf16 did run: the weights are not the float32 ones


def test_bf16_runs_the_forward_in_bfloat16_and_the_loss_in_float32(tmp_path):
    from fedlt.algorithms.base import ClientData, LocalSchedule, forward_precision
    from fedlt.algorithms.fedavg_family import client_update
    from fedlt.algorithms.protocol import ClientTask
    from fedlt.context import ModelSpec, RoundContext

    spec = ModelSpec("mlp", 1, 10, 28)
    model = spec.build()
    seen = []
    model.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    x, y = torch.randn(20, 1, 28, 28), torch.arange(20) % 10
    counts = torch.bincount(y, minlength=10)
    ctx = RoundContext(round_index=0, rounds=1, num_clients=1, participants=(0,), num_classes=10,
                       global_counts=counts, participant_counts=counts[None], classifier_weight=None,
                       sampling_seed=0, model=spec)
    task = ClientTask(0, ctx, {k: v.clone() for k, v in model.state_dict().items()}, ClientData(0, x, y, counts),
                      {}, LocalSchedule(5, iters=2, precision="bf16"), "ce")
    result = client_update(task, model)
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert all(v.dtype == torch.float32 for v in result.weights.values())
    assert result.train_loss == result.train_loss  # finite, from float32 losses
    with forward_precision("fp32", x.device):
        assert not torch.is_autocast_enabled("cpu")


def test_precision_is_a_checked_setting(resolved):
    assert resolved("--precision", "bf16").precision == "bf16"
    assert RunConfig().precision == "fp32"
    with pytest.raises(ValueError, match="precision"):
        RunConfig(precision="fp16")

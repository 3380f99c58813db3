"""The hook with half-precision and mixed-dtype gradients, and with a loss scale."""

import math

import pytest
import torch

import workers
from harness import run_workers

STATIC = dict(policy="static", max_rank=4, warmup_steps=2, window=4, warmup="fixed", min_compression_rate=1.0)


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_mixed_dtypes_compress_with_half_precision_on_the_wire(half):
    # float32 and half matrices and 1-D tensors in one model: one P, Q and uncompressed
    # buffer per dtype (a single buffer in the first slot's dtype used to crash here)
    # (wire="native": each buffer in its own dtype; int8 sends one byte whatever the dtype)
    results = run_workers(workers.train_mixed_dtypes, 2, dict(STATIC, wire="native"), 8, half, timeout=240)
    r = results[0]
    assert r["stats"].compressed_steps == 6 and r["stats"].nonfinite_steps == 0
    assert r["groups"] == [
        ((16, 40), "torch.float32", 4, "torch.float32"),
        ((40, 48), f"torch.{half}", 4, "torch.float32"),  # Q works in float32
        ((48, 24), f"torch.{half}", 4, "torch.float32"),
    ]
    # bytes of a compressed step: 1-D tensors whole, P and Q of each matrix in its own dtype
    # (fc1.bias is half (48,), fc3.bias and scale float32 (16,))
    whole = 48 * 2 + 16 * 4 + 16 * 4
    factors = (16 + 40) * 4 * 4 + (40 + 48) * 4 * 2 + (48 + 24) * 4 * 2
    assert r["sent"][2:] == [whole + factors] * 6
    assert torch.equal(results[0]["params"], results[1]["params"])
    assert bool(torch.isfinite(r["params"]).all())


@pytest.mark.parametrize("policy", ["static", "cqm"])
def test_loss_scale_changes_nothing_when_the_state_is_told(policy):
    cfg = dict(policy=policy, max_rank=4, min_rank=2, rank_step=2, window=3, warmup_steps=3,
               iteration_sample_rate=1.0, min_compression_rate=1.0)
    steps = 18
    plain = run_workers(workers.train_scaled, 2, cfg, [1.0] * steps, True, timeout=240)
    # powers of two, changing as a GradScaler's would (growth, then halving after overflow)
    scales = [2.0 ** (10 + (k % 5) - 2 * (k % 3)) for k in range(steps)]
    told = run_workers(workers.train_scaled, 2, cfg, scales, True, timeout=240)
    untold = run_workers(workers.train_scaled, 2, cfg, scales, False, timeout=240)
    torch.testing.assert_close(told[0]["params"], plain[0]["params"], rtol=1e-12, atol=1e-12)
    assert told[0]["ranks"] == plain[0]["ranks"]
    if policy == "cqm":
        for a, b in zip(told[0]["entropies"], plain[0]["entropies"], strict=True):
            assert (math.isnan(a) and math.isnan(b)) or abs(a - b) < 1e-9
    # without being told, the error feedback is added back at the wrong scale
    assert not torch.allclose(untold[0]["params"], plain[0]["params"], rtol=1e-6, atol=1e-9)

"""The EDGC hook under DDP on several gloo processes."""

import pytest
import torch

import workers
from harness import run_workers

# Small windows and alpha = 1 so that 60 steps hold many rank decisions.
DYNAMIC = dict(
    policy="cqm", max_rank=8, min_rank=2, rank_step=2, window=4, warmup_steps=4,
    iteration_sample_rate=1.0, warmup_error_check=False, min_compression_rate=1.0,
)


@pytest.mark.parametrize("world,mode", [pytest.param(2, "pipelined", marks=pytest.mark.smoke), (4, "pipelined"),
                                        (4, "whole-step")])
def test_replicas_bit_identical_while_rank_changes(world, mode):
    results = run_workers(workers.train_and_report, world, dict(DYNAMIC, sync_mode=mode), 60, timeout=240)
    first = results[0]
    assert first["buckets"] >= 3, "the model must span several DDP buckets"
    compressed = [r for r in first["ranks"] if r > 0]
    assert len(compressed) >= 30
    assert len(set(compressed)) >= 2, f"rank never changed: {first['ranks']}"
    for other in results[1:]:
        assert torch.equal(first["params"], other["params"])
        assert other["ranks"] == first["ranks"]
    stats = first["stats"]
    assert stats.compressed_steps == 56 and stats.nonfinite_steps == 0
    assert 0 < stats.bytes_sent < stats.bytes_uncompressed
    # training still learns under compression
    assert sum(first["losses"][-5:]) < 0.5 * sum(first["losses"][:5])


def test_resume_equals_uninterrupted_run():
    # n = 22 stops mid-window, after compression started and the rank has moved.
    out = run_workers(workers.resume_check, 2, DYNAMIC, 22, timeout=240)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])


def test_nonfinite_gradient_passes_through_without_poisoning_buffers():
    cfg = dict(DYNAMIC)
    out = run_workers(workers.nonfinite_check, 2, cfg, 10, 20, timeout=240)
    for r in out:
        assert r["skipped"] == 1  # both replicas saw a non-finite average and skipped the step
        assert r["buffers_finite"] is True
        assert r["stats"].nonfinite_steps == 1
        assert bool(torch.isfinite(r["params"]).all())
    assert torch.equal(out[0]["params"], out[1]["params"])


def test_mismatched_model_raises_clear_error():
    messages = run_workers(workers.mismatch_check, 2, timeout=120)
    for msg in messages:
        assert "does not match this model" in msg


def test_calibrated_max_rank_agrees_across_replicas():
    cfg = dict(DYNAMIC, max_rank=None, min_rank=None, warmup_steps=8)
    results = run_workers(workers.train_and_report, 2, cfg, 24, timeout=240)
    s0, s1 = results[0]["stats"], results[1]["stats"]
    assert s0.max_rank == s1.max_rank >= 4 and s0.max_rank % 4 == 0
    assert s0.min_rank == max(1, s0.max_rank // 4)
    assert s0.phase == "compress"
    assert torch.equal(results[0]["params"], results[1]["params"])


def test_warmup_matches_plain_ddp_average():
    # Compression never starts: the hook must reproduce DDP's own all-reduce average.
    cfg = dict(DYNAMIC, warmup_steps=10_000)
    hooked = run_workers(workers.train_and_report, 2, cfg, 8, timeout=240)
    plain = run_workers(workers.train_plain, 2, 8, timeout=240)
    torch.testing.assert_close(hooked[0]["params"], plain[0]["params"], rtol=1e-5, atol=1e-6)
    stats = hooked[0]["stats"]
    # alpha = 1: one 4 x float64 control all-reduce per step on top of the gradient
    assert stats.bytes_sent == stats.bytes_uncompressed + 8 * 32


BUDGET = dict(DYNAMIC, policy="budget", max_rank=16, min_rank=1, error_budget=0.5, window=3)


def test_budget_policy_moves_group_ranks_apart_and_replicas_stay_identical():
    results = run_workers(workers.train_and_report, 2, BUDGET, 40, timeout=240)
    first = results[0]
    assert torch.equal(first["params"], results[1]["params"])
    assert first["group_ranks"] == results[1]["group_ranks"]
    assert len(set(first["group_ranks"].values())) >= 2, f"one rank for every group: {first['group_ranks']}"
    compressed = [r for r in first["ranks"] if r > 0]
    assert len(set(compressed)) >= 2  # the equivalent rank moved


def test_budget_policy_resumes_exactly_mid_window():
    out = run_workers(workers.resume_check, 2, BUDGET, 23, timeout=240)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])


SPECTRAL = dict(DYNAMIC, policy="spectral", max_rank=16, min_rank=1, window=3)


def test_spectral_policy_moves_group_ranks_from_the_factors_and_replicas_stay_identical():
    results = run_workers(workers.train_and_report, 2, SPECTRAL, 40, timeout=240)
    first = results[0]
    assert torch.equal(first["params"], results[1]["params"])
    assert first["group_ranks"] == results[1]["group_ranks"]
    compressed = [r for r in first["ranks"] if r > 0]
    assert compressed[0] <= 2 and len(set(compressed)) >= 3, f"the ranks did not move from r_min: {compressed}"
    assert len(set(first["group_ranks"].values())) >= 2, f"one rank for every group: {first['group_ranks']}"
    # no entropy sample is taken: the signal is the factors' spectrum
    assert first["stats"].entropy_seconds == 0


def test_spectral_policy_resumes_exactly_mid_window():
    out = run_workers(workers.resume_check, 2, SPECTRAL, 23, timeout=240)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])


def test_warmup_error_check_measures_in_the_chosen_norm():
    cfg = dict(DYNAMIC, warmup_error_check=True, warmup_steps=4, window=4)
    eps = {}
    for norm in ("relative", "l1"):
        results = run_workers(workers.train_and_report, 2, dict(cfg, warmup_error_norm=norm), 9, timeout=240)
        assert results[0]["eps_max"] == results[1]["eps_max"]  # agreed over replicas
        eps[norm] = results[0]["eps_max"]
    assert 0 < eps["relative"] < 1
    # the absolute error is in gradient units, far below the relative one for these small gradients
    assert 0 < eps["l1"] < 0.1 * eps["relative"]

"""The EDGC hook under DDP on several gloo processes."""

import itertools
import math

import pytest
import torch

import workers
from harness import assert_same, run_workers

# Small windows and alpha = 1 so that 60 steps hold many rank decisions, after a fixed
# warm-up of 4 steps.
DYNAMIC = dict(
    policy="cqm", max_rank=8, min_rank=2, rank_step=2, window=4, warmup_steps=4,
    iteration_sample_rate=1.0, warmup="fixed", min_compression_rate=1.0,
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
    # Compression never starts: with the gradient's dtype on the wire, the hook must
    # reproduce DDP's own all-reduce average (int8, the default, rounds it: test_wire.py)
    cfg = dict(DYNAMIC, warmup_steps=10_000, wire="native")
    hooked = run_workers(workers.train_and_report, 2, cfg, 8, timeout=240)
    plain = run_workers(workers.train_plain, 2, 8, timeout=240)
    torch.testing.assert_close(hooked[0]["params"], plain[0]["params"], rtol=1e-5, atol=1e-6)
    stats = hooked[0]["stats"]
    # alpha = 1: one 7 x float64 control all-reduce per step on top of the gradient
    assert stats.bytes_sent == stats.bytes_uncompressed + 8 * 56


def test_warmup_error_check_measures_in_the_chosen_norm():
    cfg = dict(DYNAMIC, warmup="release-check", warmup_steps=4, window=4)
    eps = {}
    for norm in ("relative", "l1"):
        results = run_workers(workers.train_and_report, 2, dict(cfg, warmup_error_norm=norm), 9, timeout=240)
        assert results[0]["eps_max"] == results[1]["eps_max"]  # agreed over replicas
        eps[norm] = results[0]["eps_max"]
    assert 0 < eps["relative"] < 1
    # the absolute error is in gradient units, far below the relative one for these small gradients
    assert 0 < eps["l1"] < 0.1 * eps["relative"]


# "critical": r_max = 8, r_lo = 4 (max_rank // 2); windows of 4 steps after a warm-up of one
CRITICAL = dict(DYNAMIC, policy="critical", critical_threshold=0.25)


def _windows(ranks, start=4, window=4):
    """The rank of each window of compressed steps (asserting that it holds for the window)."""
    out = []
    for w in range(start, len(ranks), window):
        assert len(set(ranks[w : w + window])) == 1, ranks
        out.append(ranks[w])
    return out


@pytest.mark.parametrize("world,mode", [(3, "pipelined"), (2, "whole-step")])
def test_critical_policy_replicas_bit_identical_while_rank_moves_both_ways(world, mode):
    # the learning rate drops tenfold at step 21: seen at the window end of step 24
    results = run_workers(workers.train_and_report, world, dict(CRITICAL, sync_mode=mode), 32, 20, timeout=240)
    first = results[0]
    for other in results[1:]:
        assert torch.equal(first["params"], other["params"])
        assert_same(first["signals"], other["signals"])  # ranks, rho, window norm, drop, noise scale
    ranks = [s[0] for s in first["signals"]]
    assert ranks[:4] == [0] * 4  # warm-up
    windows = _windows(ranks)
    assert windows[0] == 8 and set(windows) == {4, 8}, windows
    assert any(a == 4 and b == 8 for a, b in itertools.pairwise(windows)), f"never rose from r_lo: {windows}"
    assert windows[5] == 8 and first["signals"][23][3] is True  # steps 25-28: the window after the drop
    rhos = [s[1] for s in first["signals"][7::4]]
    assert all(0 <= r < 10 for r in rhos), rhos
    noise = [s[4] for s in first["signals"][3::4]]
    assert math.isfinite(noise[0]) and noise[0] > 0, noise  # (window 1: warm-up, the unbiased average)
    assert math.isfinite(first["stats"].entropy)  # measured for the plots, though the rule does not read it


@pytest.mark.parametrize("mode", ["pipelined", "whole-step"])
def test_critical_signals_are_read_from_the_average_ddp_hands_over(mode):
    # float64: the window norm and noise scale against the same recomputed from p.grad after
    # the sync, on warm-up (uncompressed) and compressed windows; one replica's inf, outside
    # the sampled elements, at a warm-up step (2) and a compressed one (10) leaves those out
    out = run_workers(workers.critical_signal_check, 2, dict(CRITICAL, sync_mode=mode), 16, (2, 10), timeout=240)
    for r in out:
        assert 0 in r["ranks"] and 8 in r["ranks"] and 4 in r["ranks"]
        assert len(r["reported"]) == 4
        assert all(math.isfinite(norm) for norm, _ in r["recomputed"])
        assert math.isfinite(r["recomputed"][0][1])  # (the warm-up window's noise scale)
        for got, want in zip(r["reported"], r["recomputed"], strict=True):
            assert got == pytest.approx(want, rel=1e-9, nan_ok=True)
    assert_same(out[0]["reported"], out[1]["reported"])


def test_critical_policy_resumes_exactly_mid_window():
    # stopped at step 22, mid-window, with a learning-rate drop still to come (step 25)
    out = run_workers(workers.resume_check, 2, CRITICAL, 22, False, 24, timeout=240)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])
        assert_same(r["resumed_signals"], r["straight_signals"])
        assert any(s[3] for s in r["straight_signals"])  # the drop was seen


def test_learning_rate_drop_raises_the_rank_for_one_window_even_when_one_replica_sees_it():
    never = dict(CRITICAL, critical_threshold=1e6)  # rho never reaches it: r_lo but after a drop
    # only replica 0 is told of a drop at step 14; it is agreed at the window end of step 16
    results = run_workers(workers.train_and_report, 2, never, 24, {0: 13}, timeout=240)
    for r in results:
        ranks = [s[0] for s in r["signals"]]
        assert _windows(ranks) == [8, 4, 4, 8, 4], ranks  # windows from step 5
        assert [s[3] for s in r["signals"][3::4]] == [False, False, False, True, False, False]
    results = run_workers(workers.train_and_report, 2, never, 24, timeout=240)  # the control: no drop
    assert _windows([s[0] for s in results[0]["signals"]]) == [8, 4, 4, 4, 4]


def test_switched_off_the_hook_all_reduces_plainly_and_changes_no_state():
    # warm-up 4, 2 compressed steps, 3 with state.enabled = False, 3 on again
    out = run_workers(workers.switch_check, 2, dict(DYNAMIC, policy="static"), timeout=240)
    for r in out:
        assert r["plain"] == [True, True, True]  # each gradient the plain mean, bit for bit
        assert_same(r["before"], r["after"], "state")  # nothing of the state moved, step count included
        assert repr(r["stats_before"]) == repr(r["stats_after"])  # (repr: nan equals nan)
        end = r["stats_end"]
        assert end.compressed_steps == r["stats_before"].compressed_steps + 3 and end.step_rank > 0
    assert torch.equal(out[0]["params"], out[1]["params"])

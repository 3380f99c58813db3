"""The "noise" rank policy and the warm-up the gradient ends, under DDP on several gloo
processes: replicas agree bit for bit, each window's rank is the rule applied to the
noise scale the replicas measured, a resumed run equals an uninterrupted one, and the
warm-up ends at the first check whose rank-r_max error is small enough."""

import pytest
import torch

import workers
from edgc.policy.noise import next_noise_rank
from harness import assert_same, run_workers

# r_max 8, r_min 2, windows of 4 steps after a warm-up of 4; gamma 2 so that the toy model's
# noise scale moves the rank within a few windows
NOISE = dict(policy="noise", max_rank=8, min_rank=2, rank_step=2, window=4, warmup_steps=4,
             iteration_sample_rate=1.0, warmup="fixed", min_compression_rate=1.0,
             noise={"exponent": 2.0})


def _expected_ranks(signals, world, window=4, start=4, r_max=8, r_min=2, step=2, gamma=2.0):
    """Each compressed window's rank, recomputed from the noise scale reported at the window
    end before it: r_max first, then the rule (edgc.policy.noise) moved at most `step`."""
    rank, out = r_max, []
    for end in range(start, len(signals) - window + 1, window):
        if end > start:
            noise = signals[end - 1][4]  # (the window that ended at step `end`)
            rank = next_noise_rank(noise, world, rank, r_min=r_min, r_max=r_max, exponent=gamma, rank_step=step,
                                   multiple=2)
        out.append(rank)
    return out


@pytest.mark.parametrize("world,mode", [(3, "pipelined"), (2, "whole-step")])
def test_noise_policy_follows_the_agreed_noise_scale_and_replicas_stay_identical(world, mode):
    results = run_workers(workers.train_and_report, world, dict(NOISE, sync_mode=mode), 40, timeout=240)
    first = results[0]
    for other in results[1:]:
        assert torch.equal(first["params"], other["params"])
        assert_same(first["signals"], other["signals"])
    ranks = [s[0] for s in first["signals"]]
    assert ranks[:4] == [0] * 4  # warm-up
    windows = [ranks[w] for w in range(4, 40, 4)]
    for w, r in zip(range(4, 40, 4), windows, strict=True):
        assert set(ranks[w : w + 4]) == {r}, ranks
    assert windows == _expected_ranks(first["signals"], world), (windows, [s[4] for s in first["signals"][3::4]])
    assert len(set(windows)) >= 2, f"the rank never moved: {windows}"


def test_noise_policy_resumes_exactly_mid_window():
    out = run_workers(workers.resume_check, 2, NOISE, 22, timeout=240)  # (stops mid-window)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])
        assert_same(r["resumed_signals"], r["straight_signals"])
        assert len({s[0] for s in r["straight_signals"][4:]}) >= 2  # the rank moved


# the warm-up the gradient ends: checks every third step (alpha 1/3), at most 20 steps
GATED = dict(NOISE, policy="static", warmup_steps=20, iteration_sample_rate=1 / 3, warmup="gradient")


@pytest.mark.parametrize("max_error, min_steps, first_compressed", [
    (1.0, 0, 4),  # any error passes: compression starts after the first check, at step 3
    (1.0, 7, 8),  # ... at step 3, but no compression before step 7 has ended
    (1e-12, 0, 21),  # none does: the warm-up lasts warmup_steps, its cap
])
def test_warmup_ends_at_the_first_check_with_a_small_enough_error(max_error, min_steps, first_compressed):
    cfg = dict(GATED, warmup_max_error=max_error, warmup_min_steps=min_steps)
    results = run_workers(workers.train_and_report, 2, cfg, 24, timeout=240)
    for r in results:
        ranks = [s[0] for s in r["signals"]]
        assert ranks.index(8) + 1 == first_compressed, ranks
        assert all(x == 0 for x in ranks[: first_compressed - 1]) and all(x == 8 for x in ranks[first_compressed - 1 :])
    assert_same(results[0]["signals"], results[1]["signals"])

"""The pipelined sync mode against the whole-step one, under DDP on several gloo processes."""

import pytest
import torch

import workers
from harness import run_workers
from test_hook_ddp import DYNAMIC

# (the gradient's dtype on the wire: a quantized format's blocks follow how the buffers are
# cut, so the modes would agree only up to its rounding; every bucket its own unit, max_units=0,
# so that the pipelined mode's lag of one bucket shows)
STATIC = dict(policy="static", max_rank=4, warmup_steps=2, warmup="fixed",
              min_compression_rate=1.0, wire="native", max_units=0)


def _assert_same_maths(run, whole):
    """`run`'s averaged gradients, error feedback and Q equal the whole-step run's, up to
    the float order of the sums (float64: a few units in the last place of the entries,
    which the orthogonalisation carries into Q)."""
    for a, b in zip(whole["grads"], run["grads"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14)
    for key in whole["error"]:
        torch.testing.assert_close(run["error"][key], whole["error"][key], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(run["q"][key], whole["q"][key], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("world", [2, 3])
def test_both_modes_give_the_same_average_and_residuals_in_float64(world):
    steps = 8
    results = run_workers(workers.compare_modes, world, STATIC, steps, 0.005, timeout=300)
    for r in results:
        whole, piped = r["whole-step"], r["pipelined"]
        assert piped["buckets"] >= 4, "the model must span several DDP buckets"
        assert piped["group_sizes"] == [1, 1, 1, 3]  # mixed shapes, and one shape three times
        assert whole["stats"].compressed_steps == piped["stats"].compressed_steps == steps - 2
        assert whole["stats"].bytes_sent == piped["stats"].bytes_sent
        # (with 3 replicas the sums' float order depends on how the buffers are cut)
        _assert_same_maths(piped, whole)
        # the whole-step mode issues at the last bucket only; the pipelined one during the
        # backward pass (after DDP's first step, which is one bucket of everything)
        assert all(last for step, _, last, _, _ in whole["issued"] if step >= 2)
        early = [b for step, b, last, _, _ in piped["issued"] if step >= 3 and not last]
        assert len(early) >= 2 * (steps - 2) * (piped["buckets"] - 2)
    for mode in ("whole-step", "pipelined"):
        sequences = [[(s, b, n, d) for s, b, _, n, d in r[mode]["issued"]] for r in results]
        assert all(seq == sequences[0] for seq in sequences[1:]), f"{mode}: replicas issued different collectives"
    if world == 2:  # sums of two are exact whatever the order: the modes agree bit for bit
        for a, b in zip(results[0]["whole-step"]["grads"], results[0]["pipelined"]["grads"], strict=True):
            assert torch.equal(a, b)


# The rank drops from 8 to 2 at step 10. At rank 8 each of StackNet's buckets puts more than
# min_unit_mb (4000 bytes) on the wire: each holds a matrix, the smallest (40, 40) one sending
# (40 + 40) * 8 float64 elements, 5120 bytes. At rank 2 each sends less, and runs are merged.
SCHEDULED = dict(DYNAMIC, policy="schedule", schedule_ranks="0:8,10:2", wire="native", max_units=0)
COARSE = {"whole-step": {"sync_mode": "whole-step"}, "pipelined": {"sync_mode": "pipelined"},
          "coarse": {"sync_mode": "pipelined", "min_unit_mb": 0.004}}


def test_coarse_units_issue_fewer_collectives_and_give_the_whole_step_average():
    steps = 14
    results = run_workers(workers.compare_modes, 2, SCHEDULED, steps, 0.005, COARSE, timeout=300)
    for r in results:
        whole, piped, coarse = r["whole-step"], r["pipelined"], r["coarse"]
        assert coarse["ranks"] == [0] * 4 + [8] * 5 + [2] * 5
        per_step = {name: [sum(1 for s, *_ in r[name]["issued"] if s == step) for step in range(1, steps + 1)]
                    for name in COARSE}
        # rank 8: every bucket is a unit of its own; rank 2: fewer units, but more than one
        for step, rank in enumerate(coarse["ranks"], start=1):
            n = {name: counts[step - 1] for name, counts in per_step.items()}
            if rank == 8:
                assert n["coarse"] == n["pipelined"], (step, n)
            elif rank == 2:
                assert n["whole-step"] < n["coarse"] < n["pipelined"], (step, n)
        assert any(not last for s, _, last, _, _ in coarse["issued"] if s > 10)  # still overlapped
        assert coarse["units"] == piped["units"]  # the plan kept is DDP's layout, not the merged units
        assert coarse["stats"].bytes_sent == whole["stats"].bytes_sent
        _assert_same_maths(coarse, whole)
    a, b = results[0]["coarse"], results[1]["coarse"]
    assert a["issued"] == b["issued"]  # the same collectives in the same order
    for x, y in zip(a["grads"], b["grads"], strict=True):  # replicas bit-identical
        assert torch.equal(x, y)


def test_coarse_units_resume_on_3_replicas_equals_uninterrupted_run():
    # the resumed job's first step (one DDP bucket) must be cut into the same merged units
    out = run_workers(workers.resume_check, 3, dict(DYNAMIC, min_unit_mb=0.006), 22, timeout=300)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])


@pytest.mark.parametrize("mode", ["pipelined", "whole-step"])
def test_nonfinite_late_bucket_leaves_every_replica_s_buffers_untouched(mode):
    cfg = dict(DYNAMIC, sync_mode=mode)
    out = run_workers(workers.nonfinite_late_bucket_check, 2, cfg, 10, 16, timeout=240)
    for r in out:
        assert r["untouched"] is True
        assert r["skipped"] == 1 and r["stats"].nonfinite_steps == 1
        assert not all(r["finite_buckets"])
        assert bool(torch.isfinite(r["params"]).all())
    assert torch.equal(out[0]["params"], out[1]["params"])
    assert out[0]["finite_buckets"] == out[1]["finite_buckets"]


def test_pipelined_resume_on_3_replicas_equals_uninterrupted_run():
    # With 3 replicas the sums' float order depends on the cut into units: the resumed
    # job's first step (one DDP bucket) must be cut as the uninterrupted run's was.
    # (test_hook_ddp resumes 2 replicas, whose sums are exact in any order.)
    out = run_workers(workers.resume_check, 3, DYNAMIC, 22, timeout=300)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])


def test_a_state_saved_before_the_pipelined_mode_resumes():
    # (edgc 0.1 sent everything in the gradient's dtype: its states load with wire="native")
    out = run_workers(workers.resume_check, 2, dict(DYNAMIC, wire="native"), 22, True, timeout=240)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])

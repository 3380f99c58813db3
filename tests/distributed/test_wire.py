"""The wire formats of the factors (EDGCConfig.wire) on 2 gloo processes: what is sent plus
what is kept equals the input, replicas stay bit-identical and resume exactly, and a
non-finite step is skipped alike on every replica."""

import pytest
import torch

import wire_workers
import workers
from harness import run_workers
from test_hook_ddp import DYNAMIC

FORMATS = ("bf16", "int8", "fp8")
# what the invariant's run sends whole in 6 steps: its first step and 5 biases, in float64
WHOLE_BYTES = 8 * (sum(a * b for a, b in wire_workers.SHAPES[:3]) + 9 * 6)


@pytest.mark.parametrize("wire,state_dtype", [("native", "native"), ("bf16", "native"), ("int8", "native"),
                                              ("fp8", "native"), ("int8", "bf16")])
def test_sent_plus_kept_equals_input_in_float64(wire, state_dtype):
    out = run_workers(wire_workers.error_feedback_invariant, 2, wire, state_dtype, 6)
    for r in out:
        assert r["checked"] == 5
        # bf16 state rounds what is kept: the sum holds to bf16's precision, not float64's
        assert r["worst"] < (1e-2 if state_dtype == "bf16" else 1e-12)
    assert torch.equal(out[0]["params"], out[1]["params"])
    for a, b in zip(out[0]["sent"], out[1]["sent"], strict=True):
        assert torch.equal(a, b)  # every replica dequantized the same sums


def test_quantized_factors_are_sent_rounded_and_count_fewer_bytes():
    native = run_workers(wire_workers.error_feedback_invariant, 2, "native", "native", 6)[0]
    for wire, most, near in (("int8", 0.3, 0.05), ("fp8", 0.3, 0.15), ("bf16", 0.55, 0.02)):
        out = run_workers(wire_workers.error_feedback_invariant, 2, wire, "native", 6)[0]
        assert not torch.equal(out["sent"][0], native["sent"][0])  # the factors were rounded on the way
        # the first compressed step (one average per matrix, from the same gradients and Q)
        # is float64's up to the format's rounding; later steps follow their own error feedback
        first = zip(out["sent"][:3], native["sent"][:3], strict=True)
        close = max(float((a - b).abs().max() / b.abs().max()) for a, b in first)
        assert close < near, f"{wire}: the first averages sent differ from float64's by {close}"
        # (the uncompressed warm-up step and the bias travel whole, in float64, in both)
        assert out["bytes"] < most * native["bytes"] + WHOLE_BYTES


@pytest.mark.parametrize("wire", FORMATS)
def test_replicas_bit_identical_while_rank_changes(wire):
    results = run_workers(workers.train_and_report, 2, dict(DYNAMIC, wire=wire), 40, timeout=240)
    first, other = results
    compressed = [r for r in first["ranks"] if r > 0]
    assert len(set(compressed)) >= 2, f"rank never changed: {first['ranks']}"
    assert torch.equal(first["params"], other["params"])
    assert sum(first["losses"][-5:]) < 0.5 * sum(first["losses"][:5])


@pytest.mark.parametrize("wire,state_dtype", [("int8", "native"), ("fp8", "bf16")])
def test_resume_equals_uninterrupted_run(wire, state_dtype):
    out = run_workers(workers.resume_check, 2, dict(DYNAMIC, wire=wire, state_dtype=state_dtype), 22, timeout=240)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])


def test_nonfinite_quantized_step_is_skipped_on_every_replica():
    out = run_workers(workers.nonfinite_check, 2, dict(DYNAMIC, wire="int8"), 10, 20, timeout=240)
    for r in out:
        assert r["skipped"] == 1
        assert r["buffers_finite"] is True
        assert r["stats"].nonfinite_steps == 1
    assert torch.equal(out[0]["params"], out[1]["params"])


@pytest.mark.parametrize("wire", ["native", "int8"])
def test_alternating_sends_one_factor_a_step_and_keeps_the_invariant(wire):
    out = run_workers(wire_workers.error_feedback_invariant, 2, wire, "native", 6, True)
    both = run_workers(wire_workers.error_feedback_invariant, 2, wire, "native", 6, False)
    for r in out:
        assert r["checked"] == 5
        assert r["worst"] < 1e-12
    assert torch.equal(out[0]["params"], out[1]["params"])
    for a, b in zip(out[0]["sent"], out[1]["sent"], strict=True):
        assert torch.equal(a, b)
    # (the warm-up step and the biases travel whole in both; the factors about half)
    assert out[0]["bytes"] - WHOLE_BYTES < 0.6 * (both[0]["bytes"] - WHOLE_BYTES)


@pytest.mark.parametrize("wire", ["native", "int8"])
def test_alternating_replicas_identical_and_resume_exactly(wire):
    results = run_workers(workers.train_and_report, 2, dict(DYNAMIC, wire=wire, alternate=True), 40, timeout=240)
    first, other = results
    assert len({r for r in first["ranks"] if r > 0}) >= 2, f"rank never changed: {first['ranks']}"
    assert torch.equal(first["params"], other["params"])
    assert sum(first["losses"][-5:]) < 0.5 * sum(first["losses"][:5])
    out = run_workers(workers.resume_check, 2, dict(DYNAMIC, wire=wire, alternate=True), 21, timeout=240)
    for r in out:
        assert r["resumed"] == r["straight"]
        assert torch.equal(r["resumed_params"], r["straight_params"])

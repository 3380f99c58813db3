"""The wire formats (EDGCConfig.wire) on 2 gloo processes: what is sent plus
what is kept equals the input, replicas stay bit-identical and resume exactly, and a
non-finite step is skipped alike on every replica."""

import math

import pytest
import torch

import wire_workers
import workers
from edgc.comm.wire import BLOCK, codec, quantized_bytes
from harness import run_workers
from test_hook_ddp import DYNAMIC

FORMATS = ("bf16", "int8", "int4", "fp8")
# what the invariant's run sends whole in 6 steps in float64: its first step and 5 biases
# (fewer in the other formats)
WHOLE_BYTES = 8 * (sum(a * b for a, b in wire_workers.SHAPES[:3]) + 9 * 6)


@pytest.mark.parametrize("wire,state_dtype", [("native", "native"), ("bf16", "native"), ("int8", "native"),
                                              ("int4", "native"), ("fp8", "native"), ("int8", "bf16")])
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
    for wire, most, near in (("int8", 0.3, 0.05), ("int4", 0.17, 0.5), ("fp8", 0.3, 0.15), ("bf16", 0.55, 0.02)):
        out = run_workers(wire_workers.error_feedback_invariant, 2, wire, "native", 6)[0]
        assert not torch.equal(out["sent"][0], native["sent"][0])  # the factors were rounded on the way
        # the first compressed step (one average per matrix, from the same gradients and Q)
        # is float64's up to the format's rounding; later steps follow their own error feedback
        first = zip(out["sent"][:3], native["sent"][:3], strict=True)
        close = max(float((a - b).abs().max() / b.abs().max()) for a, b in first)
        assert close < near, f"{wire}: the first averages sent differ from float64's by {close}"
        # (the uncompressed warm-up step and the bias travel whole: fewer bytes than float64's too)
        assert out["bytes"] < most * native["bytes"] + WHOLE_BYTES


@pytest.mark.parametrize("wire", ["native", *FORMATS])
def test_tensors_sent_whole_travel_in_the_wire_format(wire):
    # an uncompressed step: every tensor whole, each starting a block of its own
    out = run_workers(wire_workers.whole_tensors, 2, wire)
    assert out[0]["rank"] == 0
    assert torch.equal(out[0]["averages"], out[1]["averages"])  # one sum on every replica
    sizes = [math.prod(s) for s in wire_workers.SHAPES]
    if wire == "native":
        assert out[0]["worst"] < 1e-15
        assert out[0]["bytes"] == 8 * sum(sizes)
    elif wire == "bf16":
        assert 0 < out[0]["worst"] < 2**-7
        assert out[0]["bytes"] == 2 * sum(sizes)
    else:
        # each tensor's blocks are its own: every one keeps its own precision although
        # their magnitudes are 10^2 apart (int8: 2 roundings of 1/254 of a block's largest).
        # An uncompressed step on the int4 wire travels at int8: nothing keeps its rounding
        assert 0 < out[0]["worst"] < (0.01 if wire in ("int8", "int4") else 0.1)
        # about a byte an element, and a scale a block, in each bucket's buffer, padded to a
        # whole number of blocks for each of the 2 replicas
        padded = sum(n + (-n % BLOCK) for n in sizes)
        most = padded + len(sizes) * (2 * BLOCK - 1)
        code = codec("int8" if wire == "int4" else wire)
        assert quantized_bytes(padded, 2, code) <= out[0]["bytes"] <= quantized_bytes(most, 2, code)


@pytest.mark.parametrize("wire", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("world", [2, 4])
def test_each_replica_sums_whole_blocks(wire, world):
    # 5 blocks of magnitudes 10^-4 to 10^4: split into `world` chunks of 5/world blocks,
    # a chunk would start inside a block and every block of it would hold two blocks'
    # halves, the small half rounded on the large half's scale
    out = run_workers(wire_workers.quantized_sum_blocks, world, wire, 5)
    for r in out[1:]:
        assert torch.equal(r["sum"], out[0]["sum"])  # the same bytes dequantized everywhere
    # (int8: each of the `world` values rounded by up to 1/254 of its block's largest, the
    # sum once more; the split blocks of before were off by 0.6 to 0.85)
    assert 0 < out[0]["worst"] < {"int8": 0.02, "int4": 0.3}.get(wire, 0.1)
    assert out[0]["bytes"] == quantized_bytes(5 * BLOCK, world, codec(wire))


@pytest.mark.parametrize("wire", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("world", [2, 4])
def test_two_replicas_round_once(wire, world):
    # 2 replicas: one all-gather of each one's buffer, summed as it arrived; more: the
    # reduce-scatter's sums are rounded again for the all-gather
    out = run_workers(wire_workers.quantized_sum_blocks, world, wire, 4)
    once = [torch.equal(r["sum"], r["rounded_once"]) for r in out]
    assert once == [world == 2] * world
    # the same bytes: a replica's buffer, once (codes and a scale a block)
    code_bytes = 4 * BLOCK // (2 if wire == "int4" else 1)
    assert out[0]["bytes"] == (code_bytes + 2 * 4 if world == 2 else quantized_bytes(4 * BLOCK, world, codec(wire)))


def test_half_precision_tensors_sent_whole_keep_small_values():
    # fp16 gradients of 1e-6 to 1: summed and dequantized in float32 (an fp16 scale of a
    # block of values near 1e-6 would underflow and send zeros)
    out = run_workers(wire_workers.whole_tensors, 2, "int8", "float16", 1e-6)
    assert torch.equal(out[0]["averages"], out[1]["averages"])
    # (the averages near 1e-6 are fp16 subnormals, spaced 6e-8 apart: a few percent of their
    # largest; sent as zeros, the error would be 1)
    assert 0 < out[0]["worst"] < 0.1


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
def test_rank_calibration_probes_in_the_wire_format(wire):
    # max_rank=None: a warm-up step also times a compressed round at a probe rank, whose P
    # and Q must travel as the compressed steps' will (else it weighs float bytes against
    # an int8 uncompressed sum)
    out = run_workers(wire_workers.calibration_probe, 2, wire)
    assert out[0]["points"] == out[1]["points"] and len(out[0]["points"]) == 1
    r = out[0]["points"][0][0]
    mats = [s for s in wire_workers.SHAPES if len(s) == 2]
    p, q = ([s[side] * min(r, *s) for s in mats] for side in (0, 1))
    if wire == "native":
        probe = 8 * (sum(p) + sum(q))
    else:  # one buffer each for P and Q, every matrix starting a block of its own
        probe = sum(quantized_bytes(sum(n + (-n % BLOCK) for n in f), 2) for f in (p, q))
    # (and the two timings agreed as their maximum: 2 float64)
    assert out[0]["calibrated"] - out[0]["fixed"] == probe + 16

"""edgc.diloco.DiLoCo on 2 and 4 gloo processes, through its own door: a user's loop."""

import pytest
import torch

import diloco_workers
from harness import run_workers

pytestmark = pytest.mark.slow

#: edgc's core on the pseudo-gradient: a short warm-up and window, counted in outer steps
EDGC = dict(max_rank=4, min_rank=2, window=2, warmup="fixed", warmup_steps=1, min_compression_rate=1.0,
            iteration_sample_rate=1.0)
#: the same on the int4 wire, where DiLoCo keeps the error feedback of all of Δ
EDGC_INT4 = dict(EDGC, wire="int4")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("compression", [None, EDGC, EDGC_INT4], ids=["diloco", "edgc-diloco", "edgc-diloco-int4"])
def test_replicas_hold_the_same_weights_after_every_outer_step(world, compression):
    out = run_workers(diloco_workers.train, world, 5, 20, compression, timeout=180)
    assert sorted(out[0]["digests"]) == [5, 10, 15, 20]
    for r in out[1:]:
        assert r["digests"] == out[0]["digests"]
    assert len({r["final"] for r in out}) == 1
    stats = out[0]["stats"]
    whole = 4 * sum(p.numel() for p in diloco_workers._model().parameters())  # (float32 bytes, one sync)
    assert stats.step == 20 and stats.bytes_uncompressed == 20 * whole
    assert stats.comm_seconds > 0  # (the outer syncs are timed, whole or compressed)
    if compression is None:
        assert stats.bytes_sent == 4 * whole  # (1/H of DDP's bytes)
    else:
        assert stats.compressed_steps == 3 and 0 < stats.bytes_sent < 4 * whole


def test_edgc_diloco_at_full_rank_takes_diloco_s_outer_steps():
    """At full rank on the native wire the compressor loses nothing, so edgc-diloco (which
    compresses Δ minus the outer momentum's prediction, and adds that back) takes the
    outer steps plain DiLoCo takes, up to float32 rounding."""
    lossless = dict(EDGC, max_rank=64, min_rank=64, wire="native", min_compression_rate=0.1)
    plain = run_workers(diloco_workers.train, 2, 5, 20, None, timeout=180)
    full = run_workers(diloco_workers.train, 2, 5, 20, lossless, timeout=180)
    assert full[0]["stats"].compressed_steps == 3 and full[0]["stats"].rank == 64
    for a, b in zip(plain[0]["weights"], full[0]["weights"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_int4_wire_keeps_what_every_replica_sent_less_what_was_applied():
    """On the int4 wire DiLoCo keeps the error feedback of all of Δ, the core none: at every
    outer step, what the replicas handed the core less what they kept averages to exactly
    what was applied (float64), for the compressed matrices and the tensors sent whole
    alike, and the rounding it absorbs is not small."""
    out = run_workers(diloco_workers.int4_error_feedback, 2, 12, timeout=180)
    assert [r["core_error_feedback"] for r in out] == [False, False]
    assert out[0]["stats"].compressed_steps >= 4
    for t in range(6):
        assert torch.equal(out[0]["applied"][t], out[1]["applied"][t])  # one average on every replica
        recovered = (out[0]["sent"][t] - out[0]["kept"][t] + out[1]["sent"][t] - out[1]["kept"][t]) / 2
        torch.testing.assert_close(recovered, out[0]["applied"][t], rtol=0, atol=1e-15)
        # the last bias, always sent whole: its average was rounded by 4-bit codes, each
        # replica's by up to half a code step, 1/14 of its block's largest value (so the
        # invariant above holds for it only because the kept error absorbs that)
        mine, other = out[0]["sent"][t][-40:], out[1]["sent"][t][-40:]
        lost = float(((mine + other) / 2 - out[0]["applied"][t][-40:]).abs().max())
        assert 0 < lost <= (float(mine.abs().max()) + float(other.abs().max())) / 28 * (1 + 2**-7)
        # and each replica keeps only its own rounding of it, not its difference from the
        # average (which the next outer steps would sum)
        for r in out:
            kept, sent = r["kept"][t][-40:], r["sent"][t][-40:]
            assert 0 < float(kept.abs().max()) <= float(sent.abs().max()) / 14 * (1 + 2**-7)


@pytest.mark.parametrize("compression", [None, EDGC, EDGC_INT4], ids=["diloco", "edgc-diloco", "edgc-diloco-int4"])
def test_a_run_resumed_mid_phase_equals_the_uninterrupted_one(compression):
    """Stopped after 12 inner steps (H = 5: two into the third phase), each replica's model,
    optimiser and DiLoCo state restored: the rest is bit for bit the uninterrupted run's."""
    whole = run_workers(diloco_workers.train, 2, 5, 20, compression, 12, timeout=180)
    saves = [r["saved"] for r in whole]
    resumed = run_workers(diloco_workers.train, 2, 5, 20, compression, None, saves, timeout=180)
    for a, b in zip(whole, resumed, strict=True):
        assert b["losses"] == a["losses"][12:]
        assert b["digests"] == {k: v for k, v in a["digests"].items() if k > 12}
        assert b["final"] == a["final"]
        assert _untimed(a["stats"]) == _untimed(b["stats"])
        # the outer syncs' time so far travels in the state, and the resumed run adds to it
        assert 0 < a["saved"]["diloco"]["comm_seconds"] < b["stats"].comm_seconds


def _untimed(stats):
    """The stats without their timings, NaN as None (NaN equals nothing)."""
    return {k: None if v != v else v for k, v in vars(stats).items() if not k.endswith("_seconds")}

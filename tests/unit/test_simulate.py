"""`edgc simulate`: the α–β model, the cluster layout, DAC, and a hand-computed projection."""

import argparse
import math
import random

import pytest

from edgc.bench.simulate import (
    ClusterSpec,
    CostProfile,
    EntropyCost,
    SimOptions,
    add_parser,
    bundled_clusters,
    load_cluster,
    parse_bandwidth,
    parse_schedule,
    ring_allreduce_time,
    simulate,
    stage_gradients,
    stage_sync,
)
from edgc.models.gpt2 import build_model
from edgc.policy.dac import dac_ranks


def _cluster(**overrides) -> ClusterSpec:
    """A tiny hand cluster: the tiny preset on 4 GPUs, PP2 x DP2."""
    values = {"name": "hand", "preset": "tiny", "gpus": 4, "tp": 1, "pp": 2, "dp": 2, "bandwidth": 1e8,
              "latency": 1e-5, "gpus_per_node": 1, "step_compute_s": 1.0, "micro_batch": 1, "global_batch": 8,
              "seq_len": 128, "backward_fraction": 0.5, "steps": 10}
    values.update(overrides)
    return ClusterSpec(**values)


# --- ring all-reduce


def test_ring_allreduce_time_hand_computed():
    # N=4: 2(N-1) = 6 latency terms, 2(N-1)/N = 1.5 bandwidth terms
    assert ring_allreduce_time(1e6, 4, 1.25e8, 1e-5) == pytest.approx(2 * 3 * 1e-5 + 1.5 * 1e6 / 1.25e8, rel=1e-12)
    assert ring_allreduce_time(1e6, 2, 1e9, 0.0) == pytest.approx(1e6 / 1e9, rel=1e-12)  # N=2: S/B
    assert ring_allreduce_time(1e6, 1, 1e9, 1e-5) == 0.0  # nothing to reduce with


# --- cluster description


def test_layout_error_shows_the_arithmetic():
    with pytest.raises(ValueError, match=r"tp\(4\) \* pp\(4\) \* dp\(2\) != gpus\(30\) \(the product is 32\)"):
        _cluster(gpus=30, tp=4, pp=4, dp=2)


def test_global_batch_must_split_into_micro_batches():
    with pytest.raises(ValueError, match=r"global_batch\(10\).*micro_batch\(4\) \* dp\(2\) = 8"):
        _cluster(micro_batch=4, global_batch=10)


def test_compute_time_given_or_from_flops_not_both():
    with pytest.raises(ValueError, match="exactly one of step_compute_s and achieved_flops"):
        _cluster(achieved_flops=1e12)
    c = _cluster(step_compute_s=None, achieved_flops=1e12)
    # 6 * params * tokens / (gpus * flops), tokens = 8 sequences * 128
    assert c.compute_seconds(1_000_000) == pytest.approx(6 * 1e6 * 8 * 128 / (4 * 1e12), rel=1e-12)


def test_parse_bandwidth():
    assert parse_bandwidth("100gbit") == pytest.approx(100e9 / 8)
    assert parse_bandwidth("200mbit") == pytest.approx(200e6 / 8)
    assert parse_bandwidth("25Gbit") == pytest.approx(25e9 / 8)
    assert parse_bandwidth("25Gbps") == pytest.approx(25e9)  # tc syntax: bps = bytes per second
    assert parse_bandwidth(1.25e8) == 1.25e8  # numbers are bytes/s
    for bad in ("fast", "100", "-5gbit", 0, -1.0, True):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


def test_ring_bandwidth_is_shared_by_the_node_gpus():
    c = _cluster(bandwidth="100gbit", gpus_per_node=8)
    assert c.ring_bandwidth == pytest.approx(100e9 / 8 / 8)
    assert _cluster(bandwidth="100gbit", gpus_per_node=8, link_sharing=2).ring_bandwidth == pytest.approx(100e9 / 8 / 2)


def test_bundled_paper_clusters_load():
    assert {"paper-2.5b", "paper-12.1b"} <= set(bundled_clusters())
    small, big = load_cluster("paper-2.5b"), load_cluster("paper-12.1b")
    assert (small.preset, small.gpus, small.tp, small.pp, small.dp, small.micro_batch, small.seq_len) == (
        "gpt2-2.5b", 32, 4, 4, 2, 4, 1024)
    assert (big.preset, big.gpus, big.tp, big.pp, big.dp, big.micro_batch, big.seq_len) == (
        "gpt2-12.1b", 64, 4, 4, 4, 4, 1024)
    assert small.global_batch in (64, 128) and big.global_batch in (64, 128)
    with pytest.raises(ValueError, match="unknown cluster"):
        load_cluster("paper-7b")


def test_cluster_from_toml_rejects_unknown_keys(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('preset = "tiny"\ngpus = 2\ntp = 1\npp = 1\ndp = 2\nbandwidth = "1gbit"\nlatency = 0.0\n'
                    'step_compute_s = 1.0\nglobal_batch = 8\nbandwith = 3\n')
    with pytest.raises(ValueError, match=r"no field\(s\) \['bandwith'\]"):
        load_cluster(str(path))
    path.write_text(path.read_text().replace("bandwith = 3\n", ""))
    c = load_cluster(str(path))
    assert c.name == "c" and c.bandwidth == pytest.approx(1e9 / 8)


# --- gradient shards


def test_stage_gradients_megatron_split():
    model = build_model("tiny", device="meta")  # 4 blocks, C = 128, V = 2048, block_size 128
    s0, s1 = stage_gradients(model, tp=2, pp=2, layout="megatron")
    assert s0.shapes[:2] == ((1024, 128), (128, 128))  # wte split along the vocabulary; wpe whole
    block = s0.shapes[2:14]
    assert block == (
        (128,), (128,),  # ln_1 replicated
        (192, 128), (192,),  # qkv: column-parallel, bias split
        (128, 64), (128,),  # attn proj: row-parallel, bias replicated
        (128,), (128,),  # ln_2
        (256, 128), (256,),  # fc: column-parallel
        (128, 256), (128,),  # mlp proj: row-parallel
    )
    assert len(s0.shapes) == 2 + 2 * 12 and len(s1.shapes) == 2 * 12 + 2  # 2 blocks each; ln_f last
    assert s1.shapes[-2:] == ((128,), (128,))
    # pp=3 over 4 blocks: 2, 1, 1
    counts = [sum(1 for s in st.shapes if s == (384, 128))
              for st in stage_gradients(model, tp=1, pp=3, layout="megatron")]
    assert counts == [2, 1, 1]
    # tp=1: the shards are the whole model, the tied head counted once
    assert sum(st.numel for st in stage_gradients(model, tp=1, pp=2, layout="megatron")) == model.num_parameters()


def test_stage_gradients_vocab_and_whole_layouts_put_the_heads_copy_on_the_last_stage():
    model = build_model("tiny", device="meta")
    s0, s1 = stage_gradients(model, tp=2, pp=2)  # (the default, "vocab": what edgc train --tp syncs)
    megatron = stage_gradients(model, tp=2, pp=2, layout="megatron")
    assert s0.shapes == megatron[0].shapes and s0.shapes[0] == (1024, 128)
    assert s1.shapes == (*megatron[1].shapes, (1024, 128))  # the last stage's copy of the tied matrix, split
    w0, w1 = stage_gradients(model, tp=2, pp=2, layout="whole")  # (--no-vocab-parallel)
    assert w0.shapes[0] == (2048, 128) and w0.shapes[1:] == megatron[0].shapes[1:]
    assert w1.shapes == (*megatron[1].shapes, (2048, 128))
    [vocab] = stage_gradients(model, tp=2, pp=1)
    [whole] = stage_gradients(model, tp=2, pp=1, layout="whole")
    assert vocab.shapes[0] == (1024, 128) and whole.shapes[0] == (2048, 128)
    assert vocab.shapes[1:] == whole.shapes[1:] and (2048, 128) not in whole.shapes[1:]
    # tp=1, pp=2: the tied matrix on both ends, whole, in either layout
    assert stage_gradients(model, tp=1, pp=2)[1].shapes[-1] == (2048, 128)
    with pytest.raises(ValueError, match="unknown tensor-parallel layout 'sharded'"):
        stage_gradients(model, tp=2, pp=1, layout="sharded")


def test_powersgd_bytes_are_m_plus_n_times_r():
    c = _cluster()
    opts = SimOptions(rank_max=8)
    stage = stage_gradients(build_model("tiny", device="meta"), 1, 2, layout="megatron")[1]
    profile = CostProfile()
    for m, n in {(384, 128), (128, 128), (512, 128), (128, 512)}:
        profile.lowrank[(m, n, 8)] = 0.0
    sync = stage_sync(stage, 8, c, profile, opts, entropy=False)
    # stage 1 = 2 blocks: matrices (384,128), (128,128), (512,128), (128,512) twice
    sum_m, sum_n = 2 * (384 + 128 + 512 + 128), 2 * (128 + 128 + 128 + 512)
    rest = 2 * (4 * 128 + 384 + 128 + 512 + 128) + 2 * 128  # LN, biases, ln_f
    assert sync.bytes == 2 * ((sum_m + sum_n) * 8 + rest)

    def ring(elems):
        return ring_allreduce_time(2 * elems, 2, 1e8, 1e-5)

    assert sync.wire_s == pytest.approx(ring(rest) + ring(sum_m * 8) + ring(sum_n * 8), rel=1e-12)
    plain = stage_sync(stage, None, c, profile, opts, entropy=False)
    assert plain.bytes == 2 * stage.numel and plain.wire_s == pytest.approx(ring(stage.numel), rel=1e-12)


# --- DAC


def _linear(eta, c):
    return lambda r: eta * r + c


def test_dac_hand_computed_on_linear_time():
    # T(r) = 0.5 r + 1 (exact in binary); T0 = T(8) = 5; targets 8, 11, 14 -> r* 14, 20, 26
    assert dac_ranks(_linear(0.5, 1.0), 8, 3.0, 4, 32, 100.0) == [8, 16, 20, 28]


def test_dac_falls_back_to_uncompressed():
    t = _linear(0.5, 1.0)
    # budget reaches the uncompressed time (11 >= 11) from stage 2 on
    assert dac_ranks(t, 8, 3.0, 4, 32, 11.0) == [8, 16, None, None]
    # r* > r_max (T(24) = 13 < 14) although uncompressed (100) would overshoot the budget
    assert dac_ranks(t, 8, 3.0, 4, 24, 100.0) == [8, 16, 20, None]
    assert dac_ranks(t, 8, 3.0, 4, 24, 100.0, cap_at_r_max=True) == [8, 16, 20, 24]
    # rounding up past r_max: r* = 26 -> 28 > 26
    assert dac_ranks(t, 8, 3.0, 4, 26, 100.0) == [8, 16, 20, None]
    assert dac_ranks(t, 8, 3.0, 4, 26, 100.0, cap_at_r_max=True) == [8, 16, 20, 26]
    # stage 0 itself at or above the uncompressed time
    assert dac_ranks(t, 8, 3.0, 2, 32, 5.0) == [None, None]


def test_dac_properties_on_random_linear_models():
    rng = random.Random(0)
    for _ in range(300):
        eta, c = rng.uniform(1e-4, 1e-2), rng.uniform(0.0, 0.05)
        r_max = rng.choice([8, 16, 30, 32, 64])
        r0 = rng.randint(1, r_max)
        t_mb, stages = rng.uniform(0.0, 0.05), rng.randint(1, 8)
        t_unc = rng.uniform(0.0, 1.0)
        for cap in (False, True):
            ranks = dac_ranks(_linear(eta, c), r0, t_mb, stages, r_max, t_unc, cap_at_r_max=cap)
            as_num = [math.inf if r is None else r for r in ranks]
            assert as_num == sorted(as_num)  # non-decreasing in p, None = uncompressed = top
            for p, r in enumerate(ranks):
                if r is None:
                    continue
                assert r0 <= r <= r_max
                assert p == 0 or r % 4 == 0 or (cap and r == r_max)
                target = p * t_mb + eta * r0 + c
                assert target < t_unc
                # rounded up: the rank's time covers the budget unless it hit the cap
                assert eta * r + c >= target - 1e-12 or (cap and r == r_max)


def test_dac_per_stage_models_and_bad_input():
    # stage 1 is cheaper than stage 0, so it needs a higher rank to fill the same budget
    ranks = dac_ranks([_linear(1.0, 4.0), _linear(1.0, 0.0)], 8, 2.0, 2, 32, [100.0, 100.0])
    assert ranks == [8, 16]  # target 14 -> r* 14 -> 16
    with pytest.raises(ValueError, match="r0"):
        dac_ranks(_linear(1.0, 0.0), 0, 1.0, 2, 32, 100.0)
    with pytest.raises(ValueError, match="one per stage"):
        dac_ranks([_linear(1.0, 0.0)], 8, 1.0, 2, 32, 100.0)


# --- the whole projection on a hand cluster


def _profile(opts: SimOptions) -> CostProfile:
    """Costs linear in r (1e-5 s per rank unit per matrix) and 1e-9 s per gradient element."""
    profile = CostProfile()
    for m, n in {(2048, 128), (128, 128), (384, 128), (512, 128), (128, 512)}:
        for r in range(1, opts.rank_max + 1):
            profile.lowrank[(m, n, r)] = 1e-5 * r
    profile.entropy[(opts.gradient_sample_rate, opts.entropy_estimator, opts.bins)] = EntropyCost(0.0, 1e-9)
    return profile


def test_simulate_hand_cluster():
    c = _cluster(step_compute_s=0.01)
    opts = SimOptions(rank_max=8, tp_layout="megatron")  # (the head counted once, on stage 0)
    profile = _profile(opts)
    proj = simulate(c, profile, opts)
    assert profile.measured == 0  # everything came from the given profile

    def ring(elems):  # fp16, N = 2
        return ring_allreduce_time(2 * elems, 2, 1e8, 1e-5)

    # t_mb = 0.5 * 0.01 s / (4 micro-batches + 2 stages - 1)
    assert proj.t_mb == pytest.approx(0.001, rel=1e-12)
    block = 12 * 128 * 128 + 13 * 128  # weights + biases + LayerNorms of one tiny block
    numel0 = 2048 * 128 + 128 * 128 + 2 * block  # wte, wpe, 2 blocks
    numel1 = 2 * block + 2 * 128  # 2 blocks, ln_f
    assert [s.numel for s in proj.stages] == [numel0, numel1]

    none = proj.method("none")
    t0_plain = ring(numel0)  # 13.5 ms; stage 1's 8.0 ms sync ends 1 ms earlier still
    assert none.sync_s == pytest.approx(t0_plain, rel=1e-12)
    assert none.step_s == pytest.approx(0.01 + t0_plain, rel=1e-12)
    assert none.total_s == pytest.approx(10 * (0.01 + t0_plain), rel=1e-12)

    # static PowerSGD at r = 8 on stage 0: every matrix compressed (rate >= 2 at r_max 8)
    sum_m = 2048 + 128 + 2 * (384 + 128 + 512 + 128)
    sum_n = 128 + 128 + 2 * (128 + 128 + 128 + 512)
    rest0 = 2 * (4 * 128 + 384 + 128 + 512 + 128)
    compress0 = 10 * 8e-5  # 10 matrices at 1e-5 s per rank unit
    t0_psgd = ring(rest0) + ring(sum_m * 8) + ring(sum_n * 8) + compress0
    psgd = proj.method("powersgd")
    assert psgd.warmup_steps == 1 and psgd.first.ranks == (8, 8)
    assert psgd.sync_s == pytest.approx(t0_psgd, rel=1e-12)
    assert psgd.step_s == pytest.approx(0.01 + t0_psgd, rel=1e-12)
    assert psgd.total_s == pytest.approx((0.01 + t0_plain) + 9 * (0.01 + t0_psgd), rel=1e-12)

    # EDGC right after warm-up: stage 0 at r_max = 8 (~2 ms); stage 1's budget T0 + 1 ms is
    # above its T(8) (~1.5 ms) but below its uncompressed 8 ms, so the spec's rule sends it
    # uncompressed (past the budget) and the capped variant runs r_max
    assert proj.method("edgc").first.ranks == (8, None)
    assert proj.method("edgc-cap").first.ranks == (8, 8)
    assert proj.method("edgc-cap").last.ranks == (2, 8)  # r_min = 8 // 4 at the end
    first = proj.method("edgc").first
    assert first.stages[0].entropy_s == pytest.approx(0.1 * 1e-9 * numel0, rel=1e-12)  # α * per-element cost
    # the uncompressed stage 1 is now the critical path: its sync (with the amortised entropy
    # estimate and 56-byte control all-reduce) minus its 1 ms head start
    t1 = ring(numel1) + 0.1 * (1e-9 * numel1 + ring_allreduce_time(56, 2, 1e8, 1e-5))
    assert first.critical_stage == 1
    assert first.exposed_s == pytest.approx(t1 - 0.001, rel=1e-12)


def test_schedule_parsing_and_options():
    assert parse_schedule("0.1:32, 1.0:8") == ((0.1, 32.0), (1.0, 8.0))
    with pytest.raises(ValueError, match="FRACTION:RANK"):
        parse_schedule("0.1-32")
    assert SimOptions(rank_max=32).schedule == ((0.1, 32.0), (1.0, 8.0))
    with pytest.raises(ValueError, match="rise"):
        SimOptions(edgc_schedule=((0.5, 8.0), (0.2, 8.0)))
    with pytest.raises(ValueError, match="rank_max"):
        SimOptions(rank_max=16, edgc_schedule=((0.1, 32.0),))


def test_profile_round_trip(tmp_path):
    opts = SimOptions(rank_max=8)
    profile = _profile(opts)
    profile.origins["measured:test device"] = "hand-made"
    path = tmp_path / "p.json"
    profile.save(path)
    again = CostProfile(compute_scale=0.5)
    again.load(path)
    assert again.lowrank == profile.lowrank and again.entropy == profile.entropy
    assert again.origins == {"measured:test device": "hand-made"}
    assert again.lowrank_seconds(2048, 128, 4) == pytest.approx(0.5 * 4e-5)  # scaled on lookup
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid cost profile"):
        again.load(tmp_path / "bad.json")


def test_profile_interpolates_between_measured_ranks():
    profile = CostProfile()
    profile.lowrank[(64, 64, 8)] = 1.0
    profile.lowrank[(64, 64, 16)] = 3.0
    assert profile.lowrank_seconds(64, 64, 12) == pytest.approx(2.0)
    assert profile.lowrank_seconds(64, 64, 4) == pytest.approx(0.5)  # below: proportional to r
    assert profile.lowrank_seconds(64, 64, 32) == pytest.approx(6.0)  # above: proportional to r


def test_parser_defaults():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "--cluster", "paper-12.1b"])
    assert (args.cluster, args.rank_max, args.compute_scale, args.profile) == ("paper-12.1b", 32, 1.0, None)
    assert (args.device, args.gpu) == (None, None)  # no timing unless asked: the cluster's GPU is modelled

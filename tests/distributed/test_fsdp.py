"""EDGC on FSDP2 / HSDP through edgc.fsdp.register_edgc, as a user's script calls it: 4 gloo
processes, 2 replicas x 2 shards, a model whose shards are uneven (33-row embedding and
head, 37-row hidden layers, split 17 + 16)."""

import pytest
import torch

import fsdp_workers
from harness import assert_same, run_workers

pytestmark = pytest.mark.slow

# warm-up of 3 steps, windows of 2: the rank moves within a short run
BASE = dict(max_rank=4, min_rank=2, rank_step=2, window=2, warmup_steps=3, iteration_sample_rate=1.0,
            warmup="fixed", min_compression_rate=1.0, noise={"exponent": 2.0})


def _check_compressed_run(out, steps, warmup=3):
    """Every shard's replicas agree (full_tensor gathers the shards), one rank decision
    holds across the mesh, and the steps after the warm-up were compressed."""
    for r in out[1:]:
        assert_same(out[0]["params"], r["params"], "params")
    ranks = [r["ranks"] for r in out]
    assert all(x == ranks[0] for x in ranks), ranks
    assert ranks[0][:warmup] == [0] * warmup and all(r > 0 for r in ranks[0][warmup:]), ranks[0]
    for r in out:
        stats = r["stats"]
        assert stats.compressed_steps == steps - warmup and stats.nonfinite_steps == 0
        assert stats.bytes_sent < stats.bytes_uncompressed
        assert all(torch.isfinite(torch.tensor(r["losses"])))


def _untimed(state):
    """A state dict without its timings (seconds differ between runs)."""
    stats = {k: v for k, v in state["stats"].items() if not k.endswith("_seconds")}
    return dict(state, stats=stats)


@pytest.mark.parametrize("policy", ["static", "cqm", "noise"])
def test_edgc_matches_native_hsdp_in_warmup_then_compresses_with_replicas_identical(policy):
    config = dict(BASE, policy=policy)
    native = run_workers(fsdp_workers.train, 4, "native", None, 3, timeout=300)
    # (with the gradient's dtype on the wire; the default int8 rounds the warm-up's sums)
    warm = run_workers(fsdp_workers.train, 4, "edgc", dict(config, wire="native"), 3, timeout=300)
    for a, b in zip(native, warm, strict=True):  # bit for bit during the warm-up
        assert_same(a["params"], b["params"], "params")
        assert a["losses"] == b["losses"]
    _check_compressed_run(run_workers(fsdp_workers.train, 4, "edgc", config, 12, timeout=300), 12)


@pytest.mark.parametrize("units", ["joint", "tied"])
def test_modules_sharded_as_one_unit_are_one_hook_matching_native_hsdp(units):
    """fully_shard([norm, head]) and fully_shard([emb, head]) with tied weights (as
    torchtitan shards them): one FSDP state, one parameter group and one hook for two
    modules. The warm-up equals native HSDP's bit for bit, then every step compresses."""
    config = dict(BASE, policy="static")
    options = {"units": units}
    native = run_workers(fsdp_workers.train, 4, "native", None, 3, options, timeout=300)
    warm = run_workers(fsdp_workers.train, 4, "edgc", dict(config, wire="native"), 3, options, timeout=300)
    for a, b in zip(native, warm, strict=True):
        assert_same(a["params"], b["params"], "params")
        assert a["losses"] == b["losses"]
    _check_compressed_run(run_workers(fsdp_workers.train, 4, "edgc", config, 8, options, timeout=300), 8)


def test_switched_off_edgc_is_native_hsdp_and_on_again_it_warms_up_from_where_it_stopped():
    native = run_workers(fsdp_workers.train, 4, "native", None, 3, timeout=300)
    off = run_workers(fsdp_workers.train, 4, "edgc", dict(BASE, policy="static"), 6, {"off": (0, 1, 2)},
                      timeout=300)
    for a, b in zip(native, off, strict=True):
        assert a["losses"] == b["losses"][:3]  # (the same steps, bit for bit)
        assert b["stats"].step == 3 and b["stats"].compressed_steps == 0  # the 3 steps switched on, warming up
    _check_compressed_run([dict(r, ranks=r["ranks"][3:], losses=r["losses"][3:]) for r in off], 3, warmup=3)


def test_edgc_resumes_exactly_mid_window():
    config = dict(BASE, policy="noise")
    straight = run_workers(fsdp_workers.train, 4, "edgc", config, 10, {"stop_at": 5}, timeout=300)
    resumed = run_workers(fsdp_workers.train, 4, "edgc", config, 10,
                          {"resume": [r["saved"] for r in straight]}, timeout=300)
    for s, a in zip(straight, resumed, strict=True):
        assert_same(s["params"], a["params"], "params")
        assert s["losses"][5:] == a["losses"]
        assert s["ranks"][5:] == a["ranks"]
        assert_same(_untimed(s["state"]), _untimed(a["state"]), "state")


def test_accumulation_matches_native_hsdp_in_warmup_and_syncs_once_per_step():
    config = dict(BASE, policy="static")
    native = run_workers(fsdp_workers.train, 4, "native", None, 3, {"accum": 3}, timeout=300)
    warm = run_workers(fsdp_workers.train, 4, "edgc", dict(config, wire="native"), 3, {"accum": 3}, timeout=300)
    for a, b in zip(native, warm, strict=True):
        assert_same(a["params"], b["params"], "params")
    out = run_workers(fsdp_workers.train, 4, "edgc", config, 8, {"accum": 3}, timeout=300)
    _check_compressed_run(out, 8)
    assert out[0]["stats"].step == 8  # one sync per optimiser step, not per micro-batch


def test_bf16_mixed_precision_compresses_with_replicas_identical():
    config = dict(BASE, policy="cqm")
    out = run_workers(fsdp_workers.train, 4, "edgc", config, 10, {"dtype": "bfloat16"}, timeout=300)
    _check_compressed_run(out, 10)
    groups = out[0]["state"]["compression"]["groups"]
    assert groups and all(g["dtype"] == "bfloat16" for g in groups)
    assert all(g["q"].dtype == torch.float32 for g in groups)  # (float32 arithmetic)


def test_state_round_trips_through_distributed_checkpoint(tmp_path):
    out = run_workers(fsdp_workers.dcp_round_trip, 4, dict(BASE, policy="cqm"), 6, str(tmp_path / "dcp"),
                      timeout=300)
    for r in out:
        assert r["saved"]["compression"]["groups"]  # (compressing: error feedback and Q to carry)
        assert_same(r["saved"], r["loaded"], "state")
    errors = [r["saved"]["compression"]["groups"][0]["error"] for r in out[:2]]
    assert not torch.equal(errors[0], errors[1])


def _group_ranks(out):
    """Each rank's groups as {shape: rank}, the shapes being the local shards' matrices."""
    return [{tuple(g["shape"]): g["q"].shape[-1] for g in r["state"]["compression"]["groups"]} for r in out]


def test_a_long_shard_compresses_at_twice_the_rank_of_the_rest():
    # a 257-token vocabulary: the embedding's and head's shards are 129 x 24 (5.4:1), long;
    # the blocks' (19 x 24, 12 x 37 and their row shards) are not. Rank 4, then 2 from step 7
    config = dict(BASE, policy="schedule", schedule={"ranks": "0:4,7:2"}, rank_multiple=1)
    for steps, rank in ((6, 4), (10, 2)):
        out = run_workers(fsdp_workers.train, 4, "edgc", config, steps, {"vocab": 257}, timeout=300)
        _check_compressed_run(out, steps)
        for groups in _group_ranks(out):
            assert {r for shape, r in groups.items() if max(shape) >= 5 * min(shape)} == {2 * rank}, groups
            assert {r for shape, r in groups.items() if max(shape) < 5 * min(shape)} == {rank}, groups
            assert (129, 24) in groups or (24, 129) in groups, groups
    flat = run_workers(fsdp_workers.train, 4, "edgc", dict(config, long_rank_factor=1.0), 10, {"vocab": 257},
                       timeout=300)
    assert all(set(groups.values()) == {2} for groups in _group_ranks(flat))
    for a, b in zip(out, flat, strict=True):  # (the long shards' extra columns)
        assert a["stats"].bytes_sent > b["stats"].bytes_sent


@pytest.mark.parametrize("case,message", [
    ("native", "native HSDP"),
    ("mesh-names", "dimensions named 'replicate' and 'shard'"),
    ("no-fsdp", "no FSDPModule"),
    ("calibrate", "max_rank"),
    ("buffer-size", "every parameter needs a gradient"),
    ("layout", "2 replicas x 2 shards"),
])
def test_refusals_name_the_problem(case, message):
    out = run_workers(fsdp_workers.refusal, 4, case, timeout=300)
    for text in out:
        assert message in text, text


def test_warmup_ends_at_the_first_error_check_that_passes_measured_module_by_module():
    # checks every 3rd step (alpha 1/3); an error bound of 1 passes at the first check, step 3,
    # from the local shards' singular values summed over every module, agreed over the mesh
    config = dict(BASE, policy="static", warmup_steps=20, iteration_sample_rate=1 / 3, warmup="gradient",
                  warmup_max_error=1.0)
    out = run_workers(fsdp_workers.train, 4, "edgc", config, 8, timeout=300)
    _check_compressed_run(out, 8)
    # a bound no gradient meets keeps the warm-up to its cap
    capped = run_workers(fsdp_workers.train, 4, "edgc", dict(config, warmup_max_error=1e-9), 6, timeout=300)
    assert all(r["ranks"] == [0] * 6 for r in capped)


@pytest.mark.parametrize("wire", ["fp8"])
def test_quantized_modes_compress_and_resume_exactly(wire):
    # (int8, the default wire, is what every other test here compresses and resumes in)
    config = dict(BASE, policy="noise", wire=wire, state_dtype="bf16")
    full = run_workers(fsdp_workers.train, 4, "edgc", dict(BASE, policy="noise", wire="native"), 10, timeout=300)
    out = run_workers(fsdp_workers.train, 4, "edgc", config, 10, timeout=300)
    _check_compressed_run(out, 10)
    for a, b in zip(out, full, strict=True):  # (fewer bytes: the factors travel in one byte)
        assert a["stats"].bytes_sent < b["stats"].bytes_sent
    straight = run_workers(fsdp_workers.train, 4, "edgc", config, 10, {"stop_at": 5}, timeout=300)
    resumed = run_workers(fsdp_workers.train, 4, "edgc", config, 10,
                          {"resume": [r["saved"] for r in straight]}, timeout=300)
    for s, a in zip(straight, resumed, strict=True):
        assert_same(s["params"], a["params"], "params")
        assert s["losses"][5:] == a["losses"]
        assert_same(_untimed(s["state"]), _untimed(a["state"]), "state")

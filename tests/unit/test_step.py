"""The step schedule of edgc.comm.step in one process: the fixed lag of the pipelined
mode, units cut across same-shape groups, and a non-finite late bucket. (With one replica
the collectives are skipped but counted, so the order they are issued in can be watched.)"""

import pytest
import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import FlatBucket
from edgc.comm.units import Group, coarse_units, slot_wire_bytes

# slots 0-3: four (8, 6) matrices, one group; 4-5: two (5, 7); 6: a bias
SHAPES = [(8, 6), (8, 6), (8, 6), (8, 6), (5, 7), (5, 7), (7,)]
STATIC = dict(policy="static", max_rank=2, warmup_steps=1, min_compression_rate=1.0,
              wire="native", max_units=0)  # (one all-reduce a buffer: the issue order below counts elements;
# every bucket its own unit)


def _params():
    return [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES]


def _grads(step):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, dtype=torch.float64, generator=g) for s in SHAPES]


def _step(state, params, layout, step, spoil=None):
    """Hand one step's gradients over in buckets of `layout` (lists of slots); returns the
    averaged gradient per slot, the futures, and which collectives each call issued."""
    grads = _grads(step)
    if spoil is not None:
        grads[spoil][0, 0] = float("inf")
    buckets = [FlatBucket(i, torch.cat([grads[s].reshape(-1) for s in b]), [params[s] for s in b], i == len(layout) - 1)
               for i, b in enumerate(layout)]
    issued, call = [], [0]
    original = state.sync.collectives.all_reduce

    def spy(tensor, **kwargs):
        issued.append((call[0], tensor.numel()))
        return original(tensor, **kwargs)

    state.sync.collectives.all_reduce = spy
    futures, done_before_last = [], []
    try:
        for i, b in enumerate(buckets):
            call[0] = i
            if b.is_last():
                done_before_last = [f.done() for f in futures]
            futures.append(edgc_hook(state, b))
    finally:
        del state.sync.collectives.all_reduce
    out = {}
    for f, slots in zip(futures, layout, strict=True):
        flat = f.wait()
        for s, g in zip(slots, FlatBucket(0, flat, [params[s] for s in slots], True).gradients(), strict=True):
            out[s] = g.clone()
    return out, done_before_last, issued


def _run(mode, layout, steps, units=None, spoil_at=None, spoil=None, **config):
    params = _params()
    state = EDGCState(None, EDGCConfig(**{**STATIC, **config}, sync_mode=mode))
    first = [list(range(len(SHAPES)))]  # (the first step: one bucket of everything, as DDP's)
    outs = []
    for step in range(1, steps + 1):
        if step == 2 and units is not None:
            state.sync.compression.units = units
        out, done, issued = _step(state, params, first if step == 1 else layout, step,
                                  spoil if step == spoil_at else None)
        outs.append((out, done, issued))
    return state, outs


def test_pipelined_issues_with_a_fixed_lag_of_one_bucket():
    layout = [[6, 5], [4, 3], [2, 1], [0]]  # reverse order, as DDP's
    state, outs = _run("pipelined", layout, 4)
    _, done, issued = outs[-1]  # a compressed step in the pipelined mode
    # per unit: P = (rows * 2) per matrix, Q = (cols * 2); unit 0 also sends the bias whole
    p = {0: 5 * 2, 1: 5 * 2 + 8 * 2, 2: 8 * 2 * 2, 3: 8 * 2}
    q = {0: 7 * 2, 1: 7 * 2 + 6 * 2, 2: 6 * 2 * 2, 3: 6 * 2}
    assert issued == [(0, 7), (0, p[0]),  # call 0: bucket 0's bias and P
                      (1, p[1]), (1, q[0]),  # call 1: bucket 1's P, then bucket 0's Q
                      (2, p[2]), (2, q[1]),  # call 2: ... bucket 0 completed
                      (3, p[3]), (3, q[2]), (3, q[3])]  # the last call drains
    # every bucket holds a compressed matrix, whose average waits for the step's end (its
    # finiteness): none is handed back before the last call
    assert done == [False, False, False]


def test_whole_step_issues_everything_at_the_last_bucket():
    layout = [[6, 5], [4, 3], [2, 1], [0]]
    state, outs = _run("whole-step", layout, 3)
    _, done, issued = outs[-1]
    assert {c for c, _ in issued} == {3} and done == [False, False, False]
    assert [n for _, n in issued] == [7, (8 * 4 + 5 * 2) * 2, (6 * 4 + 7 * 2) * 2]  # whole, all P, all Q


@pytest.mark.parametrize("units", [None, [(0, 2), (6, 4, 1), (3, 5)]])
def test_units_across_groups_give_the_whole_step_result(units):
    # units=None: DDP's buckets; else a plan whose units hold non-consecutive members of a
    # group (slots 0 and 2 of the four (8, 6) matrices), handed over in buckets that differ from it
    layout = [[6, 5], [4, 3], [2, 1], [0]]
    whole, a = _run("whole-step", layout, 6)
    piped, b = _run("pipelined", layout, 6, units=units)
    for (out_a, _, _), (out_b, _, _) in zip(a, b, strict=True):
        for s in range(len(SHAPES)):
            torch.testing.assert_close(out_b[s], out_a[s], rtol=1e-13, atol=1e-15)
    for key, g in whole.sync.compression.groups.items():
        torch.testing.assert_close(piped.sync.compression.groups[key].error, g.error, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(piped.sync.compression.groups[key].q, g.q, rtol=1e-13, atol=1e-15)
    assert whole.stats().compressed_steps == piped.stats().compressed_steps == 5
    assert whole.stats().bytes_sent == piped.stats().bytes_sent  # the same bytes, cut differently
    if units is not None:
        assert piped.sync.compression.units == [tuple(b) for b in layout]  # DDP's layout replaced the plan


def test_wire_bytes_per_slot_in_each_format():
    dtypes = [torch.float64] * 4 + [torch.bfloat16] * 2 + [torch.float32]
    # a bf16 group works in float32 (its Q), but P and Q travel in bf16: 2 bytes an element
    groups = [Group((8, 6), [0, 1, 2, 3], torch.zeros(4, 6, 2, dtype=torch.float64), None, torch.float64),
              Group((5, 7), [4, 5], torch.zeros(2, 7, 3), None, torch.bfloat16)]
    assert slot_wire_bytes(SHAPES, dtypes, groups) == [(8 + 6) * 2 * 8] * 4 + [(5 + 7) * 3 * 2] * 2 + [7 * 4]
    assert slot_wire_bytes(SHAPES, dtypes, []) == [48 * 8] * 4 + [35 * 2] * 2 + [7 * 4]  # an uncompressed step
    # int8: a byte an element and a 2-byte scale a block of 32, for factors and whole tensors
    # alike, and each factor column padded to a whole block (8 and 6 rows: 32 each)
    assert slot_wire_bytes(SHAPES, dtypes, groups, "int8") == [64 * 2 + 2 * 4] * 4 + [64 * 3 + 2 * 6] * 2 + [7 + 2]
    assert slot_wire_bytes(SHAPES, dtypes, [], "int8") == [48 + 2 * 2] * 4 + [35 + 2 * 2] * 2 + [7 + 2]


def test_coarse_units_merge_consecutive_units_until_the_threshold():
    layout = [(6, 5), (4, 3), (2, 1), (0,)]
    sizes = [224, 224, 224, 224, 288, 288, 56]  # per unit: 344, 512, 448, 224 bytes
    assert coarse_units(layout, sizes, 0) == layout  # 0: every unit as it is
    assert coarse_units(layout, sizes, 500) == [(6, 5, 4, 3), (2, 1, 0)]  # 856, 672
    # 344 reaches 344 (a unit closes at the threshold); 224 at the end is short: it joins (2, 1)
    assert coarse_units(layout, sizes, 344) == [(6, 5), (4, 3), (2, 1, 0)]
    assert coarse_units(layout, sizes, 400) == [(6, 5, 4, 3), (2, 1, 0)]  # 856, then 448 + the short 224
    assert coarse_units(layout, sizes, 10**9) == [(6, 5, 4, 3, 2, 1, 0)]  # all short: the only unit
    assert coarse_units(layout, sizes, 1529) == [(6, 5, 4, 3, 2, 1, 0)]  # one byte more than all: the same
    # an uncompressed step's sizes (384 per matrix, 280, 56) cut the same plan otherwise: 336, 664, 768, 384
    assert coarse_units(layout, [384] * 4 + [280] * 2 + [56], 700) == [(6, 5, 4, 3), (2, 1, 0)]
    assert coarse_units(layout, [384] * 4 + [280] * 2 + [56], 380) == [(6, 5, 4, 3), (2, 1), (0,)]


def test_coarse_units_issue_fewer_collectives_for_the_whole_step_average():
    # at rank 2, in float64: 7 * 8 = 56 bytes for the bias, (5 + 7) * 2 * 8 = 192 per (5, 7)
    # matrix and (8 + 6) * 2 * 8 = 224 per (8, 6) one; the buckets hold 248, 416, 448, 224
    # bytes, so at 600 bytes the step is two units: buckets 0-1 and 2-3
    layout = [[6, 5], [4, 3], [2, 1], [0]]
    whole, a = _run("whole-step", layout, 4)
    coarse, b = _run("pipelined", layout, 4, min_unit_mb=600e-6)
    _, done, issued = b[-1]
    assert issued == [(1, 7), (1, 5 * 2 * 2 + 8 * 2),  # call 1: unit 0's bias and P (slots 5, 4, 3)
                      (2, 7 * 2 * 2 + 6 * 2),  # call 2: unit 0's Q
                      (3, 3 * 8 * 2), (3, 3 * 6 * 2)]  # the last call: unit 1's P and Q
    assert done == [False, False, False]  # unit 0, started in call 1, completes in call 3: the last
    for (out_a, _, _), (out_b, _, _) in zip(a, b, strict=True):
        for s in range(len(SHAPES)):
            torch.testing.assert_close(out_b[s], out_a[s], rtol=1e-13, atol=1e-15)
    assert coarse.sync.compression.units == [tuple(u) for u in layout]  # the plan kept is DDP's layout, not the cut
    assert coarse.stats().bytes_sent == whole.stats().bytes_sent


@pytest.mark.parametrize("mode", ["pipelined", "whole-step"])
def test_a_late_nonfinite_bucket_leaves_error_feedback_and_q_as_they_were(mode):
    # inf in slot 0, the last bucket, at step 4: in the pipelined mode buckets 0-2 were
    # finished (finite) before it arrived, and their new error feedback must not be kept either
    layout = [[6, 5], [4, 3], [2, 1], [0]]
    ref, _ = _run(mode, layout, 3)
    state, outs = _run(mode, layout, 4, spoil_at=4, spoil=0)
    out = outs[-1][0]
    assert state.stats().nonfinite_steps == 1 and state.stats().compressed_steps == 2
    assert state.stats().step_rank == 0  # the step did not count as sent compressed
    assert not bool(torch.isfinite(out[0]).all())  # the optimiser sees it and skips
    for key, g in state.sync.compression.groups.items():
        kept = ref.sync.compression.groups[key]
        assert torch.equal(g.error, kept.error) and torch.equal(g.q, kept.q)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy,rank", [("static", 2), ("static", 4), ("cqm", 4), ("noise", 4), ("critical", 4)])
def test_no_host_sync_before_the_last_bucket_on_cuda(policy, rank):
    # One replica (the collectives are skipped, the arithmetic is not): with CUDA's sync
    # debug mode on "error", any host synchronisation inside a bucket's hook call but the
    # last raises. Units are cut across groups, so both kinds of part run.
    device = torch.device("cuda")
    params = [p.to(device) for p in _params()]
    cfg = dict(STATIC, policy=policy, max_rank=rank, iteration_sample_rate=1.0, window=2,
               min_compression_rate=0.5)  # (every matrix compressed at rank 4 too)
    if policy != "static":
        cfg["min_rank"] = 1
    state = EDGCState(None, EDGCConfig(**cfg))
    layout = [[6, 5], [4, 3], [2, 1], [0]]
    for step in range(1, 9):
        state.sync.compression.units = [(0, 2), (6, 4, 1), (3, 5)] if step == 2 else state.sync.compression.units
        grads = [g.to(device) for g in _grads(step)]
        cut = [list(range(len(SHAPES)))] if step == 1 else layout
        buckets = [FlatBucket(i, torch.cat([grads[s].reshape(-1) for s in b]), [params[s] for s in b],
                              i == len(cut) - 1) for i, b in enumerate(cut)]
        futures = []
        for b in buckets:
            guarded = step >= 4 and not b.is_last()  # (after the units' plans were made once)
            torch.cuda.set_sync_debug_mode("error" if guarded else "default")
            try:
                futures.append(edgc_hook(state, b))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for f in futures:
            assert bool(torch.isfinite(f.wait()).all())
    assert state.stats().compressed_steps == 7 and len(state.sync.compression.groups) == 2

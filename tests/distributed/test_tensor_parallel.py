"""EDGC with torch's tensor parallelism, through edgc.fsdp.register_edgc as a user's script
calls it: 4 gloo processes, 2 replicas x 1 shard x 2 TP ranks, the MLPs split with
ColwiseParallel / RowwiseParallel, the embeddings and the head whole on every TP rank."""

import pytest
import torch

import tp_workers
from harness import assert_same, run_workers

pytestmark = pytest.mark.slow

# warm-up of 3 steps, windows of 2: the rank moves within a short run
BASE = dict(max_rank=4, min_rank=2, rank_step=2, window=2, warmup_steps=3, iteration_sample_rate=1.0,
            warmup="fixed", min_compression_rate=1.0, noise={"exponent": 2.0})
STEPS = 10


def _untimed(state):
    stats = {k: v for k, v in state["stats"].items() if not k.endswith("_seconds")}
    return dict(state, stats=stats)


def test_warmup_equals_native_hsdp_times_tp_then_compresses_with_copies_identical():
    native = run_workers(tp_workers.train, 4, "native", None, 3, timeout=300)
    warm = run_workers(tp_workers.train, 4, "edgc", dict(BASE, wire="native"), 3, timeout=300)
    for a, b in zip(native, warm, strict=True):  # bit for bit during the warm-up
        assert_same(a["params"], b["params"], "params")
        assert a["losses"] == b["losses"]

    out = run_workers(tp_workers.train, 4, "edgc", dict(BASE), STEPS, timeout=300)
    by_coords = {r["coords"]: r for r in out}
    # every TP shard's replicas are bit-identical, and so is the whole model
    for tp in (0, 1):
        assert_same(by_coords[(0, 0, tp)]["local"], by_coords[(1, 0, tp)]["local"], f"tp {tp} replicas")
    for r in out[1:]:
        assert_same(out[0]["params"], r["params"], "params")
    # the tensors outside the plan (embeddings, head, norms, the row-parallel bias) are
    # the same on every rank
    whole = [n for n in out[0]["local"] if not (n.endswith("up.weight") or n.endswith("up.bias")
                                                 or n.endswith("down.weight"))]
    assert "pos" in whole and "emb.weight" in whole and "blocks.0.down.bias" in whole
    for r in out[1:]:
        for n in whole:
            assert torch.equal(out[0]["local"][n], r["local"][n]), n
    # the TP shards differ between TP ranks (they are halves of the matrices)
    assert not torch.equal(by_coords[(0, 0, 0)]["local"]["blocks.0.up.weight"],
                           by_coords[(0, 0, 1)]["local"]["blocks.0.up.weight"])
    # one rank history on every rank; compressed after the warm-up, with fewer bytes
    ranks = [r["ranks"] for r in out]
    assert all(x == ranks[0] for x in ranks), ranks
    assert ranks[0][:3] == [0, 0, 0] and all(x > 0 for x in ranks[0][3:]), ranks[0]
    assert len(set(ranks[0][3:])) > 1, ranks[0]  # (the rank moved)
    for r in out:
        assert r["stats"].compressed_steps == STEPS - 3
        assert r["stats"].bytes_sent < r["stats"].bytes_uncompressed
        assert r["layout"] == [2, 1, 2]
    # TP rank 1 leaves its copies out of the signals; TP rank 0 counts them
    assert all(not r["uncounted"] for r in out if r["coords"][2] == 0)
    assert all(len(r["uncounted"]) == len(whole) for r in out if r["coords"][2] == 1)


def test_resumes_exactly_mid_window():
    straight = run_workers(tp_workers.train, 4, "edgc", BASE, STEPS, {"stop_at": 6}, timeout=300)
    resumed = run_workers(tp_workers.train, 4, "edgc", BASE, STEPS, {"resume": [r["saved"] for r in straight]},
                          timeout=300)
    for s, a in zip(straight, resumed, strict=True):
        assert_same(s["params"], a["params"], "params")
        assert s["losses"][6:] == a["losses"]
        assert s["ranks"][6:] == a["ranks"]
        assert_same(_untimed(s["state"]), _untimed(a["state"]), "state")


@pytest.mark.parametrize(("case", "message"), [
    ("ddp", "FSDP2"),
    ("other layout", "4 replicas x 1 shards x 1 TP ranks, but this job has 2 replicas x 1 shards x 2 TP ranks"),
])
def test_refusals_name_the_problem(case, message):
    out = run_workers(tp_workers.refusal, 4, case, timeout=300)
    assert all(message in m for m in out), out

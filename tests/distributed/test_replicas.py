"""edgc.checkpoint across 2 gloo processes: every replica's state gathered in rank order,
and each handed back its own, by scatter or from a file."""

import torch

from harness import assert_same, run_workers
from workers import replicas_check


def test_gather_scatter_and_file_round_trip(tmp_path):
    results = run_workers(replicas_check, 2, str(tmp_path))
    mine = [r["mine"] for r in results]
    assert results[0]["on_one"] is None and results[1]["on_one"] is not None
    assert_same(results[1]["on_one"], mine, "gathered on 1")
    assert_same(results[0]["on_all"], mine, "gathered on all")
    assert_same(results[1]["on_all"], mine, "gathered on all")
    # the error feedback differs between replicas, so each must get its own back
    errors = [m["compression"]["groups"][0]["error"] for m in mine]
    assert not torch.equal(errors[0], errors[1])
    for r, own in zip(results, mine, strict=True):
        assert_same(r["scattered"], own, "scattered")
        assert_same(r["from_file"], own, "from the file")
        assert "holds the states of 1 replicas, and this job has 2" in r["wrong_length"]
    assert results[0]["gathered"] is None
    assert results[1]["gathered"] == [[0.0] * 3, [1.0] * 3]

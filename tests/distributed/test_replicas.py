"""edgc.checkpoint across 2 gloo processes: every replica's state gathered in rank order,
and each handed back its own, by scatter or from a file."""

import torch

from harness import run_workers
from workers import replicas_check


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def test_gather_scatter_and_file_round_trip(tmp_path):
    results = run_workers(replicas_check, 2, str(tmp_path))
    mine = [r["mine"] for r in results]
    assert results[0]["on_one"] is None and results[1]["on_one"] is not None
    assert _same(results[1]["on_one"], mine) and _same(results[0]["on_all"], mine) and _same(results[1]["on_all"], mine)
    # the error feedback differs between replicas, so each must get its own back
    assert not torch.equal(mine[0]["groups"][0]["error"], mine[1]["groups"][0]["error"])
    for r, own in zip(results, mine):
        assert _same(r["scattered"], own) and _same(r["from_file"], own)
        assert "holds the states of 1 replicas, and this job has 2" in r["wrong_length"]

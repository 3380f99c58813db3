"""The round launches a few batched ops per matrix shape and unit, not per matrix: a model of
twice the layers (the same shapes) dispatches nearly the same ops a step, counted as a GPU
would launch them (edgc.bench.ops.OpCounter), and gives the same average as a round cut
bucket by bucket. One process: the collectives are skipped but the arithmetic is all there."""

import pytest
import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.bench.ops import OpCounter
from edgc.comm.buckets import FlatBucket

# one layer: a (24, 8) and an (8, 24) matrix, an (8, 8) one and a bias
LAYER = [(24, 8), (8, 24), (8, 8), (8,)]
CONFIG = dict(policy="static", max_rank=2, warmup="fixed", warmup_steps=1, min_compression_rate=1.0,
              wire="native")


def _model(layers):
    return [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for _ in range(layers) for s in LAYER]


def _steps(layers, steps, per_bucket, **config):
    """Train `steps` steps of random gradients through the hook, in buckets of `per_bucket`
    layers (the first step one bucket, as DDP's); returns the state, the ops of the last
    step, its averaged gradients and the workspace's size at its end."""
    params = _model(layers)
    state = EDGCState(None, EDGCConfig(**{**CONFIG, **config}))
    n = len(LAYER)
    layout = [list(range(i * n, min(layers, i + per_bucket) * n)) for i in range(0, layers, per_bucket)][::-1]
    counter, out, peak = OpCounter(), {}, []
    workspace = state.sync.compression.workspace
    clear = workspace.clear

    def spy():  # the workspace's size at the step's end, just before it is emptied
        peak.append(workspace.nbytes)
        clear()

    workspace.clear = spy
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, dtype=torch.float64, generator=g) for p in params]
        buckets = [list(range(len(params)))] if step == 1 else layout
        futures = []
        for i, b in enumerate(buckets):
            bucket = FlatBucket(i, torch.cat([grads[s].reshape(-1) for s in b]), [params[s] for s in b],
                                i == len(buckets) - 1)
            if step == steps:
                with counter:
                    futures.append(edgc_hook(state, bucket))
            else:
                futures.append(edgc_hook(state, bucket))
        if step == steps:
            for f, b in zip(futures, buckets, strict=True):
                flat = f.wait()
                for s, grad in zip(b, FlatBucket(0, flat, [params[s] for s in b], True).gradients(), strict=True):
                    out[s] = grad.clone()
    return state, counter, out, peak[-1]


@pytest.mark.parametrize("buckets", ["one layer each", "a quarter of the layers each"])
def test_twice_the_layers_dispatch_at_most_a_tenth_more_ops(buckets):
    # (one layer each: each of the 4 units gathers its matrices from several buckets; a
    # quarter each: each unit is one bucket, whose matrices of a shape lie at one stride)
    state, small, _, _ = _steps(8, 4, 1 if buckets == "one layer each" else 2)
    _, large, _, _ = _steps(16, 4, 1 if buckets == "one layer each" else 4)
    assert state.stats().compressed_steps == 3
    assert large.ops["bmm"] == small.ops["bmm"]  # (one batched matmul per part and stage, whatever the layers)
    assert large.total <= 1.1 * small.total, (small.ops, large.ops)


def test_a_round_cut_bucket_by_bucket_launches_per_matrix_and_gives_the_same_average():
    # the contrast: with every bucket its own unit (max_units=0), the ops grow with the layers
    _, small, _, _ = _steps(8, 4, 1, max_units=0)
    _, large, per_bucket, _ = _steps(16, 4, 1, max_units=0)
    assert large.total >= 1.8 * small.total
    _, coarse, merged, _ = _steps(16, 4, 1)
    assert coarse.total < large.total / 3
    for s, grad in per_bucket.items():
        torch.testing.assert_close(merged[s], grad, rtol=1e-12, atol=1e-12)


def test_a_bucket_of_whole_layers_is_worked_on_where_it_lies():
    # one bucket of all layers: each shape's matrices lie at one stride, so the float64 round
    # needs no workspace; buckets of one layer merged into one unit are gathered into it
    _, _, _, whole = _steps(8, 3, 8, max_units=1)
    _, _, _, gathered = _steps(8, 3, 1, max_units=1)
    assert whole == 0
    assert gathered == 8 * 24 * 8 * 8  # (the largest part: eight (24, 8) float64 matrices)


def test_both_orthogonalizations_give_the_same_average_step_after_step():
    # P's orthonormal basis differs between the two by a rotation of its columns, which the
    # round undoes: P Q^T = P P^T M is the same projection, and the warm start carries the
    # rotation along; so in float64 the averages agree to rounding over several steps
    # (rank 4: at rank 2 "householder" is Gram-Schmidt)
    _, chol, by_cholesky, _ = _steps(4, 5, 1, max_rank=4, orthogonalization="cholesky")
    _, house, by_householder, _ = _steps(4, 5, 1, max_rank=4, orthogonalization="householder")
    assert chol.ops["linalg_cholesky_ex"] > 0 and house.ops["linalg_qr"] > 0
    for s, grad in by_householder.items():
        torch.testing.assert_close(by_cholesky[s], grad, rtol=1e-9, atol=1e-10)

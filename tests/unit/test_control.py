"""The control vector's warm-up check: the group's error is that of all its processes'
matrices taken together, not a mean of each process's own ratio, and 0 where none has one."""


import pytest
import torch

from edgc.comm.control import CONTROL_LEN, ENTROPY, add_error_sums, control_values, warmup_errors
from edgc.comm.step import StepInfo
from edgc.compress import lowrank_error_sums, lowrank_errors_from_sums
from edgc.config import EDGCConfig
from edgc.policy.warmup import WarmupGate

RANKS = (2, 4)


def _matrices(seed, shapes, scale):
    gen = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]


def _group_control(per_process, norm, *, eager, scale=1.0):
    """The control vectors of processes holding `per_process` matrices, summed and then
    averaged from ENTROPY on, as StepSync does after its all-reduce."""
    config = EDGCConfig(warmup="release-check", warmup_error_norm=norm, min_compression_rate=1.0)
    info = StepInfo(step=3, compressed=False, want_entropy=False, want_errors=True, flush=False, scale=scale,
                    error_ranks=RANKS)
    total = torch.zeros(CONTROL_LEN, dtype=torch.float64)
    for mats in per_process:
        sums = add_error_sums([0.0] * 3, mats, info, config) if eager else None
        total += control_values(info, config, local_finite=True, sample=None, error_sums=sums, grads=mats,
                                slot_shapes=[tuple(m.shape) for m in mats])
    total[ENTROPY:] /= len(per_process)
    return total


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("norm", ["relative", "l1"])
def test_group_error_pools_every_process_matrices(norm, eager):
    # one process holds large, nearly low-rank matrices; the other a small, noisy shard whose
    # own relative error is near 1: the mean of the two ratios is far from the pooled error
    u = _matrices(0, [(32, 2)], 1.0)[0]
    big = [u @ _matrices(1, [(2, 24)], 1.0)[0] + 0.01 * _matrices(2, [(32, 24)], 1.0)[0],
           u @ _matrices(3, [(2, 24)], 1.0)[0]]
    small = _matrices(4, [(16, 12)], 0.05)
    control = _group_control([big, small], norm, eager=eager)
    pooled = lowrank_errors_from_sums(lowrank_error_sums(big + small, list(RANKS), norm), norm)
    assert warmup_errors(control, norm) == pytest.approx(tuple(pooled), rel=1e-12)
    own = [lowrank_errors_from_sums(lowrank_error_sums(m, list(RANKS), norm), norm) for m in (big, small)]
    mean_of_ratios = (own[0][1] + own[1][1]) / 2
    assert abs(warmup_errors(control, norm)[1] - mean_of_ratios) > 0.2 * mean_of_ratios


def test_l1_tails_are_in_unscaled_units_and_no_matrix_loses_nothing():
    mats = _matrices(5, [(16, 12), (20, 9)], 1.0)
    plain = warmup_errors(_group_control([mats], "l1", eager=True), "l1")
    scaled = warmup_errors(_group_control([[1024.0 * m for m in mats]], "l1", eager=True, scale=1024.0), "l1")
    assert scaled == pytest.approx(plain, rel=1e-12)
    # a process with no compressible matrix adds nothing; a group with none loses nothing to
    # low rank, so its check passes: the gradient warm-up ends at its floor, not its ceiling
    assert warmup_errors(_group_control([mats, []], "l1", eager=False), "l1") == pytest.approx(plain, rel=1e-12)
    for norm in ("relative", "l1"):
        assert warmup_errors(_group_control([[], []], norm, eager=False), norm) == (0.0, 0.0)
    gate = WarmupGate("gradient", warmup_steps=20, window=5, min_steps=10)
    assert [gate.update(step, 0.0, 0.0) for step in range(1, 12)] == [False] * 9 + [True, True]

"""The control vector: what a step measures on its own replica for the decisions that
every replica must take alike, averaged over the control group in one small all-reduce.

Layout (float64, all-reduced with SUM; every entry from ENTROPY on is then divided by the
control group's size, a mean over replicas):

    NONFINITE  replicas whose local gradient had inf/nan (sampled steps, warm-up checks)
    ENTROPY    the entropy of the local gradient's GDS sample (sampled steps)
    ERR_MIN, ERR_MAX, ERR_TOTAL  the warm-up error check's sums over the local gradient
               (edgc.compress.lowrank_error_sums): the tails at r_min and r_max and their
               total, so that the group's error is the error of all its processes' matrices
               taken together (`warmup_errors`), whatever each process holds: a replica's
               whole gradient, or one tensor-parallel shard of it
    GRAD_SQ    ||g_i||², the squared norm of the local gradient's sample: its mean is
               |G_small|² of the noise scale (sampled steps, world > 1; edgc.comm.windowgrad)
    LR_DROP    1 where this replica saw the learning rate drop in the window (window ends
               of a policy that reads the learning rate): above 0 after the sum where any
               replica did
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from edgc.compress import compressible, lowrank_error_sums, lowrank_errors_from_sums
from edgc.entropy import estimate_entropy

__all__ = ["CONTROL_LEN", "ENTROPY", "ERR_MAX", "ERR_MIN", "ERR_TOTAL", "GRAD_SQ", "LR_DROP", "NONFINITE",
           "add_error_sums", "control_values", "warmup_errors"]

NONFINITE, ENTROPY, ERR_MIN, ERR_MAX, GRAD_SQ, LR_DROP, ERR_TOTAL, CONTROL_LEN = 0, 1, 2, 3, 4, 5, 6, 7


def control_values(info: Any, config: Any, *, local_finite: bool, sample: torch.Tensor | None,
                   error_sums: Sequence[float] | None, grads: Sequence[torch.Tensor],
                   slot_shapes: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """This replica's control vector for a step of plan `info` (edgc.comm.step.StepInfo):
    its finiteness, and as the step wants, the entropy and squared norm of its gradient
    `sample` (divided here by the loss scale), its learning-rate drop and its warm-up
    error sums, the eager mode's `error_sums` or else those of the gradients `grads`."""
    control = torch.zeros(CONTROL_LEN, dtype=torch.float64)
    control[NONFINITE] = float(not local_finite)
    if info.want_sample and info.scale != 1.0:
        assert sample is not None  # (taken on a step that wants a sample)
        sample.div_(info.scale)  # the true gradient's entropy and norm, not the scaled one's
    if info.want_entropy:
        assert sample is not None
        control[ENTROPY] = estimate_entropy(sample, config.entropy_estimator, config.bins, config.differential)
    if info.want_noise:
        assert sample is not None
        control[GRAD_SQ] = float(torch.linalg.vector_norm(sample, dtype=torch.float64).square())
    if info.want_lr_drop:
        control[LR_DROP] = float(info.lr_dropped)
    if info.want_errors:
        if error_sums is None:
            r_max = info.error_ranks[1]
            mats = [g for s, g in enumerate(grads) if compressible(slot_shapes[s], r_max, config.min_compression_rate)]
            error_sums = lowrank_error_sums(mats, list(info.error_ranks), config.warmup_error_norm)
        tail_min, tail_max, total = error_sums
        if config.warmup_error_norm == "l1":  # (the tails in unscaled gradient units; total counts elements)
            tail_min, tail_max = tail_min / info.scale, tail_max / info.scale
        control[ERR_MIN], control[ERR_MAX], control[ERR_TOTAL] = tail_min, tail_max, total
    return control


def warmup_errors(control: torch.Tensor, norm: str) -> tuple[float, float]:
    """The warm-up check's errors at r_min and r_max from a control vector summed (or
    averaged) over its group: one ratio of the pooled sums, not a mean of each process's
    ratio, so that a small shard with a large relative error weighs by its size; 0 when no
    process had a compressible matrix (or one with a nonzero gradient): low rank then loses
    nothing, and the check passes (a model whose every matrix goes whole at r_max, such as
    `tiny` under edgc-diloco at rank 64, would otherwise warm up for warmup_steps)."""
    if float(control[ERR_TOTAL]) == 0.0:
        return 0.0, 0.0
    eps_min, eps_max = lowrank_errors_from_sums([float(control[ERR_MIN]), float(control[ERR_MAX]),
                                                 float(control[ERR_TOTAL])], norm)
    return eps_min, eps_max


def add_error_sums(sums: list[float], mats: Sequence[torch.Tensor], info: Any, config: Any) -> list[float]:
    """Eager warm-up check: `sums` with a buffer's compressible matrices `mats`, before
    they are averaged, added (edgc.compress.lowrank_error_sums)."""
    more = lowrank_error_sums(list(mats), list(info.error_ranks), config.warmup_error_norm)
    return [a + b for a, b in zip(sums, more, strict=True)]

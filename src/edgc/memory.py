"""What the hook's state will cost in memory, before a run pays it.

`state_bytes` counts, for the gradient one GPU synchronises (its tensors' shapes and
dtype) and an EDGCConfig, what edgc's compression state holds once compression runs at a
rank: each compressed matrix's error feedback and warm-start Q, in the dtypes the config
keeps them in, as edgc.comm.compression lays them out (the same rule picks the matrices
and their ranks), and the window's sums of the averaged gradient's sample, which the
policies that read the window's norm keep (an upper bound: they are freed at each
window's end). It also gives the step's transient workspace, one unit's matrices of one
shape in the working dtype (edgc.comm.step, "The round on a device, and its memory"), and
what torch's powerSGD_hook keeps for the same gradient
(`torch_hook_bytes`), for comparison.

Under DDP the gradient is the whole model; under FSDP2/HSDP each parameter's shard (its
first dimension divided by the shard count, rounded up); under tensor parallelism a TP
rank's shards; in a pipeline one stage's parameters. edgc.bench.simulate.memory lays a
named model out that way, and `edgc simulate --memory` prints the table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgc.comm.compression import CompressionState
from edgc.comm.units import working_dtype
from edgc.compress import compressible
from edgc.config import EDGCConfig
from edgc.entropy import sample_offsets

__all__ = ["StateBytes", "state_bytes", "torch_hook_bytes"]

#: Policies that keep the window's sums of the averaged gradient's sample (the window norm).
_WINDOW_NORM_POLICIES = ("critical",)


@dataclass(frozen=True)
class StateBytes:
    """The bytes edgc's hook state holds for one GPU's gradient (see module doc)."""

    error: int  # the error feedback of every compressed matrix
    q: int  # the warm-start Q of every compressed matrix
    window: int  # at most: the window's sums of the averaged gradient's sample
    workspace: int  # transient, during a compressed step, at most: one unit's matrices of one shape
    compressed: int  # elements of the compressed matrices
    elements: int  # elements of the whole gradient

    @property
    def total(self) -> int:
        """What the state holds between steps: error feedback, Q and the window's sums."""
        return self.error + self.q + self.window


def state_bytes(shapes: Sequence[Sequence[int]], dtype: torch.dtype, config: EDGCConfig | None = None,
                rank: int | None = None) -> StateBytes:
    """The bytes edgc keeps for a gradient of tensors `shapes` in `dtype`, under `config`
    (default EDGCConfig()), once compressing at `rank` (default: config.max_rank, or 32
    when that is calibrated). Which matrices compress is decided at r_max, as the hook
    decides it (compressible with config.min_compression_rate). Raises ValueError for a
    rank below 1."""
    config = config or EDGCConfig()
    r_max = config.max_rank or 32
    rank = r_max if rank is None else rank
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    kept = CompressionState(0, config.state_dtype, config.long_rank_factor, config.rank_multiple)
    error_size = kept.error_dtype(dtype).itemsize if config.use_error_feedback else 0
    q_size = kept.q_dtype(dtype).itemsize
    error = q = compressed = 0
    counts: dict[tuple[int, int], int] = {}
    for shape in shapes:
        if not compressible(tuple(shape), r_max, config.min_compression_rate):
            continue
        m, n = int(shape[0]), math.prod(int(d) for d in shape[1:])
        compressed += m * n
        counts[(m, n)] = counts.get((m, n), 0) + 1
        error += m * n * error_size
        q += n * kept.group_rank((m, n), rank) * q_size
    # the workspace: one unit's matrices of one shape, a unit holding about 1/max_units of each
    # shape's (a transformer's shapes repeat layer by layer), where M is gathered from several
    # buckets or made in float32 for half gradients; none where each unit is one bucket of
    # gradients in their own dtype, which this upper bound does not assume
    units = max(1, config.max_units)
    workspace = max((-(-c // units) * m * n for (m, n), c in counts.items()), default=0)
    workspace *= working_dtype(dtype).itemsize
    window = 0
    if config.policy in _WINDOW_NORM_POLICIES:  # (the sample's sums in float64, and the count)
        window = 8 * sample_offsets([math.prod(s) for s in shapes], config.gradient_sample_rate)[-1] + 8
    window += 16  # (the noise scale's two sums, on sampled steps)
    return StateBytes(error, q, window, workspace, compressed, sum(math.prod(s) for s in shapes))


def torch_hook_bytes(shapes: Sequence[Sequence[int]], dtype: torch.dtype, rank: int,
                     min_compression_rate: float = 2.0) -> int:
    """What torch's powerSGD_hook keeps for the same gradient at `rank`, with error feedback
    and warm start (its defaults): the error feedback of every element of the buckets, in
    the gradient's dtype, and P and Q of each matrix it compresses (a matrix compresses
    where (m + n) r * min_compression_rate < m n), in the gradient's dtype too."""
    size = dtype.itemsize
    held = sum(math.prod(s) for s in shapes) * size
    for shape in shapes:
        if len(shape) < 2:
            continue
        m, n = int(shape[0]), math.prod(int(d) for d in shape[1:])
        r = min(m, n, rank)
        if (m + n) * r * min_compression_rate < m * n:
            held += (m + n) * r * size
    return held

"""EDGCState and edgc_hook: the DDP adapter over the compression core (edgc.comm.sync).

Usage (the calling convention of torch's powerSGD_hook):

    state = EDGCState(process_group=None, config=EDGCConfig(max_rank=32))
    ddp.register_comm_hook(state, edgc_hook)

DDP hands the hook one bucket at a time. The adapter turns a bucket into what the core
takes (its flat buffer, each parameter's id and shape, a future, whether it is the last)
and returns the future; everything else, from error feedback to the collectives' order,
is GradientSync's. Parameters are numbered ("slots") in the order of their first
appearance in the first synchronised step: a fresh DDP always builds the same first-step
buckets for the same model, so slots are stable across a checkpoint and resume.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.

from typing import Any

import torch
import torch.distributed as dist

from edgc.comm.sync import EDGCStats, GradientSync
from edgc.config import EDGCConfig

__all__ = ["EDGCState", "EDGCStats", "edgc_hook"]


class EDGCState(GradientSync):
    """All mutable state of the EDGC hook for one DDP model (see GradientSync for the
    stats, state_dict and the knobs: set_grad_scale, set_learning_rate)."""

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, config: EDGCConfig | None = None, *, alignment: Any = None
    ) -> None:
        super().__init__(process_group, config, alignment=alignment)

    def _receive(self, buffer: torch.Tensor, params: list[torch.Tensor], future: torch.futures.Future,
                 last: bool) -> None:
        """One DDP bucket: its parameters named by id, handed to the core."""
        self.receive(buffer, [(id(p), tuple(p.shape)) for p in params], future, last)


def edgc_hook(state: EDGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: entropy-driven low-rank compression of the gradient.

    Algorithm, per step (GradientSync._begin_step, edgc.comm.stepsync and
    GradientSync._end_step mark the same steps):
      1. Take the bucket. Pipelined: start the units whose gradients have all arrived,
         finish the P of the units started one call before and complete those whose Q
         was issued one call before. Whole-step: record it, and do all of it at the last.
      2. On sampled steps (alpha), sample beta of the local gradient as it arrives; at
         the last bucket estimate its entropy and average it over replicas (one small
         all-reduce, also carrying the warm-up error check, waited for at the end).
      3. During warm-up: plain all-reduce (and r_max calibration if max_rank is None).
         Afterwards: PowerSGD with error feedback and warm-started Q at the current rank;
         1-D and small tensors are all-reduced uncompressed.
      4. At the last bucket, drain every unit; keep the new error feedback and Q if the
         step was finite everywhere; at each window end, move the rank within [r_min, r_max].
      5. Each bucket's future completes with its (now averaged) buffer.

    Side effect: the bucket buffers hold the averaged gradient; the compression error is
    kept in `state` for the next step. A gradient with inf/nan anywhere comes out
    non-finite on every replica, for the optimiser or GradScaler to skip; it never
    reaches the EF or Q buffers.
    """
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state._receive(bucket.buffer(), bucket.parameters(), future, bucket.is_last())
    return future

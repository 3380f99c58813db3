"""EDGCState and edgc_hook: the DDP adapter over the compression core (edgc.comm.sync).

Usage (the calling convention of torch's powerSGD_hook):

    state = EDGCState(process_group=None, config=EDGCConfig(max_rank=32))
    ddp.register_comm_hook(state, edgc_hook)

DDP hands the hook one bucket at a time. The adapter turns a bucket into what the core
takes (its flat buffer, each parameter's id and shape, a future, whether it is the last)
and returns the future; everything else, from error feedback to the collectives' order,
is the core's (`state.sync`, a GradientSync). Parameters are numbered ("slots") in the
order of their first appearance in the first synchronised step: a fresh DDP always
builds the same first-step buckets for the same model, so slots are stable across a
checkpoint and resume.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.

from typing import Any

import torch
import torch.distributed as dist

from edgc.comm.facade import SyncState
from edgc.comm.stats import EDGCStats
from edgc.comm.sync import GradientSync
from edgc.config import EDGCConfig

__all__ = ["EDGCState", "EDGCStats", "edgc_hook"]


class EDGCState(SyncState):
    """The state of the EDGC hook for one DDP model: the compression core (`sync`) it
    wraps, and what a user calls on it (stats, state_dict, the knobs set_grad_scale and
    set_learning_rate).

    It may be built before `init_process_group` and pickled into worker processes (as
    Lightning and mp.spawn do): it binds its group when the hook first runs. Pickling
    keeps the config, the alignment and the state_dict; a state built on a group of its
    own comes back without it (`state.process_group = group` before training).
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, config: EDGCConfig | None = None, *,
        alignment: Any = None, control_group: dist.ProcessGroup | None = None, count_once: Any = (),
    ) -> None:
        """`control_group`: the group that agrees the rank and phase, when larger than
        `process_group` (a pipeline stage's replicas x TP ranks); `count_once`: parameters
        this process holds as a copy that another one counts in the signals (a tensor TP
        leaves whole, on every TP rank but the first)."""
        self.sync = GradientSync(process_group, config, alignment=alignment, control_group=control_group)
        self.sync.compression.uncounted_keys = frozenset(id(p) for p in count_once)

    # ------------------------------------------------------------------ what a user reads and sets

    @property
    def alignment(self) -> Any:
        """A pipeline stage's DAC (edgc.comm.pipeline.StageAlignment), or None."""
        return self.sync.alignment

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group gradients are averaged over (None: the default group); settable until
        the first step."""
        return self.sync.process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self.sync.process_group = group

    @property
    def world_size(self) -> int:
        return self.sync.world_size

    def state_dict(self) -> dict[str, Any]:
        """This replica's compression state (error feedback, Q, generator, policy; CPU tensors)."""
        return self.sync.state_dict()

    def load_state_dict(self, d: dict[str, Any], *, strict_replica: bool = True) -> None:
        """Resume from state_dict(), before the first step; a mismatched model, world size or
        replica raises ValueError (GradientSync.load_state_dict)."""
        self.sync.load_state_dict(d, strict_replica=strict_replica)

    def align(self) -> None:
        """In a pipeline: finish a window-end decision with the DAC exchange (called by the stage)."""
        self.sync.align()

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        """Config, alignment and state_dict() only: process groups and CUDA events cannot
        travel between processes."""
        sync = self.sync
        return {"config": sync.config, "alignment": sync.alignment, "state": sync.state_to_carry(),
                "group_dropped": sync.collectives.group_dropped or sync.process_group is not None,
                "grad_scale": float(sync.grad_scale)}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.sync = GradientSync(None, d["config"], alignment=d["alignment"])
        self.sync.collectives.group_dropped = d["group_dropped"]
        self.sync.grad_scale = d["grad_scale"]
        if d["state"] is not None:
            self.sync.load_state_dict(d["state"])


def edgc_hook(state: EDGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: entropy-driven low-rank compression of the gradient.

    Algorithm, per step (GradientSync._begin_step, edgc.comm.step and
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
         step was finite everywhere; at each window end, the policy moves the rank
         within [r_min, r_max].
      5. Each bucket's future completes with its (now averaged) buffer.

    Side effect: the bucket buffers hold the averaged gradient; the compression error is
    kept in `state` for the next step. A gradient with inf/nan anywhere comes out
    non-finite on every replica, for the optimiser or GradScaler to skip; it never
    reaches the EF or Q buffers.
    """
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    params = bucket.parameters()
    if state.sync.collectives.bound is None and any(hasattr(p, "_st_info") for p in params):
        # (DDP(device_mesh=...) turned tensor-parallel DTensors into local parameters
        # marked with their sharding: torch's DDP + TP workaround)
        raise ValueError("EDGC does not compress a tensor-parallel model under DDP: its TP ranks would choose "
                         "their ranks apart; shard it with FSDP2 instead (fully_shard on a shard mesh of size 1 is "
                         "fine) and call edgc.fsdp.register_edgc(model, mesh['replicate', 'shard'], config), as "
                         "docs/tensor-parallel.md shows")
    if state.sync.collectives.bound is None and any(getattr(p, "_edgc_expert_parallel", False) for p in params):
        # (edgc.moe.parallelize_experts marks the parameters it splits)
        raise ValueError("EDGC does not average experts split over expert-parallel ranks under DDP (DDP would "
                         "average them over every replica); shard the model with FSDP2, the experts on their own "
                         "mesh, and call edgc.fsdp.register_edgc(model, mesh, config, expert_mesh=...), as "
                         "docs/moe.md shows")
    state.sync.receive(bucket.buffer(), _entries(params), future, bucket.is_last())
    return future


def _entries(params: list[torch.Tensor]) -> list[tuple[Any, tuple[int, ...]]]:
    """A bucket's tensors for the core, in order: each parameter whole, but a stack of
    experts' weights [E, out, in] (edgc.models.moe) as E matrices of (out, in), which the
    round compresses in one batch ([E, out]: E vectors, sent whole)."""
    out: list[tuple[Any, tuple[int, ...]]] = []
    for p in params:
        if getattr(p, "_edgc_stacked_experts", False) and p.dim() >= 2:
            out += [((id(p), e), tuple(p.shape[1:])) for e in range(p.shape[0])]
        else:
            out.append((id(p), tuple(p.shape)))
    return out

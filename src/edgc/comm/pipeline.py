"""Pipeline wiring: a PipelineStage whose data-parallel sync follows its last send, and the
Dynamic Alignment Compressor's exchange between stages.

Why the sync is moved. torch.distributed.pipelining lets DDP's reducer sync a stage's
gradient inside the stage's last backward pass (`last_backward=True`), and the stage sends
its input gradient to the previous stage only after that backward returns. So stage p's
whole DP sync lies on the critical path of stages p-1 ... 0, the syncs of the stages run
one after another, and there is no slack for DAC to align. `EDGCPipelineStage` runs every
backward under `no_sync` and calls the same communication hook from the schedule's
REDUCE_GRAD action, after the schedule has waited for its sends: stage p's sync then
overlaps the last backward passes of stages p-1 ... 0, which is the setting in which
the paper's DAC is derived. `sync_after_send=False` keeps torch's placement (to
measure the difference).

`StageAlignment` is the DAC at run time: it measures this stage's sync times and backward
time per micro-batch, fits T(r) (policy/dac.py), hears T₀ and r₀ from stage 0 over the
pipeline group, and agrees the stage's rank over its DP group. At a window end EDGCState
leaves the decision pending, and the stage completes it (`EDGCState.align`) once its sends
are done, so the exchange never waits on a stage that is still in its backward pass.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc.comm.buckets import sync_with_hook
from edgc.comm.collectives import Collectives
from edgc.comm.timing import Lap, LapSum, start_lap
from edgc.policy.dac import DACConfig, TimeModel, rank_for_budget, stage_rank

__all__ = ["EDGCPipelineStage", "StageAlignment", "StageTimes"]


@dataclass
class StageTimes:
    """Seconds of one stage's work in the current step (reset by the trainer).

    Device times (edgc.comm.timing laps: CUDA events on a GPU), read with float() once
    the step is done. sync_start and sync_end are host wall-clock stamps.
    """

    forward: LapSum = field(default_factory=LapSum)  # forward_one_chunk, all micro-batches
    backward: LapSum = field(default_factory=LapSum)  # backward passes (sync excluded when after send)
    backward_chunks: list[Lap] = field(default_factory=list)  # per micro-batch, for t_mb
    sync: LapSum = field(default_factory=LapSum)  # the DP gradient sync
    sync_start: float = math.nan  # time.time() at the start of the sync
    sync_end: float = math.nan  # time.time() at its end

    def reset(self) -> None:
        self.forward, self.backward, self.sync = LapSum(), LapSum(), LapSum()
        self.backward_chunks = []
        self.sync_start = self.sync_end = math.nan


class EDGCPipelineStage(PipelineStage):
    """A PipelineStage over a DDP-wrapped stage module, with a communication hook that runs
    after the stage's last send (see the module doc) and timings for DAC and the metrics.

    A stage split with tensor parallelism (DTensor parameters, which DDP does not take) is
    given as the plain module: its sync runs after the sends in the same way, each TP
    rank's shards through the hook (edgc.comm.buckets.sync_with_hook)."""

    submod: nn.Module  # (PipelineStage's stage module: a DDP, or a plain module under TP)

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup,
        *,
        sync_after_send: bool = True,
        bucket_cap_mb: float = 25.0,
        input_args: Any = None,
        output_args: Any = None,
    ) -> None:
        plain = not isinstance(submodule, DDP)
        if plain and not sync_after_send:
            raise ValueError("a stage module without DDP (tensor parallelism) syncs after its sends only "
                             "(sync_after_send=True)")
        # example input and output tensors of one micro-batch (torch's "static" mode) spare
        # the shape-inference forward and backward passes, which would arm DDP's reducer
        # and run the activation compressor on throw-away gradients
        super().__init__(submodule, stage_index, num_stages, device, input_args=input_args,
                         output_args=output_args, group=group)
        self.sync_after_send = sync_after_send
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        inner: nn.Module = submodule.module if isinstance(submodule, DDP) else submodule
        self._params = list(inner.parameters())
        self.times = StageTimes()
        self._hook: tuple[Any, Any] | None = None
        self.alignment: StageAlignment | None = None
        if sync_after_send and isinstance(submodule, DDP):  # DDP's reducer must stay silent; a call would be a bug
            submodule.register_comm_hook(None, _reducer_must_not_sync)

    def no_sync(self) -> Any:
        """Run each schedule step inside this (`with stage.no_sync(): schedule.step(...)`).

        DDP arms its reducer in any forward with grad enabled outside `no_sync`, and an
        armed reducer all-reduces in the next backward, no_sync or not. torch 2.13's
        pipelining runs a shape-inference forward of the DDP module outside `no_sync` on
        the first step, which armed the reducer for an extra, uncompressed all-reduce.
        Inside this context only the backward that torch arms on purpose (the last one,
        when syncing in the backward) reaches the reducer. A plain stage module has no
        reducer: nothing to do.
        """
        return self.submod.no_sync() if isinstance(self.submod, DDP) else contextlib.nullcontext()

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Use `hook(state, bucket)` for this stage's DP gradient sync (and the state's
        StageAlignment, if it has one, for this stage's backward timings)."""
        self._hook = (state, hook)
        if getattr(state, "alignment", None) is not None:
            self.alignment = state.alignment
        if not self.sync_after_send:
            assert isinstance(self.submod, DDP)  # (checked in __init__)
            self.submod.register_comm_hook(state, hook)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        lap = start_lap(self.device)
        out = super().forward_one_chunk(*args, **kwargs)
        if torch.is_grad_enabled():  # not during evaluation
            self.times.forward.add(lap.stop())
        return out

    def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        # after-send: DDP's reducer never syncs here (torch uses no_sync when not last)
        sync_here = last_backward and not self.sync_after_send
        lap = start_lap(self.device)
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=sync_here)
        lap.stop()
        if sync_here:  # this backward includes the DDP sync
            self.times.sync_end = time.time()
        else:
            self.times.backward.add(lap)
            self.times.backward_chunks.append(lap)
            if self.alignment is not None:
                self.alignment.observe_backward(lap)
        return result

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.sync_after_send and self.has_backward:  # (not in schedule.eval)
            if self._hook is None:
                raise RuntimeError("EDGCPipelineStage has no communication hook; call register_comm_hook first")
            state, hook = self._hook
            self.times.sync_start = time.time()
            lap = start_lap(self.device)
            sync_with_hook(self._params, state, hook, self.bucket_cap_bytes)
            self.times.sync.add(lap.stop())
            self.times.sync_end = time.time()
        if self.has_backward and self._hook is not None and hasattr(self._hook[0], "align"):
            self._hook[0].align()  # a window-end DAC decision, now that the sends are done
        super().perform_reduce_grad(grad_scale_factor)


def _reducer_must_not_sync(state, bucket):  # (unannotated: DDP checks annotations as objects)
    raise RuntimeError("DDP's reducer tried to sync a pipeline stage whose sync runs after its last send")


class StageAlignment:
    """The DAC decision of one replica of pipeline stage `stage` (docs/pipelines.md).

    `EDGCState.align` calls `decide` after a window end with the entropy-driven rank.
    Collectives, issued in this order by every rank of the job at the same step:
      1. all-reduce SUM over the pipeline group of 5 + stages float64: stage 0's T₀ = T(r₀),
         r₀ and change of T₀; every stage's measured t_mb (averaged: the spec's one t_mb)
         and its mean wait for the other stages (for slack="measured");
      2. all-reduce MAX over the DP group of the stage's rank (replicas agree on the max).
    Timings are this replica's own measurements; a given `eta`, `t_mb` or `t_uncompressed`
    in DACConfig replaces the measurement (then decisions are deterministic). They may
    be given as laps (edgc.comm.timing) and are read only at a decision or a checkpoint,
    so that on CUDA nothing waits for the device to time a step.
    """

    def __init__(self, stage: int, num_stages: int, pp_group: dist.ProcessGroup | None,
                 config: DACConfig | None = None) -> None:
        config = config if config is not None else DACConfig()
        config.validate()
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is outside 0 .. {num_stages - 1}")
        self.stage, self.num_stages, self.pp_group, self.config = stage, num_stages, pp_group, config
        self._pp_group_dropped = False  # unpickled without its group (see __getstate__)
        self.samples: list[tuple[int, float]] = []  # (rank, seconds) of compressed syncs
        self.uncompressed: list[float] = []  # seconds of uncompressed syncs
        self.backward: list[float] = []  # seconds per micro-batch backward
        self.waits: list[float] = []  # seconds waited for the other stages after the sync, this window
        self.decisions: list[dict[str, Any]] = []

    # ---------------------------------------------------------------- measurements

    def _keep(self, values: list, value: Any) -> None:
        values.append(value)
        del values[: max(0, len(values) - self.config.max_samples)]

    def observe_compressed(self, rank: int, seconds: float | Lap | LapSum) -> None:
        self._keep(self.samples, (int(rank), seconds))

    def observe_uncompressed(self, seconds: float | Lap | LapSum) -> None:
        self._keep(self.uncompressed, seconds)

    def observe_backward(self, seconds: float | Lap | LapSum) -> None:
        self._keep(self.backward, seconds)

    def _resolve(self) -> None:
        """Read every pending lap into seconds (waits for the device's timed work)."""
        self.samples = [(r, float(t)) for r, t in self.samples]
        self.uncompressed = [float(t) for t in self.uncompressed]
        self.backward = [float(t) for t in self.backward]

    def __getstate__(self) -> dict[str, Any]:
        """Without the pipeline group, which cannot travel between processes (set
        `pp_group` again after unpickling) and with laps read into seconds."""
        self._resolve()
        d = dict(self.__dict__)
        d["_pp_group_dropped"] = self.pp_group is not None
        d["pp_group"] = None
        return d

    def observe_wait(self, seconds: float) -> None:
        """Seconds this stage waited, after its sync, in the step's first pipeline-wide
        collective: how much earlier than the last stage to finish it was done."""
        self._keep(self.waits, float(seconds))

    def time_model(self) -> TimeModel | None:
        """T(r) of this stage: the given one, the fit to its measurements, or None (none yet)."""
        self._resolve()
        if self.config.eta is not None:
            return TimeModel.given(self.config.eta, self.config.intercept)
        return TimeModel.fit(self.samples, self.config.time_model) if self.samples else None

    def t_mb(self) -> float:
        if self.config.t_mb is not None:
            return float(self.config.t_mb)
        self._resolve()
        return sum(self.backward) / len(self.backward) if self.backward else 0.0

    def t_uncompressed(self) -> float:
        if self.config.t_uncompressed is not None:
            return float(self.config.t_uncompressed)
        self._resolve()
        return sum(self.uncompressed) / len(self.uncompressed) if self.uncompressed else math.inf

    # ---------------------------------------------------------------- the decision

    def _current_time(self, model: TimeModel | None, current: int | None) -> float:
        """Predicted seconds of this stage's sync at its present rank `current` (None:
        uncompressed)."""
        if current is None or model is None:
            return self.t_uncompressed()
        return model(current)

    def decide(self, collectives: Collectives, r_entropy: int, step: int, *, current: int | None, r_min: int,
               r_max: int) -> int | None:
        """This stage's rank for the next window (None: uncompressed), agreed over its DP
        group (`collectives`, the stage synchroniser's); `current` is the rank in use (None:
        uncompressed), [r_min, r_max] the stage's bounds."""
        if self._pp_group_dropped and self.pp_group is None:
            raise RuntimeError("this StageAlignment was pickled without its pipeline group; "
                               "set alignment.pp_group = <the pipeline group> before training")
        cfg, p, n = self.config, self.stage, self.num_stages
        model = self.time_model()
        t_unc = self.t_uncompressed()
        msg = torch.zeros(5 + n, dtype=torch.float64)
        if p == 0:
            t0_new = model(r_entropy) if model is not None else 0.0
            msg[0] = t0_new
            msg[1] = r_entropy
            now = self._current_time(model, current)
            msg[4] = t0_new - now if math.isfinite(now) else 0.0
        msg[2] = self.t_mb()
        msg[3] = 1.0
        msg[5 + p] = sum(self.waits) / len(self.waits) if self.waits else 0.0
        # collective: all-reduce SUM of 5 + stages float64 over the pipeline group
        # (stage 0's T₀, r₀ and change of T₀; every stage's t_mb and mean wait)
        _all_reduce_cpu(msg, dist.ReduceOp.SUM, self.pp_group, collectives.device)
        t0, r0, t_mb, dt0 = float(msg[0]), int(round(float(msg[1]))), float(msg[2] / msg[3]), float(msg[4])
        waits = [float(w) for w in msg[5:]]
        budget = None
        if cfg.stage_ranks == "uniform" or model is None:
            local: int | None = r0
        elif cfg.slack == "measured" and p > 0:
            # finish when stage 0 will: the time it has now, plus how much earlier than
            # stage 0 it finished, plus how much longer stage 0's next sync will take
            # (uncompressed only where the budget covers the uncompressed time: with a
            # measured budget below it, sending uncompressed would overshoot, so a rank
            # above r_max runs r_max)
            budget = self._current_time(model, current) + (waits[p] - waits[0]) + dt0
            local = rank_for_budget(model, budget, r_min, r_max, t_unc, cfg.multiple, cap_at_r_max=True)
        else:
            local = stage_rank(p, model, r0, t0, t_mb, r_max, t_unc, multiple=cfg.multiple,
                               cap_at_r_max=cfg.cap_at_r_max)
        agreed_t = torch.tensor([float(local if local is not None else r_max + 1)], dtype=torch.float64)
        # collective: all-reduce MAX of 1 float64 over the control group (the stage's replicas,
        # and with tensor parallelism their TP ranks: all take the maximum)
        collectives.all_reduce(agreed_t, op=dist.ReduceOp.MAX, device_copy=collectives.device, control=True)
        agreed_v = int(agreed_t[0])
        agreed = None if agreed_v > r_max else agreed_v
        self.decisions.append({
            "step": step, "stage": p, "r_entropy": int(r_entropy), "r0": r0, "t0": t0, "t_mb": t_mb,
            "t_uncompressed": t_unc if math.isfinite(t_unc) else None,
            "model": model.to_dict() if model is not None else None, "r_max": r_max, "r_min": r_min,
            "slack": cfg.slack, "waits": waits, "dt0": dt0, "budget": budget,
            "local": local, "rank": agreed, "stage_ranks": cfg.stage_ranks,
        })
        self.waits = []
        return agreed

    # ---------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        self._resolve()
        return {"stage": self.stage, "num_stages": self.num_stages, "samples": [list(s) for s in self.samples],
                "uncompressed": list(self.uncompressed), "backward": list(self.backward), "waits": list(self.waits),
                "decisions": list(self.decisions)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if (d["stage"], d["num_stages"]) != (self.stage, self.num_stages):
            raise ValueError(f"DAC state is for stage {d['stage']} of {d['num_stages']}, "
                             f"this is stage {self.stage} of {self.num_stages}")
        self.samples = [(int(r), float(t)) for r, t in d["samples"]]
        self.uncompressed = [float(t) for t in d["uncompressed"]]
        self.backward = [float(t) for t in d["backward"]]
        self.waits = [float(t) for t in d["waits"]]
        self.decisions = list(d["decisions"])


def _all_reduce_cpu(tensor: torch.Tensor, op: Any, group: dist.ProcessGroup | None,
                    device: torch.device | None) -> None:
    """All-reduce a small CPU tensor in place (through `device` where the backend needs it)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if device is not None and device.type != "cpu":
        moved = tensor.to(device)
        dist.all_reduce(moved, op=op, group=group)
        tensor.copy_(moved.cpu())
    else:
        dist.all_reduce(tensor, op=op, group=group)

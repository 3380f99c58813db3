"""GradientSync: the one compression core behind every way edgc synchronises gradients.

An adapter turns its framework's gradient buffers into what this core takes: a flat
buffer, the tensors it holds ("entries": a key and a shape each, in buffer order), a
future to complete with the averaged buffer, and whether it is the step's last buffer
(`GradientSync.receive`). Three adapters sit on it:

- DDP: `edgc_hook` and `EDGCState` (edgc.comm.hook), one call per DDP bucket;
- FSDP2 and HSDP: `edgc.fsdp.register_edgc`, one call per FSDPModule's reduce-scatter
  output, averaged across the replicate group before the call returns ("eager");
- the pipeline stage (edgc.comm.pipeline), which runs a stage's DDP with the DDP hook.

The core owns everything else: the step counter, the policy and warm-up, error feedback
and warm-started Q, the collectives in their fixed order (edgc.comm.stepsync), the stats
and the checkpointable state.

Why the collectives follow a fixed order. DDP calls the hook once per bucket. torch's
powerSGD_hook issues each bucket's second all-reduce from a future callback, so two
replicas can issue bucket i's Q and bucket i+1's P in different orders; gloo then
deadlocks or aborts (it failed 4 of 7 runs of a 29M-parameter GPT on this project's
machine). Here every collective is issued from the thread that hands a buffer over, in
an order that depends only on which buffer is being handed over, on the step counter and
on values that were themselves all-reduced, never on how fast a collective finished
(edgc.comm.stepsync). Three modes:
- "pipelined" (EDGCConfig.sync_mode, the default): bucket i's P all-reduce starts when
  DDP hands it over, and bucket i-1 is finished meanwhile (a fixed lag of one bucket), so
  the sync overlaps the backward pass; same-shape matrices of a bucket share one bmm.
  With EDGCConfig.min_unit_mb, consecutive buckets too small on the wire are merged into
  one unit: fewer collectives, less overlap.
- "whole-step": the hook records each bucket and returns an unfinished future; at the
  last bucket it synchronises the whole gradient at once, then completes every future:
  same-shape matrices of all buckets share one bmm, and a step costs at most four
  collectives (control, uncompressed, P, Q) per gradient dtype, none of them overlapping
  the backward pass.
- eager (adapters whose framework needs each buffer averaged before the call returns,
  as FSDP2's all-reduce hook does): every buffer is one unit, started and completed in
  its own call. The slots are declared before the first step (`declare`), and what a
  step needs from the local gradient before it is averaged (the warm-up error check,
  the sample for the entropy and the noise scale) is measured buffer by buffer.
All give the same average, up to the float order of the sums.

Two groups. `process_group` is the group a gradient is averaged over: under DDP every
replica; under HSDP the replicate group of one shard. `control_group` is the group whose
members must reach the same decisions (rank, phase): by default the same one; under HSDP
the whole world, so that every shard runs at the same rank. The control values (entropy,
warm-up errors, the noise scale's norms, the per-group policies' sums) are agreed over it;
gradients never travel on it.

Why the process group is resolved at the first step, not in __init__. Frameworks build the
state before `init_process_group` (Lightning's PowerSGD recipe does, in the launching
process), and a state may be pickled into the worker processes. A world size read in the
constructor would be 1 there, and every collective would be skipped: replicas would drift
apart while the stats looked normal. So the group, the world size and this replica's
rank are bound when the first buffer arrives, and a job of several processes that gets
there without an initialised group is an error.

Precision. Gradients are grouped by dtype as well as shape. For bf16 and fp16 gradients
the arithmetic (M + error, P, Q, orthogonalisation, the error-feedback buffer) runs in
float32, and P and Q travel in the gradient's dtype: the rounding on the wire lands in
the error feedback instead of being lost. With a GradScaler, `set_grad_scale` tells the
state the loss scale, so the error feedback and the entropy stay in unscaled units when
the scale changes.

Timing. On CUDA, times are CUDA events read lazily (edgc.comm.timing): no host
synchronisation is added to a step to time it.
"""

from __future__ import annotations

import collections
import logging
import math
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from edgc.comm.stepsync import (
    ENTROPY,
    EPS_MAX,
    EPS_MIN,
    GRAD_SQ,
    LR_DROP,
    NONFINITE,
    Group,
    StepInfo,
    StepSync,
    UnitPlan,
    flatten_by_dtype,
    scatter,
    unit_plan,
    working_dtype,
)
from edgc.comm.timing import Lap, LapSum, start_lap
from edgc.comm.windowgrad import WindowGradient
from edgc.compress import compressible, draw_q, orthogonalize_, project_p, project_q, resize_q
from edgc.config import EARLIER_DEFAULTS, GROUP_POLICIES, EDGCConfig, pipeline_refusal
from edgc.entropy import is_sampled_step, sample_offsets, sample_stride
from edgc.policy import ErrorModel, RankController, WarmupGate, calibrated_max_rank, probe_ranks
from edgc.policy.budget import budget_rank, equivalent_rank
from edgc.policy.critical import CriticalRule, low_rank, noise_scale
from edgc.policy.noise import next_noise_rank
from edgc.policy.schedule import parse_rank_schedule, scheduled_rank
from edgc.policy.spectral import spectral_rank

logger = logging.getLogger(__name__)

#: One tensor of a flat buffer handed to GradientSync.receive: a key that names it in every
#: step (DDP: id(param); FSDP: (module, parameter)) and its shape; entries lie in the buffer
#: one after the other, in the order given.
Entry = tuple[Hashable, tuple[int, ...]]

__all__ = ["EDGCStats", "Entry", "GradientSync"]

_FORMAT = "edgc-state"
_VERSION = 1  # (version-1 states written before "replica" existed load without the check)
# Keys every state_dict() of this version has, and the ones its "stats" hold (the rest,
# e.g. "replica" and "applied_rank", came later and are optional).
_REQUIRED_KEYS = ("world_size", "config", "step", "phase", "r_min", "r_max", "slot_shapes", "uncompressed_slots",
                  "groups", "generator", "controller", "gate", "calibration", "stats")
_REQUIRED_STATS = ("comm_seconds", "entropy_seconds", "compress_seconds")


@dataclass
class EDGCStats:
    """What the compressor has done so far on this replica."""

    step: int
    phase: str  # "warmup" (uncompressed, maybe calibrating) or "compress", from the next step on
    rank: int  # rank in use from the next step on; 0 while uncompressed
    step_phase: str  # the phase the last synchronised step ran in ("warmup" before any)
    step_rank: int  # the rank the last step was sent at; 0 if it went uncompressed
    entropy: float  # last replica-averaged entropy estimate (nan before the first)
    min_rank: int  # r_min; 0 until known
    max_rank: int  # r_max; 0 until known (calibration)
    bytes_sent: int  # bytes this replica handed to collectives
    bytes_uncompressed: int  # bytes plain DDP all-reduce would have handed over
    compress_seconds: float  # local compression arithmetic (P, Q, orthogonalisation, EF)
    comm_seconds: float  # time spent waiting for collectives (pipelined: the part the backward pass did not hide)
    entropy_seconds: float  # sampling and entropy estimation
    nonfinite_steps: int  # compressed steps whose gradient had inf/nan (sent on; EF and Q kept as they were)
    compressed_steps: int  # steps synchronised with low-rank compression
    # policy "critical" (edgc.policy.critical), at the last window end; nan (False) before one
    critical_rho: float = math.nan  # rho = |N_old - N_new| / N_old (nan: no earlier window to compare)
    window_norm: float = math.nan  # N: the norm of the window's mean averaged gradient, on the GDS sample
    lr_drop: bool = False  # the learning rate dropped in that window (set_learning_rate), agreed over replicas
    # the last window's gradient noise scale B_simple (McCandlish et al. 2018) in units of one
    # replica's batch: multiply by that batch's size for examples. Measured on sampled steps
    # of the policies that sample the gradient (all but static, schedule and the per-group
    # ones); biased high on compressed steps, whose average is the low-rank one
    # (edgc.comm.windowgrad); nan with one replica, or before the first window end
    noise_scale: float = math.nan

    @property
    def compression_ratio(self) -> float:
        """bytes_uncompressed / bytes_sent (1.0 before any step)."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0

    def scalars(self) -> dict[str, float]:
        """These stats as numbers for a metrics logger (edgc.comm.stats.log_stats): "rank"
        and "compressing" (1 or 0) say what the last step did (step_rank, step_phase), as
        metrics.jsonl does; then "entropy" (left out before the first estimate), "min_rank",
        "max_rank", the byte counts so far and their "compression_ratio", the seconds spent,
        the counts of compressed and non-finite steps, and where measured "critical_rho",
        "window_norm", "lr_drop" (1 or 0, from the first "critical" window end on) and
        "noise_scale"; values not measured yet (nan) are left out."""
        out = {
            "rank": float(self.step_rank), "compressing": float(self.step_phase == "compress"),
            "entropy": self.entropy, "min_rank": float(self.min_rank), "max_rank": float(self.max_rank),
            "bytes_sent": float(self.bytes_sent), "bytes_uncompressed": float(self.bytes_uncompressed),
            "compression_ratio": self.compression_ratio, "compress_seconds": self.compress_seconds,
            "comm_seconds": self.comm_seconds, "entropy_seconds": self.entropy_seconds,
            "compressed_steps": float(self.compressed_steps), "nonfinite_steps": float(self.nonfinite_steps),
            "critical_rho": self.critical_rho, "window_norm": self.window_norm,
            "lr_drop": float(self.lr_drop) if math.isfinite(self.window_norm) else math.nan,
            "noise_scale": self.noise_scale,
        }
        return {name: value for name, value in out.items() if math.isfinite(value)}


#: How many of the latest collectives' handles a state keeps (GradientSync._recent_works).
_RECENT_WORKS = 256


class GradientSync:
    """All mutable state of EDGC compression, grouped by role as in torch's PowerSGDState.

    Tensors are identified by "slots": their order of first appearance in the first
    synchronised step (buffer order, then order within the buffer), or the order an eager
    adapter declares them in. A fresh DDP always builds the same first-step buckets for
    the same model, and an adapter declares the same model alike, so slots are stable
    across a checkpoint and resume.
    """

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, config: EDGCConfig | None = None, *,
        alignment: Any = None, control_group: dist.ProcessGroup | None = None, eager: bool = False,
    ) -> None:
        """`process_group`: the group gradients are averaged over (None: the default
        group); `control_group`: the group that agrees the decisions (None: the same);
        `alignment`: a pipeline stage's DAC (edgc.comm.pipeline); `eager`: every buffer
        is averaged before `receive` returns, and the slots are declared up front."""
        config = config if config is not None else EDGCConfig()
        if not isinstance(config, EDGCConfig):
            raise TypeError(f"config must be an EDGCConfig, got {type(config).__name__}")
        config.validate()
        # hyperparameters
        self.config = config
        self._process_group = process_group
        self._control_group = control_group
        self.eager = eager
        if eager and config.max_rank is None:
            raise ValueError("max_rank must be set here: calibrating r_max times the whole local gradient at once, "
                             "and this synchroniser averages it buffer by buffer")
        if eager and alignment is not None:
            raise ValueError("a pipeline stage's alignment needs the DDP adapter, not the eager one")
        if alignment is not None and (why := pipeline_refusal(config)) is not None:
            raise ValueError(why)
        self._bound: tuple[int, int] | None = None  # (world size, replica rank) from the first step
        self._control_size = 1  # members of the control group (bound with the group)
        self._group_dropped = False  # unpickled from a state whose own group could not travel
        self._loaded: dict[str, Any] | None = None  # a state_dict loaded before the first step
        self._loaded_identity: tuple[int, int | None, bool] | None = None  # (world, replica, strict) to check
        self.grad_scale = 1.0  # the loss scale the gradients carry (set_grad_scale)
        logger.info("EDGC config: %s", config)
        # pipeline stage alignment (comm.pipeline.StageAlignment), or None outside a pipeline
        self.alignment = alignment
        self._pending_alignment: tuple[int, int] | None = None

        # internal state
        self.step = 0
        self.phase = "warmup"
        self.applied_rank = 0  # rank of compressed steps; the controller's, or DAC's in a pipeline
        self.stage_uncompressed = False  # DAC sent this stage uncompressed for the window
        self.step_phase = "warmup"  # what the last synchronised step did (for metrics)
        self.step_rank = 0
        self._residual_pending = False  # error feedback may hold a residual not yet sent
        self.device: torch.device | None = None
        self.r_max = config.max_rank or 0
        self.r_min = config.resolved_min_rank(config.max_rank) if config.max_rank else 0
        self.controller = RankController(config.policy, rank_step=config.rank_step, rank_multiple=config.rank_multiple,
                                         smoothing=config.entropy_smoothing)
        self.gate = WarmupGate(config.warmup_steps, config.window, config.warmup_error_check,
                               config.warmup_max_error, sample_stride(config.iteration_sample_rate))
        # "critical": the last window's norm and the learning rates given (set_learning_rate),
        # and the window sums of the averaged gradient it (and the noise scale) reads
        self.critical = CriticalRule(config.critical_threshold, config.lr_drop_factor)
        self._window_grad = WindowGradient()
        self._schedule = parse_rank_schedule(config.rank_schedule) if config.policy == "schedule" else []
        self.generator = torch.Generator().manual_seed(config.seed)
        self.calibration: dict[str, Any] = {"points": [], "t_uncompressed": [], "done": config.max_rank is not None}
        self.groups: dict[tuple[int, int, str], Group] = {}  # by (m, n, dtype)
        # per-group policies, a (2, groups) float64 sum over the window's steps, on the
        # gradients' device (no host sync per step), agreed at the window end: "budget"
        # sums local (‖M‖², ‖Q‖²), "spectral" (Σ effective rank, matrices counted)
        self._window_sums: torch.Tensor | None = None
        self.uncompressed_slots: list[int] = []
        self._slot_of: dict[Hashable, int] = {}  # an entry's key (DDP: id(param)) -> slot
        self.slot_shapes: list[tuple[int, ...]] = []
        self._expected_shapes: list[tuple[int, ...]] | None = None  # from load_state_dict
        self._pending_groups: list[dict[str, Any]] | None = None
        self._slot_dtypes: list[torch.dtype] = []  # (this process's; from its first step)
        # the plan of the units a step is synchronised in: DDP's bucket layout of the last
        # step that had several buckets, as slots (edgc.comm.stepsync, "The plan"; a step
        # may merge runs of it, "Coarse units", but the plan stays the layout); None: none yet
        self._units: list[tuple[int, ...]] | None = None
        self._unit_plans: dict[tuple[bool, tuple[int, ...]], UnitPlan] = {}
        self._sample_at: tuple[float, list[int], torch.dtype] | None = None
        self._sync: StepSync | None = None  # the step whose buckets are being handed over

        # stats
        self.last_entropy = math.nan
        self.noise_scale = math.nan  # the last window's (EDGCStats.noise_scale)
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        self._comm = LapSum()  # inside collectives, waiting included
        # The latest collectives' handles, kept so that gloo's threads never drop the last
        # reference to a finished collective: if a thread did, at interpreter shutdown,
        # the process would abort ("terminate called without an active exception") after
        # training finished. Held here, they are freed by Python, with the GIL.
        self._recent_works: collections.deque = collections.deque(maxlen=_RECENT_WORKS)
        self._entropy = LapSum()  # sampling and estimation
        self._busy = LapSum()  # whole syncs; compression is the rest
        self.nonfinite_steps = 0
        self.compressed_steps = 0

    # ------------------------------------------------------------------ the group

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group gradients are averaged over (None: the default group)."""
        return self._process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        if self._bound is not None:
            raise RuntimeError("the EDGC state's process group cannot change after its first step")
        self._process_group = group
        self._group_dropped = False

    @property
    def world_size(self) -> int:
        """Replicas in the group: bound at the first step; before it, what the group says
        now (1 while torch.distributed is not initialised)."""
        return (self._bound or self._identity() or (1, 0))[0]

    @property
    def replica(self) -> int:
        """This process's rank in the group (bound at the first step, like world_size)."""
        return (self._bound or self._identity() or (1, 0))[1]

    def _identity(self) -> tuple[int, int] | None:
        """(world size, rank) in the group, or None when torch.distributed is not initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.get_world_size(self._process_group), dist.get_rank(self._process_group)

    def _bind(self) -> None:
        """At the first step: fix the group's world size and this replica's rank, and check
        a state loaded before the group existed. Raises where a job of several processes
        would otherwise train unsynced."""
        if self._group_dropped:
            raise RuntimeError(
                "this EDGC state was pickled with its own process group, which cannot travel between "
                "processes; set state.process_group = <the DDP's group> before training")
        identity = self._identity()
        if identity is None:
            env_world = int(os.environ.get("WORLD_SIZE", "1") or 1)
            if env_world > 1:
                raise RuntimeError(
                    f"the EDGC hook ran before torch.distributed was initialised, in a job of WORLD_SIZE={env_world}: "
                    "gradients would not be synchronised; call init_process_group first")
            identity = (1, 0)
        if identity[1] < 0:
            raise RuntimeError("this process is not a member of the EDGC state's process group")
        self._bound = identity
        if self._control_group is not None and identity[0] > 1:
            self._control_size = dist.get_world_size(self._control_group)
            if self._control_size % identity[0]:
                raise ValueError(f"the control group ({self._control_size} processes) must be a whole number of "
                                 f"copies of the averaging group ({identity[0]})")
        else:
            self._control_size = identity[0]
        logger.info("EDGC bound to a group of %s replicas, this one rank %s", *identity)
        if self._loaded_identity is not None:
            self._check_identity(*self._loaded_identity)
            self._loaded_identity = None

    def _check_identity(self, world: int, replica: int | None, strict: bool) -> None:
        if world != self.world_size:
            raise ValueError(
                f"EDGC state was saved with world size {world} but this job has {self.world_size}; "
                "error-feedback buffers are per replica and cannot be remapped")
        if replica is not None and replica != self.replica:
            if strict:
                raise ValueError(
                    f"EDGC state was saved by replica {replica} but is being loaded on replica {self.replica}: "
                    "its error-feedback buffers belong to the replica that built them. Load each replica's own "
                    "state, or pass strict_replica=False to load another replica's on purpose")
            logger.warning("EDGC: loading replica %s's state on replica %s (strict_replica=False)",
                           replica, self.replica)

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        """Config, alignment and state_dict() only: process groups and CUDA events cannot
        travel between processes. A state with its own group comes back without it, and
        must be given it again (`state.process_group = group`) before its first step."""
        if self.eager:
            raise TypeError("an eager synchroniser (edgc.fsdp) is bound to its model's sharded layout and cannot be "
                            "pickled; save its state_dict() instead")
        if self._bound is None:
            saved = self._loaded  # never stepped here: at most a loaded state to pass on
        else:
            saved = self.state_dict()
        return {"config": self.config, "alignment": self.alignment, "state": saved,
                "group_dropped": self._group_dropped or self._process_group is not None,
                "grad_scale": float(self.grad_scale)}

    def __setstate__(self, d: dict[str, Any]) -> None:
        type(self).__init__(self, None, d["config"], alignment=d["alignment"])
        self._group_dropped = d["group_dropped"]
        self.grad_scale = d["grad_scale"]
        if d["state"] is not None:
            self.load_state_dict(d["state"])

    # ------------------------------------------------------------------ public API

    @property
    def comm_seconds(self) -> float:
        return float(self._comm)

    @property
    def entropy_seconds(self) -> float:
        return float(self._entropy)

    @property
    def compress_seconds(self) -> float:
        return max(0.0, float(self._busy) - float(self._comm) - float(self._entropy))

    def set_grad_scale(self, scale: float) -> None:
        """Tell the state the loss scale the next gradients carry (GradScaler.get_scale()).

        The error feedback is kept in unscaled units and the entropy is measured on the
        unscaled gradient, so a changing loss scale neither mis-sizes the residual added
        back nor reads as an entropy change. 1.0 (the default) without a GradScaler.
        """
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"grad scale must be a positive finite number, got {scale}")
        self.grad_scale = scale

    def set_learning_rate(self, lr: float) -> None:
        """Tell the state the learning rate of the next step: call it before each backward
        pass, or at least whenever the rate changes (a rate holds until the next call).

        The "critical" policy runs the window after a learning-rate drop at r_max: at each
        window end, a drop is the least rate given in the window falling below
        `lr_drop_factor` times the rate in force at the previous window end (by default,
        below half of it). Replicas agree on it at the window end (one entry of the
        step's control all-reduce), so one replica's drop raises the rank everywhere.
        Without calls no drop is ever seen. Other policies only record the rate. Raises
        ValueError unless `lr` is a finite number >= 0.
        """
        lr = float(lr)
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        self.critical.observe_lr(lr)

    @property
    def rank(self) -> int:
        """The rank used for compressed steps now (0 while uncompressed)."""
        if self.phase != "compress" or self.stage_uncompressed:
            return 0
        if self.config.policy in GROUP_POLICIES and self.groups:
            # per-group ranks: the uniform rank that would send the same bytes
            groups = list(self.groups.values())
            return int(round(equivalent_rank([g.q.shape[-1] for g in groups],
                                             [len(g.slots) * sum(g.shape) for g in groups])))
        return self.applied_rank

    def stats(self) -> EDGCStats:
        """A snapshot of this replica's counters."""
        return EDGCStats(
            step=self.step,
            phase=self.phase,
            rank=self.rank,
            step_phase=self.step_phase,
            step_rank=self.step_rank,
            entropy=self.last_entropy,
            min_rank=self.r_min,
            max_rank=self.r_max,
            bytes_sent=self.bytes_sent,
            bytes_uncompressed=self.bytes_uncompressed,
            compress_seconds=self.compress_seconds,
            comm_seconds=self.comm_seconds,
            entropy_seconds=self.entropy_seconds,
            nonfinite_steps=self.nonfinite_steps,
            compressed_steps=self.compressed_steps,
            critical_rho=self.critical.rho,
            window_norm=self.critical.norm,
            lr_drop=self.critical.lr_drop,
            noise_scale=self.noise_scale,
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything mutable, so that load_state_dict continues exactly (CPU tensors).

        It records this replica's rank: error-feedback buffers are per replica, so a
        checkpoint holds one state per replica and each goes back to its own rank.
        """
        if self._bound is None and self._loaded is not None:
            return self._loaded  # loaded but not stepped yet: pass it on unchanged
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "world_size": self.world_size,
            "replica": self.replica,
            "config": self.config.to_dict(),
            "step": self.step,
            "phase": self.phase,
            "applied_rank": self.applied_rank,
            "stage_uncompressed": self.stage_uncompressed,
            "step_phase": self.step_phase,
            "step_rank": self.step_rank,
            "alignment": self.alignment.state_dict() if self.alignment is not None else None,
            "r_min": self.r_min,
            "r_max": self.r_max,
            "slot_shapes": [list(s) for s in self.slot_shapes],
            "uncompressed_slots": list(self.uncompressed_slots),
            "units": None if self._units is None else [list(u) for u in self._units],
            "groups": [
                {
                    "shape": list(g.shape),
                    "dtype": str(g.dtype).removeprefix("torch."),
                    "slots": list(g.slots),
                    "q": g.q.detach().cpu().clone(),
                    "error": None if g.error is None else g.error.detach().cpu().clone(),
                }
                for g in self.groups.values()
            ],
            "generator": self.generator.get_state(),
            "policy_window": None if self._window_sums is None else self._window_sums.cpu().tolist(),
            "controller": self.controller.state_dict(),
            "critical": self.critical.state_dict(),
            "window_gradient": self._window_grad.state_dict(),
            "gate": self.gate.state_dict(),
            "calibration": {k: (list(v) if isinstance(v, list) else v) for k, v in self.calibration.items()},
            "stats": {
                "last_entropy": self.last_entropy,
                "bytes_sent": self.bytes_sent,
                "bytes_uncompressed": self.bytes_uncompressed,
                "compress_seconds": self.compress_seconds,
                "comm_seconds": self.comm_seconds,
                "entropy_seconds": self.entropy_seconds,
                "grad_scale": float(self.grad_scale),
                "nonfinite_steps": self.nonfinite_steps,
                "compressed_steps": self.compressed_steps,
                "noise_scale": self.noise_scale,
            },
        }

    def load_state_dict(self, d: dict[str, Any], *, strict_replica: bool = True) -> None:
        """Restore from state_dict(); raises ValueError on a foreign or mismatched state.

        World size and replica are checked here when the process group exists, else at
        the first step. A state saved by another replica is refused: its error feedback
        is that replica's (a flow that saves rank 0's state and loads it everywhere would
        otherwise corrupt every other replica without a word). `strict_replica=False`
        loads it on purpose, with a warning. The model's parameter shapes are checked at
        the first synchronised step, when DDP shows them to the hook.
        """
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise ValueError("not an EDGC state dict (missing format marker 'edgc-state')")
        if d.get("version") != _VERSION:
            raise ValueError(f"EDGC state version {d.get('version')} is not supported (expected {_VERSION})")
        if self.step != 0:
            raise ValueError("load_state_dict must be called before the first training step")
        _check_state_keys(d)
        identity = (int(d["world_size"]), None if d.get("replica") is None else int(d["replica"]), strict_replica)
        if self._bound is not None or self._identity() is not None:
            self._check_identity(*identity)
        else:
            self._loaded_identity = identity  # checked when the hook binds its group
        # (a state saved before a field existed ran with its EARLIER_DEFAULTS value)
        saved_config = {**EARLIER_DEFAULTS, **d["config"]}
        if saved_config != self.config.to_dict():
            changed = sorted(k for k, v in saved_config.items() if self.config.to_dict().get(k) != v)
            logger.warning("EDGC config differs from the checkpoint's in %s; using the new values", changed)
        self.step = int(d["step"])
        self.phase = d["phase"]
        # (states written before pipelines existed lack the next three keys)
        self.applied_rank = int(d.get("applied_rank", d["controller"]["rank"]))
        self.stage_uncompressed = bool(d.get("stage_uncompressed", False))
        self.step_phase = d.get("step_phase", self.phase)
        self.step_rank = int(d.get("step_rank", self.rank))
        self._residual_pending = self.phase == "compress"  # (flushing zeros is harmless)
        if (d.get("alignment") is None) != (self.alignment is None):
            raise ValueError("EDGC state and this job differ in pipeline stage alignment (DAC): "
                             "a pipeline-stage state cannot resume outside a pipeline, or the reverse")
        if self.alignment is not None:
            self.alignment.load_state_dict(d["alignment"])
        self.r_min, self.r_max = int(d["r_min"]), int(d["r_max"])
        self._expected_shapes = [tuple(s) for s in d["slot_shapes"]]
        if self.eager and self._slot_of:
            self._check_expected_shapes()  # (declared already: say it now, not at the first step)
        self.uncompressed_slots = list(d["uncompressed_slots"])
        # (states written before the pipelined mode lack "units": DDP's buckets serve until known)
        self._units = _checked_units(d.get("units"), len(self._expected_shapes))
        self._pending_groups = d["groups"]
        self.generator.set_state(d["generator"])
        sums = d.get("policy_window", d.get("budget_window"))  # (the key's name before "spectral")
        self._window_sums = None if sums is None else torch.tensor(sums, dtype=torch.float64)
        self.controller.load_state_dict(d["controller"])
        # (states written before the "critical" policy lack the next two: nothing recorded yet)
        self.critical = CriticalRule(self.config.critical_threshold, self.config.lr_drop_factor)
        if d.get("critical") is not None:
            self.critical.load_state_dict(d["critical"])
        self._window_grad = WindowGradient()
        if d.get("window_gradient") is not None:
            self._window_grad.load_state_dict(d["window_gradient"])
        self.gate.load_state_dict(d["gate"])
        self.calibration = dict(d["calibration"])
        stats = dict(d["stats"])
        self._comm = LapSum(stats.pop("comm_seconds"))
        self._entropy = LapSum(stats.pop("entropy_seconds"))
        self._busy = LapSum(stats.pop("compress_seconds") + float(self._comm) + float(self._entropy))
        self.grad_scale = float(stats.pop("grad_scale", 1.0))
        for k, v in stats.items():
            setattr(self, k, v)
        self._loaded = d

    # ------------------------------------------------------------------ the step

    def _new_slot(self, key: Hashable, shape: tuple[int, ...]) -> int:
        """The slot of `key`, given the next free one if it has none."""
        if key not in self._slot_of:
            self._slot_of[key] = len(self.slot_shapes)
            self.slot_shapes.append(tuple(shape))
        return self._slot_of[key]

    def declare(self, layout: Sequence[Sequence[Entry]], dtypes: Sequence[torch.dtype]) -> None:
        """Eager adapters: give every tensor its slot before the first step, buffer by
        buffer in `layout` (each buffer's entries in order); `dtypes`, one per buffer, the
        dtype of the parameters it holds. A state loaded before is checked against it
        here. Raises ValueError on a mismatch, RuntimeError once slots are assigned."""
        if self._slot_of:
            raise RuntimeError("this EDGC state's tensors were declared or seen already")
        if len(dtypes) != len(layout):
            raise ValueError(f"declare: {len(layout)} buffers but {len(dtypes)} dtypes")
        for entries, dtype in zip(layout, dtypes, strict=True):
            for key, shape in entries:
                self._new_slot(key, shape)
                self._slot_dtypes.append(dtype)
        self._check_expected_shapes()

    def _check_expected_shapes(self) -> None:
        """Raise ValueError where a loaded state was saved for other tensors."""
        if self._expected_shapes is not None and self._expected_shapes != self.slot_shapes:
            raise ValueError(
                "EDGC checkpoint does not match this model: it holds "
                f"{len(self._expected_shapes)} parameters, the model has {len(self.slot_shapes)}; "
                f"first difference at {_first_difference(self._expected_shapes, self.slot_shapes)}"
            )

    def _assign_slots(
        self, pending: list[tuple[torch.Tensor, Sequence[Entry], Any]]
    ) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
        """Gradient views in slot order, and each buffer's slots; new tensors get the
        next free slots."""
        views: dict[int, torch.Tensor] = {}
        layout = []
        for buffer, entries, _ in pending:
            offset, slots = 0, []
            for key, shape in entries:
                s = self._new_slot(key, shape)
                numel = math.prod(shape)
                views[s] = buffer[offset : offset + numel].view(shape)
                slots.append(s)
                offset += numel
            layout.append(tuple(slots))
        if self._expected_shapes is not None:
            self._check_expected_shapes()
            self._expected_shapes = None
            self._restore_groups({s: v.device for s, v in views.items()}, {s: v.dtype for s, v in views.items()})
        if len(views) != len(self.slot_shapes):
            raise RuntimeError(
                "EDGC saw a step without some parameters' gradients; the hook needs every "
                "parameter in every step (do not use find_unused_parameters with EDGC)"
            )
        grads = [views[s] for s in range(len(self.slot_shapes))]
        self._slot_dtypes = [g.dtype for g in grads]
        return grads, layout

    def _restore_groups(self, devices: dict[int, torch.device], dtypes: dict[int, torch.dtype]) -> None:
        """The loaded state's groups, on the gradients' device and in their dtype (by slot)."""
        for g in self._pending_groups or []:
            device, dtype = devices[g["slots"][0]], dtypes[g["slots"][0]]
            shape = (int(g["shape"][0]), int(g["shape"][1]))
            work = working_dtype(dtype)
            error = None if g["error"] is None else g["error"].to(device=device, dtype=work)
            group = Group(shape, list(g["slots"]), g["q"].to(device=device, dtype=work), error, dtype)
            self.groups[group.key] = group
        self._pending_groups = None
        self._unit_plans = {}
        if self.phase == "compress" and self.config.policy == "cqm":
            self.controller.error_model = self._error_model()

    def receive(self, buffer: torch.Tensor, entries: Sequence[Entry], future: torch.futures.Future,
                last: bool) -> None:
        """One flat buffer of gradients, holding `entries` one after the other: hand it to
        the step under way, or start one. `future` is completed with `buffer` once it holds
        the average (eager: before this returns); `last` ends the step."""
        lap = start_lap(buffer.device)
        sync = self._sync
        try:
            if sync is None:  # the step's first buffer
                if self._bound is None:
                    self._bind()
                self.device = buffer.device
                if self.eager and self._expected_shapes is not None:
                    self._expected_shapes = None  # (checked by declare or load_state_dict, whichever came last)
                    self._restore_groups(collections.defaultdict(lambda: buffer.device),
                                         {g["slots"][0]: _saved_dtype(g) for g in self._pending_groups or []})
                sync = self._sync = StepSync(self, pipelined=self._pipelined_next())
            sync.add(buffer, entries, future)
            if last:
                self._sync = None
                sync.finish()
        except Exception as exc:
            self._sync = None  # (the next step starts afresh)
            if sync is not None:
                sync.fail(exc)
            raise
        finally:
            self._busy.add(lap.stop())

    def _pipelined_next(self) -> bool:
        """Whether the next step can start its units at its first bucket (decided from
        replica-identical values only). Steps that need the whole local gradient first, or
        the slots checked, run whole-step: this process's first step (slots are assigned,
        a loaded state checked against the model), r_max calibration and the warm-up error
        check (warm-up only), and flushing the error feedback into an uncompressed window."""
        if self.eager:
            return True  # (declared slots; no calibration; the warm-up check is measured per buffer)
        if self.config.sync_mode != "pipelined":
            return False
        if self._bound is None or not self._slot_of or self._expected_shapes is not None:
            return False
        if self.phase == "warmup":
            return self.calibration["done"] and not self.gate.needs_errors(self.step + 1)
        return not (self.stage_uncompressed and self._residual_pending)

    def _bucket_views(self, buffer: torch.Tensor, entries: Sequence[Entry],
                      views: dict[int, torch.Tensor]) -> tuple[int, ...]:
        """A buffer of a step whose slots are known: its gradients' views into `views`;
        returns its slots."""
        slots, offset = [], 0
        for key, shape in entries:
            s = self._slot_of.get(key)
            if s is None or tuple(shape) != self.slot_shapes[s]:
                raise RuntimeError("EDGC was handed a parameter that its first step did not have; the hook "
                                   "needs the same parameters in every step")
            if s in views:
                raise RuntimeError(f"EDGC was handed parameter slot {s} twice in one step (a step whose "
                                   "last buffer never came: every parameter needs a gradient in every step)")
            numel = math.prod(shape)
            views[s] = buffer[offset : offset + numel].view(shape)
            offset += numel
            slots.append(s)
        return tuple(slots)

    def _begin_step(self) -> StepInfo:
        """Start a step (at its first bucket, or its last in the whole-step mode): count it
        and decide what it does, from replica-identical values."""
        self._loaded = None  # the state has moved on from what was loaded
        self.step += 1
        step, cfg = self.step, self.config
        # (static, schedule and the per-group policies decide nothing from the gradient's sample, so
        # they pay nothing for it; "critical" and "noise" decide from the noise scale, and measure
        # the entropy too, for the user's plots and the paper's comparison)
        sampled = (cfg.policy not in ("static", "schedule", *GROUP_POLICIES)
                   and is_sampled_step(step, cfg.iteration_sample_rate))
        want_entropy = sampled
        critical = cfg.policy == "critical"
        want_errors = self.phase == "warmup" and self.gate.needs_errors(step) and self.calibration["done"]
        self.step_phase, self.step_rank = self.phase, 0
        if self.phase == "compress" and cfg.policy == "schedule":
            rank = scheduled_rank(self._schedule, step)
            if rank != self.applied_rank:
                self._apply_rank(rank)
        compressed = self.phase == "compress" and not self.stage_uncompressed
        if compressed and not cfg.warm_start:
            for g in self.groups.values():
                g.q = draw_q(len(g.slots), g.shape[1], g.q.shape[-1], self.generator, dtype=g.q.dtype,
                             device=g.q.device)
        flush = self.phase == "compress" and not compressed and self._residual_pending
        return StepInfo(step, compressed, want_entropy, want_errors, flush, self.grad_scale,
                        want_noise=sampled and self.world_size > 1,
                        want_lr_drop=critical and step % cfg.window == 0, watch_average=critical)

    def _end_step(self, info: StepInfo, control: torch.Tensor | None, grads: list[torch.Tensor], finite: bool,
                  sums_finite: torch.Tensor, step_comm: LapSum, plain: Lap | None,
                  average: torch.Tensor | None = None) -> None:
        """Decisions at the end of a step, from replica-identical values (`control` is the
        replica-summed control vector, its averages divided already; `grads` the averaged
        gradient in slot order, views of DDP's buckets, in both sync modes and whether the
        step was compressed or not; `sums_finite` the device flag of StepSync.ok: on
        compressed steps, and on every step of "critical", whether every sum was finite)."""
        step, cfg = info.step, self.config
        if info.compressed:
            if finite:
                self.step_rank = self.rank
                if self.alignment is not None:
                    self.alignment.observe_compressed(self.rank, step_comm)
        else:
            if self.alignment is not None:
                self.alignment.observe_uncompressed(step_comm)
            if not self.calibration["done"]:
                assert plain is not None  # (StepSync times an uncompressed step while calibrating)
                self._calibrate(grads, float(plain))  # (warm-up only: waits for the device)
        if info.want_entropy:
            assert control is not None  # (StepSync all-reduces it on a step that wants the entropy)
            # a replica with inf/nan gradients contributes no entropy sample this step
            self.last_entropy = float(control[ENTROPY]) if control[NONFINITE] == 0 else math.nan
            self.controller.observe(self.last_entropy)
        self._observe_average(info, control, grads, sums_finite, average)
        if step % cfg.window == 0:
            self.controller.close_window()
            average_rank = self._close_average_window(control)
            if self.phase == "compress" and cfg.policy in GROUP_POLICIES:
                self._group_decide()
            elif self.phase == "compress" and cfg.policy != "schedule":
                rank = average_rank if cfg.policy in ("critical", "noise") else self.controller.decide()
                if self.alignment is not None:
                    # the stage exchange waits for stage 0, which may still be in its
                    # backward pass: the pipeline stage calls align() after its sends
                    self._pending_alignment = (rank, step)
                else:
                    self._apply_rank(rank)
        if self.phase == "warmup" and self.calibration["done"]:
            eps_min = eps_max = math.nan
            if info.want_errors:
                assert control is not None  # (and on a step that wants the errors)
                eps_min, eps_max = float(control[EPS_MIN]), float(control[EPS_MAX])
                logger.info(
                    "EDGC warm-up check at step %s: eps(r_min=%s) = %.4g, eps(r_max=%s) = %.4g, eps_max = %.4g",
                    step, self.r_min, eps_min, self.r_max, eps_max,
                    math.nan if self.gate.eps_max is None else self.gate.eps_max,
                )
            if self.gate.update(step, eps_min, eps_max):
                self._start_compression(grads)

    def _observe_average(self, info: StepInfo, control: torch.Tensor | None, grads: list[torch.Tensor],
                         sums_finite: torch.Tensor, average: torch.Tensor | None) -> None:
        """Add the step's averaged gradient to the window's sums (edgc.comm.windowgrad): its
        sample every step for "critical", and on sampled steps, where every replica's
        gradient was finite, the noise scale's two squared norms."""
        small_sq = None
        if info.want_noise and control is not None and control[NONFINITE] == 0:  # (control: on such steps)
            small_sq = float(control[GRAD_SQ])  # |G_small|²: the replicas' mean
        if not (info.watch_average or small_sq is not None):
            return
        offsets, dtype = self._sample_layout()
        self._window_grad.observe(grads, offsets, dtype, self.config.gradient_sample_rate, info.scale, sums_finite,
                                  accumulate=info.watch_average, small_sq=small_sq, sample=average)

    def _close_average_window(self, control: torch.Tensor | None) -> int:
        """At a window end: the window's noise scale; for "critical" the next window's rank
        (edgc.policy.critical), from the window's norm and the learning-rate drop the
        replicas agreed in this step's control vector; for "noise" the next window's rank
        from the noise scale (edgc.policy.noise). Returns that rank (the rank in use for
        other policies). In warm-up the rules only record the window."""
        cfg = self.config
        agree = self._agree_over_control if self.control_size > self.world_size else None
        norm, noise = self._window_grad.close(agree)
        window_noise = math.nan
        if noise is not None:
            # (the window's sums: their count cancels in the ratio)
            window_noise = self.noise_scale = noise_scale(noise[0], noise[1], self.world_size)
        if cfg.policy == "noise":
            return self._noise_decide(window_noise)
        if cfg.policy != "critical":
            return self.applied_rank
        assert control is not None  # (issued at every window end of "critical")
        dropped = bool(control[LR_DROP] > 0)  # (any replica's drop: a SUM of 0/1 flags)
        r_lo = low_rank(cfg.critical_low_rank, self.r_min, self.r_max, cfg.rank_multiple)
        rank = self.critical.close_window(norm, dropped, self.r_max, r_lo)
        logger.info("EDGC critical: step %s, window gradient norm %.6g, rho %.4g%s -> rank %s%s", self.step, norm,
                    self.critical.rho, ", learning rate dropped" if dropped else "", rank,
                    "" if self.phase == "compress" else " (warm-up: not applied)")
        return rank

    def _agree_over_control(self, values: torch.Tensor) -> None:
        """Average a float64 CPU vector in place over the control group (window ends only)."""
        # collective: all-reduce SUM of a few float64 over the control group
        self._all_reduce(values, device_copy=self.device, control=True)
        values /= self.control_size

    def _noise_decide(self, window_noise: float) -> int:
        """The "noise" policy at a window end in the compress phase: the controller's rank
        moved towards r_max (n / B)^gamma, at most `rank_step` (edgc.policy.noise); kept
        where the window measured no noise scale. Returns it (the applied rank in warm-up)."""
        if self.phase != "compress":
            return self.applied_rank
        cfg = self.config
        rank = next_noise_rank(window_noise, self.world_size, self.controller.rank, r_min=self.r_min, r_max=self.r_max,
                               exponent=cfg.noise_exponent, rank_step=cfg.rank_step, multiple=cfg.rank_multiple)
        logger.info("EDGC noise: step %s, noise scale %.4g replica batches -> rank %s", self.step, window_noise, rank)
        self.controller.rank = rank
        self.controller.rank_value = float(rank)
        self.controller.moves += 1
        return rank

    def _unit_plan(self, unit: tuple[int, ...], groups: list[Group]) -> UnitPlan:
        """The cached UnitPlan of a unit (per set of groups: [] for an uncompressed step)."""
        key = (bool(groups), unit)
        plan = self._unit_plans.get(key)
        if plan is None:
            plan = self._unit_plans[key] = unit_plan(unit, groups, self.device)
        return plan

    def _sample_layout(self) -> tuple[list[int], torch.dtype]:
        """Where each slot's entropy sample lies in the step's sample buffer, and its dtype
        (sample_gradient of the gradients in slot order)."""
        rate = self.config.gradient_sample_rate
        if self._sample_at is None or self._sample_at[0] != rate:
            dtype = torch.float64 if torch.float64 in self._slot_dtypes else torch.float32
            self._sample_at = (rate, sample_offsets([math.prod(s) for s in self.slot_shapes], rate), dtype)
        return self._sample_at[1], self._sample_at[2]

    def _add_window_sums(self, sums: torch.Tensor) -> None:
        """Add one step's (2, groups) values to the window's sums (on the gradients' device)."""
        self._window_sums = sums if self._window_sums is None else self._window_sums.to(sums.device) + sums

    def _group_decide(self) -> None:
        """Per-group policies, at a window end: each group's rank from its window sums,
        agreed over replicas: "budget" from the share of the energy the window's compressed
        steps left out (edgc.policy.budget), "spectral" from the mean effective rank of the
        transmitted spectrum (edgc.policy.spectral)."""
        groups = list(self.groups.values())
        if self._window_sums is None or not groups:
            return
        # collective (window ends only): all-reduce SUM of 2 float64 per group
        sums = self._window_sums.cpu()
        self._all_reduce(sums, device_copy=self.device, control=True)
        self._window_sums = None
        cfg = self.config
        signals = []
        for g, (a, b) in zip(groups, sums.t().tolist(), strict=True):
            r_min, r_max, rank = min(self.r_min, *g.shape), min(self.r_max, *g.shape), g.q.shape[-1]
            if cfg.policy == "budget":  # a = Σ‖M‖², b = Σ‖Q‖²
                signal = 1.0 - b / a if a > 0 else math.nan
                rank = budget_rank(rank, signal, cfg.error_budget, r_min=r_min, r_max=r_max, multiple=cfg.rank_multiple)
            else:  # a = Σ effective rank, b = matrices counted
                signal = a / b if b > 0 else math.nan
                rank = spectral_rank(rank, signal, cfg.spectral_headroom, r_min=r_min, r_max=r_max,
                                     multiple=cfg.rank_multiple)
            signals.append(round(signal, 4))
            g.q = resize_q(g.q, rank, self.generator)
        self.applied_rank = self.rank
        logger.info("EDGC %s: step %s, %s %s -> group ranks %s", cfg.policy, self.step,
                    "energy left out" if cfg.policy == "budget" else "effective ranks", signals,
                    [g.q.shape[-1] for g in groups])

    def align(self) -> None:
        """In a pipeline: finish a window-end decision with the DAC exchange between stages
        (comm.pipeline.StageAlignment). Called by the stage once its step's sends are done;
        a no-op on other steps."""
        if self._pending_alignment is None:
            return
        r_entropy, step = self._pending_alignment
        self._pending_alignment = None
        self._apply_rank(self.alignment.decide(self, r_entropy, step))

    def _apply_rank(self, rank: int | None) -> None:
        """Use `rank` from the next step on; None: uncompressed (a DAC decision)."""
        self.stage_uncompressed = rank is None
        if rank is not None:
            self.applied_rank = rank
            self._set_rank(rank)

    def _flush_error_feedback(self, grads: list[torch.Tensor]) -> None:
        """Entering an uncompressed window in the compress phase: the residual the error
        feedback holds is added to this step's gradient (so it is sent, not lost) and
        zeroed. Skipped while the gradient is non-finite, which would poison nothing but
        would lose the residual with the skipped step."""
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            return
        self._residual_pending = False
        for g in self.groups.values():
            if g.error is None:
                continue
            for i, s in enumerate(g.slots):
                grads[s].add_(g.error[i].view(grads[s].shape), alpha=self.grad_scale)
            g.error.zero_()

    def _set_rank(self, rank: int) -> None:
        """Resize every group's Q to `rank` (capped by the matrix), keeping the warm start."""
        for g in self.groups.values():
            g.q = resize_q(g.q, min(rank, *g.shape), self.generator)

    def _revive_dead_q(self, g: Group, dead: torch.Tensor, count: int) -> None:
        """Redraw the all-zero Q matrices (from an all-zero gradient), which would stay zero
        forever: `dead` (B,) marks them, `count` of them (read to the host by the caller).

        Q is replica-identical after its all-reduce, so every replica redraws the same ones.
        """
        if count:
            g.q[dead] = draw_q(count, g.q.shape[1], g.q.shape[2], self.generator, dtype=g.q.dtype, device=g.q.device)

    def _start_compression(self, grads: list[torch.Tensor]) -> None:
        """Leave warm-up: fix which slots compress, build groups and the error model."""
        cfg = self.config
        members: dict[tuple[int, int, torch.dtype], list[int]] = {}
        self.uncompressed_slots = []
        for s, shape in enumerate(self.slot_shapes):
            if compressible(shape, self.r_max, cfg.min_compression_rate):
                mat = (int(shape[0]), int(math.prod(shape[1:])))
                members.setdefault((*mat, grads[s].dtype), []).append(s)
            else:
                self.uncompressed_slots.append(s)
        # (a window that already holds warm-up steps is not compared by the CQM)
        rank = self.controller.start(self.r_min, self.r_max, None, mid_window=self.step % cfg.window != 0)
        if cfg.policy == "spectral":
            rank = self.r_min  # (early gradients are the most low-rank; the groups grow from there)
        elif cfg.policy == "schedule":
            rank = scheduled_rank(self._schedule, self.step + 1)
        self.applied_rank = rank
        device = grads[0].device
        self.groups = {}
        self._unit_plans = {}
        for m, n, dtype in sorted(members, key=lambda k: (k[0], k[1], str(k[2]))):
            slots = members[(m, n, dtype)]
            work = working_dtype(dtype)
            q = draw_q(len(slots), n, min(rank, m, n), self.generator, dtype=work, device=device)
            error = torch.zeros((len(slots), m, n), dtype=work, device=device) if cfg.use_error_feedback else None
            group = Group((m, n), slots, q, error, dtype)
            self.groups[group.key] = group
        if cfg.policy == "cqm":
            self.controller.error_model = self._error_model()
        self.phase = "compress"
        logger.info(
            "EDGC: compression starts after step %s at rank %s (r_min %s, r_max %s); %s matrices in %s groups",
            self.step, rank, self.r_min, self.r_max, sum(len(s) for s in members.values()), len(members),
        )

    def _error_model(self) -> ErrorModel:
        shapes = [g.shape for g in self.groups.values() for _ in g.slots]
        return ErrorModel(shapes, method=self.config.cqm_method)

    def _calibrate(self, grads: list[torch.Tensor], t_plain: float) -> None:
        """Time compressed all-reduce at the next probe rank (release's r_max calibration).

        One probe rank per warm-up step: `calibration_repeats` timed compressed rounds on
        a copy of this step's gradient, without touching any state. Times are agreed as
        the maximum over replicas, so every replica reaches the same r_max. On CUDA the
        probe is timed with events and read at once (a decision needs it; warm-up only).
        """
        cfg, cal = self.config, self.calibration
        mats_all = [(s, g) for s, g in enumerate(grads) if g.dim() >= 2]
        cap = max((min(int(g.shape[0]), g[0].numel()) for _, g in mats_all), default=0)
        ranks = probe_ranks(cap) if cap else []
        k = len(cal["points"])
        if k >= len(ranks):
            self._finish_calibration(rank_cap=cap)
            return
        r = ranks[k]
        mats = [g.reshape(g.shape[0], -1) for _, g in mats_all if compressible(g.shape, r, cfg.min_compression_rate)]
        if not mats:
            self._finish_calibration(rank_cap=cap)
            return
        generator = torch.Generator().manual_seed(cfg.seed + 1 + k)
        lap = start_lap(self.device)
        for _ in range(cfg.calibration_repeats):
            self._probe_round(mats, r, generator)
        t_probe = float(lap.stop()) / cfg.calibration_repeats
        times = torch.tensor([t_plain, t_probe], dtype=torch.float64)
        # collective: all-reduce MAX of two float64 timings (16 bytes)
        self._all_reduce(times, op=dist.ReduceOp.MAX, device_copy=grads[0].device, control=True)
        cal["t_uncompressed"].append(float(times[0]))
        cal["points"].append((r, float(times[1])))
        logger.info("EDGC calibration: rank %s compressed %.4fs vs uncompressed %.4fs", r, times[1], times[0])
        if float(times[1]) >= float(times[0]) or k + 1 >= len(ranks):
            self._finish_calibration(rank_cap=cap)

    def _probe_round(self, mats: list[torch.Tensor], rank: int, generator: torch.Generator) -> None:
        """One timed compressed round (P and Q all-reduces, one buffer per dtype each) whose
        result is thrown away."""
        ps = []
        for m in mats:
            q = draw_q(1, m.shape[1], min(rank, *m.shape), generator, dtype=m.dtype, device=m.device)
            ps.append(project_p(m.unsqueeze(0), q))
        p_flats = flatten_by_dtype(ps, range(len(ps)))
        # collectives (calibration only): all-reduce SUM of P, one per dtype
        self._wait([self._all_reduce(flat, async_op=True) for flat, _ in p_flats])
        for flat, idx in p_flats:
            scatter(flat, [ps[i] for i in idx])
        qs = []
        for m, p in zip(mats, ps, strict=True):
            qs.append(project_q(m.unsqueeze(0), orthogonalize_(p)))
        # collectives (calibration only): all-reduce SUM of Q, one per dtype
        self._wait([self._all_reduce(flat, async_op=True) for flat, _ in flatten_by_dtype(qs, range(len(qs)))])

    def _finish_calibration(self, rank_cap: int) -> None:
        cal = self.calibration
        if cal["points"]:
            t_unc = sum(cal["t_uncompressed"]) / len(cal["t_uncompressed"])
            r_max = calibrated_max_rank(cal["points"], t_unc)
        else:
            r_max = 4
        if rank_cap:
            r_max = min(r_max, max(1, rank_cap))
        self.r_max = r_max
        self.r_min = self.config.resolved_min_rank(r_max)
        cal["done"] = True
        logger.info("EDGC calibration done: r_max %s, r_min %s (points %s)", self.r_max, self.r_min, cal["points"])

    # ------------------------------------------------------------------ collectives

    @property
    def control_size(self) -> int:
        """Processes that agree the decisions (the control group's size; bound at the first step)."""
        return self._control_size if self._bound is not None else self.world_size

    def _all_reduce(self, tensor: torch.Tensor, *, op=dist.ReduceOp.SUM, async_op: bool = False,
                    device_copy=None, control: bool = False) -> _Issued:
        """All-reduce `tensor` in place over the process group (`control`: over the control
        group); counts its bytes as sent.

        A blocking call is timed here; an async call returns a handle for `_wait`.
        device_copy: for small control tensors built on the CPU, the device the backend
        needs (NCCL reduces only CUDA tensors); the result is copied back (after the wait).
        """
        self.bytes_sent += tensor.numel() * tensor.element_size()
        group = self._control_group if control and self._control_group is not None else self.process_group
        if (self.control_size if control else self.world_size) == 1:
            return _Issued(None)
        lap = None if async_op else start_lap(self.device)
        back = None
        if device_copy is not None and device_copy.type != "cpu":
            back = (tensor.to(device_copy), tensor)
        work = dist.all_reduce(back[0] if back else tensor, op=op, group=group, async_op=True)
        self._recent_works.append(work)
        if async_op:
            return _Issued(work, back)
        work.wait()
        if back is not None:
            back[1].copy_(back[0].cpu())
        assert lap is not None  # (started above for a blocking call)
        self._comm.add(lap.stop())
        return _Issued(None)

    def _wait(self, issued: list[_Issued], step_comm: LapSum | None = None) -> None:
        """Wait for async collectives; the time spent waiting counts once as communication
        (in the pipelined mode, that is the part not hidden behind the backward pass; on
        CUDA, how long the current stream stands still for them)."""
        pending = [i for i in issued if i.work is not None]
        if not pending:
            return
        lap = start_lap(self.device)
        for i in pending:
            i.work.wait()
        lap.stop()
        self._comm.add(lap)
        if step_comm is not None:
            step_comm.add(lap)
        for i in pending:
            if i.back is not None:
                i.back[1].copy_(i.back[0].cpu())  # (a host read: control values only)


@dataclass
class _Issued:
    """An issued collective: its work handle (None: already done) and, for a CPU tensor
    reduced on the device, (device copy, CPU tensor) to copy back after the wait."""

    work: Any
    back: tuple[torch.Tensor, torch.Tensor] | None = None


def _check_state_keys(d: dict[str, Any]) -> None:
    """Raise ValueError naming what a state dict of this version lacks (a truncated or
    hand-made state) before load_state_dict changes anything."""
    missing = [k for k in _REQUIRED_KEYS if k not in d]
    if missing:
        raise ValueError(f"EDGC state dict lacks {missing} (expected every key that state_dict() writes)")
    not_dicts = [k for k in ("config", "controller", "gate", "calibration", "stats") if not isinstance(d[k], dict)]
    if not_dicts:
        raise ValueError(f"EDGC state dict: {not_dicts} must be dicts, as state_dict() writes them")
    missing = [k for k in _REQUIRED_STATS if k not in d["stats"]]
    if missing:
        raise ValueError(f"EDGC state dict: 'stats' lacks {missing}")


def _checked_units(units: Any, n_slots: int) -> list[tuple[int, ...]] | None:
    """A state dict's "units" as tuples; raises ValueError unless they cut the slots
    0 .. n_slots-1 into disjoint, non-empty sets (a torn or hand-edited state)."""
    if units is None:
        return None
    out = [tuple(int(s) for s in u) for u in units]
    flat = sorted(s for u in out for s in u)
    if any(not u for u in out) or flat != list(range(n_slots)):
        raise ValueError(f"EDGC state dict: 'units' must cut the {n_slots} parameter slots into disjoint "
                         "non-empty sets, as state_dict() writes them")
    return out


def _saved_dtype(group: dict[str, Any]) -> torch.dtype:
    """The gradient dtype a state dict's group was saved with ("float32", "bfloat16", ...)."""
    dtype = getattr(torch, str(group["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"EDGC state dict: a group's dtype {group['dtype']!r} is not a torch dtype")
    return dtype


def _first_difference(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # (the lengths may differ)
        if x != y:
            return f"parameter {i}: checkpoint {x} vs model {y}"
    return f"parameter {min(len(a), len(b))}: present in only one of them"

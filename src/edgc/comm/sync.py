"""GradientSync: the one compression core behind every way edgc synchronises gradients.

An adapter turns its framework's gradient buffers into what this core takes: a flat
buffer, the tensors it holds ("entries": a key and a shape each, in buffer order), a
future to complete with the averaged buffer, and whether it is the step's last buffer
(`GradientSync.receive`). Three adapters wrap it:

- DDP: `edgc_hook` and `EDGCState` (edgc.comm.hook), one call per DDP bucket;
- FSDP2 and HSDP: `edgc.fsdp.register_edgc`, one call per FSDPModule's reduce-scatter
  output, averaged across the replicate group before the call returns ("eager");
- the pipeline stage (edgc.comm.pipeline), which runs a stage's DDP with the DDP hook.

The core ties together objects that each own one role:

- the collectives (edgc.comm.collectives): the groups, bound at the first step, every
  collective, and the bytes and seconds they cost;
- the compression state (edgc.comm.compression): slots, groups of matrices with their Q
  and error feedback, the generator and the plan of units;
- the step (edgc.comm.step): one step's collectives in their fixed order, a plan
  (`StepInfo`) in and a `StepResult` out;
- the rank policy (edgc.policy): which signals to measure and the next window's rank;
- the warm-up gate and r_max calibration (edgc.policy.warmup, edgc.comm.calibration).

GradientSync keeps the step counter and the phase, decides each step's plan from values
that are the same on every replica, and acts on each step's result. Its state_dict holds
every piece's state (edgc.comm.state_format).

Why the collectives follow a fixed order. torch's powerSGD_hook issues each bucket's
second all-reduce from a future callback, so two replicas can issue bucket i's Q and
bucket i+1's P in different orders; gloo then deadlocks or aborts (it failed 4 of 7 runs
of a 29M-parameter GPT on this project's machine). Here every collective is issued from
the thread that hands a buffer over, in an order that depends only on which buffer is
being handed over, on the step counter and on values that were themselves all-reduced
(edgc.comm.step). Three modes (`GradientSync.mode`, one value):
- "pipelined" (EDGCConfig.sync_mode, the default): bucket i's P all-reduce starts when
  DDP hands it over, and bucket i-1 is finished meanwhile (a fixed lag of one bucket), so
  the sync overlaps the backward pass.
- "whole-step": the hook records each bucket and returns an unfinished future; at the
  last bucket it synchronises the whole gradient at once (at most four collectives per
  gradient dtype: control, uncompressed, P, Q), then completes every future.
- "eager" (adapters whose framework needs each buffer averaged before the call returns,
  as FSDP2's all-reduce hook does): every buffer is one unit, started and completed in
  its own call. The slots are declared before the first step (`declare`).
Every buffer goes to the step under way (edgc.comm.step.StepSync), which parks what it
cannot start yet.
All give the same average, up to the float order of the sums.

Precision. Gradients are grouped by dtype as well as shape. For bf16 and fp16 gradients
the arithmetic (M + error, P, Q, orthogonalisation, the error feedback) runs in float32,
and P and Q travel in the wire format (EDGCConfig.wire; "native": the gradient's dtype):
the rounding on the wire lands in the error feedback instead of being lost. With a
GradScaler, `set_grad_scale` tells the core the loss scale, so the error feedback and the
entropy stay in unscaled units.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from edgc.comm.calibration import Calibration
from edgc.comm.collectives import Collectives
from edgc.comm.compression import CompressionState, Entry
from edgc.comm.control import ENTROPY, GRAD_SQ, LR_DROP, NONFINITE, warmup_errors
from edgc.comm.state_format import FORMAT, VERSION, check_state
from edgc.comm.stats import EDGCStats
from edgc.comm.step import StepInfo, StepResult, StepSync
from edgc.comm.timing import LapSum, start_lap
from edgc.comm.windowgrad import WindowGradient
from edgc.config import EDGCConfig, pipeline_refusal, with_added_fields
from edgc.entropy import is_sampled_step, sample_stride
from edgc.policy import EntropyWindow, WarmupGate, WindowEnd, make_policy
from edgc.policy.noise import noise_scale

logger = logging.getLogger(__name__)

__all__ = ["EDGCStats", "Entry", "GradientSync"]


class GradientSync:
    """The compression core: one per model (DDP) or per sharded model (FSDP2/HSDP)."""

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, config: EDGCConfig | None = None, *,
        alignment: Any = None, control_group: dist.ProcessGroup | None = None, eager: bool = False,
    ) -> None:
        """`process_group`: the group gradients are averaged over (None: the default
        group); `control_group`: the group that agrees the decisions (None: the same);
        `alignment`: a pipeline stage's DAC (edgc.comm.pipeline.StageAlignment); `eager`:
        every buffer is averaged before `receive` returns, and the slots are declared up
        front."""
        config = config if config is not None else EDGCConfig()
        if not isinstance(config, EDGCConfig):
            raise TypeError(f"config must be an EDGCConfig, got {type(config).__name__}")
        config.validate()
        if eager and config.max_rank is None:
            raise ValueError("max_rank must be set here: calibrating r_max times the whole local gradient at once, "
                             "and this synchroniser averages it buffer by buffer")
        if eager and alignment is not None:
            raise ValueError("a pipeline stage's alignment needs the DDP adapter, not the eager one")
        if alignment is not None and (why := pipeline_refusal(config)) is not None:
            raise ValueError(why)
        logger.info("EDGC config: %s", config)
        # hyperparameters
        self.config = config
        # how buckets become units: "pipelined" or "whole-step" (config.sync_mode), or
        # "eager" (each buffer averaged in its own call: edgc.fsdp)
        self.mode = "eager" if eager else config.sync_mode
        self.alignment = alignment  # a pipeline stage's DAC, or None outside a pipeline
        # the parts, each owning one role
        self.collectives = Collectives(process_group, control_group)
        self.compression = CompressionState(config.seed, config.state_dtype, config.long_rank_factor,
                                            config.rank_multiple)
        self.policy = make_policy(config)
        self.gate = WarmupGate(config.warmup, config.warmup_steps, config.window, config.warmup_max_error,
                               sample_stride(config.iteration_sample_rate), config.warmup_min_steps)
        self.calibration = Calibration(config.max_rank is not None, config.seed, config.calibration_repeats,
                                       config.min_compression_rate)
        self.entropy_window = EntropyWindow()
        self.window_gradient = WindowGradient()  # the window's averaged gradient: its norm and noise scale
        # internal state
        self.step = 0
        self.phase = "warmup"
        self.applied_rank = 0  # rank of compressed steps: the policy's, or the DAC's in a pipeline
        self.stage_uncompressed = False  # the DAC sent this stage uncompressed for the window
        self.step_phase = "warmup"  # what the last synchronised step did (for metrics)
        self.step_rank = 0
        self.r_max = config.max_rank or 0
        self.r_min = config.resolved_min_rank(config.max_rank) if config.max_rank else 0
        self.grad_scale = 1.0  # the loss scale the gradients carry (set_grad_scale)
        self._pending_alignment: tuple[int, int] | None = None  # (rank, step) for align()
        self._loaded: dict[str, Any] | None = None  # a state loaded and not stepped from yet
        self._shapes_bound = True  # the policy knows the compressed matrices' shapes
        self.enabled = True  # False: every buffer plain all-reduced, nothing here changes (`_plain`)
        self._step: StepSync | None = None  # the step whose buffers are being handed over
        # stats
        self.last_entropy = math.nan
        self.noise_scale = math.nan  # the last window's (EDGCStats.noise_scale)
        self.bytes_uncompressed = 0
        self._entropy = LapSum()  # sampling and estimation
        self._busy = LapSum()  # whole syncs; compression is the rest
        self.nonfinite_steps = 0
        self.compressed_steps = 0

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a GradientSync holds process groups and device buffers and cannot be pickled; pickle its "
                        "DDP adapter (EDGCState), or save state_dict() (an eager one, edgc.fsdp, is bound to its "
                        "model's sharded layout)")

    # ------------------------------------------------------------------ public API

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group gradients are averaged over (None: the default group); settable until
        the first step."""
        return self.collectives.process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self.collectives.process_group = group

    @property
    def world_size(self) -> int:
        """Replicas in the group (bound at the first step)."""
        return self.collectives.world_size

    @property
    def replica(self) -> int:
        """This process's rank in the group (bound at the first step)."""
        return self.collectives.replica

    @property
    def rank(self) -> int:
        """The rank used for compressed steps now (0 while uncompressed)."""
        if self.phase != "compress" or self.stage_uncompressed:
            return 0
        return self.applied_rank

    @property
    def comm_seconds(self) -> float:
        return float(self.collectives.comm)

    @property
    def entropy_seconds(self) -> float:
        return float(self._entropy)

    @property
    def compress_seconds(self) -> float:
        return max(0.0, float(self._busy) - self.comm_seconds - self.entropy_seconds)

    def set_grad_scale(self, scale: float) -> None:
        """Tell the core the loss scale the next gradients carry (GradScaler.get_scale()).

        The error feedback is kept in unscaled units and the entropy is measured on the
        unscaled gradient, so a changing loss scale neither mis-sizes the residual added
        back nor reads as an entropy change. 1.0 (the default) without a GradScaler.
        """
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"grad scale must be a positive finite number, got {scale}")
        self.grad_scale = scale

    def set_learning_rate(self, lr: float) -> None:
        """Tell the core the learning rate of the next step: call it before each backward
        pass, or at least whenever the rate changes (a rate holds until the next call).

        A policy that reads the learning rate (Signals.learning_rate, as "critical") runs
        the window after a drop at r_max; the replicas agree on a drop at the window end,
        so one replica's drop raises the rank everywhere. Other policies ignore it. Raises
        ValueError unless `lr` is a finite number >= 0.
        """
        lr = float(lr)
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        self.policy.observe_lr(lr)

    def stats(self) -> EDGCStats:
        """A snapshot of this replica's counters."""
        report = self.policy.report()
        return EDGCStats(
            step=self.step, phase=self.phase, rank=self.rank, step_phase=self.step_phase, step_rank=self.step_rank,
            entropy=self.last_entropy, min_rank=self.r_min, max_rank=self.r_max,
            bytes_sent=self.collectives.bytes_sent, bytes_uncompressed=self.bytes_uncompressed,
            compress_seconds=self.compress_seconds, comm_seconds=self.comm_seconds,
            entropy_seconds=self.entropy_seconds, nonfinite_steps=self.nonfinite_steps,
            compressed_steps=self.compressed_steps, critical_rho=report.get("critical_rho", math.nan),
            window_norm=report.get("window_norm", math.nan), lr_drop=bool(report.get("lr_drop", 0.0)),
            noise_scale=self.noise_scale, state_bytes=self.compression.nbytes + self.window_gradient.nbytes,
        )

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """Everything mutable, so that load_state_dict continues exactly (CPU tensors;
        edgc.comm.state_format). It records this replica's rank: error-feedback buffers
        are per replica, so a checkpoint holds one state per replica. `copy` False: the
        error feedback and Q are the live CPU tensors, for a caller that serialises the
        dict before the next step (CompressionState.state_dict)."""
        if self.collectives.bound is None and self._loaded is not None:
            return self._loaded  # loaded but not stepped yet: pass it on unchanged
        return {
            "format": FORMAT, "version": VERSION,
            "world_size": self.world_size, "replica": self.replica, "config": self.config.to_dict(),
            "step": self.step, "phase": self.phase, "applied_rank": self.applied_rank,
            "stage_uncompressed": self.stage_uncompressed, "step_phase": self.step_phase,
            "step_rank": self.step_rank, "r_min": self.r_min, "r_max": self.r_max,
            "compression": self.compression.state_dict(copy=copy),
            "policy": {"name": self.config.policy, "state": self.policy.state_dict()},
            "entropy": self.entropy_window.state_dict(),
            "window_gradient": self.window_gradient.state_dict(),
            "gate": self.gate.state_dict(),
            "calibration": self.calibration.state_dict(),
            "alignment": self.alignment.state_dict() if self.alignment is not None else None,
            "stats": {
                "last_entropy": self.last_entropy, "bytes_sent": self.collectives.bytes_sent,
                "bytes_uncompressed": self.bytes_uncompressed, "compress_seconds": self.compress_seconds,
                "comm_seconds": self.comm_seconds, "entropy_seconds": self.entropy_seconds,
                "grad_scale": float(self.grad_scale), "nonfinite_steps": self.nonfinite_steps,
                "compressed_steps": self.compressed_steps, "noise_scale": self.noise_scale,
            },
        }

    def state_to_carry(self) -> dict[str, Any] | None:
        """What a copy of this synchroniser in another process must load: its state_dict()
        once it has stepped; before, the state loaded into it, or None."""
        return self._loaded if self.collectives.bound is None else self.state_dict()

    def load_state_dict(self, d: dict[str, Any], *, strict_replica: bool = True) -> None:
        """Restore from state_dict() (version 2, or version 1 through its upgrade); raises
        ValueError on a foreign or mismatched state.

        World size and replica are checked here when the process group exists, else at
        the first step. A state saved by another replica is refused: its error feedback
        is that replica's. `strict_replica=False` loads it on purpose, with a warning. The
        model's parameter shapes are checked when the tensors are first seen.
        """
        d = check_state(d)
        if self.step != 0:
            raise ValueError("load_state_dict must be called before the first training step")
        if d["policy"]["name"] != self.config.policy:
            raise ValueError(f"EDGC state was saved by policy {d['policy']['name']!r}, this config's is "
                             f"{self.config.policy!r}: a policy's state does not carry over to another")
        self.collectives.expect(int(d["world_size"]), None if d["replica"] is None else int(d["replica"]),
                                strict_replica)
        saved, now = EDGCConfig.from_dict(with_added_fields(d["config"])).to_flat(), self.config.to_flat()
        if saved != now:
            logger.warning("EDGC config differs from the checkpoint's in %s; using the new values",
                           sorted(k for k in now if saved.get(k) != now[k]))
        if (d["alignment"] is None) != (self.alignment is None):
            raise ValueError("EDGC state and this job differ in pipeline stage alignment (DAC): "
                             "a pipeline-stage state cannot resume outside a pipeline, or the reverse")
        if self.alignment is not None:
            self.alignment.load_state_dict(d["alignment"])
        self.step, self.phase = int(d["step"]), d["phase"]
        self.applied_rank, self.stage_uncompressed = int(d["applied_rank"]), bool(d["stage_uncompressed"])
        self.step_phase, self.step_rank = d["step_phase"], int(d["step_rank"])
        self.r_min, self.r_max = int(d["r_min"]), int(d["r_max"])
        self.compression.load_state_dict(d["compression"])
        self.policy.load_state_dict(d["policy"]["state"])
        self._shapes_bound = self.phase != "compress"  # (bound when the groups are restored)
        self.entropy_window.load_state_dict(d["entropy"])
        self.window_gradient = WindowGradient()
        if d["window_gradient"] is not None:
            self.window_gradient.load_state_dict(d["window_gradient"])
        self.gate.load_state_dict(d["gate"])
        self.calibration.load_state_dict(d["calibration"])
        stats = d["stats"]
        self.collectives.load_state_dict(stats)
        self._entropy = LapSum(float(stats["entropy_seconds"]))
        self._busy = LapSum(float(stats["compress_seconds"]) + self.comm_seconds + self.entropy_seconds)
        self.grad_scale = float(stats["grad_scale"])
        self.last_entropy, self.noise_scale = float(stats["last_entropy"]), float(stats["noise_scale"])
        self.bytes_uncompressed = int(stats["bytes_uncompressed"])
        self.nonfinite_steps, self.compressed_steps = int(stats["nonfinite_steps"]), int(stats["compressed_steps"])
        self._loaded = d

    def declare(self, layout: Sequence[Sequence[Entry]], dtypes: Sequence[torch.dtype],
                uncounted: Collection[Hashable] = ()) -> None:
        """Eager adapters: give every tensor its slot before the first step, buffer by
        buffer in `layout`; `dtypes`, one per buffer; `uncounted`, the keys of copies that
        another process counts in the signals (CompressionState.declare)."""
        self.compression.declare(layout, dtypes, uncounted)

    # ------------------------------------------------------------------ the step

    def receive(self, buffer: torch.Tensor, entries: Sequence[Entry], future: torch.futures.Future,
                last: bool) -> None:
        """One flat buffer of gradients, holding `entries` one after the other: hand it to
        the step under way, or start one. `future` is completed with `buffer` once it holds
        the average (eager: before this returns); `last` ends the step."""
        step = self._step
        if not self.enabled and step is None:  # (switched off between steps)
            self._plain(buffer, future)
            return
        lap = start_lap(buffer.device)
        try:
            if step is None:  # the step's first buffer
                step = self._step = self._start_step(buffer.device)
            step.add(buffer, entries, future)
            if last:
                self._step = None
                self._end_step(step.finish())
        except Exception as exc:
            self._step = None  # (the next step starts afresh)
            if step is not None:
                step.fail(exc)
            raise
        finally:
            self._busy.add(lap.stop())

    def _start_step(self, device: torch.device) -> StepSync:
        """A step's first buffer is on `device`: bind the groups (first step) and start the
        step, with its plan now if its units can start as the buffers arrive, else with the
        plan decided at its last buffer (`_pipelined_next`)."""
        if self.collectives.bound is None:
            self.collectives.bind()
        self.collectives.device = device
        if self.mode == "eager":
            self.compression.restore_declared(device)
        plan = self._begin_step() if self._pipelined_next() else self._begin_step
        return StepSync(self.mode, self.compression, self.collectives, self.config, plan)

    def _plain(self, buffer: torch.Tensor, future: torch.futures.Future) -> None:
        """EDGC switched off (`enabled` False, the same on every replica): average the
        buffer with one all-reduce in its own dtype, as DDP does without a hook (eager:
        before returning), and change nothing of the state, its step count and stats
        included. Switched on again, compression goes on where it stopped."""
        world = self.collectives.world_size
        if world == 1:
            future.set_result(buffer)
            return
        # collective: all-reduce SUM of the buffer as it is (no compression, no quantization)
        work = dist.all_reduce(buffer, group=self.collectives.process_group, async_op=True)
        if self.mode == "eager":
            work.wait()
            future.set_result(buffer.div_(world))
            return

        def done(fut: torch.futures.Future) -> None:
            try:
                fut.value()
                future.set_result(buffer.div_(world))
            except Exception as exc:  # (a failed all-reduce reaches DDP, which waits on `future`)
                future.set_exception(exc)

        work.get_future().then(done)

    def _pipelined_next(self) -> bool:
        """Whether the next step can start its units at its first buffer (decided from
        replica-identical values only). Steps that need the whole local gradient first, or
        the slots checked, wait for their last buffer: this process's first step (slots are
        assigned, a loaded state checked against the model), r_max calibration and the
        warm-up error check (warm-up only), and flushing the error feedback into an
        uncompressed window."""
        if self.mode == "eager":
            return True  # (declared slots; no calibration; the warm-up check is measured per buffer)
        if self.mode == "whole-step":
            return False
        if not self.compression.declared or self.compression.expected_shapes is not None:
            return False
        if self.phase == "warmup":
            return self.calibration.done and not self.gate.needs_errors(self.step + 1)
        return not (self.stage_uncompressed and self.compression.residual_pending)

    def _begin_step(self) -> StepInfo:
        """Start a step: count it and decide its plan, from replica-identical values."""
        self._loaded = None  # the state has moved on from what was loaded
        if not self._shapes_bound:  # (a loaded state's groups are restored by now)
            self.policy.bind_shapes(self.compression.matrix_shapes())
            self._shapes_bound = True
        self.step += 1
        step, cfg, signals = self.step, self.config, self.policy.signals
        # (policies that read no sample of the gradient pay nothing for it)
        sampled = signals.sample and is_sampled_step(step, cfg.iteration_sample_rate)
        want_errors = self.phase == "warmup" and self.gate.needs_errors(step) and self.calibration.done
        self.step_phase, self.step_rank = self.phase, 0
        if self.phase == "compress":
            forced = self.policy.rank_at(step)
            if forced is not None and forced != self.applied_rank:
                self._apply_rank(forced)
        compressed = self.phase == "compress" and not self.stage_uncompressed
        if compressed and not cfg.warm_start:
            self.compression.redraw_q()
        flush = self.phase == "compress" and not compressed and self.compression.residual_pending
        want_lr_drop = signals.learning_rate and step % cfg.window == 0
        return StepInfo(step, compressed, sampled, want_errors, flush, self.grad_scale,
                        want_noise=sampled and self.world_size > 1, want_lr_drop=want_lr_drop,
                        watch_average=signals.window_norm, lr_dropped=want_lr_drop and self.policy.lr_dropped(),
                        error_ranks=(self.r_min, self.r_max), time_plain=not compressed and not self.calibration.done)

    def _end_step(self, result: StepResult) -> None:
        """Act on a step's result, from replica-identical values (`result.control` is the
        replica-averaged control vector; `result.grads` the averaged gradient in slot order)."""
        info, control, grads = result.info, result.control, result.grads
        self.bytes_uncompressed += result.bytes_uncompressed
        self._entropy.add(result.entropy_seconds)
        if result.layout is not None:
            self.compression.units = result.layout  # the units from the next step on (edgc.comm.step, "The plan")
        if info.compressed:
            if result.finite:
                self.compressed_steps += 1
                self.step_rank = self.rank
                if self.alignment is not None:
                    self.alignment.observe_compressed(self.rank, result.step_comm)
            else:
                self.nonfinite_steps += 1
        else:
            if self.alignment is not None:
                self.alignment.observe_uncompressed(result.step_comm)
            if not self.calibration.done:
                assert result.plain is not None  # (timed on a step while calibrating)
                r_max = self.calibration.observe(grads, float(result.plain), self.collectives, self.config.wire)
                if r_max is not None:
                    self.r_max, self.r_min = r_max, self.config.resolved_min_rank(r_max)
        if info.want_entropy:
            assert control is not None  # (issued on a step that wants the entropy)
            # a replica with inf/nan gradients contributes no entropy sample this step
            self.last_entropy = float(control[ENTROPY]) if control[NONFINITE] == 0 else math.nan
            self.entropy_window.observe(self.last_entropy)
        self._observe_average(result)
        if info.step % self.config.window == 0:
            self._close_window(control)
        if self.phase == "warmup" and self.calibration.done:
            eps_min = eps_max = math.nan
            if info.want_errors:
                assert control is not None  # (and on a step that wants the errors)
                eps_min, eps_max = warmup_errors(control, self.config.warmup_error_norm)
                logger.info("EDGC warm-up check at step %s: eps(r_min=%s) = %.4g, eps(r_max=%s) = %.4g",
                            info.step, self.r_min, eps_min, self.r_max, eps_max)
            if self.gate.update(info.step, eps_min, eps_max):
                self._start_compression(grads)

    def _observe_average(self, result: StepResult) -> None:
        """Add the step's averaged gradient to the window's sums (edgc.comm.windowgrad): its
        sample every step when the policy reads the window norm, and on sampled steps,
        where every replica's gradient was finite, the noise scale's two squared norms."""
        info, control = result.info, result.control
        small_sq = None
        if info.want_noise and control is not None and control[NONFINITE] == 0:  # (control: on such steps)
            small_sq = float(control[GRAD_SQ])  # |G_small|²: the replicas' mean
        if not (info.watch_average or small_sq is not None):
            return
        offsets, dtype = self.compression.sample_layout(self.config.gradient_sample_rate)
        self.window_gradient.observe(result.grads, offsets, dtype, self.config.gradient_sample_rate, info.scale,
                                     result.sums_finite, accumulate=info.watch_average, small_sq=small_sq,
                                     sample=result.average)

    def _close_window(self, control: torch.Tensor | None) -> None:
        """At a window end: close the entropy and gradient windows, measure the noise scale,
        and let the policy decide (applied from the next step on, through the DAC in a
        pipeline; in warm-up the policy only records the window)."""
        self.entropy_window.close()
        agree = self.collectives.agree_mean if self.collectives.control_size > self.world_size else None
        norm, noise = self.window_gradient.close(agree)
        window_noise = math.nan
        if noise is not None:  # (the window's sums: their count cancels in the ratio)
            window_noise = self.noise_scale = noise_scale(noise[0], noise[1], self.world_size)
        dropped = False
        if self.policy.signals.learning_rate:
            assert control is not None  # (issued at every window end of such a policy)
            dropped = bool(control[LR_DROP] > 0)  # (any replica's drop: a SUM of 0/1 flags)
        end = WindowEnd(step=self.step, compressing=self.phase == "compress", rank=self.applied_rank,
                        r_min=self.r_min, r_max=self.r_max, replicas=self.world_size,
                        history=tuple(self.entropy_window.history), noise_scale=window_noise, window_norm=norm,
                        lr_dropped=dropped, windows_closed=len(self.entropy_window.history) - 1)
        rank = self.policy.decide(end)
        if self.phase != "compress" or rank is None:
            return
        if self.alignment is not None:
            # the stage exchange waits for stage 0, which may still be in its backward
            # pass: the pipeline stage calls align() after its sends
            self._pending_alignment = (rank, self.step)
        else:
            self._apply_rank(rank)

    def align(self) -> None:
        """In a pipeline: finish a window-end decision with the DAC exchange between stages
        (edgc.comm.pipeline.StageAlignment). Called by the stage once its step's sends are
        done; a no-op on other steps."""
        if self._pending_alignment is None:
            return
        r_entropy, step = self._pending_alignment
        self._pending_alignment = None
        current = None if self.stage_uncompressed else self.applied_rank
        self._apply_rank(self.alignment.decide(self.collectives, r_entropy, step, current=current, r_min=self.r_min,
                                               r_max=self.r_max))

    def _apply_rank(self, rank: int | None) -> None:
        """Use `rank` from the next step on; None: uncompressed (a DAC decision)."""
        self.stage_uncompressed = rank is None
        if rank is not None:
            self.applied_rank = rank
            self.compression.set_rank(rank)

    def _start_compression(self, grads: list[torch.Tensor]) -> None:
        """Leave warm-up: the policy's first rank, and the groups of compressed matrices."""
        cfg = self.config
        # (a window that already holds warm-up steps is not compared by the CQM)
        rank = self.policy.start(self.r_min, self.r_max, step=self.step,
                                 windows_closed=len(self.entropy_window.history),
                                 mid_window=self.step % cfg.window != 0)
        shapes = self.compression.start(grads, self.r_max, rank, cfg.min_compression_rate, cfg.use_error_feedback)
        self.policy.bind_shapes(shapes)
        self.applied_rank = rank
        self.phase = "compress"
        logger.info("EDGC: compression starts after step %s at rank %s (r_min %s, r_max %s); %s matrices in %s groups",
                    self.step, rank, self.r_min, self.r_max, len(shapes), len(self.compression.groups))
        if "window" in getattr(cfg, "long_run_defaults", ()):
            logger.warning("EDGC: the rank moves once every %s steps and the warm-up lasts at most %s, defaults that "
                           "suit a run of about 100,000 steps; give EDGCConfig(total_steps=<the run's steps>) to "
                           "scale them to yours (docs/config.md#scaled-to-the-run)", cfg.window, cfg.warmup_steps)

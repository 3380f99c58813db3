"""A step's plan and its result: what the synchroniser (edgc.comm.sync.GradientSync)
decides at a step's start (`StepInfo`) and what the step (edgc.comm.step.StepSync) hands
back at its end (`StepResult`), and the modes a step takes its buckets in (`MODES`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgc.comm.timing import Lap, LapSum

__all__ = ["MODES", "StepInfo", "StepResult"]

#: How a step's buckets become units (GradientSync.mode): EDGCConfig.sync_mode's two, and
#: "eager", an adapter's whose framework needs each buffer averaged in its own call.
MODES = ("pipelined", "whole-step", "eager")


@dataclass
class StepInfo:
    """The plan of a step: what the synchroniser decided at its start (GradientSync._begin_step)."""

    step: int
    compressed: bool  # low-rank round (else every unit is all-reduced whole)
    want_entropy: bool  # a sampled step: measure and agree the entropy
    want_errors: bool  # the warm-up error check
    flush: bool  # add the error feedback to this gradient first
    scale: float  # the loss scale the gradients carry
    want_noise: bool = False  # a sampled step: agree |G_small|² for the noise scale (GRAD_SQ)
    want_lr_drop: bool = False  # a window end: agree whether the learning rate dropped
    watch_average: bool = False  # the average is read (window norm), so its finiteness is tracked
    lr_dropped: bool = False  # this replica saw the learning rate drop in the window (with want_lr_drop)
    error_ranks: tuple[int, int] = (0, 0)  # (r_min, r_max), the ranks the warm-up check measures at
    time_plain: bool = False  # time the uncompressed all-reduce (r_max calibration)

    @property
    def want_sample(self) -> bool:
        """Whether the step samples the local gradient (GDS) as it arrives."""
        return self.want_entropy or self.want_noise

    @property
    def want_control(self) -> bool:
        """Whether the step issues the control all-reduce."""
        return self.want_sample or self.want_errors or self.want_lr_drop


@dataclass
class StepResult:
    """What a step hands back to the synchroniser (StepSync.finish)."""

    info: StepInfo
    control: torch.Tensor | None  # the replica-averaged control vector (None: not issued)
    grads: list[torch.Tensor]  # the averaged gradient in slot order (views of the buckets)
    finite: bool  # a compressed step's sums were finite (its EF and Q were committed); True otherwise
    sums_finite: torch.Tensor  # device flag: every sum tracked was finite
    step_comm: LapSum  # this step's time waiting for collectives (the DAC's T(r))
    plain: Lap | None  # the uncompressed all-reduce's time (info.time_plain)
    average: torch.Tensor | None  # eager: the averaged gradient's sample, taken as each buffer was averaged
    layout: list[tuple[int, ...]] | None  # DDP's buckets as slots, when there were several
    bytes_uncompressed: int  # what a plain all-reduce of the step would have sent
    entropy_seconds: float  # measuring the control values

"""The protocol every rank policy implements: what it needs measured, and how it decides.

A policy turns what the synchroniser measured over a window into the next window's rank.
The synchroniser (edgc.comm.sync.GradientSync) owns every measurement and collective; a
policy only declares which signals it reads (`Signals`), is handed them at each window end
(`WindowEnd`), and keeps its own state between windows (`state_dict`). So a policy is pure
python, tested in one process, and adding one touches policy/ and the registry
(edgc.policy.registry, and docs/developing.md for an example), and, for a policy with
settings, edgc.config too: its settings' dataclass is a section of EDGCConfig (a field
and an entry in SECTIONS), which `register_policy` from a user's code cannot add.

The life of a policy:

    start(r_min, r_max, ...)   compression begins: returns the first compressed rank
    rank_at(step)              before each compressed step: a rank forced for that step, or None
    decide(end)                at every window end, warm-up included: the next window's rank,
                               or None to keep the rank in use (ignored during warm-up)

Pure python: nothing here calls torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["RankPolicy", "Signals", "WindowEnd"]


@dataclass(frozen=True)
class Signals:
    """What a policy needs the synchroniser to measure. Each costs something, so a policy
    asks only for what it reads."""

    entropy: bool = False
    """The entropy of a sample of the local gradient, on every 1/iteration_sample_rate-th
    step, averaged over replicas; handed over as each window's mean (`WindowEnd.history`).
    Taking the sample also gives the noise scale, so both come together."""

    noise_scale: bool = False
    """The window's gradient noise scale B_simple, in replica batches (`WindowEnd.noise_scale`),
    from the same samples of the local and the averaged gradient."""

    window_norm: bool = False
    """The norm of the window's mean averaged gradient, on the sample's elements, summed
    every step (`WindowEnd.window_norm`)."""

    learning_rate: bool = False
    """The learning rates given (set_learning_rate, handed to `observe_lr`); at each window
    end the replicas agree on `lr_dropped()` (`WindowEnd.lr_dropped`)."""

    @property
    def sample(self) -> bool:
        """Whether sampled steps take a sample of the local gradient."""
        return self.entropy or self.noise_scale


@dataclass(frozen=True)
class WindowEnd:
    """What the synchroniser hands a policy at a window end; every value is the same on
    every replica (agreed through a collective, or computed from the averaged gradient)."""

    step: int
    """The step that ended the window."""
    compressing: bool
    """Whether compression has started; during warm-up a policy only records the window."""
    rank: int
    """The rank in use (the policy's last, or a pipeline's aligned one)."""
    r_min: int
    r_max: int
    replicas: int
    """Replicas the gradient is averaged over."""
    history: Sequence[float] = ()
    """The mean entropy of every window closed so far, this one last (nan: no sample)."""
    noise_scale: float = math.nan
    """This window's gradient noise scale in replica batches (nan: not measured)."""
    window_norm: float = math.nan
    """The norm of this window's mean averaged gradient (nan: not measured)."""
    lr_dropped: bool = False
    """Whether any replica's learning rate dropped in this window (Signals.learning_rate)."""
    windows_closed: int = field(default=0)
    """Windows closed before this one (len(history) - 1 when entropy is measured)."""


class RankPolicy:
    """The base of every rank policy: a fixed rank r_max, and no state beyond it.

    Subclasses set `signals` and override what they decide. They receive the EDGCConfig
    in their constructor and read their own section of it (e.g. `config.noise`).
    """

    #: The signals this policy reads.
    signals: ClassVar[Signals] = Signals()
    #: Kept for comparison, not recommended: measured at or behind the static frontier.
    experimental: ClassVar[bool] = False
    #: Whether a pipeline stage's DAC may replace the rank this policy decides at a window
    #: end (edgc.comm.pipeline): a policy that decides per step cannot take it.
    aligns: ClassVar[bool] = True

    def __init__(self, config: Any) -> None:
        """`config`: the EDGCConfig (rank_step, rank_multiple and the policy's section)."""
        self.rank_step: int = config.rank_step
        self.rank_multiple: int = config.rank_multiple
        self.rank = 0  # the rank this policy chose last (0 before compression starts)

    def start(self, r_min: int, r_max: int, *, step: int, windows_closed: int, mid_window: bool) -> int:
        """Compression starts after `step`, inside a window when `mid_window`, with
        `windows_closed` windows behind it; returns the first compressed rank (r_max)."""
        self.rank = r_max
        return self.rank

    def bind_shapes(self, shapes: Sequence[tuple[int, int]]) -> None:
        """The (m, n) of every compressed matrix, when compression starts or a state is
        restored. Nothing by default."""

    def rank_at(self, step: int) -> int | None:
        """A rank forced for compressed step `step`, or None (the default) to keep the rank."""
        return None

    def observe_lr(self, lr: float) -> None:
        """The learning rate of the next step (set_learning_rate). Ignored by default."""

    def lr_dropped(self) -> bool:
        """Whether this replica saw the learning rate drop in the open window."""
        return False

    def decide(self, end: WindowEnd) -> int | None:
        """The next window's rank, or None to keep the rank in use. Called at every window
        end; while `end.compressing` is False the answer is ignored."""
        return self.rank if end.compressing else None

    def report(self) -> dict[str, float]:
        """Values for EDGCStats beyond the rank (e.g. "critical_rho"); none by default."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything this policy changes between windows."""
        return {"rank": self.rank}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.rank = int(d["rank"])

    @classmethod
    def state_from_v1(cls, v1: dict[str, Any]) -> dict[str, Any]:
        """This policy's `state_dict` from a whole version-1 state (edgc 0.1), which kept the
        rank rules' state in "controller" and the learning rates in "critical"."""
        return {"rank": int(v1["controller"]["rank"])}

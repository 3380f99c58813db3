"""The "critical" rank policy: high rank while training changes fast, low rank otherwise.

Why not the gradient's shape. Measured on the tiny GPT-2 (BENCHMARKS.md, "Where does
rank matter"), every shape signal (entropy, the spectrum's effective rank, the energy a rank leaves out) grows
over training, so the policies that follow them hold r_max to the end, while the loss
says rank is worth most early: the fixed schedule "0:32,500:16" of a 1000-step run beats
the static-rank frontier. This rule looks for that shape in how fast the gradient
changes instead.

The rule is Accordion's (Agarwal et al., "Adaptive Gradient Communication via Critical
Learning Regime Identification", MLSys 2021). At each window end, with N_k the norm of
the gradient accumulated over window k,

    rho = |N_(k-1) - N_k| / N_(k-1)

and the next window runs at r_hi while rho >= eta ("critical regime": the gradient is
still changing fast) and at r_lo otherwise; and at r_hi for the window after a
learning-rate drop, which starts a new critical regime (Accordion, Section 3.2). The
paper's eta is 0.5. Where rho is undefined (no earlier window to compare with, a zero
or non-finite norm) the rule takes r_hi: without evidence that training has settled, it
does not compress harder.

Here N_k is measured on what every replica already holds alike, the averaged gradient
(edgc.comm.windowgrad), so replicas decide alike without communicating; Accordion's own
code decides from rank 0's local gradient.

Pure python: nothing here calls torch.distributed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edgc.policy.base import RankPolicy, Signals, WindowEnd
from edgc.policy.window import limit_rank

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_THRESHOLD", "CriticalConfig", "CriticalPolicy", "CriticalRule", "critical_rank", "low_rank",
           "lr_dropped"]

#: Accordion's eta: the relative change of the window gradient norm above which training
#: is taken to be in a critical regime (Agarwal et al. 2021, Section 3.2).
DEFAULT_THRESHOLD = 0.5


def critical_rank(n_old: float | None, n_new: float, lr_dropped: bool, r_hi: int, r_lo: int,
                  threshold: float) -> tuple[int, float]:
    """The rank for the next window and rho = |n_old - n_new| / n_old.

    n_old is the previous window's gradient norm (None: there is none yet), n_new this
    window's. Returns (r_hi, rho) when the learning rate dropped (`lr_dropped`), when rho
    >= threshold, or when rho is undefined (n_old None, zero or non-finite; n_new
    non-finite), rho then being nan; else (r_lo, rho). Changes nothing.
    """
    if n_old is None or not (math.isfinite(n_old) and n_old > 0 and math.isfinite(n_new)):
        return r_hi, math.nan
    rho = abs(n_old - n_new) / n_old
    return (r_hi if lr_dropped or rho >= threshold else r_lo), rho


def low_rank(configured: int | None, r_min: int, r_max: int, multiple: int) -> int:
    """r_lo: `configured` (None: r_max // 2, at least 1) rounded to a multiple of `multiple`
    and kept in [r_min, r_max] (edgc.policy.window.limit_rank). r_hi is r_max."""
    proposed = configured if configured is not None else max(1, r_max // 2)
    return limit_rank(proposed, r_max, r_min=r_min, r_max=r_max, step=None, multiple=multiple)


def lr_dropped(window_min: float | None, reference: float | None, factor: float) -> bool:
    """Whether the learning rate dropped in a window: the least rate seen in it is below
    `factor` times `reference`, the rate at the previous window end. False when either is
    unknown (None: no rate was given). Changes nothing."""
    if window_min is None or reference is None:
        return False
    return window_min < factor * reference


class CriticalRule:
    """The state of the "critical" rule between windows: the last window's norm, and the
    learning rates given since the last window end (EDGCState.set_learning_rate).

    `observe_lr` records each learning rate given; `lr_dropped` says whether this window's
    least rate fell below `lr_drop_factor` times the rate at the previous window end;
    `close_window` decides the next window's rank and starts the next window. The rates
    are kept for every policy (they cost nothing); only "critical" decides from them.
    """

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, lr_drop_factor: float = 0.5) -> None:
        self.threshold = threshold
        self.lr_drop_factor = lr_drop_factor
        # internal state
        self.previous_norm: float | None = None  # the last window's finite norm (None: none yet)
        self.lr: float | None = None  # the rate given last (in force from then on)
        self.lr_min: float | None = None  # the least rate in force in the open window
        self.lr_reference: float | None = None  # the rate in force at the last window end
        # the last window end's values (stats)
        self.rho = math.nan
        self.norm = math.nan
        self.lr_drop = False

    def observe_lr(self, lr: float) -> None:
        """Record the learning rate of the next step."""
        self.lr = lr
        self.lr_min = lr if self.lr_min is None else min(self.lr_min, lr)

    def lr_dropped(self) -> bool:
        """Whether the learning rate dropped in the open window (module function `lr_dropped`)."""
        return lr_dropped(self.lr_min, self.lr_reference, self.lr_drop_factor)

    def close_window(self, norm: float, dropped: bool, r_hi: int, r_lo: int) -> int:
        """End a window whose gradient norm is `norm`, `dropped` saying whether the learning
        rate dropped in it (as agreed by the replicas); returns the next window's rank
        (critical_rank). A non-finite norm leaves the previous one as the next reference."""
        rank, self.rho = critical_rank(self.previous_norm, norm, dropped, r_hi, r_lo, self.threshold)
        self.norm, self.lr_drop = norm, dropped
        if math.isfinite(norm):
            self.previous_norm = norm
        self.lr_reference = self.lr
        self.lr_min = self.lr  # (the rate in force carries into the next window)
        return rank

    def state_dict(self) -> dict[str, Any]:
        return {"previous_norm": self.previous_norm, "lr": self.lr, "lr_min": self.lr_min,
                "lr_reference": self.lr_reference, "rho": self.rho, "norm": self.norm, "lr_drop": self.lr_drop}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        def opt(x: Any) -> float | None:
            return None if x is None else float(x)

        self.previous_norm, self.lr, self.lr_min = opt(d["previous_norm"]), opt(d["lr"]), opt(d["lr_min"])
        self.lr_reference = opt(d["lr_reference"])
        self.rho, self.norm, self.lr_drop = float(d["rho"]), float(d["norm"]), bool(d["lr_drop"])


@dataclass(kw_only=True)
class CriticalConfig:
    """The "critical" policy's parameters (EDGCConfig.critical)."""

    threshold: float = DEFAULT_THRESHOLD
    """eta: the relative change rho = |N_old - N_new| / N_old of the window gradient's norm
    from one window to the next at and above which the next window runs at r_max (the
    "critical regime"; Accordion's 0.5). A finite number > 0; a large one keeps the low
    rank but after learning-rate drops."""

    low_rank: int | None = None
    """r_lo, the rank outside the critical regime, rounded to `rank_multiple` and kept in
    [r_min, r_max]. None: max_rank // 2 (at least 1). The rank jumps between r_max and r_lo
    directly: `rank_step` does not apply. At most max_rank and at least min_rank."""

    lr_drop_factor: float = 0.5
    """A learning rate (set_learning_rate) falling in a window below this factor times the
    rate at the previous window end counts as a drop, and the next window runs at r_max
    (Accordion). In (0, 1)."""

    def check(self, bad: Callable[[str, str], None]) -> None:
        """Call `bad(field, why)` for the first field out of its range (the bounds that
        depend on max_rank and min_rank are EDGCConfig's to check)."""
        if not self.threshold > 0:
            bad("threshold", "must be a finite number > 0")
        if self.low_rank is not None and not 1 <= self.low_rank <= 2**16:
            bad("low_rank", "must be an integer in [1, 65536] or None (max_rank // 2)")
        if not 0.0 < self.lr_drop_factor < 1.0:
            bad("lr_drop_factor", "must be in (0, 1)")


class CriticalPolicy(RankPolicy):
    """Accordion's rule on the averaged gradient (`CriticalRule`): r_max in the critical
    regime and for the window after a learning-rate drop, r_lo otherwise. Experimental:
    measured on the static frontier, not beyond it. The entropy is measured too, for the
    plots."""

    signals = Signals(entropy=True, window_norm=True, learning_rate=True)
    experimental = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.low_rank: int | None = config.critical.low_rank
        self.rule = CriticalRule(config.critical.threshold, config.critical.lr_drop_factor)

    def observe_lr(self, lr: float) -> None:
        self.rule.observe_lr(lr)

    def lr_dropped(self) -> bool:
        return self.rule.lr_dropped()

    def decide(self, end: WindowEnd) -> int | None:
        """Every window end, warm-up included (the rule records the window's norm)."""
        r_lo = low_rank(self.low_rank, end.r_min, end.r_max, self.rank_multiple)
        rank = self.rule.close_window(end.window_norm, end.lr_dropped, end.r_max, r_lo)
        logger.info("EDGC critical: step %s, window gradient norm %.6g, rho %.4g%s -> rank %s%s", end.step,
                    end.window_norm, self.rule.rho, ", learning rate dropped" if end.lr_dropped else "", rank,
                    "" if end.compressing else " (warm-up: not applied)")
        if not end.compressing:
            return None
        self.rank = rank
        return rank

    def report(self) -> dict[str, float]:
        return {"critical_rho": self.rule.rho, "window_norm": self.rule.norm, "lr_drop": float(self.rule.lr_drop)}

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "rule": self.rule.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.rank = int(d["rank"])
        self.rule.load_state_dict(d["rule"])

    @classmethod
    def state_from_v1(cls, v1: dict[str, Any]) -> dict[str, Any]:
        # (states before this policy existed lack "critical": nothing recorded yet)
        rule = v1.get("critical") or CriticalRule().state_dict()
        return {"rank": int(v1.get("applied_rank", v1["controller"]["rank"])), "rule": dict(rule)}

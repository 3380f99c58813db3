"""The "critical" rank policy: high rank while training changes fast, low rank otherwise.

Why not the gradient's shape. Measured on the tiny GPT-2 (BENCHMARKS §8 and §9), every
shape signal (entropy, the spectrum's effective rank, the energy a rank leaves out) grows
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

`noise_scale` is the gradient noise scale B_simple of McCandlish et al. ("An Empirical
Model of Large-Batch Training", 2018, Appendix A.1) from the two batch sizes data
parallelism measures for free: one replica's batch and the whole world's.

Pure python: nothing here calls torch.distributed.
"""

from __future__ import annotations

import math
from typing import Any

from edgc.policy.window import limit_rank

__all__ = ["DEFAULT_THRESHOLD", "CriticalRule", "critical_rank", "low_rank", "lr_dropped", "noise_scale"]

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


def noise_scale(g_small_sq: float, g_big_sq: float, replicas: int) -> float:
    """The simple gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018,
    Appendix A.1), in units of one replica's batch b; returns nan where undefined.

    `g_small_sq` estimates |G_b|^2, the squared norm of a gradient over one replica's batch
    b (the mean over replicas of each one's ||g_i||^2), `g_big_sq` estimates |G_B|^2 over
    the world's batch B = n b (the squared norm of the average of the n = `replicas`
    gradients). With E|G_b|^2 = |G|^2 + tr(Sigma) / b for a batch of b examples, the two
    sizes give

        |G|^2     = (B |G_B|^2 - b |G_b|^2) / (B - b)     = (n g_big - g_small) / (n - 1)
        tr(Sigma) = (|G_b|^2 - |G_B|^2) / (1/b - 1/B)     = b n (g_small - g_big) / (n - 1)

    so B_simple / b = n (g_small - g_big) / (n g_big - g_small): b cancels into a ratio of
    replica counts, and the result times b (in examples, or tokens) is B_simple. The paper
    advises averaging the two squared norms over many steps before dividing, as the caller
    does over a window. nan for fewer than 2 replicas, non-finite input or |G|^2 <= 0.
    """
    n = replicas
    if n < 2 or not (math.isfinite(g_small_sq) and math.isfinite(g_big_sq)):
        return math.nan
    true_sq = n * g_big_sq - g_small_sq  # (n - 1) |G|^2
    if true_sq <= 0:
        return math.nan
    return n * (g_small_sq - g_big_sq) / true_sq


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

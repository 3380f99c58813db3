"""The "noise" rank policy: compress harder as the gradient's own noise grows.

Why. Measured on the tiny GPT-2 (BENCHMARKS.md, "Where does rank matter"), rank is worth
most early in a run, while every signal of the gradient's shape (entropy, effective rank, the energy a
rank leaves out) grows over training and so holds the rank up. One signal moves the
right way: the gradient noise scale B_simple of McCandlish et al. ("An Empirical Model
of Large-Batch Training", 2018), measured for free from each replica's gradient and
their average (`noise_scale` below). It grows as the loss falls: about 1,
then 3 to 6, then 15 replica batches over the first 1000 steps of the tiny preset.

The rule. With n replicas, the averaged gradient is a batch of n replica batches, and
B / n is the ratio of the noise's energy in it to the signal's (E|G_avg|^2 = |G|^2
(1 + B/n)). While B <= n the step is mostly signal, and compression error would show:
the rank stays at r_max. Beyond, an error of the compressed step weighs less against
the noise each step already carries, and the rank falls as

    r = r_max * (n / B)^gamma,    gamma = `EDGCConfig.noise.exponent` (0.35 by default),

clipped to [r_min, r_max], rounded to `rank_multiple` and moved at most `rank_step` per
window (edgc.policy.window.limit_rank), so that a noisy window moves it little. gamma is
a choice, not a law: 0.5 would scale the rank with the noise's standard deviation. With
the token embedding at twice the rank (EDGCConfig.long_rank_factor) 0.35 kept the loss
of static rank 32 at both widths measured (128 and 384) where 0.5 did at 128 only: the
other matrices' rank falls while the embedding, where low rank costs the loss most,
keeps twice theirs (docs/policies.md). Where the noise scale is unknown (one replica, a
non-finite window) the rank stays where it is.

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

__all__ = ["NoiseConfig", "NoisePolicy", "next_noise_rank", "noise_rank", "noise_scale"]

logger = logging.getLogger(__name__)


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



def noise_rank(noise: float, replicas: int, r_max: int, exponent: float) -> float:
    """The rank the noise scale asks for: r_max * min(1, (replicas / noise)^exponent).

    `noise` is the window's gradient noise scale in replica batches. Returns nan where
    it is unknown (nan, infinite, or not positive) or `replicas` < 2, leaving the rank as
    it was; a continuous value otherwise, in (0, r_max]. Changes nothing.
    """
    if replicas < 2 or not (math.isfinite(noise) and noise > 0.0):
        return math.nan
    ratio = replicas / noise
    return float(r_max) * min(1.0, ratio**exponent)


def next_noise_rank(noise: float, replicas: int, current: int, *, r_min: int, r_max: int, exponent: float,
                    rank_step: int, multiple: int) -> int:
    """The next window's rank: `current` moved towards `noise_rank`, clipped to [r_min,
    r_max], rounded to `multiple` and by at most `rank_step` (limit_rank); `current` where
    the noise scale is unknown. Changes nothing."""
    return limit_rank(noise_rank(noise, replicas, r_max, exponent), current, r_min=r_min, r_max=r_max,
                      step=rank_step, multiple=multiple)


@dataclass(kw_only=True)
class NoiseConfig:
    """The "noise" policy's parameters (EDGCConfig.noise)."""

    exponent: float = 0.35
    """gamma in r = r_max * min(1, (n / B)^gamma), B the window's gradient noise scale in
    replica batches and n the replicas. In (0, 4]; a larger one drops the rank faster as
    the noise grows."""

    def check(self, bad: Callable[[str, str], None]) -> None:
        """Call `bad(field, why)` for the first field out of its range."""
        if not 0.0 < self.exponent <= 4.0:
            bad("exponent", "must be in (0, 4]")


class NoisePolicy(RankPolicy):
    """r_max while the averaged gradient is mostly signal, then r_max (n / B)^gamma, moved
    at most `rank_step` per window (`next_noise_rank`); the rank stays where the window
    measured no noise scale (one replica, a non-finite window). The entropy is measured
    too, for the plots."""

    signals = Signals(entropy=True, noise_scale=True)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.exponent: float = config.noise.exponent

    def decide(self, end: WindowEnd) -> int | None:
        if not end.compressing:
            return None
        self.rank = next_noise_rank(end.noise_scale, end.replicas, self.rank, r_min=end.r_min, r_max=end.r_max,
                                    exponent=self.exponent, rank_step=self.rank_step, multiple=self.rank_multiple)
        logger.info("EDGC noise: step %s, noise scale %.4g replica batches -> rank %s", end.step, end.noise_scale,
                    self.rank)
        return self.rank

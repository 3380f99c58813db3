"""The "noise" rank policy: compress harder as the gradient's own noise grows.

Why. Measured on the tiny GPT-2 (BENCHMARKS §8 to §12), rank is worth most early in a
run, while every signal of the gradient's shape (entropy, effective rank, the energy a
rank leaves out) grows over training and so holds the rank up. One signal moves the
right way: the gradient noise scale B_simple of McCandlish et al. ("An Empirical Model
of Large-Batch Training", 2018), measured for free from each replica's gradient and
their average (edgc.policy.critical.noise_scale). It grows as the loss falls: about 1,
then 3 to 6, then 15 replica batches over the first 1000 steps of the tiny preset.

The rule. With n replicas, the averaged gradient is a batch of n replica batches, and
B / n is the ratio of the noise's energy in it to the signal's (E|G_avg|^2 = |G|^2
(1 + B/n)). While B <= n the step is mostly signal, and compression error would show:
the rank stays at r_max. Beyond, an error of the compressed step weighs less against
the noise each step already carries, and the rank falls as

    r = r_max * (n / B)^gamma,    gamma = `noise_exponent` (0.5 by default),

clipped to [r_min, r_max], rounded to `rank_multiple` and moved at most `rank_step` per
window (edgc.policy.window.limit_rank), so that a noisy window moves it little. gamma is
a choice, not a law: 0.5 scales the rank with the noise's standard deviation. Where the
noise scale is unknown (one replica, a non-finite window) the rank stays where it is.

Pure python: nothing here calls torch.distributed.
"""

from __future__ import annotations

import math

from edgc.policy.window import limit_rank

__all__ = ["next_noise_rank", "noise_rank"]


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

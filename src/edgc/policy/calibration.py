"""r_max calibration (release): the rank at which compressed all-reduce stops paying."""

from __future__ import annotations

import math


def probe_ranks(cap: int) -> list[int]:
    """The ranks probed in order: 2, 4, 8, ... up to and including `cap` (at least [cap])."""
    ranks = []
    r = 2
    while r < cap:
        ranks.append(r)
        r *= 2
    ranks.append(max(1, cap))
    return ranks


def calibrated_max_rank(points: list[tuple[int, float]], t_uncompressed: float, multiple: int = 4) -> int:
    """r_max from measured (rank, seconds) points of compressed all-reduce.

    The rank where the compressed time crosses the uncompressed time, by linear
    interpolation between the last probe below it and the first at or above it,
    floored to a multiple of `multiple` (release: 4) and at least `multiple`. If no
    probe reached the uncompressed time, the largest probed rank (floored) is used.
    """
    if not points:
        raise ValueError("calibration needs at least one (rank, time) point")
    points = sorted(points)
    prev: tuple[int, float] | None = None
    crossing = float(points[-1][0])
    for r, t in points:
        if t >= t_uncompressed:
            if prev is None:
                crossing = float(r) * t_uncompressed / t if t > 0 else float(r)
            else:
                r0, t0 = prev
                crossing = r0 + (t_uncompressed - t0) * (r - r0) / (t - t0) if t > t0 else float(r0)
            break
        prev = (r, t)
    if not math.isfinite(crossing):
        crossing = float(points[-1][0])
    return max(multiple, int(crossing // multiple) * multiple)

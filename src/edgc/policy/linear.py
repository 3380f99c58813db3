"""The released code's rank rule: a large entropy change asks for a high rank."""

from __future__ import annotations

import math

from edgc.policy.base import RankPolicy, Signals, WindowEnd
from edgc.policy.window import limit_rank

__all__ = ["LinearPolicy", "linear_rank"]


def linear_rank(dh_cur: float, dh_ref: float, r_min: int, r_max: int) -> float:
    """r = r_min + (r_max - r_min) * dH_cur / dH_ref, clipped to [r_min, r_max].

    dh_cur = |mean H(window k) - mean H(window k-1)|; dh_ref = the same for windows 1
    and 2. The release records warm-up entropies as 0, making dh_ref = 0; here the
    reference comes from measured windows, and a zero reference maps any change to
    r_max and no change to r_min. Returns a continuous rank; rounding happens in
    `limit_rank`.
    """
    if not (math.isfinite(dh_cur) and math.isfinite(dh_ref)):
        return float(r_max)
    if dh_ref <= 0.0:
        return float(r_max if dh_cur > 0.0 else r_min)
    r = r_min + (r_max - r_min) * dh_cur / dh_ref
    return float(min(max(r, r_min), r_max))


class LinearPolicy(RankPolicy):
    """The released code's rule: r = r_min + (r_max - r_min) dH_cur / dH_ref (`linear_rank`),
    dH_ref the change between the first two measured windows (warm-up included) and dH_cur
    between the last two, moved by at most `rank_step` per window."""

    signals = Signals(entropy=True)

    def decide(self, end: WindowEnd) -> int | None:
        if not end.compressing:
            return None
        finite = [h for h in end.history if math.isfinite(h)]
        if not (end.history and math.isfinite(end.history[-1])) or len(finite) < 2:
            return self.rank
        proposed = linear_rank(abs(finite[-1] - finite[-2]), abs(finite[1] - finite[0]), end.r_min, end.r_max)
        self.rank = limit_rank(proposed, self.rank, r_min=end.r_min, r_max=end.r_max, step=self.rank_step,
                               multiple=self.rank_multiple)
        return self.rank

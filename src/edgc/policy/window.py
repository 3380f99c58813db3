"""The window mechanism: entropy is averaged per window and the rank moves once per window."""

from __future__ import annotations

import math
from typing import Any

from edgc.policy.cqm import ErrorModel, cqm_rank
from edgc.policy.linear import linear_rank


def limit_rank(
    proposed: float,
    current: int,
    *,
    r_min: int,
    r_max: int,
    step: int | None,
    multiple: int,
) -> int:
    """The proposed rank after clipping, rounding and the rate limit.

    The proposal is clipped to [r_min, r_max], rounded to the nearest multiple of
    `multiple`, and kept within `step` of `current` (no limit when step is None: the
    release's first move, which may span the whole range). The result always lies in
    [r_min, r_max].
    """
    if not math.isfinite(proposed):
        return current
    r = min(max(proposed, r_min), r_max)
    r = int(round(r / multiple)) * multiple
    if step is not None:
        r = min(max(r, current - step), current + step)
    return int(min(max(r, r_min), r_max))


class RankController:
    """Turns per-step entropy samples into a rank decision at the end of each window.

    Holds the window accumulators and the history of window means (warm-up windows
    included, measured rather than recorded as 0 as in the release). Which rule maps
    the entropy change to a rank is `policy`: "static", "cqm" or "linear".

    Every move, the first included, is limited to `rank_step` (the release's first move
    takes r_max - s when the mapped rank is further than s away). For "cqm" the rank is
    kept as a continuous value between windows (`rank_value`), so that a slow drift of
    entropy, each window's move smaller than one rounding step, still adds up; the rank
    in use is that value rounded to `rank_multiple`. `smoothing` in [0, 1) compares
    exponential moving averages of the window means instead of the raw means (0: raw).
    """

    def __init__(self, policy: str, *, rank_step: int, rank_multiple: int, smoothing: float = 0.0) -> None:
        self.policy = policy
        self.rank_step = rank_step
        self.rank_multiple = rank_multiple
        self.smoothing = smoothing
        # internal state
        self.window_sum = 0.0
        self.window_count = 0
        self.history: list[float] = []  # mean entropy of each closed window
        self.r_min = 0
        self.r_max = 0
        self.rank = 0
        self.rank_value = 0.0  # the continuous rank behind `rank` (cqm)
        self.moves = 0  # rank decisions made since compression started
        # index in `history` of the first window still open when compression started; the
        # CQM compares only windows from there on (see decide)
        self.first_window = 0
        self.error_model: ErrorModel | None = None

    def observe(self, entropy: float) -> None:
        """Add one entropy sample to the current window; non-finite samples are dropped."""
        if math.isfinite(entropy):
            self.window_sum += entropy
            self.window_count += 1

    def close_window(self) -> float:
        """End the current window; returns its mean entropy (nan if it had no samples)."""
        mean = self.window_sum / self.window_count if self.window_count else float("nan")
        self.history.append(mean)
        self.window_sum = 0.0
        self.window_count = 0
        return mean

    def start(self, r_min: int, r_max: int, error_model: ErrorModel | None, *, mid_window: bool = False) -> int:
        """Begin compressing at r_max (the release's starting point); returns the rank.

        mid_window: compression starts inside a window, whose samples then mix warm-up
        steps with compressed ones; the CQM's first compared window is the next one.
        """
        self.r_min, self.r_max = r_min, r_max
        self.rank = r_max
        self.rank_value = float(r_max)
        self.moves = 0
        self.error_model = error_model
        self.first_window = len(self.history) + (1 if mid_window else 0)
        return self.rank

    def compared(self) -> list[float]:
        """The window means the CQM compares: finite ones since compression started,
        exponentially smoothed when `smoothing` > 0."""
        finite = [h for h in self.history[self.first_window :] if math.isfinite(h)]
        if self.smoothing <= 0.0 or not finite:
            return finite
        out = [finite[0]]
        for h in finite[1:]:
            out.append(self.smoothing * out[-1] + (1.0 - self.smoothing) * h)
        return out

    def decide(self) -> int:
        """The rank for the next window, from the last two window means; returns it."""
        if self.policy == "static" or not math.isfinite(self.history[-1] if self.history else math.nan):
            return self.rank
        if self.policy == "cqm":
            # The CQM assumes roughly normal gradients; windows that hold warm-up steps
            # (the skewed, unstable phase the warm-up exists to skip) are not compared.
            compared = self.compared()
            if len(compared) < 2:
                return self.rank
            assert self.error_model is not None, "cqm needs an error model"
            proposed = cqm_rank(compared[-2], compared[-1], self.rank_value, self.error_model)
            if math.isfinite(proposed):  # rate limit and bounds on the continuous value
                value = min(max(proposed, self.rank_value - self.rank_step), self.rank_value + self.rank_step)
                self.rank_value = min(max(value, float(self.r_min)), float(self.r_max))
            self.rank = limit_rank(self.rank_value, self.rank, r_min=self.r_min, r_max=self.r_max, step=None,
                                   multiple=self.rank_multiple)
        else:  # linear: the release's reference is the first two windows, warm-up included
            finite = [h for h in self.history if math.isfinite(h)]
            if len(finite) < 2:
                return self.rank
            proposed = linear_rank(abs(finite[-1] - finite[-2]), abs(finite[1] - finite[0]), self.r_min, self.r_max)
            self.rank = limit_rank(proposed, self.rank, r_min=self.r_min, r_max=self.r_max, step=self.rank_step,
                                   multiple=self.rank_multiple)
            self.rank_value = float(self.rank)
        self.moves += 1
        return self.rank

    def state_dict(self) -> dict[str, Any]:
        return {
            "window_sum": self.window_sum,
            "window_count": self.window_count,
            "history": list(self.history),
            "r_min": self.r_min,
            "r_max": self.r_max,
            "rank": self.rank,
            "rank_value": self.rank_value,
            "moves": self.moves,
            "first_window": self.first_window,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.window_sum = float(d["window_sum"])
        self.window_count = int(d["window_count"])
        self.history = [float(h) for h in d["history"]]
        self.r_min, self.r_max = int(d["r_min"]), int(d["r_max"])
        self.rank, self.moves = int(d["rank"]), int(d["moves"])
        self.rank_value = float(d.get("rank_value", self.rank))  # (older states: the rounded rank)
        self.first_window = int(d["first_window"])

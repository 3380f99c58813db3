"""The window mechanism: entropy is averaged per window, and a rank moves once per window
by at most a step."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["EntropyWindow", "limit_rank"]


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
    `multiple`, and kept within `step` of `current` (no limit when step is None). A
    non-finite proposal keeps `current`. The result always lies in [r_min, r_max].
    """
    if not math.isfinite(proposed):
        return current
    r = min(max(proposed, r_min), r_max)
    r = int(round(r / multiple)) * multiple
    if step is not None:
        r = min(max(r, current - step), current + step)
    return int(min(max(r, r_min), r_max))


class EntropyWindow:
    """The entropy samples of the open window, and the mean of every closed one (warm-up
    windows included, measured rather than recorded as 0 as in the released code)."""

    def __init__(self) -> None:
        self.window_sum = 0.0
        self.window_count = 0
        self.history: list[float] = []  # mean entropy of each closed window

    def observe(self, entropy: float) -> None:
        """Add one sample to the open window; non-finite samples are dropped."""
        if math.isfinite(entropy):
            self.window_sum += entropy
            self.window_count += 1

    def close(self) -> float:
        """End the open window; returns its mean (nan if it had no samples)."""
        mean = self.window_sum / self.window_count if self.window_count else math.nan
        self.history.append(mean)
        self.window_sum, self.window_count = 0.0, 0
        return mean

    def state_dict(self) -> dict[str, Any]:
        return {"window_sum": self.window_sum, "window_count": self.window_count, "history": list(self.history)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.window_sum = float(d["window_sum"])
        self.window_count = int(d["window_count"])
        self.history = [float(h) for h in d["history"]]

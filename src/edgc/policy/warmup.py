"""When compression starts: the warm-up, in one of three modes (EDGCConfig.warmup).

- "gradient": the gradient ends it. Every `check_every` steps the relative error of the
  best rank-r_max approximation of the replica-averaged gradient is measured until a check
  finds it at most `max_error`; compression starts after that check, or after step
  `min_steps` if that is later, and after `warmup_steps` at the latest.
- "fixed": exactly `warmup_steps` uncompressed steps.
- "release-check": the released code's criterion. At least `warmup_steps` uncompressed
  steps; eps_max, the error at r_max, is recorded at the first window end; then
  compression starts at the first window end where the error at r_min is below eps_max.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["WARMUP_MODES", "WarmupGate"]

#: The values of EDGCConfig.warmup.
WARMUP_MODES = ("gradient", "fixed", "release-check")


class WarmupGate:
    """Decides the step after which compression begins (see the module doc)."""

    def __init__(self, mode: str, warmup_steps: int, window: int, max_error: float = 0.1,
                 check_every: int = 1, min_steps: int = 0) -> None:
        if mode not in WARMUP_MODES:
            raise ValueError(f"warm-up mode must be one of {WARMUP_MODES}, got {mode!r}")
        self.mode = mode
        self.warmup_steps = warmup_steps
        self.window = window
        self.max_error = max_error
        self.check_every = max(1, check_every)
        self.min_steps = min_steps
        self.eps_max: float | None = None  # "release-check": the error at r_max at the first check
        self.passed = False  # "gradient": a check found the error small enough
        self.open = False  # compression has started

    def needs_errors(self, step: int) -> bool:
        """True if step's gradient must be measured (eps at r_min and r_max) for the check."""
        if self.open or self.mode == "fixed":
            return False
        if self.mode == "gradient":
            return not self.passed and step % self.check_every == 0 and step < self.warmup_steps
        return step % self.window == 0

    def update(self, step: int, eps_rmin: float = math.nan, eps_rmax: float = math.nan) -> bool:
        """Feed the end of `step`; returns True if compression starts with step + 1.

        eps_rmin and eps_rmax are the replica-averaged errors measured on this step's
        gradient when `needs_errors(step)` was True.
        """
        if self.open:
            return True
        if self.mode == "gradient":
            if step % self.check_every == 0 and math.isfinite(eps_rmax) and eps_rmax <= self.max_error:
                self.passed = True
            self.open = step >= self.warmup_steps or (self.passed and step >= self.min_steps)
            return self.open
        if self.mode == "fixed":
            self.open = step >= self.warmup_steps
            return self.open
        if step % self.window != 0:
            return False
        if self.eps_max is None:
            if math.isfinite(eps_rmax):
                self.eps_max = eps_rmax
            return False
        if step >= self.warmup_steps and math.isfinite(eps_rmin) and eps_rmin < self.eps_max:
            self.open = True
        return self.open

    def state_dict(self) -> dict[str, Any]:
        return {"eps_max": self.eps_max, "passed": self.passed, "open": self.open}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.eps_max = d["eps_max"]
        self.open = bool(d["open"])
        # (states saved before the floor existed: an open gate had passed, a closed one checks again)
        self.passed = bool(d.get("passed", self.open))

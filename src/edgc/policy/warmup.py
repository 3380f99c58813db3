"""When compression starts: a fixed warm-up, the release's error check after it, or an
end decided by the gradient (`max_error`)."""

from __future__ import annotations

import math
from typing import Any


class WarmupGate:
    """Decides the step after which compression begins.

    Release criterion: train uncompressed for at least `warmup_steps`; record
    eps_max = the relative error of the best rank-r_max approximation when checks
    begin; then, at each window end, start once eps(r_min) < eps_max. Without the
    error check, compression starts right after `warmup_steps`.

    With `max_error` (EDGCConfig.warmup_max_error) the gradient ends the warm-up: every
    `check_every` steps the error at r_max is measured, and compression starts after the
    first check where it is at most `max_error`, or after `warmup_steps` at the latest.
    Measured on the tiny GPT-2, the relative error of the best rank-32 approximation falls
    below 0.1 within the first checks (step 20 of a 1000-step run, step 6 of a 150-step one),
    so a threshold of 0.1 ends the warm-up there (BENCHMARKS §13).
    """

    def __init__(self, warmup_steps: int, window: int, error_check: bool, max_error: float | None = None,
                 check_every: int = 1) -> None:
        self.warmup_steps = warmup_steps
        self.window = window
        self.error_check = error_check
        self.max_error = max_error
        self.check_every = max(1, check_every)
        self.eps_max: float | None = None  # error at r_max, recorded at the first check
        self.open = False  # compression has started

    def needs_errors(self, step: int) -> bool:
        """True if step's gradient must be measured (eps at r_min and r_max) for the check."""
        if self.open:
            return False
        if self.max_error is not None:
            return step < self.warmup_steps and step % self.check_every == 0
        return self.error_check and step % self.window == 0

    def update(self, step: int, eps_rmin: float = math.nan, eps_rmax: float = math.nan) -> bool:
        """Feed the end of `step`; returns True if compression starts with step + 1.

        eps_rmin and eps_rmax are the replica-averaged relative errors measured on
        this step's gradient when `needs_errors(step)` was True.
        """
        if self.open:
            return True
        if self.max_error is not None:
            self.open = step >= self.warmup_steps or (
                step % self.check_every == 0 and math.isfinite(eps_rmax) and eps_rmax <= self.max_error)
            return self.open
        if not self.error_check:
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
        return {"eps_max": self.eps_max, "open": self.open}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.eps_max = d["eps_max"]
        self.open = bool(d["open"])

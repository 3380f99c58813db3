"""Configuration for EDGC compression.

Every field is documented where it is declared. `EDGCConfig.validate()` runs in
`__post_init__`, so an invalid value raises `ValueError` naming the field before
any worker starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from edgc.entropy import ESTIMATORS
from edgc.policy.cqm import METHODS as CQM_METHODS
from edgc.policy.schedule import parse_rank_schedule

POLICIES = ("cqm", "linear", "static", "budget", "spectral", "schedule")
#: Policies that set one rank per group of same-shape matrices.
GROUP_POLICIES = ("budget", "spectral")
WARMUP_ERROR_NORMS = ("relative", "l1")


@dataclass(kw_only=True)
class EDGCConfig:
    """Hyperparameters of the EDGC compressor (see EDGC_SPEC.md)."""

    policy: str = "cqm"
    """How the rank is chosen: "cqm" (the paper's rule, r1 = g^-1(e^(H0-H1) g(r0))),
    "linear" (the released code's rule), "static" (fixed rank `max_rank`: PowerSGD), or
    "budget" (beyond the paper: one rank per group of same-shape matrices, steered each
    window towards leaving out `error_budget` of the group's energy; edgc.policy.budget), or
    "spectral" (beyond the paper: one rank per group, following the effective rank of the
    spectrum PowerSGD transmits; edgc.policy.spectral), or "schedule" (the rank as a fixed
    step function of the step, `rank_schedule`; edgc.policy.schedule)."""

    max_rank: int | None = None
    """Upper rank bound r_max. None: calibrate it by timing compressed against
    uncompressed all-reduce at ranks 2, 4, 8, ... during warm-up (release behaviour)."""

    min_rank: int | None = None
    """Lower rank bound r_min. None: max_rank // 4 (the paper recommends r_max/4 to r_max/6)."""

    rank_step: int = 4
    """s: the most the rank may move in one window, the first move included (release: 4;
    its first move takes r_max - s when the mapped rank is further than s from r_max)."""

    rank_multiple: int = 2
    """Ranks are rounded to a multiple of this (release: even ranks)."""

    error_budget: float = 0.05
    """For policy "budget": the share of each matrix group's energy (gradient plus error
    feedback) that the low-rank approximation may leave out, averaged over a window."""

    spectral_headroom: float = 1.5
    """For policy "spectral": each group's rank is moved towards this multiple of its
    window-mean effective rank exp(H(σ²/Σσ²)); the rank settles where the transmitted
    spectrum's effective rank is 1/headroom of the rank (edgc.policy.spectral)."""

    rank_schedule: str = ""
    """For policy "schedule": knots "STEP:RANK,..." (e.g. "0:32,300:16"); from each
    knot's step on, compressed steps use its rank. Ranks must not exceed `max_rank`."""

    window: int = 1000
    """w: iterations per entropy window; the rank is revisited once per window (paper: 1000)."""

    iteration_sample_rate: float = 0.1
    """alpha: entropy is estimated every round(1/alpha) iterations (paper: 0.1)."""

    gradient_sample_rate: float = 0.25
    """beta: the fraction of gradient elements used for the estimate; every
    round(1/beta)-th element of the flat gradient (paper and release: 0.25)."""

    entropy_estimator: str = "histogram"
    """"histogram" (Shannon entropy over a histogram, as released) or "gaussian"
    (1/2 log(2 pi e sigma^2))."""

    entropy_smoothing: float = 0.0
    """In [0, 1): the CQM compares exponential moving averages of the window mean
    entropies, each window weighing 1 - entropy_smoothing (0: the raw means, as the
    paper). A window mean of a few samples is noisy next to the entropy change the whole
    rank range spans, so smoothing keeps the rule from following noise."""

    differential: bool = True
    """For the histogram estimator: add log(bin width), giving the differential entropy,
    which shifts by log c when the gradient scales by c (the CQM relies on this). False
    gives the release's discrete entropy, which does not move with scale."""

    bins: int = 1000
    """Histogram bins (release: 1000)."""

    cqm_method: str = "mp"
    """How g(r; m, n) is computed for the CQM: "mp" (Marchenko-Pastur law) or
    "montecarlo" (exact SVD of sampled Gaussian matrices)."""

    warmup_steps: int = 1000
    """The least number of uncompressed steps before compression may start (release:
    10% of all iterations; torch's PowerSGD hook defaults to 1000)."""

    warmup_error_check: bool = False
    """After `warmup_steps`, start compressing only at the first window end where the
    relative error of the best rank-r_min approximation is below eps_max, the error at
    r_max recorded when warm-up checks begin (release criterion, on in the release).
    Off by default: measured on the tiny GPT-2 (`edgc -v train --steps 200`), eps_max was
    0.078 at the first check (step 13) while eps(r_min) rose from 0.17 to 0.58 by step 195,
    so compression never started. Early gradients are the most low-rank ones here."""

    warmup_error_norm: str = "relative"
    """The error the warm-up check compares: "relative" (Frobenius error of the best
    rank-r approximation over the gradient's norm) or "l1" (its absolute mean |A - A_r|
    per element, in gradient units, as the release measures it). The absolute error
    falls as gradients shrink, so with "l1" the check can pass later in training."""

    calibration_repeats: int = 3
    """Timed compressed all-reduces per probed rank when calibrating r_max (release: ~3)."""

    min_compression_rate: float = 2.0
    """A matrix is compressed only if m*n / ((m+n)*r_max) is at least this; others, and
    every tensor with fewer than 2 dimensions, are all-reduced uncompressed."""

    use_error_feedback: bool = True
    """Carry the compression error into the next step's gradient (PowerSGD/EF-SGD)."""

    warm_start: bool = True
    """Reuse Q from the previous step instead of drawing a new random Q (release: on)."""

    seed: int = 0
    """Seed of the replica-identical generator that draws Q columns."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        def bad(field: str, why: str) -> None:
            raise ValueError(f"EDGCConfig.{field}={getattr(self, field)!r}: {why}")

        if self.policy not in POLICIES:
            bad("policy", f"must be one of {POLICIES}")
        if self.max_rank is not None and (not _is_int(self.max_rank) or self.max_rank < 1):
            bad("max_rank", "must be a positive integer or None (calibrate)")
        if self.min_rank is not None and (not _is_int(self.min_rank) or self.min_rank < 1):
            bad("min_rank", "must be a positive integer or None (max_rank // 4)")
        if self.min_rank is not None and self.max_rank is not None and self.min_rank > self.max_rank:
            bad("min_rank", f"must not exceed max_rank={self.max_rank}")
        if self.policy in ("static", "schedule") and self.max_rank is None:
            bad("max_rank", f'the "{self.policy}" policy needs a fixed rank')
        if self.policy == "schedule":
            try:
                knots = parse_rank_schedule(self.rank_schedule)
            except ValueError as exc:
                bad("rank_schedule", str(exc))
            if _is_int(self.max_rank) and max(r for _, r in knots) > self.max_rank:
                bad("rank_schedule", f"ranks must not exceed max_rank={self.max_rank}")
        for name in ("rank_step", "rank_multiple", "window", "bins", "calibration_repeats"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                bad(name, "must be a positive integer")
        for name in ("iteration_sample_rate", "gradient_sample_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                bad(name, "must be in (0, 1]")
        if self.entropy_estimator not in ESTIMATORS:
            bad("entropy_estimator", f"must be one of {ESTIMATORS}")
        if isinstance(self.entropy_smoothing, bool) or not isinstance(self.entropy_smoothing, (int, float)) \
                or not 0.0 <= self.entropy_smoothing < 1.0:
            bad("entropy_smoothing", "must be in [0, 1)")
        if isinstance(self.error_budget, bool) or not isinstance(self.error_budget, (int, float)) \
                or not 0.0 < self.error_budget < 1.0:
            bad("error_budget", "must be in (0, 1)")
        if isinstance(self.spectral_headroom, bool) or not isinstance(self.spectral_headroom, (int, float)) \
                or not 1.0 <= self.spectral_headroom <= 8.0:
            bad("spectral_headroom", "must be in [1, 8]")
        if self.warmup_error_norm not in WARMUP_ERROR_NORMS:
            bad("warmup_error_norm", f"must be one of {WARMUP_ERROR_NORMS}")
        if self.cqm_method not in CQM_METHODS:
            bad("cqm_method", f"must be one of {CQM_METHODS}")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            bad("warmup_steps", "must be a non-negative integer")
        if not isinstance(self.min_compression_rate, (int, float)) or self.min_compression_rate < 0:
            bad("min_compression_rate", "must be a non-negative number")
        for name in ("differential", "warmup_error_check", "use_error_feedback", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if not _is_int(self.seed):
            bad("seed", "must be an integer")

    def resolved_min_rank(self, max_rank: int) -> int:
        """r_min for a known r_max: the configured value, or max_rank // 4 (at least 1)."""
        if self.min_rank is not None:
            return min(self.min_rank, max_rank)
        return max(1, max_rank // 4)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EDGCConfig":
        """Build from a mapping; an unknown key raises ValueError naming it."""
        reject_unknown_fields(cls, values, "EDGCConfig has no field(s)")
        return cls(**values)


def reject_unknown_fields(cls: type, values: dict[str, Any], message: str) -> None:
    """Raise ValueError '<message> [...]; known: [...]' if `values` has keys that are not
    fields of the dataclass `cls` (shared by every config's from_dict)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{message} {unknown}; known: {sorted(known)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

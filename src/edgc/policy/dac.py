"""Dynamic Alignment Compressor (DAC): per-pipeline-stage ranks that finish together.

The paper's DAC, aligning ranks across pipeline stages (docs/pipelines.md). In 1F1B the last micro-batch's
backward pass runs from the last stage to the first, so stage p finishes its last backward
about p·t_mb before stage 0 (t_mb = one micro-batch's backward time) and stage 0 is the
critical path of the data-parallel gradient sync. (The spec's wording says "after"; what
matters is the slack p·t_mb that stage p has relative to stage 0.) Stage 0 syncs at the
entropy-driven rank r₀, taking T₀ = T(r₀); stage p may spend T_p = p·t_mb + T₀ and so runs
the rank r_p = T⁻¹(T_p), rounded up to a multiple of 4. A stage whose budget reaches the
uncompressed time, or whose rank would exceed r_max, sends its gradient uncompressed.

Pure python; nothing here calls torch.distributed. Replicas that disagree take the
maximum over the DP group, which is the caller's business.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from edgc.config import MAX_RANK
from edgc.fields import check_field_types, reject_unknown_fields

__all__ = ["DACConfig", "TimeModel", "dac_ranks", "rank_for_budget", "smallest_rank", "stage_rank"]

TimeOfRank = Callable[[int], float]


def smallest_rank(reaches: Callable[[int], bool], lo: int, hi: int) -> int:
    """The smallest integer r in [lo, hi] with reaches(r) True, by bisection.

    `reaches` must be monotone (False ... False True ... True) and reaches(hi) True.
    """
    while lo < hi:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _per_stage(value, stages: int, name: str) -> list:
    """`value` repeated `stages` times, or `value` itself when it is a sequence of that length."""
    if isinstance(value, Sequence):
        if len(value) != stages:
            raise ValueError(f"{name} has {len(value)} entries, expected one per stage ({stages})")
        return list(value)
    return [value] * stages


def dac_ranks(
    t_of_rank: TimeOfRank | Sequence[TimeOfRank],
    r0: int,
    t_mb: float,
    stages: int,
    r_max: int,
    t_uncompressed: float | Sequence[float],
    multiple: int = 4,
    cap_at_r_max: bool = False,
) -> list[int | None]:
    """Return the DAC rank of each pipeline stage, index p = 0 .. stages-1; None = uncompressed.

    `t_of_rank` is T(r), the seconds one stage's DP gradient sync takes at integer rank r;
    it must be non-decreasing in r (the paper assumes T(r) = η·r; any monotone model
    works, e.g. an α–β model with compression compute). Pass one callable for all stages
    (the paper's single model) or one per stage (stage 0 holds the embedding, so its T is
    larger); `t_uncompressed` likewise, a float or one per stage.

    The rule, with T₀ = T_0(r0) and T_p's own model T_p(r):

    - target_p = p·t_mb + T₀;
    - if target_p >= t_uncompressed_p: None (stage p sends uncompressed);
    - stage 0 keeps r0 itself (it is the entropy-driven rank, not rounded);
    - otherwise r* = the smallest integer r in [r0, r_max] with T_p(r) >= target_p, found by
      bisection (this is T⁻¹(target_p) rounded up to an integer); when even T_p(r_max) is
      below target_p the rank needed exceeds r_max, so None;
    - r_p = r* rounded up to a multiple of `multiple` (release: 4); None if r_p > r_max.

    `cap_at_r_max=True` is a variant, not the paper's rule: a stage whose rank would exceed
    r_max (but whose budget is below its uncompressed time) runs r_max instead of going
    uncompressed. The paper's rule assumes r_max is calibrated to where T(r_max) meets the
    uncompressed time, so "above r_max" implies "uncompressed fits the budget"; with a fixed
    r_max far below that point (e.g. the release's default 32 on a slow network) sending
    uncompressed overshoots the budget, and capping keeps the stage within it.

    Reading None as "rank infinity" (uncompressed is the most accurate sync), the result is
    non-decreasing in p whenever every stage uses the same T and uncompressed time, never
    exceeds r_max, and every entry after stage 0 is a multiple of `multiple` (or r_max
    itself, when capped).

    Raises ValueError unless 1 <= r0 <= r_max, stages >= 1, t_mb >= 0 and multiple >= 1.
    Changes nothing.
    """
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if not 1 <= r0 <= r_max:
        raise ValueError(f"r0 must be in [1, r_max={r_max}], got {r0}")
    if not (t_mb >= 0.0 and math.isfinite(t_mb)):
        raise ValueError(f"t_mb must be a finite number >= 0, got {t_mb}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    times = _per_stage(t_of_rank, stages, "t_of_rank")
    t_unc = _per_stage(t_uncompressed, stages, "t_uncompressed")

    t0 = times[0](r0)  # stage 0's predicted sync time, "broadcast" to the pipeline group
    return [
        stage_rank(p, times[p], r0, t0, t_mb, r_max, t_unc[p], multiple=multiple, cap_at_r_max=cap_at_r_max)
        for p in range(stages)
    ]


def stage_rank(
    p: int,
    t_of_rank: TimeOfRank,
    r0: int,
    t0: float,
    t_mb: float,
    r_max: int,
    t_uncompressed: float,
    multiple: int = 4,
    cap_at_r_max: bool = False,
) -> int | None:
    """One stage's share of `dac_ranks`: what stage p decides once it has heard T₀ = `t0`
    (and r0) from stage 0. `t_of_rank` and `t_uncompressed` are stage p's own. None means
    uncompressed. Changes nothing."""
    if p == 0:
        return r0 if t0 < t_uncompressed else None
    return rank_for_budget(t_of_rank, p * t_mb + t0, r0, r_max, t_uncompressed, multiple, cap_at_r_max)


def rank_for_budget(
    t_of_rank: TimeOfRank,
    target: float,
    r_lo: int,
    r_max: int,
    t_uncompressed: float,
    multiple: int = 4,
    cap_at_r_max: bool = False,
) -> int | None:
    """The rank whose sync time T(r) fills `target` seconds: T⁻¹(target) rounded up to an
    integer in [r_lo, r_max], then up to a multiple of `multiple`. None (uncompressed)
    where target >= t_uncompressed or the rank would exceed r_max (r_max itself instead,
    with `cap_at_r_max`)."""
    if target >= t_uncompressed:
        return None
    if t_of_rank(r_max) < target:
        return r_max if cap_at_r_max else None  # T⁻¹(target) > r_max
    lo = smallest_rank(lambda r: t_of_rank(r) >= target, r_lo, r_max)  # T(r_max) >= target checked above
    r = -(-lo // multiple) * multiple  # round up to a multiple
    if r > r_max:
        return r_max if cap_at_r_max else None
    return r


@dataclass
class TimeModel:
    """T(r): seconds of one stage's compressed gradient sync at rank r, fitted to measurements.

    - "linear": least squares T = eta·r + intercept over the measured (rank, seconds) points.
      With a single distinct rank it is the paper's T = eta·r through the origin.
    - "interp": piecewise-linear through the mean time at each measured rank (the
      release's choice); through the origin below the first point, and on the last
      segment's slope above the last one.

    Both are made non-decreasing in r (eta >= 0; running maximum of the means), which
    `dac_ranks` needs for its bisection.
    """

    method: str
    eta: float
    intercept: float
    ranks: list[float]
    times: list[float]

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]], method: str = "linear") -> TimeModel:
        """Fit to (rank, seconds) samples; raises ValueError with no samples or an unknown method."""
        if method not in TIME_MODELS:
            raise ValueError(f"time model must be one of {TIME_MODELS}, got {method!r}")
        points = [(float(r), float(t)) for r, t in samples if r > 0 and math.isfinite(t)]
        if not points:
            raise ValueError("T(r) needs at least one measured (rank, seconds) sample with rank > 0")
        by_rank: dict[float, list[float]] = {}
        for r, t in points:
            by_rank.setdefault(r, []).append(t)
        ranks = sorted(by_rank)
        means = [sum(by_rank[r]) / len(by_rank[r]) for r in ranks]
        for i in range(1, len(means)):  # non-decreasing
            means[i] = max(means[i], means[i - 1])
        if len(ranks) == 1:
            eta, intercept = max(0.0, means[0] / ranks[0]), 0.0
        else:
            n = len(points)
            mr = sum(r for r, _ in points) / n
            mt = sum(t for _, t in points) / n
            var = sum((r - mr) ** 2 for r, _ in points)
            eta = max(0.0, sum((r - mr) * (t - mt) for r, t in points) / var)
            intercept = mt - eta * mr
        return cls(method, eta, intercept, ranks, means)

    @classmethod
    def given(cls, eta: float, intercept: float = 0.0) -> TimeModel:
        """The fixed model T = eta·r + intercept (a profiled cluster, or a test)."""
        return cls("linear", float(eta), float(intercept), [], [])

    def __call__(self, r: float) -> float:
        if self.method == "linear" or not self.ranks:
            return self.eta * r + self.intercept
        ranks, times = self.ranks, self.times
        if r <= ranks[0]:
            return times[0] * r / ranks[0]
        for i in range(1, len(ranks)):
            if r <= ranks[i]:
                w = (r - ranks[i - 1]) / (ranks[i] - ranks[i - 1])
                return times[i - 1] + w * (times[i] - times[i - 1])
        slope = (times[-1] - times[-2]) / (ranks[-1] - ranks[-2]) if len(ranks) > 1 else times[0] / ranks[0]
        return times[-1] + max(0.0, slope) * (r - ranks[-1])

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "eta": self.eta, "intercept": self.intercept,
                "ranks": list(self.ranks), "times": list(self.times)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TimeModel:
        return cls(d["method"], float(d["eta"]), float(d["intercept"]), list(d["ranks"]), list(d["times"]))


TIME_MODELS = ("linear", "interp")
STAGE_RANKS = ("dac", "uniform")
SLACKS = ("t_mb", "measured")


@dataclass(kw_only=True)
class DACConfig:
    """How pipeline stages choose their ranks (`edgc train --pp P`, `--dac-FIELD`)."""

    #: The values each text field may take (validate checks them; the CLI lists them).
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "stage_ranks": STAGE_RANKS, "slack": SLACKS, "time_model": TIME_MODELS,
    }

    stage_ranks: str = "dac"
    """"dac": stage p runs T⁻¹(p·t_mb + T₀), aligned with stage 0; "uniform": every stage
    runs stage 0's entropy-driven rank r₀ (the comparison the DAC is measured against)."""

    slack: str = "t_mb"
    """How much later stage 0's sync may end than stage p's: "t_mb" is the spec's p·t_mb;
    "measured" uses how long each stage actually waited for stage 0 at the end of the
    last window's steps (beyond the paper: the p·t_mb model ignores the send latency and
    any contention between a stage's sync and its neighbours' backward passes). A stage
    may then also go below r₀ (to r_min) when it finishes after stage 0, and a rank above
    r_max runs r_max unless the budget covers the uncompressed time."""

    time_model: str = "linear"
    """T(r) fitted online to this run's measured sync times: "linear" or "interp"."""

    eta: float | None = None
    """Seconds per unit of rank, given instead of measured (with `intercept`): T = eta·r + c.
    A finite number >= 0."""

    intercept: float = 0.0
    """c of the given model; used only with `eta`. A finite number (it may be negative)."""

    t_mb: float | None = None
    """Backward seconds per micro-batch, given instead of measured; a finite number >= 0."""

    t_uncompressed: float | None = None
    """Seconds of one uncompressed sync, given instead of measured; a finite number >= 0."""

    multiple: int = 4
    """Stage ranks after stage 0 are rounded up to a multiple of this (release: 4); in
    [1, MAX_RANK]."""

    cap_at_r_max: bool = False
    """Run r_max instead of uncompressed when T⁻¹(T_p) > r_max but T_p is below the
    uncompressed time (a variant; the paper's rule goes uncompressed)."""

    max_samples: int = 200
    """Timing samples kept for the fit (the most recent); a positive integer."""

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field and saying what it may be: its
        type first (no bool for an int, no NaN or infinity for a number), then its range."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"dac {name}={getattr(self, name)!r}: {why}")

        check_field_types(self, bad)
        for name in ("eta", "t_mb", "t_uncompressed"):
            v = getattr(self, name)
            if v is not None and v < 0:
                bad(name, "must be a finite number >= 0, or null (unset) to measure it")
        if not 1 <= self.multiple <= MAX_RANK:
            bad("multiple", f"must be an integer in [1, {MAX_RANK}]")
        if self.max_samples < 1:
            bad("max_samples", "must be a positive integer")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DACConfig:
        reject_unknown_fields(cls, values, "unknown DAC option(s)")
        cfg = cls(**values)
        cfg.validate()
        return cfg

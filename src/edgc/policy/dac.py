"""Dynamic Alignment Compressor (DAC): per-pipeline-stage ranks that finish together.

EDGC_SPEC.md, "DAC: aligning ranks across pipeline stages". In 1F1B the last micro-batch's
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

import math
from collections.abc import Callable, Sequence

__all__ = ["dac_ranks", "smallest_rank"]

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
    ranks: list[int | None] = []
    for p in range(stages):
        target = p * t_mb + t0
        if target >= t_unc[p]:
            ranks.append(None)
            continue
        if p == 0:
            ranks.append(r0)
            continue
        t = times[p]
        if t(r_max) < target:
            ranks.append(r_max if cap_at_r_max else None)  # T⁻¹(target) > r_max
            continue
        lo = smallest_rank(lambda r: t(r) >= target, r0, r_max)  # T(r_max) >= target checked above
        r = -(-lo // multiple) * multiple  # round up to a multiple
        if r > r_max:
            r = r_max if cap_at_r_max else None
        ranks.append(r)
    return ranks

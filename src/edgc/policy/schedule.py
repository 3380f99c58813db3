"""A fixed rank schedule: the rank as a step function of the training step.

`EDGCConfig.rank_schedule` holds knots "STEP:RANK,STEP:RANK,...": from each knot's step on
(counted in synchronised steps, warm-up included) compressed steps use its rank, until the
next knot. Before the first knot the first rank applies. It decides from the step counter
alone, so replicas agree without communicating, and it is the tool for asking when rank
matters most in a run (BENCHMARKS §8): high rank early and low rank late, or the reverse.
"""

from __future__ import annotations

__all__ = ["parse_rank_schedule", "scheduled_rank"]


def parse_rank_schedule(text: str) -> list[tuple[int, int]]:
    """[(step, rank), ...] from "STEP:RANK,..."; raises ValueError on anything else (steps
    must be non-negative and strictly increasing, ranks positive)."""
    knots: list[tuple[int, int]] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            step_text, rank_text = part.split(":")
            step, rank = int(step_text), int(rank_text)
        except ValueError:
            raise ValueError(f"rank schedule knot {part!r} is not STEP:RANK (two integers)") from None
        if step < 0 or rank < 1:
            raise ValueError(f"rank schedule knot {part!r}: the step must be >= 0 and the rank >= 1")
        if knots and step <= knots[-1][0]:
            raise ValueError(f"rank schedule steps must increase: {step} follows {knots[-1][0]}")
        knots.append((step, rank))
    if not knots:
        raise ValueError('a rank schedule needs at least one knot "STEP:RANK"')
    return knots


def scheduled_rank(knots: list[tuple[int, int]], step: int) -> int:
    """The rank of the last knot at or before `step` (the first knot's before it)."""
    rank = knots[0][1]
    for at, r in knots:
        if at > step:
            break
        rank = r
    return rank

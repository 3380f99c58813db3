"""A fixed rank schedule: the rank as a step function of the training step.

`EDGCConfig.schedule.ranks` holds knots "STEP:RANK,STEP:RANK,...": from each knot's step on
(counted in synchronised steps, warm-up included) compressed steps use its rank, until the
next knot. Before the first knot the first rank applies. It decides from the step counter
alone, so replicas agree without communicating, and it is the tool for asking when rank
matters most in a run: high rank early and low rank late, or the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from edgc.policy.base import RankPolicy, WindowEnd

__all__ = ["ScheduleConfig", "SchedulePolicy", "parse_rank_schedule", "scheduled_rank"]


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


@dataclass(kw_only=True)
class ScheduleConfig:
    """The "schedule" policy's parameters (EDGCConfig.schedule)."""

    METAVARS: ClassVar[dict[str, str]] = {"ranks": "STEP:RANK,..."}

    ranks: str = ""
    """Knots "STEP:RANK,..." (e.g. "0:32,300:16"): from each knot's step on, compressed
    steps use its rank. Ranks must not exceed `max_rank`. Checked whatever the policy, so
    that a malformed schedule never passes unnoticed."""

    def check(self, bad: Callable[[str, str], None]) -> None:
        """Call `bad(field, why)` when the knots do not parse (the policy needs at least one)."""
        if self.ranks:
            try:
                parse_rank_schedule(self.ranks)
            except ValueError as exc:
                bad("ranks", str(exc))


class SchedulePolicy(RankPolicy):
    """The rank as a fixed step function of the step (`scheduled_rank`), decided from the
    step counter alone: replicas agree without communicating, and no signal is read."""

    aligns = False  # (it decides per step, not at window ends)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.knots = parse_rank_schedule(config.schedule.ranks)

    def start(self, r_min: int, r_max: int, *, step: int, windows_closed: int, mid_window: bool) -> int:
        self.rank = scheduled_rank(self.knots, step + 1)
        return self.rank

    def rank_at(self, step: int) -> int | None:
        self.rank = scheduled_rank(self.knots, step)
        return self.rank

    def decide(self, end: WindowEnd) -> int | None:
        return None  # (the step decides, not the window)

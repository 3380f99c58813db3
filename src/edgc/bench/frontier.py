"""A run's place against the static frontier: the frontier, the gap below it, and the
verdict, with the margins `edgc bench pareto` uses.

The frontier joins the static ranks no other static rank beats (fewer bytes, or less time,
and a lower loss), straight lines in log bytes between them. A run's gap below it is
measured block by block where the runs kept their block losses (the *paired* SE; see
edgc.train.evaluation), over each seed against that seed's static runs, and the verdict
takes the larger of the paired SE and the seeds' SE of the mean gap as its margin
(edgc.bench.pareto's module doc says why).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from edgc.train.blocks import BlockLosses, paired_difference
from edgc.train.config import TrainConfig

__all__ = ["END_TOLERANCE", "Judgement", "ParetoPoint", "combine", "difference", "frontier", "frontier_gap",
           "frontier_verdict", "judge", "paired_gap"]


@dataclass
class ParetoPoint:
    """One run's place on the plots."""

    name: str
    kind: str  # "none", "static", "torch", "dynamic"
    rank: int | None  # static rank, or r_max of a dynamic policy
    val_loss: float
    val_se: float  # standard error of val_loss (0 when the run did not record one)
    bytes: float  # bytes this replica handed to collectives, whole run
    seconds: float  # training wall time: summed step times, evaluation excluded
    time_to_target: float  # seconds until the first validation loss <= the target (inf: never)
    wire: str = "native"  # what its sums travelled in: EDGCConfig.wire, "native" for torch's hook, "-" for none
    seed: int = TrainConfig.seed  # the run's
    # that evaluation's block losses, if kept
    blocks: BlockLosses | None = dataclasses.field(default=None, repr=False, compare=False)

    def record(self) -> dict[str, object]:
        """The point as pareto.json holds it (the block losses stay in the run's folder)."""
        return {k: v for k, v in self.__dict__.items() if k != "blocks"}


def frontier(statics: list[ParetoPoint], axis: str) -> list[ParetoPoint]:
    """The static points no other one beats: ascending in bytes (or time), each with a lower
    loss than every point before it. A static rank that sent more and ended higher than
    another (e.g. a lower rank whose warm-up ran longer) is not part of the frontier."""
    pts: list[ParetoPoint] = []
    for p in sorted((s for s in statics if math.isfinite(s.val_loss)), key=lambda s: (getattr(s, axis), s.val_loss)):
        if not pts or p.val_loss < pts[-1].val_loss:
            pts.append(p)
    return pts


def _bracket(xs: list[float], x: float) -> int | None:
    """i with xs[i] <= x <= xs[i + 1] (xs ascending, at least two), or None outside."""
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            return i
    return None


#: How far (relative) past the frontier's last (or first) point a run still counts as at
#: that point: a policy that held r_max sends r_max's bytes plus a few control bytes.
END_TOLERANCE = 0.01


def frontier_verdict(point: ParetoPoint, statics: list[ParetoPoint], axis: str) -> str:
    """Where `point` lies against the static frontier on the loss-vs-`axis` plot ("bytes"
    or "seconds"): "beyond", "on", "behind" or "outside the frontier" (see module doc);
    `judge`'s verdict for one seed."""
    return judge([point], [statics], axis).verdict


def _interpolation(point: ParetoPoint, statics: list[ParetoPoint], axis: str
                   ) -> tuple[ParetoPoint, ParetoPoint, float] | None:
    """(the frontier's static points on either side of `point`'s bytes (or time), the weight
    of the upper one in log space), or None outside the frontier's span."""
    pts = frontier(statics, axis)
    xs = [getattr(s, axis) for s in pts]
    i = _bracket(xs, getattr(point, axis)) if math.isfinite(point.val_loss) else None
    if i is None:
        return None
    span = math.log(xs[i + 1]) - math.log(xs[i])
    w = 0.0 if span == 0 else (math.log(getattr(point, axis)) - math.log(xs[i])) / span  # (log-space interpolation)
    return pts[i], pts[i + 1], w


def frontier_gap(point: ParetoPoint, statics: list[ParetoPoint], axis: str = "bytes") -> tuple[float, float] | None:
    """(how far `point`'s loss lies below the frontier's at its bytes (or time), the two
    losses' combined SE) where the frontier spans its bytes; None outside it."""
    found = _interpolation(point, statics, axis)
    if found is None:
        return None
    lo, hi, w = found
    loss = lo.val_loss + w * (hi.val_loss - lo.val_loss)
    return loss - point.val_loss, math.hypot(point.val_se, max(lo.val_se, hi.val_se))


def paired_gap(point: ParetoPoint, statics: list[ParetoPoint], axis: str = "bytes") -> tuple[float, float] | None:
    """(how far `point`'s loss lies below the frontier's at its bytes (or time), its paired
    SE): on each validation block, the frontier's loss is its two neighbours' block losses
    interpolated with the same weight as their means, and the gap's SE is the per-block
    gaps' (see edgc.train.evaluation). None outside the frontier's span, or when a run of
    the three kept no block losses."""
    found = _interpolation(point, statics, axis)
    if found is None:
        return None
    lo, hi, w = found
    if point.blocks is None or lo.blocks is None or hi.blocks is None:
        return None
    line = BlockLosses(step=lo.blocks.step, starts=lo.blocks.starts,
                       losses=(1 - w) * lo.blocks.losses + w * hi.blocks.losses)
    diff, se = paired_difference(line, point.blocks)
    return diff, se


def difference(point: ParetoPoint, ref: ParetoPoint) -> tuple[float, float, bool]:
    """(ref's loss minus point's, its SE, whether that SE is paired): paired over the
    blocks where both kept them, else the two losses' combined SE."""
    if point.blocks is not None and ref.blocks is not None:
        diff, se = paired_difference(ref.blocks, point.blocks)
        return diff, se, True
    return ref.val_loss - point.val_loss, math.hypot(point.val_se, ref.val_se), False


@dataclass(frozen=True)
class Judgement:
    """A run's place against the static frontier, over its seeds (see the module doc)."""

    verdict: str  # "beyond", "on", "behind", "outside the frontier", "no frontier", "no finite loss"
    below: float | None = None  # mean over seeds of how far its loss lies below the frontier's (or the static point's)
    margin: float | None = None  # max(eval_se, seed_se)
    eval_se: float | None = None  # the evaluation's SE of `below`: paired, or combined without block losses
    seed_se: float | None = None  # the seeds' standard deviation of the gap over sqrt(seeds); None with one seed
    seeds: int = 1
    paired: bool = True  # eval_se is the paired SE (False: the combined SE of runs without block losses)

    def describe(self) -> str:
        """The verdict with its figures: "beyond (0.0141 below, margin 0.0021: paired SE
        0.0009, seed SE 0.0021 over 3 seeds)"."""
        if self.below is None or self.margin is None or self.eval_se is None:
            return self.verdict
        kind = "paired SE" if self.paired else "combined SE"
        seeds = (f", seed SE {self.seed_se:.4f} over {self.seeds} seeds" if self.seed_se is not None
                 else ", one seed")
        return f"{self.verdict} ({self.below:+.4f} below, margin {self.margin:.4f}: {kind} {self.eval_se:.4f}{seeds})"


def combine(gaps: list[float], ses: list[float], paired: bool) -> Judgement:
    """The mean gap over seeds with its margins; the verdict is filled in by the caller."""
    n = len(gaps)
    eval_se = math.sqrt(sum(se * se for se in ses)) / n
    seed_se = statistics.stdev(gaps) / math.sqrt(n) if n >= 2 else None
    return Judgement("", statistics.fmean(gaps), max(eval_se, seed_se or 0.0), eval_se, seed_se, n, paired)


def judge(points: list[ParetoPoint], statics: list[list[ParetoPoint]], axis: str = "bytes") -> Judgement:
    """Where a run lies against the static frontier on the loss-vs-`axis` plot ("bytes" or
    "seconds"), over its seeds: `points[k]` is its run with seed k and `statics[k]` the
    static runs of that seed (each seed's frontier is drawn from its own static runs).
    Paired over the validation blocks where every run kept them; see the module doc."""
    if any(not frontier(st, axis) for st in statics):
        return Judgement("no frontier")
    if any(not math.isfinite(p.val_loss) for p in points):
        return Judgement("no finite loss")
    inside = [_interpolation(p, st, axis) is not None for p, st in zip(points, statics, strict=True)]
    if all(inside):
        gaps, ses, paired = [], [], True
        for p, st in zip(points, statics, strict=True):
            found = paired_gap(p, st, axis)
            if found is None:  # (a run without block losses)
                found, paired = frontier_gap(p, st, axis), False
            assert found is not None
            gaps.append(found[0])
            ses.append(found[1])
        j = combine(gaps, ses, paired)
        assert j.below is not None and j.margin is not None
        verdict = "beyond" if j.below > j.margin else "on" if j.below >= -j.margin else "behind"
        return Judgement(verdict, j.below, j.margin, j.eval_se, j.seed_se, j.seeds, j.paired)
    if any(inside):
        return Judgement("outside the frontier")  # (inside the span on some seeds, outside on others)
    # outside the span on every seed: against the nearest static point, on the same side on every seed
    nearest, sides = [], set()
    for p, st in zip(points, statics, strict=True):
        pts = frontier(st, axis)
        first = getattr(p, axis) < getattr(pts[0], axis)
        near = pts[0] if first else pts[-1]
        nearest.append(near)
        x, nx = getattr(p, axis), getattr(near, axis)
        end = abs(x - nx) <= END_TOLERANCE * nx
        sides.add((near.name, first, end, x <= nx, x >= nx))
    if len(sides) > 1:
        return Judgement("outside the frontier")
    _, _, end, cheaper, dearer = sides.pop()
    diffs = [difference(p, near) for p, near in zip(points, nearest, strict=True)]
    j = combine([d for d, _, _ in diffs], [se for _, se, _ in diffs], all(paired for *_, paired in diffs))
    assert j.below is not None and j.margin is not None
    if end and abs(j.below) <= j.margin:
        verdict = "on"  # at the frontier's end point (e.g. a policy that held r_max, plus its control bytes)
    elif cheaper and j.below > j.margin:
        verdict = "beyond"  # fewer bytes (or less time) and a lower loss than a static run
    elif dearer and j.below < -j.margin:
        verdict = "behind"
    else:
        verdict = "outside the frontier"
    return Judgement(verdict, j.below, j.margin, j.eval_se, j.seed_se, j.seeds, j.paired)

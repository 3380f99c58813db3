"""The α–β model: per-stage DP sync, 1F1B exposure, and the projection of whole runs.

1. Ring all-reduce of S bytes over N replicas: T(S) = 2(N−1)·α + 2(N−1)/N · S/B
   (`ring_allreduce_time`), B the inter-node bandwidth one ring gets
   (`ClusterSpec.ring_bandwidth`).
2. One stage's sync (`stage_sync`), as edgc.comm's hook does it:
   - uncompressed: one all-reduce of the whole shard;
   - PowerSGD at rank r: an all-reduce of P (m·r per matrix), one of Q (n·r per matrix) and
     one of the uncompressed rest (1-D tensors and matrices that `compressible` rejects at
     r_max with the minimum rate), each with its own latency term, plus the compression
     arithmetic from the `CostProfile` (roofline-modelled or measured);
   - EDGC adds the GDS entropy estimate at β on the shard, amortised by α because it runs
     every 1/α steps, and its 56-byte control all-reduce on those steps.
3. A step (`StepProjection`): compute + the DP sync exposed after stage 0's last backward.
   In 1F1B stage p finishes its last backward about p·t_mb before stage 0, so the exposed
   sync is max_p(T_p − p·t_mb), with t_mb the backward time of one micro-batch.
4. Methods (`simulate`): none; static PowerSGD at r_max on every stage; EDGC with a stage-0
   rank schedule standing in for the entropy trajectory and DAC ranks on the other stages
   (`edgc.policy.dac.dac_ranks`), once with the spec's DAC rule and once with the rank
   capped at r_max. Means are taken over the steps after warm-up, totals over the run.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from edgc.bench.comm import ring_allreduce_seconds
from edgc.bench.simulate.cluster import ClusterSpec
from edgc.bench.simulate.layout import StageGradients, stage_gradients
from edgc.bench.simulate.profile import CostProfile
from edgc.comm.control import CONTROL_LEN
from edgc.compress import compressible
from edgc.config import EDGCConfig
from edgc.models.gpt2 import build_model
from edgc.policy.dac import dac_ranks, smallest_rank
from edgc.policy.window import limit_rank

__all__ = [
    "PAPER_COMM_REDUCTION",
    "PAPER_TIME_REDUCTION",
    "MethodProjection",
    "Projection",
    "SimOptions",
    "StageSync",
    "StepProjection",
    "compressed_matrices",
    "parse_schedule",
    "profile_needs",
    "ring_allreduce_time",
    "simulate",
    "stage_sync",
    "wire_crossover_rank",
]

# The paper's headline figures (arXiv 2511.10333, its reported setup and results).
PAPER_COMM_REDUCTION = 0.4645
PAPER_TIME_REDUCTION = 0.1613

# Bytes of the hook's control vector (CONTROL_LEN float64 values), all-reduced on entropy steps.
_CONTROL_BYTES = 8 * CONTROL_LEN


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Return T(S) = 2(N−1)·α + 2(N−1)/N · S/B for a ring all-reduce of S = `nbytes` bytes.

    `bandwidth` is B in bytes/s, `latency` α in seconds; 0 for N = 1.
    """
    return ring_allreduce_seconds(nbytes, n, 8.0 * bandwidth, latency)


@dataclass(kw_only=True)
class SimOptions:
    """What is projected, besides the cluster."""

    rank_max: int = 32
    """r_max: the static PowerSGD rank and EDGC's upper bound (release fixed-rank default 32)."""

    rank_min: int | None = None
    """r_min; None: rank_max // 4 (the paper recommends r_max/4 to r_max/6)."""

    warmup_fraction: float = 0.1
    """Share of the steps trained uncompressed before compression starts (release: 10%)."""

    edgc_schedule: tuple[tuple[float, float], ...] | None = None
    """EDGC's stage-0 rank as (fraction of training, rank) knots, linear in between and
    uncompressed before the first knot. None: (warmup_fraction, r_max) to (1.0, r_min)."""

    min_compression_rate: float = EDGCConfig.min_compression_rate
    """A matrix is compressed only if m·n / ((m+n)·r_max) reaches this (as in the hook)."""

    iteration_sample_rate: float = EDGCConfig.iteration_sample_rate
    """α of the GDS: entropy is estimated every 1/α steps."""

    gradient_sample_rate: float = EDGCConfig.gradient_sample_rate
    """β of the GDS: the share of gradient elements the estimate reads."""

    entropy_estimator: str = EDGCConfig.entropy_estimator
    bins: int = EDGCConfig.bins
    rank_multiple: int = EDGCConfig.rank_multiple
    """The stage-0 rank is rounded to a multiple of this (release: even)."""

    tp_layout: str = "vocab"
    """How tensor parallelism splits the model (edgc.bench.simulate.layout.LAYOUTS): "vocab",
    as `edgc train --tp` does by default (the token embedding and the head's copy split on
    the vocabulary), "whole" (as with --no-vocab-parallel), or "megatron" (the vocabulary
    split, the head's copy left out)."""

    def __post_init__(self) -> None:
        if self.rank_max < 1:
            raise ValueError(f"rank_max must be >= 1, got {self.rank_max}")
        if not 1 <= self.resolved_rank_min <= self.rank_max:
            raise ValueError(f"rank_min must be in [1, rank_max={self.rank_max}], got {self.rank_min}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        _check_schedule(self.schedule, self.rank_max)

    @property
    def resolved_rank_min(self) -> int:
        return self.rank_min if self.rank_min is not None else max(1, self.rank_max // 4)

    @property
    def schedule(self) -> tuple[tuple[float, float], ...]:
        """The EDGC stage-0 schedule, the default filled in."""
        if self.edgc_schedule is not None:
            return tuple(self.edgc_schedule)
        return ((self.warmup_fraction, float(self.rank_max)), (1.0, float(self.resolved_rank_min)))


def _check_schedule(schedule: Sequence[tuple[float, float]], rank_max: int) -> None:
    if not schedule:
        raise ValueError("the EDGC schedule needs at least one (fraction, rank) knot")
    fractions = [f for f, _ in schedule]
    if any(not 0.0 <= f <= 1.0 for f in fractions) or fractions != sorted(fractions):
        raise ValueError(f"EDGC schedule fractions must rise within [0, 1], got {fractions}")
    if any(not 1 <= r <= rank_max for _, r in schedule):
        raise ValueError(f"EDGC schedule ranks must lie in [1, rank_max={rank_max}], got {[r for _, r in schedule]}")


def parse_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """Parse "FRACTION:RANK,..." (e.g. "0.1:32,1.0:8") into (fraction, rank) knots."""
    knots = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*([0-9.]+)\s*:\s*([0-9.]+)\s*", part)
        if not m:
            raise ValueError(f"--edgc-schedule {text!r}: expected FRACTION:RANK pairs like 0.1:32,1.0:8")
        knots.append((float(m.group(1)), float(m.group(2))))
    return tuple(knots)


def _schedule_rank(schedule: Sequence[tuple[float, float]], fraction: float, rank_max: int,
                   multiple: int) -> int | None:
    """Stage-0 rank at `fraction` of training; None before the first knot (warm-up)."""
    if fraction < schedule[0][0]:
        return None
    value = schedule[-1][1]
    for (f0, r0), (f1, r1) in pairwise(schedule):
        if f0 <= fraction < f1:
            value = r0 + (r1 - r0) * (fraction - f0) / (f1 - f0)
            break
    low = int(min(r for _, r in schedule))
    return limit_rank(value, round(value), r_min=max(1, low), r_max=rank_max, step=None, multiple=multiple)


@dataclass(frozen=True)
class StageSync:
    """One stage's DP gradient sync for one step, per replica."""

    rank: int | None
    """PowerSGD rank, or None for an uncompressed all-reduce."""
    bytes: float
    """Bytes handed to all-reduces (control vector excluded)."""
    wire_s: float
    """α–β time of the all-reduces."""
    compress_s: float
    """Low-rank arithmetic (scaled profile)."""
    entropy_s: float
    """GDS entropy estimate amortised over 1/α steps (EDGC only)."""

    @property
    def total_s(self) -> float:
        """Seconds of the whole sync: wire + compression + amortised entropy."""
        return self.wire_s + self.compress_s + self.entropy_s


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def compressed_matrices(stage: StageGradients, opts: SimOptions) -> tuple[Counter, int]:
    """Return ({(m, n): count} of the matrices the hook compresses, numel of the rest).

    A matrix is compressed if `compressible` accepts it at r_max with the minimum rate;
    same-shape matrices form one batch, as in the hook.
    """
    mats: Counter = Counter()
    rest = 0
    for shape in stage.shapes:
        if compressible(shape, opts.rank_max, opts.min_compression_rate):
            mats[_matrix(shape)] += 1
        else:
            rest += math.prod(shape)
    return mats, rest


def stage_sync(
    stage: StageGradients,
    rank: int | None,
    cluster: ClusterSpec,
    profile: CostProfile,
    opts: SimOptions,
    *,
    entropy: bool,
) -> StageSync:
    """Return the sync of `stage`'s shard at `rank` (None: uncompressed) for one step.

    Compressed: all-reduces of P (Σ m·r elements), Q (Σ n·r) and the uncompressed rest, r
    clipped to min(r, m, n) per matrix as the hook does. `entropy` adds the GDS cost and
    the control all-reduce, both times α. The profile must hold the stage's shapes.
    """
    n, bw, lat, eb = cluster.dp, cluster.ring_bandwidth, cluster.latency, cluster.grad_bytes
    ent = 0.0
    wire = 0.0
    if entropy:
        isr = opts.iteration_sample_rate
        ent = isr * profile.entropy_seconds(stage.numel, opts.gradient_sample_rate, opts.entropy_estimator, opts.bins)
        wire += isr * ring_allreduce_time(_CONTROL_BYTES, n, bw, lat)
    if rank is None:
        nbytes = stage.numel * eb
        return StageSync(None, nbytes, wire + ring_allreduce_time(nbytes, n, bw, lat), 0.0, ent)
    mats, rest = compressed_matrices(stage, opts)
    p_elems = sum(c * m * min(rank, m, k) for (m, k), c in mats.items())  # P: (m, r) per matrix
    q_elems = sum(c * k * min(rank, m, k) for (m, k), c in mats.items())  # Q: (n, r) per matrix
    for elems in (rest, p_elems, q_elems):
        if elems:
            wire += ring_allreduce_time(elems * eb, n, bw, lat)
    compress = sum(c * profile.lowrank_seconds(m, k, rank) for (m, k), c in mats.items())
    return StageSync(rank, (rest + p_elems + q_elems) * eb, wire, compress, ent)


@dataclass(frozen=True)
class StepProjection:
    """One step under one assignment of ranks to pipeline stages."""

    ranks: tuple[int | None, ...]
    stages: tuple[StageSync, ...]
    compute_s: float
    t_mb: float

    @property
    def critical_stage(self) -> int:
        """The stage whose sync ends last after stage 0's last backward."""
        return max(range(len(self.stages)), key=lambda p: self.stages[p].total_s - p * self.t_mb)

    @property
    def exposed_s(self) -> float:
        """DP sync exposed after stage 0's last backward: max_p(T_p − p·t_mb)."""
        p = self.critical_stage
        return self.stages[p].total_s - p * self.t_mb

    @property
    def step_s(self) -> float:
        """Seconds of the step: compute + exposed DP sync."""
        return self.compute_s + self.exposed_s


@dataclass(frozen=True)
class MethodProjection:
    """A method over the whole projected run."""

    method: str
    label: str
    warmup_steps: int
    first: StepProjection
    """The first step after warm-up (the only kind of step for "none")."""
    last: StepProjection
    """The last step."""
    sync_s: float
    """Mean exposed DP sync per step after warm-up."""
    wire_s: float
    """Mean α–β time of the critical stage after warm-up."""
    overhead_s: float
    """Mean compression + entropy time of the critical stage after warm-up."""
    step_s: float
    """Mean step time after warm-up."""
    total_s: float
    """Training time of all steps, warm-up included."""


@dataclass(frozen=True)
class Projection:
    """Everything `simulate` computed, for printing or tests."""

    cluster: ClusterSpec
    options: SimOptions
    n_params: int
    stages: tuple[StageGradients, ...]
    compute_s: float
    t_mb: float
    methods: tuple[MethodProjection, ...]

    def method(self, name: str) -> MethodProjection:
        """Return the projection of the method named `name` ("none", "powersgd", "edgc", "edgc-cap")."""
        return next(m for m in self.methods if m.method == name)


def _project_method(
    method: str, label: str, steps: int, step_at: Callable[[int], StepProjection], warmup_steps: int
) -> MethodProjection:
    """Accumulate `step_at(step)` over the run; means over steps >= warmup_steps.

    `step_at` returns one of a few cached StepProjections, so each distinct one is
    evaluated once (by identity) and the run is summed from those figures.
    """
    total = sync = wire = overhead = step_sum = 0.0
    counted = 0
    first = last = None
    figures: dict[int, tuple[float, float, float, float]] = {}  # id -> (step, exposed, wire, overhead)
    for step in range(steps):
        sp = step_at(step)
        fig = figures.get(id(sp))
        if fig is None:
            crit = sp.stages[sp.critical_stage]
            fig = figures[id(sp)] = (sp.step_s, sp.exposed_s, crit.wire_s, crit.compress_s + crit.entropy_s)
        total += fig[0]
        if step >= warmup_steps:
            first = first or sp
            sync += fig[1]
            wire += fig[2]
            overhead += fig[3]
            step_sum += fig[0]
            counted += 1
        last = sp
    assert last is not None  # (ClusterSpec.steps is at least 1)
    k = max(1, counted)
    return MethodProjection(method, label, warmup_steps, first or last, last, sync / k, wire / k, overhead / k,
                            step_sum / k, total)


def profile_needs(stages: Sequence[StageGradients], opts: SimOptions) -> tuple[dict[tuple[int, int], int], list[int]]:
    """Return ({(m, n): largest count on one stage}, ranks to measure) for `simulate`.

    Ranks: r_min, r_max, the schedule's knots and every multiple of 8 between; others are
    interpolated by `CostProfile.lowrank_seconds`.
    """
    shapes: dict[tuple[int, int], int] = {}
    for stage in stages:
        for mn, c in compressed_matrices(stage, opts)[0].items():
            shapes[mn] = max(shapes.get(mn, 0), c)
    lo = opts.resolved_rank_min
    ranks = {lo, opts.rank_max, *(int(r) for _, r in opts.schedule)}
    ranks |= set(range(8 * math.ceil(lo / 8), opts.rank_max, 8))
    return shapes, sorted(r for r in ranks if r >= 1)


def simulate(cluster: ClusterSpec, profile: CostProfile, opts: SimOptions) -> Projection:
    """Project none, static PowerSGD and EDGC (two DAC variants) onto `cluster`.

    The model is the cluster's preset with its position embedding sized to `seq_len`.
    Fills into `profile` whatever it lacks from its source (see `profile_needs`); returns
    the Projection.
    """
    model = build_model(cluster.preset, block_size=cluster.seq_len, device="meta")
    n_params = model.num_parameters()
    stages = stage_gradients(model, cluster.tp, cluster.pp, opts.tp_layout)
    shapes, ranks = profile_needs(stages, opts)
    profile.ensure_lowrank(shapes, ranks)
    profile.ensure_entropy(opts.gradient_sample_rate, opts.entropy_estimator, opts.bins)

    compute = cluster.compute_seconds(n_params)
    t_mb = cluster.backward_per_micro_batch(compute)
    steps = cluster.steps
    cache: dict[tuple, StepProjection] = {}

    def project(ranks_: Sequence[int | None], entropy: bool) -> StepProjection:
        key = (tuple(ranks_), entropy)
        if key not in cache:
            syncs = tuple(stage_sync(s, r, cluster, profile, opts, entropy=entropy)
                          for s, r in zip(stages, ranks_, strict=True))
            cache[key] = StepProjection(tuple(ranks_), syncs, compute, t_mb)
        return cache[key]

    pp = cluster.pp
    plain = [None] * pp
    static_warmup = round(opts.warmup_fraction * steps)
    r_max = opts.rank_max

    def time_of_rank(stage: StageGradients) -> Callable[[int], float]:
        """T(r) made non-decreasing for dac_ranks' bisection: max of T(r') over r' <= r.

        Measured arithmetic need not be monotone in r (on this project's CPU a narrow
        r = 8 bmm ran slower than r = 16); the envelope only matters where it is not. The
        roofline model is monotone in r.
        """
        envelope: list[float] = [0.0]  # envelope[r] for r = 0, 1, ...

        def t(r: int) -> float:
            while len(envelope) <= r:
                k = len(envelope)
                envelope.append(max(envelope[-1], stage_sync(stage, k, cluster, profile, opts, entropy=True).total_s))
            return envelope[r]
        return t

    t_of_rank = [time_of_rank(s) for s in stages]
    t_unc = [stage_sync(s, None, cluster, profile, opts, entropy=True).total_s for s in stages]

    dac: dict[tuple[int, bool], list[int | None]] = {}

    def edgc_step(cap: bool) -> Callable[[int], StepProjection]:
        def step_at(step: int) -> StepProjection:
            r0 = _schedule_rank(opts.schedule, step / steps, r_max, opts.rank_multiple)
            if r0 is None:
                return project(plain, True)
            if (r0, cap) not in dac:
                dac[(r0, cap)] = dac_ranks(t_of_rank, r0, t_mb, pp, r_max, t_unc, cap_at_r_max=cap)
            return project(dac[(r0, cap)], True)
        return step_at

    edgc_warmup = next((s for s in range(steps) if s / steps >= opts.schedule[0][0]), steps)
    methods = (
        _project_method("none", "none", steps, lambda s: project(plain, False), 0),
        _project_method("powersgd", f"PowerSGD r={r_max}", steps,
                        lambda s: project(plain if s < static_warmup else [r_max] * pp, False), static_warmup),
        _project_method("edgc", "EDGC (DAC as specified)", steps, edgc_step(False), edgc_warmup),
        _project_method("edgc-cap", "EDGC (DAC capped at r_max)", steps, edgc_step(True), edgc_warmup),
    )
    return Projection(cluster, opts, n_params, tuple(stages), compute, t_mb, methods)


def wire_crossover_rank(stage: StageGradients, cluster: ClusterSpec, opts: SimOptions) -> int:
    """Return the smallest rank whose α–β wire time reaches the uncompressed one (no compute).

    This is where the release's r_max calibration would land on an ideal network with free
    arithmetic; the compressible set is held at the one chosen for `opts.rank_max`.
    """
    mats, rest = compressed_matrices(stage, opts)
    if not mats:
        return 0
    n, bw, lat, eb = cluster.dp, cluster.ring_bandwidth, cluster.latency, cluster.grad_bytes
    plain = ring_allreduce_time(stage.numel * eb, n, bw, lat)

    def wire(r: int) -> float:
        p = sum(c * m * min(r, m, k) for (m, k), c in mats.items())
        q = sum(c * k * min(r, m, k) for (m, k), c in mats.items())
        return sum(ring_allreduce_time(e * eb, n, bw, lat) for e in (rest, p, q) if e)

    hi = max(min(m, k) for m, k in mats)
    if wire(hi) < plain:
        return hi
    return smallest_rank(lambda r: wire(r) >= plain, 1, hi)

"""StepSync: one step's gradient synchronisation, unit by unit, in one fixed collective order.

A step takes a plan (`StepInfo`: what the synchroniser decided for it), the compression
state (slots, groups, the plan of units) and the collectives, and hands back a
`StepResult`: the averaged gradient is in the buckets, and the result holds what the
synchroniser decides from (the agreed control values, whether the step was finite). It
changes the compression state only through its methods (`commit`, `flush_error_feedback`).

Units. The gradient is synchronised in units, sets of parameter slots (the compression
state numbers the parameters by slot). A unit's round is local arithmetic around at most two
collectives per gradient dtype in flight at a time:

    start      M = G + error, P = M Q
               -> all-reduce SUM of the unit's uncompressed tensors and of its P
    finish P   wait; orthogonalise P; Q = M^T P
               -> all-reduce SUM of Q
    complete   wait; Q /= W; then, once the step is known finite (below),
               error = M - P Q^T and G = P Q^T

(a step sent uncompressed has one all-reduce per unit, completed like a Q; on the int4
wire it travels at int8). With a quantized wire format (EDGCConfig.wire, edgc.comm.wire)
the sums of P and Q are each a reduce-scatter issued where the all-reduce would be and an
all-gather issued at its wait; everything else is unchanged. A unit's arithmetic reads
only its own slots, so how the gradient is cut into units changes the average only
through the float order of the sums.

Three modes (GradientSync.mode: EDGCConfig.sync_mode's two, or "eager" for an adapter):
- "whole-step": the whole gradient is one unit, started when DDP hands over its last
  bucket. Every bucket waits for the last; a step costs at most four collectives per
  dtype (control, uncompressed, P, Q), and none of them overlaps the backward pass.
- "pipelined": DDP's buckets are the units (or runs of them, see "Coarse units"). In the
  hook call for bucket i, the hook starts every unit whose slots have all arrived (bucket
  i's), then finishes the P of the units started in earlier calls (bucket i-1's), then
  completes the units whose Q was issued in earlier calls (bucket i-2's); the last call
  drains the rest. While the autograd engine computes bucket i+1, buckets i and i-1 are
  on the wire.
- "eager" (edgc.fsdp): each buffer is a unit, started and completed in its own call,
  because FSDP2 needs it averaged before the call returns.
Every bucket reaches a step the same way (`StepSync.add`). A step that cannot start its
units as the buckets arrive parks them and starts at the last: the whole-step mode's
steps, a job's first step (its slots are assigned from its buckets), and the steps whose
plan reads the whole local gradient (r_max calibration, the warm-up error check, flushing
the error feedback into an uncompressed window).

Why a fixed lag, and not "whatever has arrived". Every collective is issued from the
thread that calls the hook, and every replica must issue the same collectives in the same
order, or gloo pairs one replica's Q of bucket i with another's P of bucket j and hangs or
aborts (torch's powerSGD_hook issues its Q from future callbacks, and does). What a hook
call issues therefore depends only on which call it is: DDP hands the buckets over in
index order on every replica, and a unit started in call i has its P finished in call
i+1 and its Q completed in call i+2, waiting if the bytes are not there yet, never sooner
because a collective happened to finish early on one replica. (Polling for completion
would make the order depend on timing.) The price: a replica whose link is slow blocks
its backward pass at the wait, which is where the wire is the bottleneck anyway.

The plan. The units are DDP's bucket layout of the last step that had more than one
bucket, kept in the state and its checkpoints (DDP's first step of every job is one bucket
of everything; it rebuilds its buckets after it). A resumed job's first step, one bucket,
is then cut into the units the uninterrupted run used, and sums in the same float order.
Where DDP's buckets differ from the plan, a unit starts once all its slots have arrived,
in plan order; the new layout becomes the plan from the next step on.

Coarse units (EDGCConfig.max_units, min_unit_mb). Each all-reduce pays its latency
whatever its size, each unit's round launches its batched ops once per shape, and at low
rank a bucket's P and Q are small, so a step of many buckets can spend more on latency and
launches than on bytes (DDP's 25 MB buckets hold less than one layer of a large model). So
the step's units are the plan's units merged, in plan order, until each puts at least
1/max_units of the step's bytes (and at least min_unit_mb MB) on the wire in this step
(`coarse_units`, with each slot's bytes from `slot_wire_bytes`: (m + n) r elements for a
compressed matrix at its group's rank, in the wire format, and every element of a tensor
sent whole). A remainder below the threshold at the end joins the unit before it, or is
the step's one unit when there is no other. The cut depends only on the
plan, on the step's groups and ranks and on the threshold, all replica-identical, so
every replica cuts alike; it is made afresh each step, as ranks move. The plan kept in
the state stays DDP's layout: a resumed job cuts its first step as the uninterrupted run
did, and a threshold changed on resume changes only the cut (the float order of the
sums). The price is overlap: a merged unit starts at its last bucket, so the bytes of the
buckets before it leave later. DDP's first step of a job, which has no plan yet, is not
merged, and the whole-step mode, one unit already, ignores the threshold.

The round on a device, and its memory. On a GPU a round costs launches more than flops,
so it works on a unit's matrices of one shape (a part) as one batch: each stage is one
batched op per part (M = G + error an add, P = M Q a bmm, the orthogonalisation a dozen
(EDGCConfig.orthogonalization), Q = M^T P a bmm, the new error M - P Q^T a baddbmm that
subtracts inside the matmul, the average P Q^T a bmm); the tensors sent whole leave and
return by one cat and one multi-tensor copy; finiteness is one multi-tensor norm per wait,
read at the step's end. The launches grow with units times shapes, not with matrices.
A step keeps no copy of the gradient's matrices. A part whose matrices lie at one stride
in one bucket (one per layer) is worked on where it lies, as one strided view
(`strided_batch`), and where the gradient is in the working dtype (float32, float64) M =
G + error is written into it, since the average replaces it anyway. Otherwise (matrices
from several buckets, half-precision gradients) M is made afresh in the workspace
(edgc.comm.workspace) each time it is read (for P, for Q, at the end) by one multi-tensor
copy, and the average goes back by another. The workspace holds one part in the working
dtype at a time and is emptied at the step's end; the error feedback is one buffer,
updated in place.

Non-finite gradients. When a unit finishes, a later unit of the same step may still turn
out non-finite, and a host read per bucket would stall a GPU. So a compressed unit's
average and new error feedback are written only at the end of the step, after one host
read of a device flag that says whether every summed P and uncompressed buffer of the step
was finite (M waits in the gradient, or is recomputed from it); only then is each
matrix's error replaced by M - P Q^T, and the new Q kept. Any replica's inf/nan makes a
sum non-finite on every replica, so all replicas leave their error feedback and Q alike.
The average of such a step is non-finite too (an inf or nan in a P sum spreads to its
whole matrix through the orthogonalisation), the same on every replica, and the optimiser
or GradScaler skips it. The collectives are issued on the same lag as ever: only the
arithmetic after the last one waits. The eager mode (edgc.fsdp) must hand each buffer
back averaged before its call returns, before the step's end is known: there a unit
keeps its new error feedback only where every sum of the step so far, its own included,
was finite (a device-side choice, no host read), and Q is kept only for a finite step;
the units of a non-finite step before the one that turned non-finite keep their new
error, the residual of an average the optimiser then skips.

Host reads and blocking. Nothing is read to the host in a bucket's hook call but the
last's. At the last bucket: the end-of-step flag (with the count of all-zero Q matrices
to redraw), and on sampled steps this replica's finiteness, the entropy estimate and the
gradient sample's squared norm.
The values replicas must agree on (entropy, warm-up errors, finiteness, the sample norm
and, at window ends of a policy that reads the learning rate, whether it dropped) travel in a control
all-reduce issued at the last bucket and waited for at the end of the drain: nothing
extra blocks the backward pass. The window norm needs none: it is read from the average,
the same on every replica (edgc.comm.windowgrad), once a window.
On CUDA with NCCL every collective runs on NCCL's stream and `wait` only orders the
current stream after it (gloo, which copies CUDA tensors through the host, blocks); the
hook's arithmetic runs on the current stream, with no side stream and so no events to record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from edgc.comm.collectives import Collectives, Issued
from edgc.comm.compression import CompressionState, Entry
from edgc.comm.control import ENTROPY, add_error_sums, control_values
from edgc.comm.plan import MODES, StepInfo, StepResult
from edgc.comm.timing import Lap, LapSum, start_lap
from edgc.comm.units import (
    PartPlan,
    UnitPlan,
    coarse_units,
    factor_buffers,
    flatten_by_dtype,
    put_matrices,
    scatter,
    slot_wire_bytes,
    strided_batch,
    take_matrices,
    working_dtype,
)
from edgc.comm.wire import WireFormat, wire_format
from edgc.compress import compressible, orthogonalize_
from edgc.entropy import sample_into

__all__ = ["MODES", "StepInfo", "StepResult", "StepSync"]

@dataclass
class _Part:
    """One group's matrices of a unit, in flight."""

    plan: PartPlan
    grads: list[torch.Tensor]  # each matrix's gradient, (m, n) views of the buckets
    batch: torch.Tensor | None  # (B', m, n) the same, one strided view of a bucket where they lie so; else None
    errors: torch.Tensor | None  # (B', m, n) their error feedback: a view of the group's (scattered: a copy)
    in_place: bool  # the gradient is in the working dtype and holds M = G + error until the end
    q_in: torch.Tensor  # (B', n, r) the warm-start Q it projects on
    p: torch.Tensor | None = None  # (B', m, r) working dtype
    p_send: torch.Tensor | None = None  # the same on the wire (a view of the unit's P buffer)
    q: torch.Tensor | None = None  # (B', n, r)
    q_send: torch.Tensor | None = None


@dataclass
class _Round:
    """One unit's round in flight."""

    plan: UnitPlan
    flats: list[tuple[torch.Tensor, list[int]]]  # uncompressed part, one buffer per dtype
    parts: list[_Part] = field(default_factory=list)
    p_flats: list[torch.Tensor] = field(default_factory=list)
    q_flats: list[torch.Tensor] = field(default_factory=list)
    works: list[Issued] = field(default_factory=list)  # the collectives in flight
    call: int = 0  # the hook call that issued them


class StepSync:
    """One step: takes the buckets one by one (`add`), issues the step's collectives in the
    fixed order the module doc describes, and completes each bucket's future with its
    averaged buffer. `finish`, at the last bucket, returns the StepResult.

    A step whose plan is known at its first bucket starts its units as the buckets arrive.
    One that needs every bucket first (the whole-step mode; a job's first step, whose slots
    are assigned from its buckets; r_max calibration and the warm-up check, which read the
    whole local gradient) parks each bucket as it comes and starts at the last, where it
    asks for its plan."""

    def __init__(self, mode: str, compression: CompressionState, collectives: Collectives, config: Any,
                 plan: StepInfo | Callable[[], StepInfo]) -> None:
        """`mode`: "pipelined", "whole-step" or "eager" (every buffer is one unit, averaged
        in its own call; GradientSync.mode); `config`: the EDGCConfig (read only); `plan`:
        the step's plan, or the function that decides it once every bucket has arrived (the
        step parks its buckets until then)."""
        if mode not in MODES:
            raise ValueError(f"unknown sync mode {mode!r}; choose from {MODES}")
        self.mode = mode
        self.compression = compression
        self.collectives = collectives
        self.config = config
        self.wire = wire_format(config.wire)
        self.align = self.wire.alignment  # (a quantized block never spans two tensors)
        self.device = collectives.device
        self.call = 0
        self.buckets: list[tuple[torch.Tensor, Sequence[Entry], torch.futures.Future]] = []
        self.grads: dict[int, torch.Tensor] = {}  # slot -> its gradient, a view of its bucket
        self.owner: dict[int, int] = {}  # slot -> its bucket in this step
        self.left: list[int] = []  # per bucket: slots not yet averaged
        self.layout: list[tuple[int, ...]] = []  # this step's buckets as slots
        self.started = 0  # units[:started] are under way
        self.in_p: list[_Round] = []  # P issued, not finished
        self.in_q: list[_Round] = []  # last collective issued, not completed
        self.step_comm = LapSum()  # this step's time waiting for collectives (the DAC's T(r))
        self.plain_lap: Lap | None = None
        self.bytes_uncompressed = 0
        self.entropy_seconds = 0.0
        self.next_q: dict[int, torch.Tensor] = {}  # group column -> its new Q
        self.ending: list[_Round] = []  # compressed rounds whose average waits for the step's end
        self.ok = torch.ones((), dtype=torch.bool, device=self.device)  # every sum so far finite
        self.watched: list[torch.Tensor] = []  # the largest magnitudes of sums not yet folded into `ok`
        self.local_finite = torch.ones((), dtype=torch.bool, device=self.device)  # this replica's gradient
        # eager: the warm-up check's sums over the local gradient, buffer by buffer
        # (edgc.compress.lowrank_error_sums), and the averaged gradient's sample, taken as
        # each buffer is averaged (the framework may change a buffer once handed back)
        self.error_sums = [0.0, 0.0, 0.0]  # (tails at r_min and r_max, total: lowrank_error_sums)
        self.average: torch.Tensor | None = None
        self.sample: torch.Tensor | None = None
        self.decide: Callable[[], StepInfo] | None = None  # set while the step parks its buckets
        if isinstance(plan, StepInfo):
            self._plan(plan)
        elif mode == "eager":
            raise ValueError("an eager step averages each buffer in its own call: it needs its plan at the start")
        else:
            self.decide = plan

    def _plan(self, info: StepInfo) -> None:
        """Set up what the step's plan decides: its groups, units and samples."""
        compression, config, eager = self.compression, self.config, self.mode == "eager"
        self.info = info
        if not info.compressed:
            self.wire = self.wire.uncompressed  # (int4's at int8: WireFormat.uncompressed)
        self.groups = groups = list(compression.groups.values()) if info.compressed else []
        plan = compression.units if not eager else None  # (eager: each buffer is its own unit)
        whole = self.mode == "whole-step"
        self.units: list[tuple[int, ...]] = [] if (whole or not plan) else list(plan)
        if self.units and (config.min_unit_mb > 0 or config.max_units > 0):  # (see "Coarse units")
            sizes = slot_wire_bytes(compression.slot_shapes, compression.slot_dtypes, groups, self.wire)
            self.units = coarse_units(self.units, sizes, config.min_unit_mb * 1e6, config.max_units)
        self.bucket_units = not whole and not plan  # the buckets are the units
        if info.want_sample or (eager and info.watch_average):
            offsets, dtype = compression.sample_layout(config.gradient_sample_rate)
            self.sample_at = offsets
            if info.want_sample:
                self.sample = torch.empty(offsets[-1], dtype=dtype, device=self.device)
            if eager:
                self.average = torch.empty(offsets[-1], dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ the framework's side

    def add(self, buffer: torch.Tensor, entries: Sequence[Entry], future: torch.futures.Future) -> None:
        """Take the next bucket: park it (a step that waits for its last bucket), or start
        and finish units in the pipelined mode's lag; eager, average it before returning."""
        self.call += 1
        self.buckets.append((buffer, entries, future))
        if self.decide is not None:
            return  # (parked: slots, plan and units at the last bucket, in `finish`)
        slots = self.compression.bucket_views(buffer, entries, self.grads)
        self._arrive(len(self.buckets) - 1, slots, buffer)
        if self.mode == "eager":
            self._drain()
        else:
            self._advance()

    def _unpark(self) -> None:
        """At the last bucket of a parked step: assign the slots (a job's first step; a
        loaded state is checked against them), decide the plan, and take every bucket."""
        assert self.decide is not None
        grads, layout = self.compression.assign_slots(self.buckets)
        self._plan(self.decide())
        self.decide = None
        self.grads = dict(enumerate(grads))
        for b, (slots, (buffer, _, _)) in enumerate(zip(layout, self.buckets, strict=True)):
            self._arrive(b, slots, buffer)
        if self.mode == "whole-step":
            self.units = [tuple(range(len(grads)))]

    def finish(self) -> StepResult:
        """At the last bucket: start what is left, drain every round, agree the control
        values and commit the step; returns what the synchroniser decides from."""
        if self.decide is not None:
            self._unpark()
        compression, info = self.compression, self.info
        if len(self.grads) != len(compression.slot_shapes):
            raise RuntimeError(
                "EDGC saw a step without some parameters' gradients; the hook needs every "
                "parameter in every step (do not use find_unused_parameters with EDGC)")
        grads = [self.grads[s] for s in range(len(compression.slot_shapes))]
        if info.flush:
            compression.flush_error_feedback(grads, info.scale)
        pending = self._control(grads)
        if info.time_plain:
            self.plain_lap = start_lap(self.device)
        self._drain()
        if self.started != len(self.units):
            raise RuntimeError("EDGC: the step's units do not cover its parameters")  # (a corrupt plan)
        if self.plain_lap is not None:
            self.plain_lap.stop()
        control = None
        if pending is not None:
            control, work = pending
            self.collectives.wait([work])
            control[ENTROPY:] /= self.collectives.control_size
        finite = self._commit() if info.compressed else True
        compression.workspace.clear()  # (one part's matrices, allocated again next step)
        return StepResult(info, control, grads, finite, self._sums_finite(), self.step_comm, self.plain_lap,
                          self.average, self.layout if len(self.layout) > 1 else None, self.bytes_uncompressed,
                          self.entropy_seconds)

    def fail(self, exc: BaseException) -> None:
        """Hand `exc` to every bucket future not completed yet (nobody waits forever)."""
        for _, _, fut in self.buckets:
            if not fut.done():
                fut.set_exception(exc)

    # ------------------------------------------------------------------ bookkeeping

    def _arrive(self, b: int, slots: tuple[int, ...], buffer: torch.Tensor) -> None:
        """Bucket b's gradient is here: note it, and sample it before it is averaged."""
        info = self.info
        self.layout.append(slots)
        self.left.append(len(slots))
        for s in slots:
            self.owner[s] = b
        self.bytes_uncompressed += buffer.numel() * buffer.element_size()
        if info.want_sample or info.want_errors:
            self.local_finite &= torch.isfinite(buffer).all()
        if self.sample is not None:
            rate = self.config.gradient_sample_rate
            for s in slots:
                sample_into(self.sample[self.sample_at[s] : self.sample_at[s + 1]], self.grads[s], rate)
        if self.mode == "eager" and info.want_errors:
            self._add_error_sums(slots)
        if self.bucket_units:
            self.units.append(slots)

    def _drain(self) -> None:
        """Start every unit whose slots have arrived and finish every round in flight."""
        self._start_ready()
        for r in self.in_p:
            self._finish_p(r)
        self.in_p = []
        for r in self.in_q:
            self._complete(r)
        self.in_q = []

    def _advance(self) -> None:
        """The fixed lag of the pipelined mode (see the module doc)."""
        self._start_ready()
        due = [r for r in self.in_p if r.call < self.call]
        self.in_p = [r for r in self.in_p if r.call == self.call]
        for r in due:
            self._finish_p(r)  # (into in_q, as issued in this call)
        due = [r for r in self.in_q if r.call < self.call]
        self.in_q = [r for r in self.in_q if r.call == self.call]
        for r in due:
            self._complete(r)

    def _start_ready(self) -> None:
        """Start the units, in order, whose slots have all arrived."""
        while self.started < len(self.units) and all(s in self.grads for s in self.units[self.started]):
            r = self._start(self.units[self.started])
            self.started += 1
            r.call = self.call
            (self.in_p if r.parts else self.in_q).append(r)

    def _done(self, slots: Sequence[int]) -> None:
        """These slots hold their average: complete the futures of buckets now averaged."""
        for s in slots:
            b = self.owner[s]
            self.left[b] -= 1
            if self.left[b] == 0:
                buffer, _, fut = self.buckets[b]
                fut.set_result(buffer)

    # ------------------------------------------------------------------ the rounds

    def _start(self, unit: tuple[int, ...]) -> _Round:
        """M and P of a unit, and its first collectives."""
        plan = self.compression.unit_plan(unit, self.groups, self.device)
        r = _Round(plan, flatten_by_dtype(self.grads, plan.uncompressed, self.align))
        r.parts = [self._part(part) for part in plan.parts]
        if r.parts:
            r.p_flats, works, sends = _factor_buffers(r.parts, 0, self.device, self.wire)
            for part, p, send in zip(r.parts, works, sends, strict=True):
                part.p, part.p_send = p, send
                torch.bmm(self._m(part), part.q_in, out=p)  # P = M Q: (B', m, n) @ (B', n, r)
                if send is not p:
                    send.copy_(p)  # (to the wire dtype)
        # collectives: sum of the unit's uncompressed tensors (numel elements), then of its
        # P ((m*r) per matrix), one buffer per dtype each, in the wire format
        r.works = [self._sum(flat) for flat, _ in r.flats]
        r.works += [self._sum(flat) for flat in r.p_flats]
        return r

    def _part(self, part: PartPlan) -> _Part:
        """A unit's matrices of one group, one batch where they lie at one stride in a bucket;
        in the working dtype, M = G + error is written into the gradient now ("Memory")."""
        g = part.group
        grads = [self.grads[s].view(g.shape) for s in part.slots]
        batch = strided_batch(grads)
        errors = None if g.error is None else take_matrices(g.error, part.index)
        in_place = g.dtype == working_dtype(g.dtype)
        if in_place and errors is not None:  # (the residual is kept unscaled)
            if batch is not None:
                batch.add_(errors, alpha=self.info.scale)
            else:
                torch._foreach_add_(grads, list(errors.unbind(0)), alpha=self.info.scale)
        q_in = take_matrices(g.q, part.index).to(working_dtype(g.dtype))  # (.to: Q kept in bf16, worked in float32)
        return _Part(part, grads, batch, errors, in_place, q_in)

    def _m(self, part: _Part) -> torch.Tensor:
        """M = G + error of a part's matrices (B', m, n), in the working dtype: the gradient
        itself where M was written into it and the matrices form one batch, else gathered
        afresh into the workspace (see "Memory")."""
        if part.in_place and part.batch is not None:
            return part.batch
        b, (rows, cols) = len(part.grads), part.plan.group.shape
        m = self.compression.workspace.take("m", (b, rows, cols), part.q_in.dtype, part.q_in.device)
        if part.batch is not None:
            m.copy_(part.batch)
        else:
            torch._foreach_copy_(list(m.unbind(0)), part.grads)
        if part.errors is not None and not part.in_place:
            m.add_(part.errors, alpha=self.info.scale)
        return m

    def _sum(self, flat: torch.Tensor) -> Issued:
        """Issue the sum of a buffer (factors, or tensors sent whole) in the step's wire format."""
        return self.collectives.sum_in(flat, self.wire)

    def _watch(self, flats: list[torch.Tensor]) -> None:
        """Note summed buffers' largest magnitudes, on the device, for `_sums_finite`."""
        if flats:
            self.watched.extend(torch._foreach_norm(flats, float("inf")))

    def _sums_finite(self) -> torch.Tensor:
        """The device flag: every sum watched so far was finite."""
        if self.watched:
            self.ok = self.ok & torch.stack(self.watched).isfinite().all()
            self.watched = []
        return self.ok

    def _finish_p(self, r: _Round) -> None:
        """Wait for a unit's P; orthogonalise it, project Q and issue Q's all-reduce."""
        self.collectives.wait(r.works, self.step_comm)
        self._watch([*(f for f, _ in r.flats), *r.p_flats])
        for part in r.parts:
            assert part.p is not None and part.p_send is not None  # (set by _start)
            if part.p_send is not part.p:
                part.p.copy_(part.p_send)  # the sum, as it arrived
            orthogonalize_(part.p, self.config.orthogonalization)
        r.q_flats, works, sends = _factor_buffers(r.parts, 1, self.device, self.wire)
        for part, q, send in zip(r.parts, works, sends, strict=True):
            part.q, part.q_send = q, send
            assert part.p is not None
            torch.bmm(self._m(part).mT, part.p, out=q)  # Q = M^T P: (B', n, m) @ (B', m, r)
            if send is not q:
                send.copy_(q)
        # collectives: all-reduce SUM of the unit's Q ((n*r) per matrix), one buffer per dtype
        r.works = [self._sum(flat) for flat in r.q_flats]
        r.call = self.call
        self.in_q.append(r)

    def _complete(self, r: _Round) -> None:
        """Wait for a unit's last collectives; average what it sent whole and keep its new
        Q aside (committed at the end of the step). Its compressed matrices' average and
        error feedback wait for the step's end (see "Non-finite gradients"); eager, they
        are written now."""
        info, world = self.info, self.collectives.world_size
        self.collectives.wait(r.works, self.step_comm)
        if (info.compressed or info.watch_average) and not r.parts:
            self._watch([*(f for f, _ in r.flats), *r.p_flats])
        for part in r.parts:
            assert part.q is not None and part.q_send is not None  # (set by _finish_p)
            if part.q_send is not part.q:
                part.q.copy_(part.q_send)
            if world > 1:
                part.q.div_(world)
            column = part.plan.column
            if column not in self.next_q:
                self.next_q[column] = torch.empty_like(part.plan.group.q)
            put_matrices(self.next_q[column], part.plan.index, part.q)
        if r.flats:
            flats = [f for f, _ in r.flats]
            if world > 1:
                torch._foreach_div_(flats, world)
            scatter(flats, [[self.grads[s] for s in slots] for _, slots in r.flats], self.align)
        if r.parts and self.mode != "eager":
            self.ending.append(r)
        else:  # (eager: kept where every sum so far was finite, decided on the device)
            self._end(r, self._sums_finite() if r.parts else True)

    def _end(self, r: _Round, keep: bool | torch.Tensor) -> None:
        """A unit's compressed matrices: the new error feedback M - P Q^T where `keep` (a
        host bool, or eager a device flag), and the average P Q^T into the gradient; then
        hand back the buckets it completes."""
        for part in r.parts:
            p, q = part.p, part.q
            assert p is not None and q is not None
            m = self._m(part)  # (B', m, n): the gradient itself, or the workspace's
            errors = part.errors
            if errors is not None and keep is not False:
                view = isinstance(part.plan.index, slice)  # (errors is the group's own buffer, not a copy)
                if keep is True and errors.dtype == m.dtype and view and self.info.scale == 1.0:
                    torch.baddbmm(m, p, q.mT, alpha=-1, out=errors)  # error = M - P Q^T
                else:  # (M is the gradient's or the workspace's, and not read again)
                    m.baddbmm_(p, q.mT, alpha=-1)
                    if self.info.scale != 1.0:
                        m.div_(self.info.scale)
                    if keep is not True:
                        torch.where(keep, m, errors, out=m)
                    assert part.plan.group.error is not None  # (errors is part of it)
                    put_matrices(part.plan.group.error, part.plan.index, m)
            # the average P Q^T: (B', m, r) @ (B', r, n), into the gradient
            if part.in_place and part.batch is not None:
                torch.bmm(p, q.mT, out=part.batch)
            else:
                torch.bmm(p, q.mT, out=m)
                if part.batch is not None:
                    part.batch.copy_(m)
                else:
                    torch._foreach_copy_(part.grads, list(m.unbind(0)))
        if self.average is not None:
            rate = self.config.gradient_sample_rate
            for s in r.plan.slots:
                sample_into(self.average[self.sample_at[s] : self.sample_at[s + 1]], self.grads[s], rate)
        self._done(r.plan.slots)

    # ------------------------------------------------------------------ the step's end

    def _control(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, Issued] | None:
        """Measure this replica's control values (edgc.comm.control), as the step wants,
        and issue their all-reduce (waited for in the drain); None on steps that need none."""
        if not self.info.want_control:
            return None
        lap = start_lap(self.device)
        control = control_values(self.info, self.config, local_finite=bool(self.local_finite), sample=self.sample,
                                 error_sums=self.error_sums if self.mode == "eager" else None, grads=grads,
                                 slot_shapes=self.compression.slot_shapes)
        self.entropy_seconds += float(lap.stop())
        # collective: all-reduce SUM of CONTROL_LEN = 7 float64 values (56 bytes), issued at the
        # last bucket (pipelined: after every unit's P) and waited for at the end of the step
        return control, self.collectives.all_reduce(control, async_op=True, device_copy=self.device, control=True)

    def _add_error_sums(self, slots: Sequence[int]) -> None:
        """Eager warm-up check: add a buffer's compressible matrices, before they are
        averaged, to the step's error sums."""
        mats = [self.grads[s] for s in slots if s not in self.compression.uncounted
                and compressible(self.compression.slot_shapes[s], self.info.error_ranks[1],
                                self.config.min_compression_rate)]
        self.error_sums = add_error_sums(self.error_sums, mats, self.info, self.config)

    def _commit(self) -> bool:
        """Write the compressed rounds' averages, and keep the step's new error feedback
        and Q if every sum was finite; returns whether it was. One host read: that flag
        and which Q matrices are all zero."""
        dead = [torch.linalg.vector_norm(self.next_q[c], float("inf"), dim=(1, 2)) == 0
                for c in range(len(self.groups))]  # (B,) per group
        flags = torch.cat([self._sums_finite().reshape(1), *dead]).tolist()
        for r in self.ending:
            self._end(r, bool(flags[0]))
        self.ending = []
        if not flags[0]:
            return False
        counts, at = [], 1
        for d in dead:
            counts.append(sum(flags[at : at + len(d)]))
            at += len(d)
        self.compression.commit(self.next_q, dead, counts)
        return True


def _factor_buffers(parts: list[_Part], side: int, device: torch.device | None, wire: WireFormat
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The buffers of P (`side` 0: m rows a matrix) or Q (1: n rows) of every part
    (edgc.comm.units.factor_buffers)."""
    shapes = [(len(p.grads), p.plan.group.shape[side], p.q_in.shape[-1]) for p in parts]
    return factor_buffers([p.plan.group for p in parts], shapes, device, wire)

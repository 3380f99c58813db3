"""CompressionState: what low-rank compression keeps between steps on one replica.

Slots. Tensors are numbered by "slot": their order of first appearance in the first
synchronised step (buffer order, then order within the buffer), or the order an eager
adapter declares them in. A fresh DDP always builds the same first-step buckets for the
same model, and an adapter declares the same model alike, so slots are stable across a
checkpoint and resume.

Groups. Once compression starts, the compressible matrices are grouped by shape and
dtype (edgc.comm.units.Group), each group with its warm-start Q, replica-identical, and
its error feedback, this replica's own. A group's rank is the policy's, or for long
matrices (the token embedding) EDGCConfig.long_rank_factor times it (`group_rank`). What
EDGCConfig.state_dtype keeps them in (`error_dtype`, `q_dtype`): "native", the error
feedback in the gradient's dtype (bf16 for fp16 gradients, whose range an unscaled residual
can leave) and Q in the working dtype (float32 for half-precision gradients); "float32",
both in the working dtype; "bf16", both in bf16. The step always works in the working
dtype, and rounds the new values as it keeps them. The error feedback is one buffer,
updated in place at the end of a finite step (edgc.comm.step, "Non-finite gradients"); the
step's temporaries (one unit's matrices of one shape) live in a `Workspace` (edgc.comm.workspace), emptied at the
step's end. The generator that draws Q is seeded alike on every replica.

The plan. `units` is DDP's bucket layout of the last step that had several buckets, as
slots (edgc.comm.step, "The plan"); kept in checkpoints so that a resumed job cuts its
first step as the uninterrupted run did.

Nothing here issues a collective.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

import torch

from edgc.comm.units import Group, UnitPlan, unit_plan, working_dtype
from edgc.comm.workspace import Workspace
from edgc.compress import compressible, draw_q, matrix_rank, resize_q
from edgc.entropy import sample_offsets

__all__ = ["CompressionState", "Entry"]

#: One tensor of a flat buffer handed to GradientSync.receive: a key that names it in every
#: step (DDP: id(param); FSDP: (module, parameter)) and its shape; entries lie in the buffer
#: one after the other, in the order given.
Entry = tuple[Hashable, tuple[int, ...]]


class CompressionState:
    """Slots, groups (Q and error feedback), the generator and the plan of units."""

    def __init__(self, seed: int, state_dtype: str = "native", long_rank_factor: float = 1.0,
                 rank_multiple: int = 1) -> None:
        """`state_dtype`: EDGCConfig.state_dtype, the dtype Q and the error feedback are kept in;
        `long_rank_factor` and `rank_multiple`: EDGCConfig's, which set each group's rank
        from the policy's (edgc.compress.matrix_rank)."""
        self.generator = torch.Generator().manual_seed(seed)
        self.state_dtype = state_dtype
        self.long_rank_factor = long_rank_factor
        self.rank_multiple = rank_multiple
        self.groups: dict[tuple[int, int, str], Group] = {}  # by (m, n, dtype)
        self.uncompressed_slots: list[int] = []
        self.slot_shapes: list[tuple[int, ...]] = []
        self.slot_dtypes: list[torch.dtype] = []  # (this process's; from its first step)
        self._slot_of: dict[Hashable, int] = {}  # an entry's key (DDP: id(param)) -> slot
        self.uncounted: set[int] = set()  # slots left out of the signals: another process counts them (TP copies)
        self.uncounted_keys: frozenset[Hashable] = frozenset()  # the keys of such tensors, for slots still to come
        self.units: list[tuple[int, ...]] | None = None  # the plan; None: none yet
        self._unit_plans: dict[tuple[bool, tuple[int, ...]], UnitPlan] = {}
        self._sample_at: tuple[float, list[int], torch.dtype] | None = None
        self.residual_pending = False  # the error feedback may hold a residual not yet sent
        self.workspace = Workspace()  # a step's large temporaries, reused across units and steps
        # a loaded state, until the tensors are seen: the shapes to check and the groups to restore
        self.expected_shapes: list[tuple[int, ...]] | None = None
        self.pending_groups: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ slots

    @property
    def declared(self) -> bool:
        """Whether any tensor has its slot."""
        return bool(self._slot_of)

    def slot_of(self, key: Hashable) -> int:
        """The slot of a declared or assigned parameter's key."""
        return self._slot_of[key]

    def compressed_slots(self) -> set[int]:
        """The slots a compressed step compresses (every group's); the rest go whole."""
        return {s for g in self.groups.values() for s in g.slots}

    def _new_slot(self, key: Hashable, shape: tuple[int, ...]) -> int:
        """The slot of `key`, given the next free one if it has none."""
        if key not in self._slot_of:
            self._slot_of[key] = len(self.slot_shapes)
            self.slot_shapes.append(tuple(shape))
            if key in self.uncounted_keys:
                self.uncounted.add(self._slot_of[key])
        return self._slot_of[key]

    def declare(self, layout: Sequence[Sequence[Entry]], dtypes: Sequence[torch.dtype],
                uncounted: Collection[Hashable] = ()) -> None:
        """Give every tensor its slot before the first step, buffer by buffer (eager
        adapters); `dtypes`, one per buffer; `uncounted`, the keys of tensors this process
        holds as a copy that another process counts (a tensor parallelism leaves whole on
        every TP rank): they are synchronised as any other, but left out of the signals
        (the GDS sample and the warm-up check), so that the group's mean counts them once.
        Raises ValueError on a mismatch with a loaded state, RuntimeError once slots are
        assigned."""
        if self._slot_of:
            raise RuntimeError("this EDGC state's tensors were declared or seen already")
        if len(dtypes) != len(layout):
            raise ValueError(f"declare: {len(layout)} buffers but {len(dtypes)} dtypes")
        self.uncounted_keys = frozenset(uncounted)
        for entries, dtype in zip(layout, dtypes, strict=True):
            for key, shape in entries:
                self._new_slot(key, shape)
                self.slot_dtypes.append(dtype)
        self.check_expected_shapes()

    def check_expected_shapes(self) -> None:
        """Raise ValueError where a loaded state was saved for other tensors."""
        if self.expected_shapes is not None and self.expected_shapes != self.slot_shapes:
            raise ValueError(
                "EDGC checkpoint does not match this model: it holds "
                f"{len(self.expected_shapes)} parameters, the model has {len(self.slot_shapes)}; "
                f"first difference at {_first_difference(self.expected_shapes, self.slot_shapes)}"
            )

    def assign_slots(self, pending: Sequence[tuple[torch.Tensor, Sequence[Entry], Any]]
                     ) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
        """Gradient views in slot order, and each buffer's slots; new tensors get the next
        free slots, and a loaded state is checked and its groups restored."""
        views: dict[int, torch.Tensor] = {}
        layout = []
        for buffer, entries, _ in pending:
            offset, slots = 0, []
            for key, shape in entries:
                s = self._new_slot(key, shape)
                numel = math.prod(shape)
                views[s] = buffer[offset : offset + numel].view(shape)
                slots.append(s)
                offset += numel
            layout.append(tuple(slots))
        if self.expected_shapes is not None:
            self.check_expected_shapes()
            self.expected_shapes = None
            self.restore_groups({s: v.device for s, v in views.items()}, {s: v.dtype for s, v in views.items()})
        if len(views) != len(self.slot_shapes):
            raise RuntimeError(
                "EDGC saw a step without some parameters' gradients; the hook needs every "
                "parameter in every step (do not use find_unused_parameters with EDGC)"
            )
        grads = [views[s] for s in range(len(self.slot_shapes))]
        self.slot_dtypes = [g.dtype for g in grads]
        return grads, layout

    def bucket_views(self, buffer: torch.Tensor, entries: Sequence[Entry],
                     views: dict[int, torch.Tensor]) -> tuple[int, ...]:
        """A buffer of a step whose slots are known: its gradients' views into `views`;
        returns its slots."""
        slots, offset = [], 0
        for key, shape in entries:
            s = self._slot_of.get(key)
            if s is None or tuple(shape) != self.slot_shapes[s]:
                raise RuntimeError("EDGC was handed a parameter that its first step did not have; the hook "
                                   "needs the same parameters in every step")
            if s in views:
                raise RuntimeError(f"EDGC was handed parameter slot {s} twice in one step (a step whose "
                                   "last buffer never came: every parameter needs a gradient in every step)")
            numel = math.prod(shape)
            views[s] = buffer[offset : offset + numel].view(shape)
            offset += numel
            slots.append(s)
        return tuple(slots)

    def sample_layout(self, rate: float) -> tuple[list[int], torch.dtype]:
        """Where each slot's sample lies in a step's sample buffer (gradient_sample_rate
        `rate`, slots in order; an uncounted slot's is empty), and the buffer's dtype."""
        if self._sample_at is None or self._sample_at[0] != rate:
            dtype = torch.float64 if torch.float64 in self.slot_dtypes else torch.float32
            numels = [0 if s in self.uncounted else math.prod(shape) for s, shape in enumerate(self.slot_shapes)]
            self._sample_at = (rate, sample_offsets(numels, rate), dtype)
        return self._sample_at[1], self._sample_at[2]

    @property
    def nbytes(self) -> int:
        """The bytes the state holds: every group's Q and error feedback, each storage
        counted once, and the workspace (empty between steps)."""
        storages: dict[int, int] = {}
        for g in self.groups.values():
            for t in (g.q, g.error):
                if t is not None:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values()) + self.workspace.nbytes

    def unit_plan(self, unit: tuple[int, ...], groups: list[Group], device: torch.device | None) -> UnitPlan:
        """The cached UnitPlan of a unit (per set of groups: [] for an uncompressed step)."""
        key = (bool(groups), unit)
        plan = self._unit_plans.get(key)
        if plan is None:
            plan = self._unit_plans[key] = unit_plan(unit, groups, device)
        return plan

    # ------------------------------------------------------------------ groups

    def start(self, grads: Sequence[torch.Tensor], r_max: int, rank: int, min_compression_rate: float,
              error_feedback: bool) -> list[tuple[int, int]]:
        """Compression starts at `rank`: fix which slots compress (at r_max), build their
        groups with a fresh Q and zero error feedback. Returns each compressed matrix's
        (m, n), group by group."""
        members: dict[tuple[int, int, torch.dtype], list[int]] = {}
        self.uncompressed_slots = []
        for s, shape in enumerate(self.slot_shapes):
            if compressible(shape, r_max, min_compression_rate):
                mat = (int(shape[0]), int(math.prod(shape[1:])))
                members.setdefault((*mat, grads[s].dtype), []).append(s)
            else:
                self.uncompressed_slots.append(s)
        device = grads[0].device
        self.groups = {}
        self._unit_plans = {}
        for m, n, dtype in sorted(members, key=lambda k: (k[0], k[1], str(k[2]))):
            slots = members[(m, n, dtype)]
            q = draw_q(len(slots), n, self.group_rank((m, n), rank), self.generator, dtype=self.q_dtype(dtype),
                       device=device)
            error = (torch.zeros((len(slots), m, n), dtype=self.error_dtype(dtype), device=device)
                     if error_feedback else None)
            group = Group((m, n), slots, q, error, dtype)
            self.groups[group.key] = group
        return self.matrix_shapes()

    def q_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the warm-start Q of gradients in `dtype` is kept in."""
        return torch.bfloat16 if self.state_dtype == "bf16" else working_dtype(dtype)

    def error_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the error feedback of gradients in `dtype` is kept in: "native" the
        gradient's own (bf16 for fp16: a residual kept unscaled can leave fp16's range),
        "float32" the working dtype, "bf16" bf16."""
        if self.state_dtype == "bf16" or (self.state_dtype == "native" and dtype == torch.float16):
            return torch.bfloat16
        return dtype if self.state_dtype == "native" else working_dtype(dtype)

    def matrix_shapes(self) -> list[tuple[int, int]]:
        """The (m, n) of every compressed matrix, group by group."""
        return [g.shape for g in self.groups.values() for _ in g.slots]

    def restore_groups(self, devices: Mapping[int, torch.device], dtypes: Mapping[int, torch.dtype]) -> None:
        """The loaded state's groups, on the gradients' device and in the dtypes this
        state keeps (`devices` and `dtypes` by slot: the gradients')."""
        for g in self.pending_groups or []:
            device, dtype = devices[g["slots"][0]], dtypes[g["slots"][0]]
            shape = (int(g["shape"][0]), int(g["shape"][1]))
            error = None if g["error"] is None else g["error"].to(device=device, dtype=self.error_dtype(dtype))
            q = g["q"].to(device=device, dtype=self.q_dtype(dtype))
            group = Group(shape, list(g["slots"]), q, error, dtype)
            self.groups[group.key] = group
        self.pending_groups = None
        self._unit_plans = {}

    def group_rank(self, shape: tuple[int, int], rank: int) -> int:
        """The rank a group of (m, n) matrices compresses at under the policy's `rank`: a long
        matrix's is long_rank_factor times it; each capped by the matrix (edgc.compress.matrix_rank)."""
        return matrix_rank(shape, rank, self.long_rank_factor, self.rank_multiple)

    def set_rank(self, rank: int) -> None:
        """Resize every group's Q to its rank under the policy's `rank` (`group_rank`),
        keeping the warm start."""
        for g in self.groups.values():
            r = self.group_rank(g.shape, rank)
            g.q = resize_q(g.q, r, self.generator)

    def redraw_q(self) -> None:
        """A fresh random Q for every group (EDGCConfig.warm_start off)."""
        for g in self.groups.values():
            g.q = draw_q(len(g.slots), g.shape[1], g.q.shape[-1], self.generator, dtype=g.q.dtype, device=g.q.device)

    def flush_error_feedback(self, grads: list[torch.Tensor], scale: float) -> None:
        """Entering an uncompressed window in the compress phase: add the residual the error
        feedback holds to this step's gradient (so it is sent, not lost) and zero it.
        Skipped while the gradient is non-finite, which would lose the residual with the
        skipped step."""
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            return
        self.residual_pending = False
        for g in self.groups.values():
            if g.error is None:
                continue
            for i, s in enumerate(g.slots):
                grads[s].add_(g.error[i].view(grads[s].shape), alpha=scale)
            g.error.zero_()

    def commit(self, next_q: Mapping[int, torch.Tensor], dead: Sequence[torch.Tensor],
               dead_counts: Sequence[int]) -> None:
        """Keep a finite compressed step's new Q by group column (its error feedback was
        updated in place), and redraw the all-zero Q matrices (`dead`, (B,) masks,
        `dead_counts` of them), which would stay zero forever. Q is replica-identical after
        its all-reduce, so every replica redraws the same ones."""
        for c, g in enumerate(self.groups.values()):
            g.q = next_q[c]
            if dead_counts[c]:
                g.q[dead[c]] = draw_q(dead_counts[c], g.q.shape[1], g.q.shape[2], self.generator, dtype=g.q.dtype,
                                      device=g.q.device)
        self.residual_pending = True

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """Slots, groups (as CPU tensors), the plan and the generator. `copy` False: the
        CPU tensors are the live ones, not copies, for a caller that serialises the dict
        at once (edgc.fsdp): the next step overwrites them (the error is updated in place)."""
        def cpu(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().cpu()
            return t.clone() if copy else t

        return {
            "slot_shapes": [list(s) for s in self.slot_shapes],
            "uncompressed_slots": list(self.uncompressed_slots),
            "units": None if self.units is None else [list(u) for u in self.units],
            "groups": [
                {
                    "shape": list(g.shape),
                    "dtype": str(g.dtype).removeprefix("torch."),
                    "slots": list(g.slots),
                    "q": cpu(g.q),
                    "error": None if g.error is None else cpu(g.error),
                }
                for g in self.groups.values()
            ],
            "generator": self.generator.get_state(),
            "residual_pending": self.residual_pending,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore from `state_dict`; the groups come back when the tensors are seen (their
        device and dtype): at `declare` and the first step (eager) or `assign_slots`."""
        self.expected_shapes = [tuple(s) for s in d["slot_shapes"]]
        if self._slot_of:
            self.check_expected_shapes()  # (declared already: say it now, not at the first step)
        self.uncompressed_slots = list(d["uncompressed_slots"])
        self.units = _checked_units(d["units"], len(self.expected_shapes))
        self.pending_groups = d["groups"]
        self.generator.set_state(d["generator"])
        self.residual_pending = bool(d["residual_pending"])

    def restore_declared(self, device: torch.device) -> None:
        """Eager adapters, at the first step: the loaded groups on `device`, in the dtype
        each was saved with (the slots were declared, and checked, already)."""
        if self.expected_shapes is None:
            return
        self.expected_shapes = None
        dtypes = {g["slots"][0]: _saved_dtype(g) for g in self.pending_groups or []}
        self.restore_groups(collections.defaultdict(lambda: device), dtypes)


def _checked_units(units: Any, n_slots: int) -> list[tuple[int, ...]] | None:
    """A state dict's "units" as tuples; raises ValueError unless they cut the slots
    0 .. n_slots-1 into disjoint, non-empty sets (a torn or hand-edited state)."""
    if units is None:
        return None
    out = [tuple(int(s) for s in u) for u in units]
    flat = sorted(s for u in out for s in u)
    if any(not u for u in out) or flat != list(range(n_slots)):
        raise ValueError(f"EDGC state dict: 'units' must cut the {n_slots} parameter slots into disjoint "
                         "non-empty sets, as state_dict() writes them")
    return out


def _saved_dtype(group: dict[str, Any]) -> torch.dtype:
    """The gradient dtype a state dict's group was saved with ("float32", "bfloat16", ...)."""
    dtype = getattr(torch, str(group["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"EDGC state dict: a group's dtype {group['dtype']!r} is not a torch dtype")
    return dtype


def _first_difference(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # (the lengths may differ)
        if x != y:
            return f"parameter {i}: checkpoint {x} vs model {y}"
    return f"parameter {min(len(a), len(b))}: present in only one of them"

"""The units a step is synchronised in, and the groups of compressed matrices they hold.

A `Group` is the compressed matrices of one shape and dtype, batched into one bmm, with
their warm-start Q and error feedback. A unit is a set of parameter slots; its
`UnitPlan` says which of its tensors travel whole and which group's matrices it
compresses. `coarse_units` merges units (EDGCConfig.max_units, min_unit_mb), and
`flatten_by_dtype` and `scatter` pack tensors into the flat buffers that travel and back.
`strided_batch` views a unit's matrices of one shape where they lie in a bucket, as one
batch; `take_matrices` and `put_matrices` read and write a unit's share of a group's Q and
error feedback.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from edgc.comm.wire import WireFormat, wire_format, working_dtype

__all__ = ["Group", "UnitPlan", "coarse_units", "dtype_order", "factor_buffers", "flatten_by_dtype", "scatter",
           "put_matrices", "slot_wire_bytes", "strided_batch", "take_matrices", "unit_plan", "working_dtype"]



@dataclass
class Group:
    """The compressed matrices of one shape and dtype, batched into one bmm."""

    shape: tuple[int, int]  # (m, n)
    slots: list[int]  # parameter slots, in slot order
    q: torch.Tensor  # (B, n, r) warm-start Q, replica-identical (CompressionState.q_dtype)
    error: torch.Tensor | None  # (B, m, n) error feedback, this replica's own (CompressionState.error_dtype)
    dtype: torch.dtype = torch.float32  # the gradients' dtype: what travels on the wire

    @property
    def key(self) -> tuple[int, int, str]:
        return (*self.shape, str(self.dtype))


def dtype_order(dtypes: Any) -> list[torch.dtype]:
    """Distinct dtypes in a fixed order (by name), so every replica issues alike."""
    return sorted(set(dtypes), key=str)


def flatten_by_dtype(tensors: Any, order: Sequence[int], align: int = 1) -> list[tuple[torch.Tensor, list[int]]]:
    """The tensors at positions `order` (of a list, or keys of a dict), flattened into one
    buffer per dtype (dtypes in a fixed order); returns (flat buffer, positions it holds)
    pairs. The buffers are copies. `align` > 1: each tensor starts at a multiple of `align`
    elements, the gaps zero (a quantized wire's blocks then never hold two tensors)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in order:
        by_dtype.setdefault(tensors[i].dtype, []).append(i)
    flats = []
    for d in dtype_order(by_dtype):
        pieces = []
        for i in by_dtype[d]:
            t = tensors[i].reshape(-1)
            pad = -t.numel() % align
            pieces.append(t if pad == 0 else torch.nn.functional.pad(t, (0, pad)))
        flats.append((torch.cat(pieces), by_dtype[d]))
    return flats


def scatter(flats: Sequence[torch.Tensor], outs: Sequence[Sequence[torch.Tensor]], align: int = 1) -> None:
    """Copy consecutive pieces of each buffer of `flats` into its tensors in `outs` (each
    piece starting at a multiple of `align` elements, as flatten_by_dtype lays them out),
    all in one multi-tensor copy."""
    dst, src = [], []
    for flat, ts in zip(flats, outs, strict=True):
        offset = 0
        for t in ts:
            n = t.numel()
            dst.append(t)
            src.append(flat[offset : offset + n].view(t.shape))
            offset += n + (-n % align)
    if dst:
        torch._foreach_copy_(dst, src)


def slot_wire_bytes(slot_shapes: Sequence[tuple[int, ...]], slot_dtypes: Sequence[torch.dtype],
                    groups: Sequence[Group], wire: str | WireFormat = "native") -> list[int]:
    """The bytes each slot puts on the wire in one step: (m + n) * r elements (its share
    of P and Q, each column padded to a block in a quantized format: `column_length`)
    for a matrix of `groups`, r being its group's q.shape[-1], in wire format `wire`
    (edgc.comm.wire.wire_bytes), and numel elements in that format for any other slot
    (sent whole). `groups` empty: a step sent uncompressed."""
    fmt = wire_format(wire)
    sizes = [fmt.bytes(math.prod(shape), dtype.itemsize) for shape, dtype in zip(slot_shapes, slot_dtypes, strict=True)]
    for g in groups:
        for s in g.slots:
            rows = sum(fmt.column_length(k) for k in g.shape)
            sizes[s] = fmt.bytes(rows * g.q.shape[-1], g.dtype.itemsize)
    return sizes


def coarse_units(units: Sequence[tuple[int, ...]], sizes: Sequence[int], min_bytes: float,
                 max_units: int = 0) -> list[tuple[int, ...]]:
    """`units` with consecutive ones merged, in order, until each merged unit's slots hold
    at least `min_bytes` of `sizes` (bytes per slot), and with `max_units` > 0 at least
    1/max_units of all of them, so that there are at most max_units; a remainder below it
    at the end joins the unit before it, or is the only unit when there is none. min_bytes
    and max_units 0 give `units` unchanged. Changes nothing."""
    if max_units > 0:
        min_bytes = max(min_bytes, sum(sizes[s] for unit in units for s in unit) / max_units)
    out: list[tuple[int, ...]] = []
    run: tuple[int, ...] = ()
    held = 0
    for unit in units:
        run += tuple(unit)
        held += sum(sizes[s] for s in unit)
        if held >= min_bytes:
            out.append(run)
            run, held = (), 0
    if run and out:
        out[-1] += run
    elif run:
        out.append(run)
    return out


@dataclass
class PartPlan:
    """The matrices of one group that a unit holds."""

    group: Group
    column: int  # the group's position among the compression state's groups
    index: slice | torch.Tensor  # their positions in the group: a slice when consecutive
    slots: list[int]  # their slots, in group order
    positions: list[int]  # their positions in the group, as numbers


@dataclass
class UnitPlan:
    """What a unit sends whole and what it compresses; cached per unit by the compression state."""

    slots: tuple[int, ...]  # in slot order
    uncompressed: list[int]  # slots sent whole, in slot order
    parts: list[PartPlan]  # compressed matrices, by group in group order


def unit_plan(slots: Sequence[int], groups: list[Group] | None, device: torch.device | None) -> UnitPlan:
    """The UnitPlan of the unit `slots`; `groups` None: a step sent uncompressed."""
    ordered = tuple(sorted(slots))
    if not groups:
        return UnitPlan(ordered, list(ordered), [])
    where = {s: (c, pos) for c, g in enumerate(groups) for pos, s in enumerate(g.slots)}
    positions: dict[int, list[int]] = {}
    for s in ordered:
        if s in where:
            c, at = where[s]
            positions.setdefault(c, []).append(at)
    parts = []
    for c in sorted(positions):
        pos = positions[c]  # ascending, as slots and g.slots are
        consecutive = pos == list(range(pos[0], pos[-1] + 1))
        index = slice(pos[0], pos[-1] + 1) if consecutive else torch.tensor(pos, dtype=torch.long, device=device)
        parts.append(PartPlan(groups[c], c, index, [groups[c].slots[p] for p in pos], pos))
    return UnitPlan(ordered, [s for s in ordered if s not in where], parts)


def factor_buffers(groups: Sequence[Group], shapes: Sequence[tuple[int, int, int]], device: torch.device | None,
                   wire: str | WireFormat) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Flat buffers to send (one per dtype, in dtype order) for one factor of the
    matrices of several groups, `shapes[i]` = (matrices, rows, rank) of group i's share,
    in wire format `wire`; returns (flats, working views, views to send), one view per group.

    The buffers are in the dtype that travels ("native": the gradient's; "bf16"), or in
    the working dtype for a quantized format, which quantizes as it sends. Where a group
    works in that dtype, its working view is its view to send (no copy). A quantized
    format's buffer holds each matrix column by column, each column starting a block of
    its own (a column of `rows` elements takes `column_length(rows, wire)` of the buffer,
    zeros after it), so that a block of consecutive elements, which shares one scale,
    lies in one column: a factor's columns differ in size by as much as the singular
    values they follow, and a block across them would round the small ones away.
    """
    fmt = wire_format(wire)
    quantized = fmt.quantized
    kinds = [fmt.send_dtype(g.dtype) for g in groups]
    flats, sent = [], {}  # sent: group's position -> its view to send
    for dtype in dtype_order(kinds):
        members = [i for i, k in enumerate(kinds) if k == dtype]
        columns = [fmt.column_length(shapes[i][1]) for i in members]
        sizes = [shapes[i][0] * shapes[i][2] * c for i, c in zip(members, columns, strict=True)]
        padded = any(c != shapes[i][1] for i, c in zip(members, columns, strict=True))
        # (the padding after a column is zeros, never written: it sums to zero)
        flat = (torch.zeros if padded else torch.empty)(sum(sizes), dtype=dtype, device=device)
        for i, c, view in zip(members, columns, flat.split(sizes), strict=True):
            b, rows, r = shapes[i]
            sent[i] = view.view(b, r, c)[:, :, :rows].transpose(1, 2) if quantized else view.view(shapes[i])
        flats.append(flat)
    sends = [sent[i] for i in range(len(groups))]
    works = [send if working_dtype(g.dtype) == send.dtype
             else torch.empty(send.shape, dtype=working_dtype(g.dtype), device=device)
             for g, send in zip(groups, sends, strict=True)]
    return flats, works, sends


def strided_batch(mats: list[torch.Tensor]) -> torch.Tensor | None:
    """The matrices `mats` (each (m, n), contiguous) as one (B, m, n) view, where they lie in
    one buffer at one stride (a bucket's matrices of one shape, one per layer, do); else None."""
    first = mats[0]
    if len(mats) == 1:
        return first.unsqueeze(0)
    storage, size = first.untyped_storage().data_ptr(), first.element_size()
    starts = [t.data_ptr() for t in mats]
    stride = starts[1] - starts[0]
    if (stride <= 0 or stride % size or any(t.untyped_storage().data_ptr() != storage for t in mats)
            or any(b - a != stride for a, b in zip(starts, starts[1:], strict=False))
            or stride // size < first.numel()):
        return None
    m, n = first.shape
    return first.as_strided((len(mats), m, n), (stride // size, n, 1))


def take_matrices(t: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    """t[index] along the group's matrices: a view for a slice, a copy for an index tensor."""
    return t[index] if isinstance(index, slice) else t.index_select(0, index)


def put_matrices(into: torch.Tensor, index: slice | torch.Tensor, values: torch.Tensor) -> None:
    """into[index] = values, in `into`'s dtype (bf16 state: rounded here)."""
    if isinstance(index, slice):
        into[index] = values
    else:
        into.index_copy_(0, index, values.to(into.dtype))

"""The wire format of what a step sums (EDGCConfig.wire), and the quantized sum.

Formats:
- "native": buffers travel in the gradient's own dtype (float32 gradients: 4 bytes an
  element; bf16 or fp16 gradients: 2), summed by one all-reduce.
- "bf16": buffers are rounded to bfloat16 and summed by one all-reduce (2 bytes).
- "int8", "fp8": buffers are quantized to one byte an element, in blocks of
  `BLOCK` (32) consecutive elements with one bfloat16 scale each (absmax / 127 for
  int8's round-to-nearest codes, absmax / 448 for float8 e4m3's, rounded up to the next
  bfloat16 so that no code exceeds its limit), and summed as quantized all-reduces are
  built, in two collectives:

      reduce-scatter  each replica quantizes its whole buffer and sends chunk j of it to
                      replica j (all-to-all); replica j dequantizes the W pieces of its
                      chunk and sums them in the working dtype (no overflow: nothing is
                      added in one byte)
      all-gather      replica j quantizes its summed chunk once more and every replica
                      gathers every chunk, then dequantizes them

  Each replica's chunk is a whole number of blocks (the buffer is padded with zeros to
  `world` of them), so the blocks of every chunk are the buffer's own.

  With 2 replicas the sum takes one collective instead: each replica's quantized buffer
  goes to the other by an all-gather, and both add the two in replica order
  (`GatheredSum`). The same bytes (each replica hands over its buffer once), one round
  trip, one rounding.

  With more, each element is rounded twice, once as a replica's own value and once as the
  sum, and never summed while rounded. Every replica dequantizes the same gathered bytes,
  so the sum is bit-identical on all of them. The wire then carries (1 + 2 / BLOCK) bytes an
  element in a ring's pattern, (W - 1) / W of the buffer each way, as an all-reduce of a
  buffer of that many bytes would.
- "int4": the same blocks and sums with 4-bit codes, two to a byte (round-to-nearest in
  [-7, 7], absmax / 7 scales): (1/2 + 2 / BLOCK) bytes an element. A code step is 1/7 of
  its block's largest magnitude, 18 times int8's, so what a tensor sent whole loses to it
  is no longer small. An uncompressed step (the warm-up's) travels at int8 instead
  (edgc.comm.step); in a compressed step the tensors sent whole go at 4 bits with no
  error feedback in the core (below), which edgc-diloco keeps itself (edgc.diloco).

`WireFormat` is a format as an object: its alignment and byte counts, the dtype of its
factor buffers, and `start_sum`, which issues a sum's first collective and returns it as a
`WireSum` whose `advance` runs each later stage (a quantized sum's all-gather and unpacking)
once the collective before it is waited for (edgc.comm.collectives.Collectives.wait).

Everything a step sums over the replicas travels in the format: the factors, and the
tensors sent whole (biases, norms, any matrix too small to compress, and every tensor of
an uncompressed step such as the warm-up's), which a quantized format lays out so that
each one starts a block of its own. Only the control values (a few float64) never change.

A factor travels column by column, each column starting a block of its own (zeros after
a column whose length is not a multiple of BLOCK: `column_length`), so that a block never
holds the end of a large column and the start of a small one.

For the factors, the error feedback absorbs what the rounding loses: it is M minus the
reconstruction from the factors as they arrived, summed and dequantized (edgc.comm.step),
so what was sent plus what is kept equals the input, in any format. A tensor sent whole
keeps no error feedback in the core: its rounding, at most half a code step (1/254 of its
block's largest magnitude for int8, 1/14 for int4; twice with more than 2 replicas), is
lost, as in quantized all-reduces of gradients.

A sum that is inf or nan stays so: a block holding one has a non-finite scale, which makes
every element of the block non-finite when dequantized, on every replica, so the step's
finiteness check sees it as it would see a full-precision sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from edgc.config import WIRE_FORMATS

__all__ = ["BLOCK", "QUANTIZED", "AllReduceSum", "Codec", "GatheredSum", "QuantizedSum", "WireFormat", "WireSum",
           "alignment", "codec", "column_length", "dequantize", "is_quantized", "quantize", "quantized_bytes",
           "wire_bytes", "wire_format", "working_dtype"]

#: Elements per scale of a quantized buffer.
BLOCK = 32

#: The formats that send codes with a scale a block.
QUANTIZED = ("int8", "int4", "fp8")

#: float8 e4m3 (no infinities) where this torch has it.
_FP8 = getattr(torch, "float8_e4m3fn", None)


@dataclass(frozen=True)
class Codec:
    """A code: the dtype its values are rounded in, the largest magnitude it holds, and
    its bits (8: a code a byte, in `dtype`; 4: two a byte, packed)."""

    name: str
    dtype: torch.dtype
    limit: float
    bits: int = 8

    def code_bytes(self, numel: int) -> int:
        """The bytes `numel` codes take (a 4-bit code's last byte may hold one)."""
        return numel if self.bits == 8 else (numel + 1) // 2


_INT8 = Codec("int8", torch.int8, 127.0)


def codec(wire: str) -> Codec | None:
    """The codec of a quantized wire format ("int8", "int4", "fp8"); None for the others.
    Raises ValueError for "fp8" on a torch without float8_e4m3fn."""
    if wire == "int8":
        return _INT8
    if wire == "int4":
        return Codec("int4", torch.int8, 7.0, bits=4)
    if wire == "fp8":
        if _FP8 is None:
            raise ValueError(f"wire='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks; "
                             "use wire='int8'")
        return Codec("fp8", _FP8, 448.0)
    return None


@dataclass(frozen=True)
class WireFormat:
    """A wire format (EDGCConfig.wire) and what it decides: where each tensor starts in a
    buffer (`alignment`, `column_length`), the dtype a factor buffer is built in
    (`send_dtype`), the bytes a buffer costs (`bytes`, `sum_bytes`) and how its sum over
    the replicas runs (`start_sum`: one all-reduce, or the stages of a quantized sum)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in WIRE_FORMATS:
            raise ValueError(f"unknown wire format {self.name!r}; choose from {WIRE_FORMATS}")

    @property
    def codec(self) -> Codec | None:
        """The code of a quantized format; None for the others."""
        return codec(self.name)

    @property
    def quantized(self) -> bool:
        """Whether it sends codes with a scale a block ("int8", "int4", "fp8")."""
        return self.name in QUANTIZED

    @property
    def uncompressed(self) -> WireFormat:
        """The format an uncompressed step (the warm-up's) travels in: int8 for "int4", whose
        rounding of a tensor sent whole nothing keeps there; this format for the others."""
        return WireFormat("int8") if self.name == "int4" else self

    @property
    def alignment(self) -> int:
        """The multiple of elements each tensor of a buffer starts at
        (edgc.comm.units.flatten_by_dtype): BLOCK for a quantized format, so that no block
        holds two tensors; 1 for the others."""
        return BLOCK if self.quantized else 1

    def column_length(self, rows: int) -> int:
        """The elements a factor column of `rows` elements takes in a buffer: `rows`
        rounded up to a whole number of blocks for a quantized format (each column starts
        a block: edgc.comm.units.factor_buffers), `rows` for the others."""
        return rows + (-rows % self.alignment)

    def send_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of a factor buffer for gradients in `dtype`: the gradient's ("native"),
        bfloat16 ("bf16"), or the working dtype, quantized as it is sent (int8, fp8)."""
        if self.name == "native":
            return dtype
        if self.name == "bf16":
            return torch.bfloat16
        return working_dtype(dtype)

    def bytes(self, numel: int, element_size: int) -> int:
        """The bytes a buffer of `numel` elements in a gradient dtype of `element_size`
        bytes puts on the wire (as edgc counts bytes: the buffer handed to an all-reduce,
        or its quantized equivalent)."""
        code = self.codec
        if code is not None:
            return _row_bytes(numel, code)
        if self.name == "bf16":
            return 2 * numel
        return element_size * numel

    def sum_bytes(self, flat: torch.Tensor, world: int) -> int:
        """The bytes `start_sum` of `flat` over `world` replicas hands over (what edgc
        counts as sent): every chunk's codes and scales for a quantized format (nothing
        with one replica), else the buffer in the format's dtype."""
        code = self.codec
        if code is not None:
            return 0 if world == 1 else quantized_bytes(flat.numel(), world, code)
        return self.bytes(flat.numel(), flat.element_size())

    def start_sum(self, flat: torch.Tensor, group: dist.ProcessGroup | None, world: int,
                  all_reduce: Callable[[torch.Tensor], Any] | None = None) -> WireSum:
        """Issue the first collective of the sum of `flat` (1-D, floating) over `group` of
        `world` replicas in this format; the sum is in `flat` once its stages are done
        (WireSum; its `work` is None with one replica, where `flat` is the sum already).
        `all_reduce(tensor)`, where given, issues a plain format's all-reduce SUM over
        `group` and returns its handle (edgc.comm.collectives issues every all-reduce in
        one place); a quantized format issues its own collectives."""
        code = self.codec
        if code is None:
            dtype = torch.bfloat16 if self.name == "bf16" and flat.dtype != torch.bfloat16 else None
            return AllReduceSum(flat, group, dtype, all_reduce)
        if world == 1:
            return WireSum()
        return GatheredSum(flat, code, group) if world == 2 else QuantizedSum(flat, code, group, world)


def wire_format(wire: str | WireFormat) -> WireFormat:
    """`wire` as a WireFormat (a name is checked)."""
    return wire if isinstance(wire, WireFormat) else WireFormat(wire)


def is_quantized(wire: str | WireFormat) -> bool:
    """Whether format `wire` sends codes with a scale a block ("int8", "int4", "fp8")."""
    return wire_format(wire).quantized


def alignment(wire: str | WireFormat) -> int:
    """WireFormat.alignment of format `wire`."""
    return wire_format(wire).alignment


def column_length(rows: int, wire: str | WireFormat) -> int:
    """WireFormat.column_length of format `wire`."""
    return wire_format(wire).column_length(rows)


def wire_bytes(numel: int, element_size: int, wire: str | WireFormat) -> int:
    """WireFormat.bytes of format `wire`."""
    return wire_format(wire).bytes(numel, element_size)


def _chunk(numel: int, world: int) -> int:
    """Elements of each replica's chunk of a quantized sum of `numel` elements (the buffer
    is padded with zeros to `world` such chunks): a whole number of blocks, so that every
    chunk's blocks are the buffer's own blocks. (A chunk ending inside a block would shift
    every block of the next chunk by part of one, and a block would then hold the end of
    one tensor or factor column and the start of the next.)"""
    return BLOCK * math.ceil(numel / (world * BLOCK))


def _row_bytes(numel: int, code: Codec) -> int:
    """The bytes `quantize` makes of `numel` elements: their codes, a bfloat16 scale a block."""
    return code.code_bytes(numel) + 2 * math.ceil(numel / BLOCK)


def quantized_bytes(numel: int, world: int, code: Codec | None = None) -> int:
    """The bytes a quantized sum of `numel` elements over `world` replicas hands over in
    `code` (int8's when None): every chunk's codes and scales (what edgc counts as sent);
    with 2 replicas, each one's whole buffer."""
    code = code if code is not None else _INT8
    if world == 2:
        return _row_bytes(numel, code)
    return world * _row_bytes(_chunk(numel, world), code)


def quantize(x: torch.Tensor, code: Codec, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x` (1-D) as bytes: its codes (a byte each, or two 4-bit codes a byte, the first in
    the low half), then one bfloat16 scale per block of BLOCK elements (the last block may
    be short), in one uint8 tensor of `_row_bytes(len(x), code)` bytes (`out`, when given).

    Each block's scale comes from a max and a min (no |x| tensor). The codes are divided,
    rounded and stored a slice of blocks at a time (on CPU; `_rows_per_pass`) through one
    small scratch buffer of float32 (or x's dtype when wider), into which a narrower x is
    first widened, slice by slice, and its scales taken there (a half-precision max over
    blocks is slow on CPU). No temporary of the whole buffer's size is made: on CPU a
    fresh large allocation costs more than the arithmetic (its pages are faulted in).
    Only a short last block is padded."""
    n = x.numel()
    if out is None:
        out = torch.empty(_row_bytes(n, code), dtype=torch.uint8, device=x.device)
    work_dtype = torch.promote_types(x.dtype, torch.float32)
    scales = []
    for blocks, dest in zip(_split(x), _code_rows(out, n, code), strict=True):
        if blocks.shape[1] < BLOCK:  # (a short last block: padded with zeros, a copy of < BLOCK values)
            blocks = torch.nn.functional.pad(blocks, (0, BLOCK - blocks.shape[1]))
        step = _rows_per_pass(blocks)
        scratch = torch.empty((min(step, len(blocks)), BLOCK), dtype=work_dtype, device=x.device)
        wide = blocks.dtype == work_dtype
        scale = _scale(blocks, code) if wide else None  # (a wide buffer's max is fast: all blocks at once)
        for lo in range(0, len(blocks), step):
            rows = blocks[lo : lo + step]
            work = scratch[: len(rows)]
            if wide:
                assert scale is not None
                rows_scale = scale[lo : lo + step]
            else:
                rows = work.copy_(rows)
                rows_scale = _scale(rows, code)
                scales.append(rows_scale)
            # |x| <= absmax <= limit * scale, and a correctly rounded quotient keeps |x / scale| <= limit:
            # no clamp is needed
            torch.div(rows, rows_scale, out=work)
            if code.dtype == torch.int8:
                work.round_()
            packed = work if code.bits == 8 else _pack(work)
            dest[lo : lo + step].copy_(packed[:, : dest.shape[1]])  # (the cast to the code)
        if scale is not None:
            scales.append(scale)
    if scales:  # (none for an empty x)
        out[code.code_bytes(n) :].copy_(torch.cat(scales).to(torch.bfloat16).view(-1).view(torch.uint8))
    return out


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """(rows, BLOCK) whole numbers in [-7, 7] as (rows, BLOCK / 2) bytes of two 4-bit codes,
    each stored plus 8 (1 to 15), the even element's in the low half. (A non-finite value's
    code may be anything: its block's scale is non-finite too, which decoding keeps.)"""
    halves = (codes + 8).to(torch.uint8).view(len(codes), -1, 2)
    return halves[..., 0] | (halves[..., 1] << 4)


def _unpack(packed: torch.Tensor, width: int) -> torch.Tensor:
    """`_pack`'s bytes (rows, k) as the first `width` of their 2k codes, int8 in [-7, 7]."""
    halves = torch.stack((packed & 15, packed >> 4), dim=-1).view(len(packed), -1)[:, :width]
    return halves.to(torch.int8) - 8


def _scale(blocks: torch.Tensor, code: Codec) -> torch.Tensor:
    """Each block's scale, (blocks, 1) float32: its largest magnitude over the code's limit,
    rounded up to a bfloat16 (1 for an all-zero block). A nan propagates through amax, amin
    and maximum: a block holding one keeps a nan scale."""
    absmax = torch.maximum(blocks.amax(dim=1, keepdim=True), blocks.amin(dim=1, keepdim=True).neg()).float()
    return _bf16_up(torch.where(absmax == 0, torch.ones_like(absmax), absmax / code.limit))


def _rows_per_pass(blocks: torch.Tensor) -> int:
    """How many blocks the codec takes a pass at a time: on CPU 8192 (a 1 MB float32
    scratch, reused), elsewhere all of them (a GPU's caching allocator reuses its memory,
    and each pass is a kernel launch)."""
    return 8192 if blocks.device.type == "cpu" else max(len(blocks), 1)


def _split(x: torch.Tensor) -> list[torch.Tensor]:
    """1-D `x` as (blocks, BLOCK) views: its whole blocks, then a short last block's
    (1, length % BLOCK) view, where there is one."""
    n = x.numel()
    full = n - n % BLOCK
    views = [x[:full].view(-1, BLOCK)] if full else []
    if full < n:
        views.append(x[full:].view(1, -1))
    return views


def _code_rows(data: torch.Tensor, numel: int, code: Codec) -> list[torch.Tensor]:
    """The codes of `numel` elements at the start of bytes `data`, as views in step with
    `_split`'s: (blocks, BLOCK) codes of the code's dtype for a one-byte code, (blocks,
    BLOCK / 2) packed bytes for 4 bits; then a short last block's (1, ...) view."""
    if code.bits == 8:
        return _split(data[:numel].view(code.dtype))
    full = numel - numel % BLOCK
    rows = [data[: full // 2].view(-1, BLOCK // 2)] if full else []
    if full < numel:
        rows.append(data[full // 2 : code.code_bytes(numel)].view(1, -1))
    return rows


def _bf16_up(x: torch.Tensor) -> torch.Tensor:
    """float32 `x` (positive, or nan or inf) rounded up to the nearest bfloat16, as float32:
    the low 16 bits of the float32 cleared after adding their largest value. A nan or inf
    is kept as it is: a nan's bits may be anything above the infinities' (a vectorised
    max gives all ones, 0xFFFFFFFF), and adding to those would carry out of the word and
    make a zero scale of it, that is a finite block."""
    bits = x.view(torch.int32)
    return torch.where(torch.isfinite(x), ((bits + 0xFFFF) & -0x10000).view(torch.float32), x)


def dequantize(data: torch.Tensor, numel: int, code: Codec, dtype: torch.dtype, out: torch.Tensor | None = None,
               add: bool = False) -> torch.Tensor:
    """The `numel` values `quantize` wrote into the bytes `data` (1-D), in `dtype`: into
    `out` (1-D, `numel` elements, of `dtype`) when given, added to what it holds when `add`.
    A code times its bfloat16 scale is exact in float32 (at most 8 + 8 significant bits), so
    adding it to `out` in one fused step rounds as adding the product would."""
    scales = data[code.code_bytes(numel) :].clone().view(torch.bfloat16)  # (copied: a view needs 2-byte alignment)
    return _decode(data, numel, code, scales, dtype, out, add)


def _decode(data: torch.Tensor, numel: int, code: Codec, scales: torch.Tensor, dtype: torch.dtype,
            out: torch.Tensor | None, add: bool) -> torch.Tensor:
    """`dequantize` of the codes of `numel` elements at the start of bytes `data` and their
    blocks' bfloat16 `scales` (one per block, possibly more than the codes' blocks: the
    rest are not read), each product taken in `dtype` and stored in `out`'s (which may be
    narrower: one rounding). In place, with no temporary of the whole buffer's size
    (`quantize`): one-byte codes are widened into `out` and scaled there; to add, and
    4-bit codes always, they are unpacked and widened into a small scratch a pass at a time."""
    if out is None:
        out = torch.zeros(numel, dtype=dtype, device=data.device) if add else \
            torch.empty(numel, dtype=dtype, device=data.device)
    full = numel // BLOCK
    scale = scales.to(dtype).view(-1, 1)
    parts = ([scale[:full]] if full else []) + ([scale[full : full + 1]] if numel % BLOCK else [])
    for rows, dest, block_scale in zip(_code_rows(data, numel, code), _split(out), parts, strict=True):
        if not add and code.bits == 8:
            dest.copy_(rows)  # (a code is exact in any floating dtype)
            dest.mul_(block_scale)
            continue
        step = _rows_per_pass(rows)
        scratch = torch.empty((min(step, len(rows)), dest.shape[1]), dtype=dtype, device=data.device)
        for lo in range(0, len(rows), step):
            codes = rows[lo : lo + step]
            widened = scratch[: len(codes)]
            widened.copy_(codes if code.bits == 8 else _unpack(codes, dest.shape[1]))
            if add:
                dest[lo : lo + step].addcmul_(widened, block_scale[lo : lo + step])
            else:
                torch.mul(widened, block_scale[lo : lo + step], out=widened)
                dest[lo : lo + step].copy_(widened)
    return out


class WireSum:
    """A sum over the replicas in flight, in stages: `work` is the handle of the stage's
    collective (None: nothing in flight, the sum is done). After waiting for it,
    `advance()` runs what follows: it issues the next stage's collective and returns True
    (`work` is then its handle), or writes the sum into the buffer and returns False. Every
    replica issues the same stages in the same order."""

    work: Any = None

    def advance(self) -> bool:
        return False


class AllReduceSum(WireSum):
    """One all-reduce SUM, in place, or of a copy in `dtype` (the "bf16" format's tensors
    sent whole) that is copied back after the wait."""

    def __init__(self, flat: torch.Tensor, group: dist.ProcessGroup | None, dtype: torch.dtype | None = None,
                 all_reduce: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.flat = flat
        self.send = flat if dtype is None else flat.to(dtype)
        # collective: all-reduce SUM of the buffer, in its dtype or the format's
        self.work = (all_reduce(self.send) if all_reduce is not None
                     else dist.all_reduce(self.send, group=group, async_op=True))

    def advance(self) -> bool:
        if self.send is not self.flat:
            self.flat.copy_(self.send)
        return False


class GatheredSum(WireSum):
    """The quantized sum over 2 replicas (`QuantizedSum` is for more): each one's whole
    buffer, quantized once, goes to the other by one all-gather, and `advance` sums the two
    buffers in replica order into `flat`. The same bytes as a reduce-scatter and an
    all-gather (each replica hands over its buffer once), with one rounding and one round
    trip instead of two."""

    def __init__(self, flat: torch.Tensor, code: Codec, group: dist.ProcessGroup | None) -> None:
        self.flat, self.code = flat, code
        self.row = _row_bytes(flat.numel(), code)
        self.gathered = torch.empty(2 * self.row, dtype=torch.uint8, device=flat.device)
        # collective: all-gather of each replica's buffer, (bits / 8 + 2 / BLOCK) bytes per element
        self.work = _all_gather(self.gathered, quantize(flat, code), group)

    def advance(self) -> bool:
        flat, n, code = self.flat, self.flat.numel(), self.code
        sum_dtype = working_dtype(flat.dtype)
        first, second = self.gathered.view(2, self.row)
        total = flat if flat.dtype == sum_dtype else torch.empty(n, dtype=sum_dtype, device=flat.device)
        dequantize(first, n, code, sum_dtype, out=total)
        dequantize(second, n, code, sum_dtype, out=total, add=True)  # (replica 0's first on both: bit-identical)
        if total is not flat:
            flat.copy_(total)
        return False


class QuantizedSum(WireSum):
    """The quantized sum over `world` > 2 replicas, in two stages (the module doc):

        reduce-scatter   (issued at the start) each replica's chunk j, quantized, to replica j
        all-gather       (issued by `advance`, once the chunks are here) this replica's
                         chunk summed and quantized again, to every replica
        unpack           (`advance` after it) every summed chunk dequantized into `flat`
    """

    def __init__(self, flat: torch.Tensor, code: Codec, group: dist.ProcessGroup | None, world: int) -> None:
        self.flat, self.code, self.group, self.world = flat, code, group, world
        n = flat.numel()
        self.chunk = chunk = _chunk(n, world)  # elements per replica's chunk
        padded = torch.nn.functional.pad(flat, (0, world * chunk - n))
        self.row = row = _row_bytes(chunk, code)  # one chunk's bytes (codes and scales)
        send = torch.empty(world * row, dtype=torch.uint8, device=flat.device)
        for piece, dest in zip(padded.split(chunk), send.split(row), strict=True):
            quantize(piece, code, out=dest)
        self.recv = torch.empty_like(send)
        self.gathered: torch.Tensor | None = None
        # collective: all-to-all of (bits / 8 + 2 / BLOCK) bytes per element: chunk j to replica j
        self.work = dist.all_to_all_single(self.recv, send, group=group, async_op=True)

    def advance(self) -> bool:
        if self.gathered is None:
            self._gather()
            return True
        self._unpack()
        return False

    def _gather(self) -> None:
        """Sum this replica's chunk from the W pieces received (in replica order: the same
        float order on every replica) and issue the all-gather of the sums."""
        code, world, chunk = self.code, self.world, self.chunk
        sum_dtype = working_dtype(self.flat.dtype)
        pieces = self.recv.view(world, self.row)
        mine = dequantize(pieces[0], chunk, code, sum_dtype)
        for j in range(1, world):
            dequantize(pieces[j], chunk, code, sum_dtype, out=mine, add=True)
        self.gathered = torch.empty(world * self.row, dtype=torch.uint8, device=self.flat.device)
        # collective: all-gather of every replica's summed chunk, quantized again
        self.work = _all_gather(self.gathered, quantize(mine, code), self.group)

    def _unpack(self) -> None:
        """Each summed chunk into `flat`: the products in the sum's dtype, rounded once into flat's."""
        assert self.gathered is not None
        flat, chunk, code = self.flat, self.chunk, self.code
        n, sum_dtype = flat.numel(), working_dtype(flat.dtype)
        for j, piece in enumerate(self.gathered.view(self.world, self.row)):
            count = min(chunk, n - j * chunk)
            if count <= 0:
                break
            _decode(piece, count, code, piece[code.code_bytes(chunk) :].clone().view(torch.bfloat16), sum_dtype,
                    flat[j * chunk : j * chunk + count], add=False)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype compression arithmetic runs in: float32 for half-precision gradients, else
    their own. A quantized sum is dequantized and added in it too (an fp16 product of a code
    and a scale of a block of small values would underflow), and a quantized format builds
    its factor buffers in it (`WireFormat.send_dtype`)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _all_gather(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (renamed in torch 2.13)
    return gather(out, x, group=group, async_op=True)

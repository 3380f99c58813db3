"""The quantized wire formats (edgc.comm.wire): rounding within the format's step, scales
per block, 4-bit codes packed two a byte, non-finite values kept non-finite, and the
config's refusals."""

import math

import pytest
import torch

from edgc import EDGCConfig
from edgc.comm.units import Group, factor_buffers
from edgc.comm.wire import BLOCK, _bf16_up, codec, column_length, dequantize, quantize, quantized_bytes, wire_bytes
from edgc.config import with_added_fields


@pytest.mark.parametrize("wire,code_bytes", [("int8", lambda n: n), ("int4", lambda n: (n + 1) // 2)])
@pytest.mark.parametrize("n", [0, 1, BLOCK - 1, BLOCK, 3 * BLOCK + 17])
def test_integer_codes_round_each_block_to_its_own_step(wire, code_bytes, n):
    code = codec(wire)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    x[: min(n, BLOCK)] *= 1000  # one loud block must not drown the others
    data = quantize(x, code)
    assert data.dtype == torch.uint8
    assert data.numel() == code_bytes(n) + 2 * math.ceil(n / BLOCK)  # a bf16 scale a block
    y = dequantize(data, n, code, torch.float64)
    for start in range(0, n, BLOCK):
        block, back = x[start : start + BLOCK], y[start : start + BLOCK]
        # (the scale, absmax / 127 or / 7, rounded up to a bfloat16: by less than 2^-7 of itself)
        step = float(block.abs().max()) / code.limit
        assert float((back - block).abs().max()) <= step / 2 * (1 + 2**-7)
        assert float((back - block).abs().max()) > 0 or n == 0


def test_fp8_keeps_relative_precision_and_zeros():
    code = codec("fp8")
    x = torch.linspace(-3, 3, 2 * BLOCK, dtype=torch.float32)
    x[BLOCK:] = 0.0
    y = dequantize(quantize(x, code), x.numel(), code, torch.float32)
    big = x.abs() > 0.05
    assert float(((y - x).abs()[big] / x.abs()[big]).max()) <= 2**-4
    assert torch.equal(y[BLOCK:], torch.zeros(BLOCK))  # an all-zero block: scale 1, codes 0


@pytest.mark.parametrize("wire", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_makes_its_block_non_finite(wire, bad):
    code = codec(wire)
    x = torch.randn(2 * BLOCK)
    x[5] = bad
    y = dequantize(quantize(x, code), x.numel(), code, torch.float32)
    assert not torch.isfinite(y[:BLOCK]).any()
    assert torch.isfinite(y[BLOCK:]).all()


def test_a_nan_scale_stays_nan_whatever_its_bits():
    # a vectorised max gives a nan of all ones (0xFFFFFFFF); rounding its bits up to a
    # bfloat16 must not carry it into a zero scale, which would make its block finite
    bits = torch.tensor([0x7FC00000, -0x400000, -1, 0x7FFFFFFF, 0x7F800000], dtype=torch.int32)  # (-1: all ones)
    up = _bf16_up(bits.view(torch.float32))
    assert not torch.isfinite(up).any() and not torch.isfinite(up.to(torch.bfloat16)).any()
    finite = torch.tensor([1.0, 1.0 + 2**-20, 3e-5, 448.0 / 127])
    up = _bf16_up(finite)  # (finite values: the smallest bfloat16 at or above each)
    assert torch.equal(up[:2], torch.tensor([1.0, 1.0 + 2**-7]))
    assert (up >= finite).all() and torch.equal(up, up.to(torch.bfloat16).float())
    # the P of a matrix with a row of inf: one nan a column, each at a block's start
    code = codec("int8")
    x = torch.randn(72 * BLOCK, generator=torch.Generator().manual_seed(4)) * 1e-4
    x[16 * BLOCK :: 2 * BLOCK] = float("nan")
    y = dequantize(quantize(x, code), x.numel(), code, torch.float32).view(-1, BLOCK)
    assert torch.equal(torch.isfinite(y).all(dim=1), torch.isfinite(x.view(-1, BLOCK)).all(dim=1))


def _reference_codes(x, code):
    """The codes and float32 scales of `x` by the format's definition, block by block, in
    float64: scale = absmax / limit rounded up to a bfloat16, code = x / scale (rounded to
    the nearest integer for int8)."""
    blocks = torch.nn.functional.pad(x.double(), (0, -x.numel() % BLOCK)).view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(absmax == 0, torch.ones_like(absmax), absmax / code.limit)
    bits = scale.view(torch.int32)
    scale = ((bits + 0xFFFF) & -0x10000).view(torch.float32)
    scaled = blocks / scale.double()
    codes = scaled.round() if code.dtype == torch.int8 else scaled
    return codes.to(code.dtype).view(-1)[: x.numel()], scale.view(-1)


def _reference_bytes(codes, code):
    """The bytes of `codes` as the format stores them: one a byte, or 4-bit codes two a
    byte, each plus 8, the even element's in the low half (an odd count's last high half 8)."""
    if code.bits == 8:
        return codes.view(torch.uint8)
    offset = torch.nn.functional.pad(codes.long() + 8, (0, codes.numel() % 2), value=8)
    return (offset[0::2] + 16 * offset[1::2]).to(torch.uint8)


@pytest.mark.parametrize("wire", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codec_matches_the_format_across_its_passes_and_adds_in_place(wire, dtype):
    # longer than the codec's CPU pass of 8192 blocks, with a short last block of an odd
    # length: every pass's blocks and the tail are coded by the format's definition, into a
    # buffer given
    code = codec(wire)
    n = 2 * 8192 * BLOCK + 3 * BLOCK + 11
    nbytes = code.code_bytes(n)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(4) * 1e-2).to(dtype)
    x[BLOCK : 2 * BLOCK] = 0
    out = torch.full((nbytes + 2 * math.ceil(n / BLOCK),), 77, dtype=torch.uint8)
    assert quantize(x, code, out=out) is out
    codes, scales = _reference_codes(x, code)
    assert code.dtype != torch.int8 or int(codes.abs().max()) == code.limit  # (every code used)
    assert torch.equal(out[:nbytes], _reference_bytes(codes, code))
    assert torch.equal(out[nbytes:].clone().view(torch.bfloat16).float(), scales)
    # decoded and added in float32: each product exact, so one rounding of the sum
    y = (torch.randn(n, generator=gen) * 1e-3).to(dtype)
    other = quantize(y, code)
    expected = codes.float() * scales.repeat_interleave(BLOCK)[:n]
    expected += dequantize(other, n, code, torch.float32)
    total = dequantize(out, n, code, torch.float32)
    assert dequantize(other, n, code, torch.float32, out=total, add=True) is total
    assert torch.equal(total, expected)
    if dtype == torch.bfloat16:  # decoded straight into bf16, which holds every scale: the product rounded once
        products = codes.float() * scales.repeat_interleave(BLOCK)[:n]
        assert torch.equal(dequantize(out, n, code, dtype), products.to(dtype))


def test_each_factor_column_starts_a_block_of_its_own():
    # columns not a whole number of blocks long (as the P of a 50257-row embedding): a
    # block shared by a loud column's end and a quiet column's start would round the quiet
    # one away; padded, every column is rounded to its own blocks' steps
    rows, rank = BLOCK + 17, 3
    group = Group((rows, 8), [0], torch.zeros(1, 8, rank), None, torch.float32)
    flats, works, sends = factor_buffers([group], [(1, rows, rank)], None, "int8")
    assert column_length(rows, "int8") == 2 * BLOCK and column_length(rows, "native") == rows
    p = torch.randn(1, rows, rank, generator=torch.Generator().manual_seed(0))
    p[..., 0] *= 1e4
    p[..., 2] *= 1e-4
    sends[0].copy_(p)
    (flat,) = flats
    assert flat.numel() == rank * 2 * BLOCK
    assert torch.equal(flat.view(rank, 2 * BLOCK)[:, rows:], torch.zeros(rank, BLOCK - 17))  # the padding
    code = codec("int8")
    flat.copy_(dequantize(quantize(flat, code), flat.numel(), code, torch.float32))  # the sum of one replica
    for k in range(rank):
        column, back = p[0, :, k], sends[0][0, :, k]
        assert float((back - column).abs().max()) <= float(column.abs().max()) / 254 * (1 + 2**-7)
    # native factors are laid out as they are, unpadded
    flats, _, sends = factor_buffers([group], [(1, rows, rank)], None, "native")
    assert flats[0].numel() == rows * rank and sends[0].shape == (1, rows, rank)


def test_byte_counts():
    assert wire_bytes(1000, 4, "native") == 4000
    assert wire_bytes(1000, 4, "bf16") == 2000
    assert wire_bytes(1000, 4, "int8") == 1000 + 2 * 32  # 32 blocks of 32, a 2-byte scale each
    # a sum over 4 replicas: each replica's chunk a whole number of blocks, so 1000
    # elements in 4 chunks of 256, each with 8 scales
    assert quantized_bytes(1000, 4) == 4 * (256 + 2 * 8)
    # int4: two codes a byte, the same scales
    assert wire_bytes(1000, 4, "int4") == 500 + 2 * 32
    assert wire_bytes(33, 4, "int4") == 17 + 2 * 2  # (an odd count's last byte holds one code)
    assert quantized_bytes(1000, 4, codec("int4")) == 4 * (128 + 2 * 8)
    assert quantized_bytes(1000, 2, codec("int4")) == 500 + 2 * 32
    assert codec("native") is None and codec("bf16") is None


def test_config_refusals():
    with pytest.raises(ValueError, match="wire"):
        EDGCConfig(max_rank=8, wire="int2")
    assert EDGCConfig.from_dict(EDGCConfig(wire="int4").to_flat()).wire == "int4"
    assert EDGCConfig.from_dict(EDGCConfig(wire="fp8").to_flat()).wire == "fp8"


def test_a_saved_config_of_the_removed_alternating_mode_loads_only_where_it_was_off():
    saved = {**EDGCConfig(wire="fp8").to_flat(), "alternate": False}
    assert EDGCConfig.from_dict(with_added_fields(saved)) == EDGCConfig(wire="fp8")
    with pytest.raises(ValueError, match="saved with alternate=True, which cannot resume: the alternating mode"):
        with_added_fields({**saved, "alternate": True})
    with pytest.raises(ValueError, match="alternate"):  # (a config written today: no such field)
        EDGCConfig.from_dict({"alternate": False})

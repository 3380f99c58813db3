"""benchmarks/diloco_bounds.py's compressors in float64: the B-bit codes, the truncated SVD
at the ranks edgc's core would give each matrix, and the bytes each counts."""

import importlib.util
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from edgc import EDGCConfig
from edgc.comm.wire import wire_bytes

ROOT = Path(__file__).resolve().parents[2]


def _bounds():
    spec = importlib.util.spec_from_file_location("diloco_bounds", ROOT / "benchmarks" / "diloco_bounds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_rounds_each_block_to_b_bit_codes_of_its_own_scale(bits):
    b = _bounds()
    x = torch.randn(1000, dtype=torch.float64) * torch.logspace(-3, 2, 1000, dtype=torch.float64)
    x[960:992] = 0  # (a block of zeros stays zeros, with no NaN)
    q = b._quantize(x, bits)
    top = 2 ** (bits - 1) - 1
    for block, qblock in zip(x.split(32), q.split(32), strict=True):
        if not block.abs().max() > 0:
            assert torch.equal(qblock, torch.zeros_like(qblock))
            continue
        scale = (block.abs().max() / top).to(torch.bfloat16).double()
        codes = qblock / scale
        assert torch.equal(codes, codes.round()) and codes.abs().max() <= top
        assert (block - qblock).abs().max() <= scale / 2 + (block.abs().max() - top * scale).clamp_min(0) + 1e-12
    assert b._wire(1000, bits) == (1000 * bits + 7) // 8 + 2 * 32
    if bits == 8:
        assert b._wire(1000, bits) == wire_bytes(1000, 4, "int8")  # (the int8 wire's own count)


def test_svd_bound_takes_each_matrix_at_the_core_s_rank_and_counts_the_int8_factors(one_process_group):
    b = _bounds()
    torch.manual_seed(0)
    params = [nn.Parameter(torch.empty(shape, dtype=torch.float64))
              for shape in [(640, 32), (96, 32), (8, 8), (32,)]]  # (long, compressed, too small, a vector)
    config = EDGCConfig(max_rank=4, min_compression_rate=2.0, long_rank_factor=2.0, rank_multiple=2)
    fake = types.SimpleNamespace(params=params, group=None, bytes_sent=0, sync=types.SimpleNamespace(config=config))
    m = torch.randn(sum(p.numel() for p in params), dtype=torch.float64)
    out = b._svd(fake, m, 1, 4)
    parts = dict(zip(["long", "mid", "small", "vector"], out.split([p.numel() for p in params]), strict=True))
    inputs = dict(zip(["long", "mid", "small", "vector"], m.split([p.numel() for p in params]), strict=True))
    for name, shape, rank in [("long", (640, 32), 8), ("mid", (96, 32), 4)]:
        u, s, vh = torch.linalg.svd(inputs[name].view(shape), full_matrices=False)
        best = (u[:, :rank] * s[:rank]) @ vh[:rank]
        torch.testing.assert_close(parts[name].view(shape), best, rtol=0, atol=1e-10)
        assert torch.linalg.matrix_rank(parts[name].view(shape)) == rank
    assert torch.equal(parts["small"], inputs["small"]) and torch.equal(parts["vector"], inputs["vector"])
    assert fake.bytes_sent == b._wire(8 * 672) + b._wire(4 * 128) + b._wire(8 * 8) + b._wire(32)


def test_int_bound_quantizes_before_and_after_the_average(one_process_group):
    b = _bounds()
    fake = types.SimpleNamespace(group=None, bytes_sent=0)
    m = torch.randn(100, dtype=torch.float64)
    out = b._int(fake, m, 1, 4)
    torch.testing.assert_close(out, b._quantize(b._quantize(m, 4), 4), rtol=0, atol=0)
    assert fake.bytes_sent == b._wire(100, 4) == 50 + 2 * 4


def test_a_bad_bound_is_refused():
    with pytest.raises(SystemExit, match="svd:RANK or int:BITS"):
        _bounds()._patch("topk:3")

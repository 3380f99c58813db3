"""How close can any compressor at edgc-diloco's byte budget come to DiLoCo? Two bounds.

    python benchmarks/diloco_bounds.py svd:40 -- --preset tiny --steps 1000 --out runs/bounds/svd40 \\
        --diloco-inner-steps 5 --diloco-outer-lr 0.5 --diloco-outer-momentum 0.8 --rank 40

runs `edgc train --method edgc-diloco` with everything after `--`, except that once edgc's
core has finished its warm-up (which runs as usual, so the bound starts where edgc-diloco
starts compressing), each outer step's pseudo-gradient, less the outer momentum's
prediction as in edgc-diloco, is compressed by one of these instead of the core:

- `svd:R`: every matrix the core would compress at rank R (the same long-matrix rule and
  minimum compression rate) becomes the truncated SVD, at the rank the core would give it,
  of the replicas' exact average, in float64; the rest is averaged whole. That is the best
  rank-r approximation of what edgc-diloco's one power iteration (warm-started Q) only
  approaches, so no refinement of the power iteration (a second one, a better start) can
  do better at the same ranks. The exact average itself travels uncounted; the bytes
  counted are what the int8 wire would send: the factors r (m + n) and the whole tensors,
  at one byte an element and a bfloat16 scale per 32.
- `int:B`: no low rank at all; every tensor is quantized to B bits (symmetric, absmax of
  each block of 32 as a bfloat16 scale), averaged, and the average quantized again before
  it is applied, as a reduce-scatter and an all-gather of B-bit codes would. B / 8 bytes
  an element and 2 bytes per 32 are counted.

Both keep error feedback as the core does: each replica keeps its input minus what every
replica applied. This script is a measurement, not a method of the library: it patches
`edgc.diloco.DiLoCo` in the workers it starts (each spawned worker imports this file again,
as multiprocessing's spawn does with the parent's main script) and nothing else. A bound's
error feedback is not checkpointed: run it whole, not with --stop-after and --resume.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist

from edgc.comm.wire import BLOCK, wire_bytes
from edgc.compress.lowrank import compressible, matrix_rank
from edgc.diloco import DiLoCo

BOUND_ENV = "EDGC_DILOCO_BOUND"


def _quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x rounded to `bits`-bit symmetric codes, a bfloat16 scale per block of 32 (the int8
    wire's blocks)."""
    top = 2 ** (bits - 1) - 1
    blocks = torch.nn.functional.pad(x, (0, (-x.numel()) % BLOCK)).view(-1, BLOCK)
    scale = (blocks.abs().amax(1, keepdim=True) / top).to(torch.bfloat16).to(x.dtype)
    scale = scale.clamp_min(torch.finfo(x.dtype).tiny)
    return ((blocks / scale).round().clamp(-top, top) * scale).reshape(-1)[: x.numel()]


def _wire(numel: int, bits: int = 8) -> int:
    """Bytes of `numel` elements at `bits` bits, with a 2-byte scale per block of 32 (at 8
    bits, the int8 wire's `wire_bytes`)."""
    return (numel * bits + 7) // 8 + 2 * ((numel + BLOCK - 1) // BLOCK)


def _svd(diloco: DiLoCo, m: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    average = m.clone()
    dist.all_reduce(average, group=diloco.group)
    average.div_(world)
    out = torch.empty_like(m)
    sizes = [p.numel() for p in diloco.params]
    config = diloco.sync.config
    for p, a, o in zip(diloco.params, average.split(sizes), out.split(sizes), strict=True):
        shape = tuple(p.shape)
        if not compressible(shape, rank, config.min_compression_rate):
            o.copy_(a)
            diloco.bytes_sent += wire_bytes(a.numel(), 4, "int8")
            continue
        matrix = a.view(shape[0], -1).double()
        r = matrix_rank(tuple(matrix.shape), rank, config.long_rank_factor, config.rank_multiple)
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        o.view(shape[0], -1).copy_((u[:, :r] * s[:r]) @ vh[:r])
        diloco.bytes_sent += wire_bytes(r * sum(matrix.shape), 4, "int8")  # (the core's count)
    return out


def _int(diloco: DiLoCo, m: torch.Tensor, world: int, bits: int) -> torch.Tensor:
    average = _quantize(m, bits)
    dist.all_reduce(average, group=diloco.group)
    average.div_(world)
    diloco.bytes_sent += _wire(m.numel(), bits)
    return _quantize(average, bits)


def _receive(diloco: DiLoCo, core_receive, kind: str, arg: int,
             delta: torch.Tensor, entries, future: torch.futures.Future, last: bool) -> None:
    if diloco.sync.stats().phase == "warmup":  # (the core's warm-up and its decision to start, as usual)
        core_receive(delta, entries, future, last)
        return
    world = dist.get_world_size(diloco.group)
    error = getattr(diloco, "_bound_error", None)
    m = delta + error if error is not None else delta.clone()
    out = _svd(diloco, m, world, arg) if kind == "svd" else _int(diloco, m, world, arg)
    diloco._bound_error = m - out
    delta.copy_(out)
    future.set_result(delta)


def _patch(bound: str) -> None:
    kind, _, arg = bound.partition(":")
    if kind not in ("svd", "int") or not arg.isdigit() or int(arg) < 1:
        raise SystemExit(f"diloco_bounds: {bound!r} is not svd:RANK or int:BITS")
    init = DiLoCo.__init__

    def patched(self: DiLoCo, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        if self.sync is not None:
            self.sync.receive = functools.partial(_receive, self, self.sync.receive, kind, int(arg))

    DiLoCo.__init__ = patched  # type: ignore[method-assign]


if os.environ.get(BOUND_ENV):  # (in the parent and in every spawned worker)
    _patch(os.environ[BOUND_ENV])

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    os.environ[BOUND_ENV] = sys.argv[1]
    _patch(sys.argv[1])
    from edgc.cli import main

    sys.exit(main(["train", "--method", "edgc-diloco", *sys.argv[3:]]))

"""Workers for the wire-format tests (test_wire.py): what one replica sends and keeps."""

from __future__ import annotations

import torch

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.comm.buckets import sync_with_hook
from edgc.comm.collectives import Collectives
from edgc.comm.wire import BLOCK, codec, dequantize, quantize

# distinct shapes, so that each compressed group holds one parameter
SHAPES = ((24, 16), (16, 10), (12, 30), (9,))


def error_feedback_invariant(rank: int, world: int, wire: str, state_dtype: str, steps: int) -> dict:
    """Float64 parameters synchronised through edgc_hook at a fixed rank in format `wire`.
    At every compressed step, for every compressed matrix: what was sent (the average
    handed back) plus what this replica kept (its new error feedback) against its own
    gradient plus what it kept before. Returns the worst difference, relative to the
    largest input, the steps checked, the averages sent and the bytes."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in SHAPES]
    config = EDGCConfig(policy="static", max_rank=3, warmup="fixed", warmup_steps=1, min_compression_rate=1.0,
                        wire=wire, state_dtype=state_dtype)
    state = EDGCState(None, config)
    by_shape = {tuple(p.shape) if p.dim() == 2 else None: p for p in params}
    worst, checked, sent = 0.0, 0, []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * (1 + rank)
        local = {k: p.grad.clone() for k, p in by_shape.items() if k is not None}
        kept = {g.shape: g.error[0].double().clone() for g in state.sync.compression.groups.values()
                if g.error is not None}
        sync_with_hook(params, state, edgc_hook, cap_bytes=1500)
        if state.stats().step_rank == 0:
            continue
        checked += 1
        for group in state.sync.compression.groups.values():
            assert group.error is not None
            m = local[group.shape] + kept.get(group.shape, torch.zeros(group.shape, dtype=torch.float64))
            average = by_shape[group.shape].grad
            now_kept = group.error[0].double()
            worst = max(worst, float((average + now_kept - m).abs().max() / m.abs().max()))
            sent.append(average.clone())
    return {"worst": worst, "checked": checked, "sent": sent, "bytes": state.stats().bytes_sent,
            "params": torch.cat([p.detach().reshape(-1) for p in params])}


def quantized_sum_blocks(rank: int, world: int, wire: str, blocks: int) -> dict:
    """One quantized sum over `world` replicas of `blocks` blocks of float64 values, block i
    of magnitude 100^(i - blocks // 2). Returns the sum, its largest error against the exact
    sum relative to the largest magnitude of that block's sum, and the bytes counted."""

    def values(replica: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(11 + replica)
        x = torch.randn(blocks, BLOCK, generator=g, dtype=torch.float64)
        return (x * 100.0 ** (torch.arange(blocks, dtype=torch.float64) - blocks // 2)[:, None]).reshape(-1)

    code = codec(wire)
    assert code is not None
    collectives = Collectives()
    flat = values(rank)
    collectives.wait([collectives.sum_in(flat, wire)])
    exact = sum(values(r) for r in range(world)).view(blocks, BLOCK)
    worst = float(((flat.view(blocks, BLOCK) - exact).abs().amax(1) / exact.abs().amax(1)).max())
    # each replica's values rounded once, summed in replica order
    n = blocks * BLOCK
    once = sum(dequantize(quantize(values(r), code), n, code, torch.float64) for r in range(world))
    return {"sum": flat, "worst": worst, "bytes": collectives.bytes_sent, "rounded_once": once}


def whole_tensors(rank: int, world: int, wire: str, dtype: str = "float64", scale: float = 1.0) -> dict:
    """One uncompressed (warm-up) step of parameters in `dtype` through edgc_hook in format
    `wire`: every tensor travels whole, the gradients of tensor i about scale * 100^i.
    Returns the averages handed back, their largest error against the exact average of
    every replica's gradient, relative to the largest magnitude of that tensor's average,
    and the bytes counted."""
    kind = getattr(torch, dtype)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=kind)) for shape in SHAPES]
    config = EDGCConfig(policy="static", max_rank=3, warmup="fixed", warmup_steps=5, wire=wire)
    state = EDGCState(None, config)

    def grads(replica: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(7 + replica)
        # (tensors of very different sizes side by side: a block across two would round
        # the small one away)
        return [(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale * 10.0 ** (2 * i)).to(kind)
                for i, p in enumerate(params)]

    for p, g in zip(params, grads(rank), strict=True):
        p.grad = g
    exact = [sum(g.double() for g in gs) / world for gs in zip(*(grads(r) for r in range(world)), strict=True)]
    sync_with_hook(params, state, edgc_hook, cap_bytes=1500)
    worst = max(float((p.grad.double() - e).abs().max() / e.abs().max()) for p, e in zip(params, exact, strict=True))
    return {"worst": worst, "bytes": state.stats().bytes_sent, "rank": state.stats().step_rank,
            "averages": torch.cat([p.grad.reshape(-1) for p in params])}


def calibration_probe(rank: int, world: int, wire: str) -> dict:
    """One warm-up step of float64 parameters through edgc_hook in format `wire`, with r_max
    calibrated (max_rank=None: the step also times a compressed probe round) and with it
    fixed. Returns the bytes each counted and the probe's rank."""
    out: dict = {}
    for max_rank in (None, 3):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64)) for shape in SHAPES]
        config = EDGCConfig(policy="linear", max_rank=max_rank, min_rank=None if max_rank is None else 1,
                            warmup="fixed", warmup_steps=5, min_compression_rate=1.0, calibration_repeats=1,
                            wire=wire)
        state = EDGCState(None, config)
        g = torch.Generator().manual_seed(7 + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
        sync_with_hook(params, state, edgc_hook, cap_bytes=1500)
        out[max_rank] = state.stats().bytes_sent
        if max_rank is None:
            out["points"] = list(state.sync.calibration.points)
    return {"calibrated": out[None], "fixed": out[3], "points": out["points"]}

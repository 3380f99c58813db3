"""Gradient buckets made outside DDP, for calling a communication hook directly.

DDP hands its hooks a `dist.GradBucket`, which Python cannot construct. `FlatBucket`
offers the same methods over a flat buffer, so the same hook (edgc_hook, allreduce_hook)
can sync gradients where DDP's reducer is not the one deciding when: after a pipeline
stage has sent its last input gradient (comm/pipeline.py), or in a benchmark.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["FlatBucket", "sync_with_hook"]


@dataclass
class FlatBucket:
    """What DDP's GradBucket offers the hooks, over a flat buffer of gradients."""

    _index: int
    _buffer: torch.Tensor
    _params: list[torch.Tensor]
    _last: bool

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def is_last(self) -> bool:
        return self._last


def sync_with_hook(params: Sequence[torch.nn.Parameter], state: Any, hook: Callable[..., Any], cap_bytes: int) -> None:
    """Average `params`' .grad over the hook's process group by calling `hook(state, bucket)`
    on DDP-like buckets (reverse parameter order, about `cap_bytes` each, one dtype per
    bucket as in DDP), then copy the result back into .grad. Every parameter must have a
    gradient. A DTensor parameter (tensor parallelism) takes part with its local shard: the
    bucket lists a stand-in of the shard's shape (`_local`), the same object every step."""
    params = [p for p in params if p.requires_grad]
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing:
        raise RuntimeError(f"parameters {missing} have no gradient; every parameter must take part in every step")
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in reversed(params):
        nbytes = _local(p).numel() * p.element_size()
        if groups[-1] and (size + nbytes > cap_bytes or p.dtype != groups[-1][0].dtype):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    buckets = [
        FlatBucket(i, torch.cat([_grad(p).reshape(-1) for p in g]), [_local(p) for p in g], i == len(groups) - 1)
        for i, g in enumerate(groups)
    ]
    futures = [hook(state, b) for b in buckets]
    for group, bucket, fut in zip(groups, buckets, futures, strict=True):
        result = fut.wait()
        averaged = FlatBucket(0, result, bucket.parameters(), True).gradients()
        for param, grad in zip(group, averaged, strict=True):
            _grad(param).copy_(grad)


def _local(param: torch.Tensor) -> torch.Tensor:
    """`param`, or for a DTensor parameter a stand-in holding its local shard's shape and
    dtype (on the meta device: no memory), kept on the parameter so that a hook that keys
    parameters by identity sees the same one every step."""
    if not isinstance(param, DTensor):
        return param
    stand_in = getattr(param, "_edgc_local", None)
    if stand_in is None:
        stand_in = torch.empty(param.to_local().shape, dtype=param.dtype, device="meta")
        param._edgc_local = stand_in  # type: ignore[attr-defined]
    return stand_in


def _grad(param: torch.Tensor) -> torch.Tensor:
    """param.grad, which sync_with_hook has checked every parameter has (its local shard
    for a DTensor parameter). A DTensor gradient laid out otherwise than its parameter (the
    vocabulary-split embedding's comes back partial: a sum over the TP ranks still to do) is
    first redistributed to the parameter's layout, in place of .grad: a collective over the
    TP group, issued in parameter order on every TP rank, as FSDP2 does before its hooks."""
    grad = param.grad
    assert grad is not None
    if not isinstance(grad, DTensor):
        return grad
    if isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()

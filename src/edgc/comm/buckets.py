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
    gradient."""
    params = [p for p in params if p.requires_grad]
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing:
        raise RuntimeError(f"parameters {missing} have no gradient; every parameter must take part in every step")
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if groups[-1] and (size + nbytes > cap_bytes or p.dtype != groups[-1][0].dtype):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    buckets = [
        FlatBucket(i, torch.cat([_grad(p).reshape(-1) for p in g]), g, i == len(groups) - 1)
        for i, g in enumerate(groups)
    ]
    futures = [hook(state, b) for b in buckets]
    for bucket, fut in zip(buckets, futures, strict=True):
        result = fut.wait()
        averaged = FlatBucket(0, result, bucket.parameters(), True).gradients()
        for param, grad in zip(bucket.parameters(), averaged, strict=True):
            _grad(param).copy_(grad)


def _grad(param: torch.Tensor) -> torch.Tensor:
    """param.grad, which sync_with_hook has checked every parameter has."""
    assert param.grad is not None
    return param.grad

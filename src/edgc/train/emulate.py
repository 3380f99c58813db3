"""Emulated accelerator time, for benchmarks on a CPU machine.

On a GPU the host thread only enqueues kernels: while the device runs a block's backward
pass, the host, its cores and the NIC are free to move the gradient buckets already
handed over. On a CPU the backward pass itself occupies the cores, so a collective in
flight and the next bucket's arithmetic compete for them, and overlap shows little.
`emulate_device_time` gives each transformer block a fixed time during which this worker
waits without using a core, as a host waits for its device: `ms` after the block's
forward pass and twice that before its backward pass (a backward pass does about twice a
forward pass's arithmetic). The maths is unchanged; only the clock is.

It is a benchmark knob (`edgc train --emulated-device-ms`), never a training setting.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["emulate_device_time"]


class _DeviceTime(torch.autograd.Function):
    """The identity, which sleeps `seconds` forward and twice that backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


def emulate_device_time(blocks: torch.nn.ModuleList, ms: float) -> None:
    """Make every block of `blocks` take `ms` more per forward pass and 2 * `ms` more per
    backward pass, idle; `ms` 0 leaves them alone."""
    if ms <= 0:
        return
    seconds = ms / 1e3

    @torch.compiler.disable  # (a compiled block, `edgc train --compile`: the wait stays outside its graph)
    def wait(_module: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return _DeviceTime.apply(out, seconds)

    for block in blocks:
        block.register_forward_hook(wait)

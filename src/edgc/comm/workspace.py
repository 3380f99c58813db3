"""Scratch buffers a step reuses across the matrices it works on, instead of allocating afresh.

A compressed step needs temporaries as large as one unit's matrices of one shape: M = G +
error in the working dtype, where the matrices are gathered from several buckets or the
gradients are half precision, and the average P Q^T on its way back (edgc.comm.step, "The
round on a device, and its memory"). A `Workspace` keeps one flat buffer per name, dtype and
device, grown to the largest request seen and handed out as views, so that a step allocates
each at most once (many short-lived blocks of varying sizes are what makes glibc's malloc
keep freed memory on the CPU). The step empties it at its end (`clear`): between steps the
state holds none of it.

A view is valid until the next `take` of the same name: the caller uses one name per
temporary that can be alive at the same time as another of its kind.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Workspace"]


class Workspace:
    """Named scratch buffers, reused: `take` returns a view of the requested shape."""

    def __init__(self) -> None:
        self._flat: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of `shape` (uninitialised), a view of the buffer `name`;
        the buffer is replaced by a larger one when it is too small."""
        key = (name, dtype, torch.device(device))
        numel = math.prod(shape)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < numel:
            flat = self._flat[key] = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)

    def clear(self) -> None:
        """Drop every buffer (they are allocated again when next needed)."""
        self._flat = {}

    @property
    def nbytes(self) -> int:
        """The bytes the buffers hold."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())
